"""Decoding: the jitted speculative engine and the autoregressive baseline."""

from tevjax.decode.engine import DecodeConfig, DecodeState, Decoder, Generation

__all__ = ["DecodeConfig", "DecodeState", "Decoder", "Generation"]
