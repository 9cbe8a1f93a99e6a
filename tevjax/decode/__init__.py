"""Decoding: the jitted speculative engine and the autoregressive baseline."""

from tevjax.decode.engine import DecodeConfig, DecodeState, Decoder, Generation, Interrupted

__all__ = ["DecodeConfig", "DecodeState", "Decoder", "Generation", "Interrupted"]
