"""Command line: `tevjax generate` (also `python -m tevjax generate`) and `tevjax demo`.

Entry points are thin: parse and check arguments, call the library, print. Every expected failure
(bad flag values, missing files, broken checkpoints) is one line on stderr and exit status 2;
`--debug` shows the traceback of an unexpected error.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

EXIT_USAGE = 2
VERIFIER_CHOICES = ("tev", "predraw", "sequential", "ar")


class CliError(Exception):
    """An error the user can fix; printed as one line."""


def _positive_int(name):
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer, got {text!r}") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"{name} must be >= 1, got {value}")
        return value

    return parse


def _temperature(text):
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"temperature must be a number, got {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"temperature must be a finite number >= 0, got {text!r}")
    return value


def _seed(text):
    from tevjax.seeding import check_seed  # jax-free, so a bad --seed fails before any import

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--seed must be an integer, got {text!r}") from None
    try:
        return check_seed(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"--{e}") from None


def _prompt_ids(text):
    try:
        ids = [int(x) for x in text.replace(" ", "").split(",") if x != ""]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--prompt-ids must be comma-separated integers, got {text!r}") from None
    if not ids:
        raise argparse.ArgumentTypeError("--prompt-ids is empty")
    return ids


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (the usage text stays available through --help)."""

    def error(self, message):
        self.exit(EXIT_USAGE, f"tevjax: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="tevjax", description="Lossless tree speculative decoding in JAX.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks of unexpected errors")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    gen = sub.add_parser("generate", help="generate text with DFlash + DDTree + an exact verifier")
    gen.add_argument("--target", default="smollm2", help="'smollm2' (embedded default) or a Hugging Face model directory")
    gen.add_argument("--drafter", default=None, help="DFlash checkpoint directory (default: the project's trained drafter, else a fresh one)")
    src = gen.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-ids", type=_prompt_ids, help="raw token ids, comma-separated (no chat template)")
    src.add_argument("--batch-file", type=Path, help="a file with one prompt per line")
    gen.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                     help="wrap text prompts in the model's chat template (default: on)")
    gen.add_argument("--max-new-tokens", type=_positive_int("--max-new-tokens"), default=128)
    gen.add_argument("--temperature", type=_temperature, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--budget", type=_positive_int("--budget"), default=16, help="draft tree budget B (non-root nodes)")
    gen.add_argument("--verifier", default="tev", help="tev (default), predraw, sequential, or ar (autoregressive baseline)")
    gen.add_argument("--seed", type=_seed, default=0, help="sampling seed, an integer in [0, 2**64)")
    gen.add_argument("--batch-size", type=_positive_int("--batch-size"), default=1,
                     help="prompts decoded together (with --batch-file)")
    gen.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                     help="compute dtype (default: the checkpoint's; use float32 on CPU)")
    gen.add_argument("--json", action="store_true", help="one JSON object per prompt on stdout")
    gen.set_defaults(func=cmd_generate)

    demo = sub.add_parser("demo", help="the main demonstration on the embedded default")
    demo.add_argument("--max-new-tokens", type=_positive_int("--max-new-tokens"), default=64)
    demo.add_argument("--budget", type=_positive_int("--budget"), default=16)
    demo.add_argument("--samples", type=_positive_int("--samples"), default=50_000,
                      help="verifier draws for the synthetic exit-law table")
    demo.add_argument("--skip-models", action="store_true", help="only the synthetic exit-law part")
    demo.set_defaults(func=cmd_demo)
    return parser


# ------------------------------------------------------------------------------------- generate


def _read_prompts(args) -> list[str] | list[list[int]]:
    if args.prompt_ids is not None:
        return [args.prompt_ids]
    if args.prompt is not None:
        if not args.prompt.strip():
            raise CliError("--prompt is empty")
        return [args.prompt]
    if not args.batch_file.is_file():
        raise CliError(f"--batch-file {str(args.batch_file)!r}: no such file")
    lines = [ln.rstrip("\n") for ln in args.batch_file.read_text(encoding="utf-8").splitlines()]
    prompts = [ln for ln in lines if ln.strip()]
    if not prompts:
        raise CliError(f"--batch-file {str(args.batch_file)!r} holds no prompts")
    return prompts


def _encode(models, prompts, chat: bool) -> list[list[int]]:
    if prompts and isinstance(prompts[0], list):
        return prompts
    tok = models.tokenizer
    if tok is None:
        raise CliError("this target has no tokenizer: give --prompt-ids")
    if chat:
        from tevjax.convert.tokenizer import chat_prompt_ids

        if not getattr(tok, "chat_template", None):
            raise CliError("this target's tokenizer has no chat template: use --no-chat")
        return [chat_prompt_ids(tok, p) for p in prompts]
    return [tok.encode(p, add_special_tokens=False) for p in prompts]


