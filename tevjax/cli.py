"""Command-line entry points: `tevjax demo` (and `tevjax generate`, added with the decoder)."""

from __future__ import annotations

import argparse
import sys


def _demo(args: argparse.Namespace) -> int:
    from tevjax import demo_laws

    demo_laws.main(samples=args.samples, temperature=args.temperature)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tevjax", description="Lossless tree speculative decoding in JAX.")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="the main demonstration on the embedded default")
    demo.add_argument("--samples", type=int, default=100_000)
    demo.add_argument("--temperature", type=float, default=1.0)
    demo.set_defaults(func=_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