def _decode(models, ids: list[int]) -> str:
    return models.tokenizer.decode(ids, skip_special_tokens=True) if models.tokenizer is not None else ""


def cmd_generate(args) -> int:
    if args.verifier not in VERIFIER_CHOICES:
        raise CliError(f"--verifier {args.verifier!r} is not one of {', '.join(VERIFIER_CHOICES)}")
    prompts = _read_prompts(args)  # cheap checks before the (slow) model load

    from tevjax.decode.engine import DecodeConfig, Decoder
    from tevjax.decode.loading import load_models

    t0 = time.perf_counter()
    models = load_models(args.target, args.drafter, dtype=args.dtype)
    load_seconds = time.perf_counter() - t0
    for note in models.notes:
        print(f"tevjax: note: {note}", file=sys.stderr)
    ids = _encode(models, prompts, args.chat)
    vocab = models.target_cfg.vocab_size
    for i, p in enumerate(ids):
        if not p:
            raise CliError(f"prompt {i} encodes to no tokens")
        bad = [t for t in p if not 0 <= t < vocab]
        if bad:
            raise CliError(f"prompt {i} holds token id {bad[0]} outside the vocabulary [0, {vocab})")

    cfg = DecodeConfig(verifier=args.verifier, budget=args.budget, temperature=args.temperature,
                       max_new_tokens=args.max_new_tokens, eos_ids=models.eos_ids)
    decoder = Decoder(models.target, None if args.verifier == "ar" else models.drafter, cfg)
    stream = not args.json and len(ids) == 1
    for start in range(0, len(ids), args.batch_size):
        batch = ids[start: start + args.batch_size]
        decoder.shapes([len(p) for p in batch])  # capacity / position checks before compiling
        compile_seconds = decoder.compile(batch, streaming=stream)
        t1 = time.perf_counter()
        if stream:
            from tevjax.convert.tokenizer import StreamDetokenizer

            # Holds back the bytes of an unfinished character (an emoji spans several tokens),
            # so what streams is exactly the final text (_decode), never a stray U+FFFD.
            detok = StreamDetokenizer(models.tokenizer) if models.tokenizer is not None else None
            for new, state in decoder.stream(batch, seed=args.seed):
                if detok is not None:
                    print(detok.feed(new[0]), end="", flush=True)
            gens = decoder.results(state)
            print(detok.flush() if detok is not None else "")
        else:
            gens = decoder.generate(batch, seed=args.seed)
        seconds = time.perf_counter() - t1
        for j, g in enumerate(gens):
            record = {
                "prompt": prompts[start + j] if isinstance(prompts[start + j], str) else None,
                "prompt_ids": batch[j],
                "tokens": g.tokens,
                "text": _decode(models, g.tokens),
                "rounds": g.rounds,
                "tau": round(g.tau, 4),
                "stop": g.stop,
                "seconds": round(seconds, 4),
                "tokens_per_second": round(len(g.tokens) / seconds, 3) if seconds > 0 else None,
                "verifier": args.verifier,
                "budget": args.budget if args.verifier != "ar" else 0,
                "temperature": args.temperature,
                "drafter_trained": models.drafter_trained if args.verifier != "ar" else None,
                "compile_seconds": round(compile_seconds, 3),
                "load_seconds": round(load_seconds, 3),
            }
            if args.json:
                print(json.dumps(record), flush=True)
            else:
                if not stream:
                    print(record["text"])
                print(f"[tevjax] {len(g.tokens)} tokens in {seconds:.2f} s "
                      f"({record['tokens_per_second']} tok/s), {g.rounds} rounds, tau {g.tau:.2f}, "
                      f"verifier {args.verifier}, budget {record['budget']}, T {args.temperature} "
                      f"(compile {compile_seconds:.1f} s, load {load_seconds:.1f} s)", flush=True)
    return 0


def cmd_demo(args) -> int:
    from tevjax import demo

    demo.main(max_new_tokens=args.max_new_tokens, budget=args.budget, samples=args.samples,
              skip_models=args.skip_models)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("tevjax: interrupted", file=sys.stderr)
        return 130
    except (CliError, ValueError, FileNotFoundError, OSError) as e:
        if args.debug:
            raise
        print(f"tevjax: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except Exception as e:  # noqa: BLE001 - the CLI never shows a raw traceback unless asked
        if args.debug:
            raise
        print(f"tevjax: internal error: {type(e).__name__}: {e} (rerun with --debug for the traceback)",
              file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
