"""Command line: `tevjax generate` (also `python -m tevjax generate`) and `tevjax demo`.

Entry points are thin: parse and check arguments, call the library, print. Every expected failure
(bad flag values, missing files, broken checkpoints) is one line on stderr and exit status 2;
`--debug` shows the traceback of an unexpected error.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

from tevjax.checks import first_repeat
from tevjax.tree import valid_temperature
from tevjax.verifiers import VERIFIERS

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a command Ctrl-C stopped
# `generate --verifier ar` means "no drafter" (autoregressive decoding), not a verifier.
AUTOREGRESSIVE = "ar"


class CliError(Exception):
    """An error the user can fix; printed as one line."""


def verifier_choices(*, autoregressive: bool) -> tuple[str, ...]:
    """The --verifier values: the library's verifiers, plus "ar" where the baseline is allowed.
    Read at call time, so a verifier registered in `VERIFIERS` is a CLI choice too."""
    return (*VERIFIERS, AUTOREGRESSIVE) if autoregressive else tuple(VERIFIERS)


def _check_verifier(name: str, *, autoregressive: bool) -> None:
    choices = verifier_choices(autoregressive=autoregressive)
    if name not in choices:
        raise CliError(f"--verifier {name!r} is not one of {', '.join(choices)}")


def _int_at_least(name, minimum):
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{name} must be >= {minimum}, got {value}")
        return value

    return parse


def _positive_int(name):
    return _int_at_least(name, 1)


def _nonnegative_int(name):
    return _int_at_least(name, 0)


LOOKUP_HELP = ("length of the context-lookup chain offered to each draft tree: the continuation of the "
               "latest earlier occurrence of the last committed tokens (default: the budget; 0: off)")


CORPUS_HELP = ("length of the corpus-lookup chain offered to each draft tree: the continuation of the last "
               "committed tokens in an n-gram table of the target's answers to other prompts, the drafter "
               "directory's corpus.npz (default: the budget where there is one; 0: off)")


FALLBACK_HELP = ("speculate only while a row's recent expected block (1 + C_p of its verified trees, tokens per "
                 "target pass) is at least this; below it the target steps on the last token alone for "
                 "--fallback-rounds rounds, twice as many each time it stays below, then drafts again. Set it "
                 "to a round's cost in target steps (0: always speculate; default: %s)")


# A budget-8 round of the shipped drafter with both chains costs about 1.9 target steps on the
# 2-core CPU (held-out tau / speedup, 2.824 / 1.49; `round_stages.md`: 2.06 AR rounds per stage
# call); the default threshold sits just below it.
CPU_FALLBACK_BELOW = 1.8
DEFAULT_FALLBACK_TEXT = (f"{CPU_FALLBACK_BELOW} on a CPU when sampling or with an untrained drafter, where it paid; "
                         "0 for greedy decoding with a trained drafter, where it cost, and on accelerators, "
                         "where it has not been measured")


def _fallback_below(args, trained: bool, temperatures: list[float] | None = None) -> float:
    """--fallback-below, or its default (DEFAULT_FALLBACK_TEXT). Measured on SmolLM2 at budget 8
    (`experiments/results/fallback.md`, speed over AR without -> with it): an untrained drafter
    0.68x -> 0.93x greedy and 0.54x -> 0.92x at temperature 1, the shipped one at temperature 1
    0.82x -> 0.98x, and greedy with the shipped one 1.38x -> 1.30x."""
    if args.fallback_below is not None:
        return args.fallback_below
    import jax

    from tevjax.law import is_greedy

    sampling = any(not is_greedy(t) for t in (temperatures or [args.temperature]))
    below = CPU_FALLBACK_BELOW if jax.default_backend() == "cpu" and (sampling or not trained) else 0.0
    if below == 0 and getattr(args, "fallback_rounds", None) is not None:  # known only once the drafter is
        raise CliError(f"--fallback-rounds {args.fallback_rounds} does nothing: --fallback-below defaults to 0 here "
                       "(greedy decoding with a trained drafter, or an accelerator), so decoding never falls back to "
                       "plain rounds; give --fallback-below above 0, or leave out --fallback-rounds")
    return below


FALLBACK_ROUNDS = 4  # --fallback-rounds' default


def _add_fallback_args(parser, default: str) -> None:
    parser.add_argument("--fallback-below", type=_nonnegative_float("--fallback-below"), default=None,
                        help=FALLBACK_HELP % default)
    # None: not given (FALLBACK_ROUNDS), so that it is refused where the fallback is off (_check_fallback_rounds).
    parser.add_argument("--fallback-rounds", type=_positive_int("--fallback-rounds"), default=None,
                        help=f"plain rounds after an estimate below --fallback-below (default {FALLBACK_ROUNDS})")


def _check_fallback_rounds(args, *, off_by_default: bool) -> None:
    """Refuses --fallback-rounds where no fallback happens (--fallback-below 0, or not given where
    `off_by_default`, as in eval): it would be accepted and do nothing. Where the default of
    --fallback-below depends on the drafter, `_fallback_below` refuses it once that is known."""
    if args.fallback_rounds is not None and (args.fallback_below == 0 or
                                             (args.fallback_below is None and off_by_default)):
        why = "is 0" if args.fallback_below == 0 else "is not given (default 0 here)"
        raise CliError(f"--fallback-rounds {args.fallback_rounds} does nothing: --fallback-below {why}, so decoding "
                       "never falls back to plain rounds; give --fallback-below above 0, or leave out "
                       "--fallback-rounds")


# The flags that only a drafter reads (generate and chat): with --verifier ar they would do nothing.
DRAFTER_FLAGS = ("drafter", "budget", "lookup", "corpus", "fallback_below", "fallback_rounds")


def _refuse_unread(args, names, why: str, remedy: str) -> None:
    """Refuses the flags among `names` (argparse dests whose default is None: not given) that were
    given where `why` says nothing reads them: they would be accepted and do nothing."""
    given = ", ".join(f"--{name.replace('_', '-')}" for name in names if getattr(args, name) is not None)
    if given:
        raise CliError(f"{given}: {why}; {remedy}, or leave out {given}")


def _fill_defaults(args, defaults: dict[str, Any]) -> None:
    """The defaults of flags whose argparse default is None (so that `_refuse_unread` sees them)."""
    for name, default in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, default)


def _check_drafter_flags(args, speculative: bool) -> None:
    """Refuses the drafter's flags without a drafter (--verifier ar), before the target loads."""
    if not speculative:
        _refuse_unread(args, DRAFTER_FLAGS, f"read only with a drafter, and --verifier {AUTOREGRESSIVE} decodes "
                       "without one", "choose a verifier")


def _check_corpus(args, ngrams) -> None:
    """Refuses a corpus chain where the drafter has no corpus table (`corpus_for` would make it 0)."""
    if args.corpus and ngrams is None:
        raise CliError(f"--corpus {args.corpus}: the drafter has no corpus table (corpus.npz in its directory), so "
                       "there is no corpus chain; leave out --corpus, or give a --drafter with one")


def _default_budget() -> int:
    """`tevjax generate`'s tree budget without --budget. On this repository's 2-core CPU the shipped
    drafter with both chains decodes at 1.49x of AR at budget 8 and 1.19x at 16 (all 256 held-out
    prompts; the README's measured section): every verified node costs the CPU target time, and
    the larger tree's tau (3.19 against 2.82) does not pay for it. On an accelerator, verifying 17
    positions of a model this size takes about as long as verifying 9 (memory-bound; not measured
    here), so the larger tree's tau wins."""
    import jax

    return 8 if jax.default_backend() == "cpu" else 16


def _check_lookup(args) -> None:
    for flag in ("lookup", "corpus"):
        value = getattr(args, flag, None)
        if value is not None and value > args.budget:
            raise CliError(f"--{flag} {value} exceeds --budget {args.budget}: a chain cannot take more "
                           "tree nodes than the budget holds")


def _note_truncation(args, temperatures: tuple[float, ...] | list[float] = ()) -> None:
    """A note where --top-k / --top-p / --min-p are given and every row is greedy: --temperature 0,
    and no .jsonl row (`temperatures`, each row's own or --temperature) samples with them."""
    from tevjax.law import GREEDY_BELOW
    from tevjax.sampling import truncates

    if max((args.temperature, *temperatures)) < GREEDY_BELOW and truncates(args.top_k, args.top_p, args.min_p):
        print("tevjax: note: --top-k, --top-p and --min-p change nothing when greedy (--temperature 0): "
              "the most probable token is always kept", file=sys.stderr)


def _float(name, minimum, inclusive):
    def parse(text):
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a number, got {text!r}") from None
        ok = value >= minimum if inclusive else value > minimum
        if not ok or value == float("inf"):
            raise argparse.ArgumentTypeError(f"{name} must be a finite number {'>=' if inclusive else '>'} {minimum}, got {text!r}")
        return value

    return parse


def _positive_float(name):
    return _float(name, 0.0, inclusive=False)


def _nonnegative_float(name):
    return _float(name, 0.0, inclusive=True)


def _weight(name):
    """A number in [0, 1]."""
    at_least_0 = _nonnegative_float(name)

    def parse(text):
        value = at_least_0(text)
        if value > 1:
            raise argparse.ArgumentTypeError(f"{name} must be a weight in [0, 1], got {text!r}")
        return value

    return parse


def _int_list(name, minimum):
    # Checked here, not where the values are used: `eval` would otherwise load the target first.
    # Spaces around an entry are allowed (int() strips them); spaces inside one are an error, not
    # removed: "4 8" is not 48.
    def parse(text):
        try:
            values = tuple(int(x) for x in text.split(",") if x.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be comma-separated integers, got {text!r}") from None
        if not values:
            raise argparse.ArgumentTypeError(f"{name} is empty")
        if min(values) < minimum:
            raise argparse.ArgumentTypeError(f"{name} must all be >= {minimum}, got {text!r}")
        # A repeated tap would feed a drafter one layer twice (and `tevjax data` failed only after
        # writing its plan); a repeated budget was measured once.
        twice = first_repeat(values)
        if twice is not None:
            raise argparse.ArgumentTypeError(f"{name} lists {twice} twice, got {text!r}")
        return values

    return parse


def _shard_range(text):
    first, sep, end = text.partition(":")
    try:
        first, end = int(first), int(end)
    except ValueError:
        first = end = None
    if not sep or first is None or not 0 <= first < end:
        raise argparse.ArgumentTypeError(f"--train-shards must be FIRST:END with 0 <= FIRST < END, got {text!r}")
    return first, end


def _temperature(text):
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"temperature must be a number, got {text!r}") from None
    if not valid_temperature(value):
        raise argparse.ArgumentTypeError(f"temperature must be a finite float32 number >= 0, got {text!r}")
    return value


def _fraction(name, *, zero: bool, one: bool):
    """A float in [0, 1], with 0 and 1 allowed as `zero` and `one` say."""
    span = f"{'[' if zero else '('}0, 1{']' if one else ')'}"

    def parse(text):
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a number in {span}, got {text!r}") from None
        if not ((0 < value or (zero and value == 0)) and (value < 1 or (one and value == 1))):
            raise argparse.ArgumentTypeError(f"{name} must be in {span}, got {text!r}")
        return value

    return parse


def _add_truncation_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--top-k", type=_nonnegative_int("--top-k"), default=0,
                   help="sample from the k most probable tokens only (default 0: off); exact, as AR with it")
    p.add_argument("--top-p", type=_fraction("--top-p", zero=False, one=True), default=1.0,
                   help="sample from the smallest most-probable set holding this much mass (default 1: off)")
    p.add_argument("--min-p", type=_fraction("--min-p", zero=True, one=False), default=0.0,
                   help="sample from the tokens at least this fraction as probable as the most probable "
                        "(default 0: off); top-k, top-p and min-p apply in that order, after --temperature")


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
        ids = [int(x) for x in text.split(",") if x.strip()]  # "1 2" is an error, not [12]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--prompt-ids must be comma-separated integers, got {text!r}") from None
    if not ids:
        raise argparse.ArgumentTypeError("--prompt-ids is empty")
    return ids


_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\"}


def _stop_string(text):
    """A --stop value with the escapes \\n, \\t, \\r and \\\\ read (a shell passes them as two
    characters); any other backslash is kept as it is."""
    out, i = [], 0
    while i < len(text):
        if text[i] == "\\" and i + 1 < len(text) and text[i + 1] in _ESCAPES:
            out.append(_ESCAPES[text[i + 1]])
            i += 2
        else:
            out.append(text[i])
            i += 1
    if not out:
        raise argparse.ArgumentTypeError("--stop is empty: it would match before the first token")
    return "".join(out)


def _add_mesh_args(parser, default: str) -> None:
    """--mesh and the multi-host flags (generate, eval, data and train share them)."""
    parser.add_argument("--mesh", default=None,
                        help=f"device mesh data=D,model=M[,expert=X]: rows over D devices, heads/MLP/vocabulary "
                             f"over M (over X x M with expert=X, which also splits a mixture-of-experts target's "
                             f"experts over X) (default: {default})")
    parser.add_argument("--coordinator", default=None, help="multi-host: coordinator address host:port")
    parser.add_argument("--num-processes", type=_positive_int("--num-processes"), default=None)
    parser.add_argument("--process-id", type=_nonnegative_int("--process-id"), default=None)
    parser.add_argument("--join-timeout", type=_positive_float("--join-timeout"), default=None, metavar="S",
                        help="multi-host: seconds to wait for every process to join, then stop (default: 300, "
                             "as jax.distributed)")
    parser.add_argument("--heartbeat-timeout", type=_positive_int("--heartbeat-timeout"), default=None, metavar="S",
                        help="multi-host: whole seconds without heartbeats after which a process counts as dead "
                             "(killed, out of memory) and the others are stopped (default: 100, as "
                             "jax.distributed)")


# The GGUF architectures are `tevjax.convert.gguf.SUPPORTED_ARCHITECTURES`, listed here rather than imported so
# that the CLI starts without loading the converter (a test keeps the two lists equal).
TARGET_HELP = ("'smollm2' (embedded default), a Hugging Face model directory or a .gguf file (llama, qwen2, qwen3, "
               "qwen3moe, qwen2moe, gemma2, gemma3, phi3, qwen3next, qwen35, qwen35moe, smollm3, granite, granitemoe, "
               "olmo2, olmoe, gpt-oss)")


MOE_DISPATCH_HELP = ("a mixture-of-experts target's experts: 'dense' runs every expert on every token, 'ragged' "
                     "groups the tokens by expert (jax.lax.ragged_dot); the same tokens either way (default: auto, "
                     "dense on a CPU and ragged elsewhere)")


# `tevjax.models.layers.MOE_DISPATCHES`, spelt out: building the parser imports no jax.
MOE_DISPATCHES = ("auto", "dense", "ragged")


def _add_moe_dispatch(parser) -> None:
    parser.add_argument("--moe-dispatch", choices=MOE_DISPATCHES, default="auto", help=MOE_DISPATCH_HELP)


def _moe_dispatch(args, target) -> None:
    """Sets --moe-dispatch on the target's routed layers (before a Decoder traces it)."""
    from tevjax.models import set_moe_dispatch

    if not set_moe_dispatch(target, args.moe_dispatch) and args.moe_dispatch != "auto":
        print(f"tevjax: note: --moe-dispatch {args.moe_dispatch} has no effect: the target has no experts",
              file=sys.stderr)


def _add_decoding_args(parser, *, max_new_tokens: int, seed_help: str, max_new_help: str | None = None) -> None:
    """The model, sampling and tree flags (generate and chat share them)."""
    parser.add_argument("--target", default="smollm2",
                        help=TARGET_HELP)
    parser.add_argument("--drafter", default=None,
                        help="DFlash checkpoint directory (default: the project's trained drafter, else a fresh one)")
    _add_moe_dispatch(parser)
    parser.add_argument("--max-new-tokens", type=_positive_int("--max-new-tokens"), default=max_new_tokens,
                        help=max_new_help)
    parser.add_argument("--temperature", type=_temperature, default=0.0,
                        help="0 = greedy (default); any value below 1e-5 is greedy too")
    _add_truncation_args(parser)
    parser.add_argument("--budget", type=_positive_int("--budget"), default=None,
                        help="draft tree budget, non-root nodes (default: 8 on a CPU, 16 on an accelerator)")
    parser.add_argument("--lookup", type=_nonnegative_int("--lookup"), default=None, help=LOOKUP_HELP)
    parser.add_argument("--corpus", type=_nonnegative_int("--corpus"), default=None, help=CORPUS_HELP)
    parser.add_argument("--verifier", default="tev",
                        help=f"{', '.join(verifier_choices(autoregressive=False))} (default tev), or "
                             f"{AUTOREGRESSIVE} (no drafter: the autoregressive baseline)")
    _add_fallback_args(parser, DEFAULT_FALLBACK_TEXT)
    parser.add_argument("--seed", type=_seed, default=0, help=seed_help)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                        help="compute dtype (default: the checkpoint's; use float32 on CPU)")


class _HiddenChoices(dict):
    """A subcommand table whose `hidden` names parse but are not listed: argparse names the choices
    in an invalid-choice error by iterating over this mapping."""

    def __init__(self, table: dict, hidden: set[str]):
        super().__init__(table)
        self.hidden = hidden

    def __iter__(self):
        return (name for name in super().__iter__() if name not in self.hidden)


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (the usage text stays available through --help)."""

    def error(self, message):
        self.exit(EXIT_USAGE, f"tevjax: error: {message}\n")


# `tevjax demo`'s model-part flags and their defaults (the flags' own defaults are None: not given).
DEMO_DEFAULTS = {"max_new_tokens": 64, "budget": 8, "repeats": 3}


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="tevjax", description="Lossless tree speculative decoding in JAX.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks of unexpected errors")
    # The choices shown: `train-export` is reached as `tevjax train export RUN DIR` and not listed
    # (before Python 3.13 a hidden subcommand still showed, with its help as "==SUPPRESS==").
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser,
                                metavar="{generate,chat,data,train,eval,demo}")

    gen = sub.add_parser("generate", help="generate text with DFlash + DDTree + an exact verifier")
    src = gen.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-ids", type=_prompt_ids, help="raw token ids, comma-separated (no chat template)")
    src.add_argument("--batch-file", type=Path,
                     help="a file with one prompt per line; a .jsonl file holds one JSON object per line instead: "
                          '"prompt" (text) or "prompt_ids" (token ids, no chat template), and optionally the '
                          'prompt\'s own "temperature", "top_k", "top_p", "min_p", "max_new_tokens" (at most '
                          '--max-new-tokens) and "stop" (a list of strings, in place of --stop)')
    # None: not given (on), so that --chat with --prompt-ids, which has no text to wrap, is refused.
    gen.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                     help="wrap text prompts in the model's chat template (default: on)")
    _add_decoding_args(gen, max_new_tokens=128, seed_help="sampling seed, an integer in [0, 2**64)")
    gen.add_argument("--batch-size", type=_positive_int("--batch-size"), default=None,
                     help="prompts decoded together (with --batch-file; default 1)")
    gen.add_argument("--continuous", action="store_true",
                     help="with --batch-file: continuous batching, --batch-size rows kept busy, a row taking the next "
                          "prompt as soon as its prompt ends; each prompt is printed as it ends, and its seconds run "
                          "from the start of decoding (the refills compile on first use, within that time)")
    gen.add_argument("--json", action="store_true", help="one JSON object per prompt on stdout")
    gen.add_argument("--logprobs", action="store_true",
                     help="with --json: each token's log-probability under the target (before temperature and "
                          "truncation)")
    gen.add_argument("--stop", type=_stop_string, action="append", default=None, metavar="TEXT",
                     help="stop a prompt's output once its text holds TEXT, which is left out of the printed text "
                          "(repeatable; \\n, \\t, \\r and \\\\ are read as escapes)")
    _add_mesh_args(gen, "one device")
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="a conversation in the terminal, every reply decoded with DFlash + DDTree + "
                                       "an exact verifier")
    chat.add_argument("--system", default=None, help="a system message that opens the conversation")
    _add_decoding_args(chat, max_new_tokens=256, max_new_help="per reply",
                       seed_help="sampling seed of the first reply (the k-th uses seed + k)")
    chat.set_defaults(func=cmd_chat)

    data = sub.add_parser("data", help="regenerate training data: ShareGPT prompts, target responses, tapped features")
    data.add_argument("--target", default="smollm2", help=TARGET_HELP)
    data.add_argument("--num-prompts", type=_positive_int("--num-prompts"), required=True, help="training prompts")
    data.add_argument("--max-new-tokens", type=_positive_int("--max-new-tokens"), default=256)
    data.add_argument("--out", type=Path, required=True, help="data directory to create (or complete with --resume)")
    data.add_argument("--resume", action="store_true", help="complete an interrupted run in --out")
    data.add_argument("--train-shards", type=_shard_range, default=None, metavar="FIRST:END",
                      help="generate only these training shards (0-based, END excluded) and the held-out ones, "
                           "e.g. to add new records in a later session or to split the work across hosts")
    data.add_argument("--heldout", type=_nonnegative_int("--heldout"), default=256, help="held-out prompts (never trained on)")
    data.add_argument("--heldout-records", type=_nonnegative_int("--heldout-records"), default=None,
                      help="held-out prompts that also get regenerated responses, for training-time evaluation "
                           "(default 64, or --heldout if fewer)")
    data.add_argument("--max-prompt-tokens", type=_positive_int("--max-prompt-tokens"), default=256)
    data.add_argument("--batch-size", type=_positive_int("--batch-size"), default=64, help="prompts per generate call (= per shard)")
    data.add_argument("--taps", type=_int_list("--taps", 0), default=None,
                      help="target layers whose hidden states are stored (default: 5 evenly spaced from 1 to L-3, plus L-1)")
    data.add_argument("--seed", type=_seed, default=0, help="prompt order")
    data.add_argument("--responses", choices=["target", "sharegpt"], default="target",
                      help="training responses: the target's greedy continuations (default), or ShareGPT's original "
                           "first replies (cheap extra text: one prefill per record); held-out records are always the target's")
    data.add_argument("--turns", choices=["first", "later"], default="first",
                      help="training prompts: ShareGPT's first human turns (default; ~7.8k fit 256 tokens), or every "
                           "later human turn taken alone (~32k fit); held-out prompts are first turns either way")
    data.add_argument("--exclusion", choices=["source", "conversation"], default="source",
                      help="what training prompts leave out around the held-out ones: every turn of their ShareGPT "
                           "conversations (default), or only the held-out records, as plans made before 2026-12-05 "
                           "did; a --resume'd directory keeps its own")
    data.add_argument("--no-progress", action="store_true", help="no progress bar (JSON lines only)")
    _add_mesh_args(data, "one device")
    data.set_defaults(func=cmd_data)

    tr = sub.add_parser("train", help="train a DFlash drafter (token loss + ExitTrain); `tevjax train export RUN DIR` exports")
    tr.add_argument("--target", default="smollm2", help=TARGET_HELP)
    tr.add_argument("--data", type=Path, required=True, help="a `tevjax data` directory")
    tr.add_argument("--out", type=Path, required=True, help="run directory (checkpoints, logs)")
    tr.add_argument("--steps", type=_positive_int("--steps"), required=True, help="total optimizer steps")
    tr.add_argument("--layers", type=_positive_int("--layers"), default=None,
                    help="drafter layers (default 1); with --init, more layers than the drafter has appends new "
                         "ones that start as the identity (a deeper drafter warm-started from a trained one)")
    tr.add_argument("--block-size", type=_positive_int("--block-size"), default=None,
                    help="a fresh drafter's block size (default 16)")
    tr.add_argument("--taps", type=_int_list("--taps", 0), default=None,
                    help="target layers the drafter reads (default: every layer stored in --data)")
    tr.add_argument("--init", default=None, help="start from this DFlash drafter directory instead of a fresh one")
    tr.add_argument("--mask-token", type=_nonnegative_int("--mask-token"), default=None,
                    help="the fresh drafter's mask token id, one that text never contains (default: chosen from the "
                         "target's tokenizer)")
    tr.add_argument("--draft-vocab", type=_nonnegative_int("--draft-vocab"), default=0,
                    help="fresh drafter: score only the K most frequent response tokens of --data (plus end-of-turn) "
                         "through those rows of the target's LM head; 0 = the whole vocabulary")
    tr.add_argument("--exit-lambda", type=_nonnegative_float("--exit-lambda"), default=0.1, help="0 = token loss only")
    # The --exit-* flags' defaults are None (not given; EXIT_DEFAULTS), so that they are refused
    # with --exit-lambda 0, which turns the exit loss off.
    tr.add_argument("--exit-weight", default=None, help="w (default), w_depth, P_floored or P_rescaled")
    tr.add_argument("--exit-budget", type=_positive_int("--exit-budget"), default=None,
                    help="tree budget of the exit loss (default 8)")
    tr.add_argument("--exit-temperature", type=_positive_float("--exit-temperature"), default=None,
                    help="target temperature of the exit loss's law (default 1)")
    tr.add_argument("--exit-top-k", type=_nonnegative_int("--exit-top-k"), default=None,
                    help="top-k of the exit loss's target law: the sampling you will decode with (default 0: off)")
    tr.add_argument("--exit-top-p", type=_fraction("--exit-top-p", zero=False, one=True), default=None,
                    help="top-p of the exit loss's target law (default 1: off)")
    tr.add_argument("--exit-min-p", type=_fraction("--exit-min-p", zero=True, one=False), default=None,
                    help="min-p of the exit loss's target law (default 0: off)")
    tr.add_argument("--exit-anchors", type=_positive_int("--exit-anchors"), default=None,
                    help="anchors per sequence with a tree, at most --anchors (default: 8, or --anchors if fewer)")
    tr.add_argument("--exit-sequences", type=_positive_int("--exit-sequences"), default=None,
                    help="sequences per batch whose anchors get trees (default: all); fewer sequences with more "
                         "--exit-anchors each give the same trees from fewer target tokens")
    tr.add_argument("--lr", type=_positive_float("--lr"), default=6e-4)
    tr.add_argument("--warmup", type=_nonnegative_float("--warmup"), default=0.04, help="warmup fraction of --steps")
    tr.add_argument("--weight-decay", type=_nonnegative_float("--weight-decay"), default=0.0)
    tr.add_argument("--gamma", type=_nonnegative_float("--gamma"), default=7.0, help="token-loss position decay; 0 = off")
    tr.add_argument("--distill", type=_weight("--distill"), default=0.0,
                    help="weight a in [0, 1] of soft labels: the token loss becomes (1 - a) * cross entropy on the data "
                         "token + a * cross entropy on the target's own distribution (read from the stored last-layer "
                         "state, so the drafter must tap the target's last layer); 0 = data tokens only")
    tr.add_argument("--batch", type=_positive_int("--batch"), default=8, help="sequences per global batch")
    tr.add_argument("--anchors", type=_positive_int("--anchors"), default=32, help="anchor blocks per sequence")
    tr.add_argument("--seq-len", type=_positive_int("--seq-len"), default=512)
    tr.add_argument("--seed", type=_seed, default=0)
    tr.add_argument("--resume", action="store_true", help="continue the run in --out from its last checkpoint")
    tr.add_argument("--until", type=_positive_int("--until"), default=None, help="stop (with a checkpoint) after this step")
    tr.add_argument("--checkpoint-every", type=_positive_float("--checkpoint-every"), default=300.0, help="seconds")
    tr.add_argument("--eval-every", type=_positive_float("--eval-every"), default=600.0, help="seconds between held-out evaluations")
    _add_mesh_args(tr, "every device on data")
    tr.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                    help="compute dtype (bfloat16 on GPUs keeps float32 master weights)")
    tr.add_argument("--no-progress", action="store_true")
    tr.set_defaults(func=cmd_train)

    ex = sub.add_parser("train-export", prog="tevjax train export")  # reached as `tevjax train export RUN DIR`
    sub._choices_actions = [a for a in sub._choices_actions if a.dest != "train-export"]  # not listed in help
    ex.add_argument("run_dir", type=Path)
    ex.add_argument("drafter_dir", type=Path)
    ex.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    ex.set_defaults(func=cmd_export)

    ev = sub.add_parser("eval", help="tau, tokens/s and speedup against autoregressive decoding, per budget")
    ev.add_argument("--target", default="smollm2", help=TARGET_HELP)
    ev.add_argument("--drafter", default=None, help="DFlash drafter directory (default: the shipped one)")
    _add_moe_dispatch(ev)
    ev.add_argument("--prompts", default="heldout",
                    help="a file with one prompt per line, or heldout[:DATA_DIR], mtbench, humaneval, gsm")
    ev.add_argument("--num-prompts", type=_positive_int("--num-prompts"), default=8)
    ev.add_argument("--budgets", type=_int_list("--budgets", 1), default=(4, 8, 16, 32))
    ev.add_argument("--lookup", type=_nonnegative_int("--lookup"), default=None,
                    help=LOOKUP_HELP + "; capped at each budget")
    ev.add_argument("--corpus", type=_nonnegative_int("--corpus"), default=None,
                    help=CORPUS_HELP + "; capped at each budget")
    ev.add_argument("--temperature", type=_temperature, default=0.0)
    _add_truncation_args(ev)
    ev.add_argument("--verifier", default="tev",
                    help=f"{', '.join(verifier_choices(autoregressive=False))} (default tev)")
    _add_fallback_args(ev, "0, so that tau measures the trees")
    ev.add_argument("--max-new-tokens", type=_positive_int("--max-new-tokens"), default=128)
    ev.add_argument("--batch-size", type=_positive_int("--batch-size"), default=1)
    ev.add_argument("--seed", type=_seed, default=0)
    ev.add_argument("--json", action="store_true", help="one JSON object on stdout")
    _add_mesh_args(ev, "one device")
    ev.set_defaults(func=cmd_eval)

    demo = sub.add_parser("demo", help="the main demonstration on the embedded default")
    # None: not given (DEMO_DEFAULTS), so that the model part's flags are refused with --skip-models.
    demo.add_argument("--max-new-tokens", type=_positive_int("--max-new-tokens"), default=None,
                      help=f"per prompt and method (default {DEMO_DEFAULTS['max_new_tokens']})")
    demo.add_argument("--budget", type=_positive_int("--budget"), default=None,
                      help="draft tree budget (8: the best measured speed of the shipped drafter on 2 CPU cores)")
    demo.add_argument("--lookup", type=_nonnegative_int("--lookup"), default=None, help=LOOKUP_HELP)
    demo.add_argument("--corpus", type=_nonnegative_int("--corpus"), default=None, help=CORPUS_HELP)
    demo.add_argument("--samples", type=_positive_int("--samples"), default=50_000,
                      help="verifier draws for the synthetic exit-law table")
    demo.add_argument("--repeats", type=_positive_int("--repeats"), default=None,
                      help=f"timed repeats per prompt and method (the speedup is their median; default "
                           f"{DEMO_DEFAULTS['repeats']})")
    demo.add_argument("--skip-models", action="store_true", help="only the synthetic exit-law part")
    demo.set_defaults(func=cmd_demo)
    sub.choices = _HiddenChoices(sub.choices, {"train-export"})  # `tevjax foo` lists what users type
    return parser


# ------------------------------------------------------------------------------------- generate


def _utf8(text: str, what: str) -> str:
    """`text` from the command line or stdin, which Python decodes with surrogate escapes: a byte
    that is not UTF-8 shows up as a lone surrogate, which no tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise CliError(f"{what} is not UTF-8 text (byte 0x{ord(text[e.start]) - 0xDC00:02x} at character "
                       f"{e.start})") from None
    return text


def _read_prompts(args) -> tuple[list[str | list[int]], list[str], list[dict[str, Any]]]:
    """(prompts, where each came from -- "--prompt", or "line 3 of FILE" for error messages -- and
    each prompt's own settings: a .jsonl batch file's sampling settings, "max_new_tokens" and "stop")."""
    if args.prompt_ids is not None:
        return [args.prompt_ids], ["--prompt-ids"], [{}]
    if args.prompt is not None:
        if not _utf8(args.prompt, "--prompt").strip():
            raise CliError("--prompt is empty")
        return [args.prompt], ["--prompt"], [{}]
    name = str(args.batch_file)
    if not args.batch_file.is_file():
        raise CliError(f"--batch-file {name!r}: " + ("a directory, not a file" if args.batch_file.is_dir() else
                                                     "no such file"))
    raw = args.batch_file.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise CliError(f"--batch-file {name!r}: not UTF-8 text (bad byte 0x{raw[e.start]:02x} on line {line})") from None
    text = text.removeprefix("\ufeff")  # a byte-order mark is not part of the first prompt
    # One prompt per "\n"-terminated line: str.splitlines() would also split at form feeds,
    # U+2028 and other characters that belong inside a prompt.
    prompts, where, settings = [], [], []
    suffix = args.batch_file.suffix.lower()
    jsonl = suffix == ".jsonl"
    if suffix == ".json":  # read as text, each of its lines would be a prompt
        raise CliError(f"--batch-file {name!r}: a .json file is not a batch file: give a text file (one prompt per "
                       "line) or a .jsonl file (one JSON object per line)")
    for n, line in enumerate(text.split("\n"), start=1):
        line = line.removesuffix("\r")
        if line.strip():
            prompt, own = _jsonl_record(line, f"--batch-file {name!r}: line {n}", args) if jsonl else (line, {})
            prompts.append(prompt)
            where.append(f"line {n} of {name}")
            settings.append(own)
    if not prompts:
        raise CliError(f"--batch-file {name!r} holds no prompts")
    return prompts, where, settings


# top_k, top_p, min_p: (whether a JSON value is one, what it must be) -- what `check_truncation` takes.
_TRUNCATION_CHECKS = {
    "top_k": (lambda v: isinstance(v, int) and 0 <= v < 2**31, "an integer >= 0 (0: off)"),
    "top_p": (lambda v: isinstance(v, (int, float)) and math.isfinite(v) and 0 < v <= 1, "a number in (0, 1] (1: off)"),
    "min_p": (lambda v: isinstance(v, (int, float)) and math.isfinite(v) and 0 <= v < 1, "a number in [0, 1) (0: off)"),
}


class _RepeatedKey(ValueError):
    """A JSON object that gives a key twice (json.loads would keep the last value, in silence)."""


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """json.loads's object_pairs_hook: the object, unless it repeats a key."""
    twice = first_repeat(k for k, _ in pairs)
    if twice is not None:
        raise _RepeatedKey(twice)
    return dict(pairs)


def _jsonl_record(line: str, where: str, args) -> tuple[str | list[int], dict[str, Any]]:
    """A .jsonl batch file's line -> (its prompt, its own settings), or a CliError naming the line."""
    try:
        record = json.loads(line, object_pairs_hook=_object)
    except json.JSONDecodeError as e:
        raise CliError(f"{where}: not a JSON object ({e.msg} at column {e.colno})") from None
    except _RepeatedKey as e:
        raise CliError(f"{where}: key {json.dumps(e.args[0])} appears twice") from None
    if not isinstance(record, dict):
        raise CliError(f"{where}: not a JSON object, got {type(record).__name__}")
    from tevjax.decode.engine import SAMPLING_COLUMNS  # a record's own sampling settings, as a row's

    unknown = sorted(set(record) - {"prompt", "prompt_ids", *SAMPLING_COLUMNS, "max_new_tokens", "stop"})
    if unknown:
        raise CliError(f"{where}: unknown key(s) {', '.join(map(repr, unknown))} (a record has \"prompt\" or "
                       "\"prompt_ids\", and optionally \"temperature\", \"top_k\", \"top_p\", \"min_p\", "
                       "\"max_new_tokens\" and \"stop\")")
    if ("prompt" in record) == ("prompt_ids" in record):
        raise CliError(f"{where}: give one of \"prompt\" (text) and \"prompt_ids\" (token ids)")
    if "prompt" in record:
        prompt = record["prompt"]
        if not isinstance(prompt, str) or not prompt.strip():
            raise CliError(f"{where}: \"prompt\" must be non-empty text, got {prompt!r}")
    else:
        prompt = record["prompt_ids"]
        if (not isinstance(prompt, list) or not prompt
                or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt)):
            raise CliError(f"{where}: \"prompt_ids\" must be a non-empty list of token ids >= 0, got {prompt!r}")
    own: dict[str, Any] = {}
    if "temperature" in record:
        t = record["temperature"]
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not valid_temperature(t):
            raise CliError(f"{where}: \"temperature\" must be a finite float32 number >= 0, got {t!r}")
        own["temperature"] = float(t)
    for key, (ok, what) in _TRUNCATION_CHECKS.items():
        if key in record:
            v = record[key]
            if isinstance(v, bool) or not ok(v):
                raise CliError(f"{where}: \"{key}\" must be {what}, got {v!r}")
            own[key] = v
    if "max_new_tokens" in record:
        m = record["max_new_tokens"]
        if isinstance(m, bool) or not isinstance(m, int) or not 1 <= m <= args.max_new_tokens:
            raise CliError(f"{where}: \"max_new_tokens\" must be an integer in [1, {args.max_new_tokens}] "
                           f"(--max-new-tokens), got {m!r}")
        own["max_new_tokens"] = m
    if "stop" in record:
        stop = record["stop"]
        if not isinstance(stop, list) or not all(isinstance(x, str) and x for x in stop):
            raise CliError(f"{where}: \"stop\" must be a list of non-empty strings, got {stop!r}")
        own["stop"] = tuple(dict.fromkeys(stop))
    return prompt, own


def _check_positions(args, speculative: bool) -> None:
    """Refuses, before the slow model load, a --max-new-tokens / --budget the target cannot hold
    even for a one-token prompt (the position limit is read from the config alone)."""
    from tevjax.models.config import ModelConfig

    if args.target == "smollm2":
        from tevjax.convert.embedded import prepare_smollm2

        config_dir = prepare_smollm2()
    else:
        config_dir = Path(args.target)
        if not (config_dir / "config.json").is_file():
            return  # load_models names what is missing
    limit = ModelConfig.from_hf_config(config_dir).max_position_embeddings
    slots = args.budget + 1 if speculative else 1
    need = 1 + args.max_new_tokens + slots
    if need > limit:
        what = f"{slots} tree slots (--budget {args.budget} + root)" if speculative else "1 slot for the next token"
        raise CliError(f"--max-new-tokens {args.max_new_tokens} + {what} need {need} positions with even a "
                       f"1-token prompt, which exceeds the target's {limit} positions")


def _encode(models, prompts, chat: bool) -> list[list[int]]:
    """Token ids of each prompt: id prompts as they are, text through the chat template (`chat`) or
    the tokenizer alone."""
    texts = [p for p in prompts if not isinstance(p, list)]
    if not texts:
        return list(prompts)
    tok = models.tokenizer
    if tok is None:
        raise CliError("this target has no tokenizer: give --prompt-ids (or \"prompt_ids\" in a .jsonl batch file)")
    if chat:
        from tevjax.convert.tokenizer import chat_prompt_ids

        if not getattr(tok, "chat_template", None):
            source = Path(getattr(tok, "name_or_path", "") or ".") / "tokenizer_config.json"
            raise CliError(f"this target's tokenizer has no chat template ({source} has no 'chat_template'): "
                           "use --no-chat")
        encode = functools.partial(chat_prompt_ids, tok)
    else:  # a plain prompt gets what the tokenizer adds to any text (Llama 3's BOS; none for SmolLM2)
        encode = tok.encode
    return [p if isinstance(p, list) else encode(p) for p in prompts]


def _decode(models, ids: list[int]) -> str:
    """The text of `ids`; without a tokenizer, the ids themselves (never an empty line)."""
    if models.tokenizer is None:
        return json.dumps(ids)
    return models.tokenizer.decode(ids, skip_special_tokens=True)


def cmd_generate(args) -> int:
    _check_verifier(args.verifier, autoregressive=True)
    speculative = args.verifier != AUTOREGRESSIVE
    if args.logprobs and not args.json:
        raise CliError("--logprobs needs --json: the log-probabilities are a field of each JSON record")
    if args.continuous and args.batch_file is None:
        raise CliError("--continuous needs --batch-file (continuous batching refills rows from its prompts)")
    if args.batch_size is not None and args.batch_file is None:
        raise CliError("--batch-size needs --batch-file: --prompt and --prompt-ids give one prompt")
    args.batch_size = args.batch_size or 1
    if args.chat and args.prompt_ids is not None:
        raise CliError("--chat wraps text prompts in the chat template, and --prompt-ids are token ids, used as "
                       "they are: leave out --chat, or give --prompt")
    prompts, where, settings = _read_prompts(args)  # cheap checks before the (slow) model load
    # Each prompt's stop strings (a .jsonl record's "stop", else --stop): rows watch theirs among
    # the union of all (DecodeConfig.stop), which one automaton holds.
    from tevjax.decode.stops import MAX_STOPS

    for stop in args.stop or ():
        _utf8(stop, "--stop")
    row_stops = [own.get("stop", tuple(args.stop or ())) for own in settings]
    stops = tuple(dict.fromkeys(s for row in [tuple(args.stop or ()), *row_stops] for s in row))
    if len(stops) > MAX_STOPS:
        raise CliError(f"{len(stops)} distinct stop strings in --stop and the batch file: at most {MAX_STOPS}")
    _check_drafter_flags(args, speculative)
    _check_fallback_rounds(args, off_by_default=False)
    mesh = _mesh(args, default_all=False)
    if args.budget is None:
        args.budget = _default_budget()
    _check_positions(args, speculative)
    _check_lookup(args)
    _note_truncation(args, [own.get("temperature", args.temperature) for own in settings])

    from tevjax.decode.engine import SAMPLING_COLUMNS, Interrupted
    from tevjax.decode.stops import StopText, cut_text
    from tevjax.evaluate import truncation_text
    from tevjax.loading import load_models
    from tevjax.multihost import check_same

    t0 = time.perf_counter()
    models = load_models(args.target, args.drafter, dtype=args.dtype, mesh=mesh, with_drafter=speculative)
    _moe_dispatch(args, models.target)
    load_seconds = time.perf_counter() - t0
    for note in models.notes:
        print(f"tevjax: note: {note}", file=sys.stderr)
    _check_corpus(args, models.ngrams)
    ids = _encode(models, prompts, args.chat is not False)
    check_same("the prompts", ids)  # in a multi-host job: the same file on every host
    vocab = models.target_cfg.vocab_size
    limit = models.target_cfg.max_position_embeddings
    slots = args.budget + 1 if speculative else 1
    # Every prompt is checked before any is generated, so a bad line 2 costs no generation of line 1.
    for i, p in enumerate(ids):
        if not p:
            raise CliError(f"prompt {i} ({where[i]}) encodes to no tokens")
        bad = [t for t in p if not 0 <= t < vocab]
        if bad:
            raise CliError(f"prompt {i} ({where[i]}) holds token id {bad[0]} outside the vocabulary [0, {vocab})")
        if len(p) + args.max_new_tokens + slots > limit:
            raise CliError(f"prompt {i} ({where[i]}) is {len(p)} tokens: with --max-new-tokens {args.max_new_tokens} "
                           f"and {slots} tree slots it exceeds the target's {limit} positions")

    # A .jsonl batch file's own sampling settings and lengths (the flags' values elsewhere): rows of
    # one batch sample with theirs (DecodeConfig.sampling_per_row, on only when they differ).
    sampling = {key: [own.get(key, getattr(args, key)) for own in settings] for key in SAMPLING_COLUMNS}
    temperatures = sampling["temperature"]
    limits = [own.get("max_new_tokens", args.max_new_tokens) for own in settings]
    per_row = any(v != getattr(args, key) for key, values in sampling.items() for v in values)
    own_stops = any("stop" in own for own in settings)
    cfg = _decode_config(args, models, speculative, stop=stops, logprobs=args.logprobs, sampling_per_row=per_row,
                         temperatures=temperatures)
    decoder = _decoder(models.target, models.drafter if speculative else None, cfg, mesh, models.ngrams,
                       spellings=_spellings(models, stops))
    # Streaming prints row 0 as it grows; a multi-host job prints once, at the end.
    stream = not args.json and not args.continuous and len(ids) == 1 and (mesh is None or jax_process_count() == 1)
    failed: list[str] = []

    def report(start, batch, gens, seconds, compile_seconds):
        """Prints a batch's records; None entries (rows an interrupt left unfinished) are skipped."""
        for j, g in enumerate(gens):
            if g is None:
                continue
            if g.stop == "nonfinite":  # reported after the rows that did finish are printed
                failed.append(f"prompt {start + j} ({where[start + j]})")
                continue
            record = {
                "index": start + j,  # the prompt's line among the prompts (printed out of order with --continuous)
                "prompt": prompts[start + j] if isinstance(prompts[start + j], str) else None,
                "prompt_ids": batch[j],
                "tokens": g.tokens,
                "text": cut_text(_decode(models, g.tokens), row_stops[start + j])[0],  # unchanged without stops
                "rounds": g.rounds,
                "plain_rounds": g.plain_rounds,
                "tau": round(g.tau, 4),
                "stop": g.stop,
                **({"logprobs": [round(x, 5) for x in g.logprobs]} if args.logprobs else {}),
                "seconds": round(seconds, 4),
                "tokens_per_second": round(len(g.tokens) / seconds, 3) if seconds > 0 else None,
                "verifier": args.verifier,
                "budget": args.budget if speculative else 0,
                "lookup": cfg.lookup if speculative else 0,
                "corpus": cfg.corpus if speculative else 0,
                "fallback_below": cfg.fallback_below if speculative else 0.0,
                **{key: sampling[key][start + j] for key in SAMPLING_COLUMNS},
                "max_new_tokens": limits[start + j],
                "drafter_trained": models.drafter_trained if speculative else None,
                "compile_seconds": round(compile_seconds, 3),
                "load_seconds": round(load_seconds, 3),
            }
            if args.json:
                print(json.dumps(record), flush=True)
            else:
                if not stream:
                    print(record["text"])
                print(f"[tevjax] {len(g.tokens)} tokens in {seconds:.2f} s "
                      f"({record['tokens_per_second']} tok/s), {g.rounds} rounds{_plain_text(g)}, tau {g.tau:.2f}, "
                      f"verifier {args.verifier}, budget {record['budget']}, lookup {record['lookup']}, "
                      f"corpus {record['corpus']}, "
                      f"temperature {temperatures[start + j]}"
                      f"{truncation_text(*(sampling[key][start + j] for key in SAMPLING_COLUMNS[1:]))} "
                      f"(compile {compile_seconds:.1f} s, load {load_seconds:.1f} s)", flush=True)

    if args.continuous:
        rows = -(-args.batch_size // decoder.row_multiple) * decoder.row_multiple
        compile_seconds = decoder.compile(ids[:rows], continuous=True)
        t1 = time.perf_counter()
        reported: set[int] = set()
        try:
            for i, g in decoder.continuous(ids, rows, seed=args.seed, max_new_tokens=limits,
                                           **({key: sampling[key] for key in SAMPLING_COLUMNS} if per_row else {}),
                                           stop=row_stops if own_stops else None):
                report(i, [ids[i]], [g], time.perf_counter() - t1, compile_seconds)
                reported.add(i)
        except Interrupted as e:  # the prompts read in the interrupted call, then main() exits with 130
            for i, g in enumerate(e.results or []):
                if g is not None and i not in reported:
                    report(i, [ids[i]], [g], time.perf_counter() - t1, compile_seconds)
            raise
    else:
        for start in range(0, len(ids), args.batch_size):
            batch = ids[start: start + args.batch_size]
            part = slice(start, start + args.batch_size)
            # first_row: prompt i samples with stream i whatever the batch size (as with --continuous),
            # not the stream of its row in its batch, which every batch would repeat.
            own = dict(max_new_tokens=limits[part], stop=row_stops[part] if own_stops else None,
                       **({key: sampling[key][part] for key in SAMPLING_COLUMNS} if per_row else {}))
            decoder.shapes([len(p) for p in batch])  # capacity / position checks before compiling
            compile_seconds = decoder.compile(batch, streaming=stream)
            t1 = time.perf_counter()
            if stream:
                from tevjax.convert.tokenizer import StreamDetokenizer

                # Holds back the bytes of an unfinished character (an emoji spans several tokens),
                # so what streams is exactly the final text (_decode), never a stray U+FFFD.
                detok = StreamDetokenizer(models.tokenizer) if models.tokenizer is not None else None
                # With --stop, a tail that may begin a stop string waits until the next tokens decide.
                shown = StopText(row_stops[start]) if row_stops[start] else None
                try:
                    for new, state in decoder.stream(batch, seed=args.seed, first_row=start, **own):
                        if detok is not None:
                            piece = detok.feed(new[0])
                            print(shown.feed(piece) if shown else piece, end="", flush=True)
                except KeyboardInterrupt:
                    print(flush=True)  # end the partial line; main() reports the interrupt
                    raise
                gens = decoder.results(state)
                # Without a tokenizer the ids are the output (printed once, at the end).
                rest = detok.flush() if detok is not None else _decode(models, gens[0].tokens)
                print(shown.feed(rest) + shown.flush() if shown else rest)
            else:
                try:
                    gens = decoder.generate(batch, seed=args.seed, first_row=start, **own)
                except Interrupted as e:
                    # Ctrl-C is answered after the loop call in flight (a fraction of a second): the
                    # rows of this batch that had finished are printed, then main() exits with 130.
                    report(start, batch, e.results or [], time.perf_counter() - t1, compile_seconds)
                    raise
            report(start, batch, gens, time.perf_counter() - t1, compile_seconds)
    if failed:
        raise CliError(f"the target {args.target!r} produced non-finite logits for {', '.join(failed)}: its weights "
                       f"are damaged or overflow in this dtype; no tokens were emitted from that point")
    return 0


def _plain_text(g) -> str:
    """", 12 of them plain" where --fallback-below made rounds step on the root alone."""
    return f", {g.plain_rounds} of them plain" if g.plain_rounds else ""


def _decode_config(args, models, speculative: bool, temperatures: list[float] | None = None, **kw):
    """The DecodeConfig of `generate` and `chat` (their flags are the same); `temperatures`: the
    rows' own, where a batch file gives them (the fallback's default looks at them)."""
    from tevjax.decode.engine import DecodeConfig
    from tevjax.evaluate import corpus_for, lookup_for

    # Without a drafter the config's verifier is never used: any valid name will do.
    return DecodeConfig(verifier=args.verifier if speculative else "tev", budget=args.budget,
                        lookup=lookup_for(args.budget, args.lookup),  # checked <= budget before
                        corpus=corpus_for(args.budget, args.corpus, models.ngrams),
                        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                        max_new_tokens=args.max_new_tokens, eos_ids=models.eos_ids,
                        fallback_below=_fallback_below(args, models.drafter_trained, temperatures) if speculative
                        else 0.0,
                        fallback_rounds=args.fallback_rounds or FALLBACK_ROUNDS, **kw)


# ------------------------------------------------------------------------------------------ chat

# Conversations grow turn by turn: coarse buckets keep recompiles (one per new prompt bucket or
# cache capacity, seconds each) to every few turns.
CHAT_PROMPT_BUCKET, CHAT_CAPACITY_BUCKET = 256, 512


def cmd_chat(args) -> int:
    _check_verifier(args.verifier, autoregressive=True)
    speculative = args.verifier != AUTOREGRESSIVE
    if sys.stdin is None:  # Python's stdin when file descriptor 0 is closed (`tevjax chat <&-`)
        raise CliError("stdin is closed: a chat reads its messages from stdin (a terminal, or one message per line "
                       "of piped input)")
    if args.system is not None and not _utf8(args.system, "--system").strip():
        raise CliError("--system is empty")
    _check_drafter_flags(args, speculative)
    _check_fallback_rounds(args, off_by_default=False)
    if args.budget is None:
        args.budget = _default_budget()
    _check_positions(args, speculative)
    _check_lookup(args)
    _note_truncation(args)

    from tevjax.chat import Conversation, run_chat
    from tevjax.evaluate import truncation_text
    from tevjax.loading import load_models

    models = load_models(args.target, args.drafter, dtype=args.dtype, with_drafter=speculative)
    _moe_dispatch(args, models.target)
    for note in models.notes:
        print(f"tevjax: note: {note}", file=sys.stderr)
    _check_corpus(args, models.ngrams)
    tok = models.tokenizer
    if tok is None or not getattr(tok, "chat_template", None):
        raise CliError(f"the target {args.target!r} has no tokenizer with a chat template, which a chat needs: "
                       f"use `tevjax generate --no-chat` or `--prompt-ids`")
    if args.system is not None:  # a template that refuses system messages fails here, not every turn
        from tevjax.convert.tokenizer import chat_prompt_ids

        chat_prompt_ids(tok, [{"role": "system", "content": args.system}, {"role": "user", "content": "Hello"}])
    cfg = _decode_config(args, models, speculative, prompt_bucket=CHAT_PROMPT_BUCKET,
                         capacity_bucket=CHAT_CAPACITY_BUCKET)
    decoder = _decoder(models.target, models.drafter if speculative else None, cfg, None, models.ngrams)
    try:
        conversation = Conversation(tok, models.target_cfg.max_position_embeddings,
                                    args.max_new_tokens + decoder.tree_slots, system=args.system)
    except ValueError as e:
        raise CliError(f"--system: {e} (--max-new-tokens and the tree)") from None
    interactive = sys.stdin.isatty()
    # Python decodes stdin with surrogate escapes only in the C / POSIX / C.UTF-8 locales (or UTF-8
    # mode); in others, such as en_US.UTF-8, a byte that is not UTF-8 raised UnicodeDecodeError from
    # the read and ended the chat (even the lines before it in the same buffered chunk went
    # unanswered). With surrogate escapes, `_utf8` refuses that line alone.
    if hasattr(sys.stdin, "reconfigure"):  # a TextIOWrapper; not io.StringIO
        sys.stdin.reconfigure(errors="surrogateescape")

    def read():
        while True:
            try:
                line = input("user> ") if interactive else (sys.stdin.readline() or None)
            except EOFError:
                print(file=sys.stderr)
                return None
            try:
                return line if line is None else _utf8(line, "this message")
            except CliError as e:  # one bad line costs that line, not the conversation
                print(f"tevjax: error: {e}; it was not sent", file=sys.stderr, flush=True)

    def write(text):
        print(text, end="", flush=True)

    method = f"verifier {args.verifier}, budget {args.budget}" if speculative else "autoregressive"
    print(f"tevjax: chatting with {args.target} ({method}, temperature {args.temperature}"
          f"{truncation_text(args.top_k, args.top_p, args.min_p)}); /help lists the commands", file=sys.stderr)
    run_chat(decoder, conversation, read=read, write=write, log=lambda m: print(m, file=sys.stderr, flush=True),
             seed=args.seed, label="assistant> " if interactive else "")
    return 0


def jax_process_count() -> int:
    import jax

    return jax.process_count()


def _spellings(models, stops) -> list[bytes] | None:
    """The bytes of every token, which --stop matches against; None without --stop."""
    if not stops:
        return None
    from tevjax.convert.tokenizer import token_bytes

    if models.tokenizer is None:
        raise CliError("--stop needs the target's tokenizer, and this target has none (no tokenizer.json)")
    try:
        return token_bytes(models.tokenizer)
    except ValueError as e:
        raise CliError(f"--stop: {e}") from None


def _decoder(target, drafter, cfg, mesh, ngrams=None, spellings=None):
    """A Decoder; a mesh that does not fit the models (heads, vocabulary) is a one-line error."""
    from tevjax.decode.engine import Decoder

    try:
        return Decoder(target, drafter, cfg, mesh=mesh, ngrams=ngrams, spellings=spellings)
    except ValueError as e:
        if mesh is None:
            raise
        raise CliError(f"--mesh {dict(mesh.shape)}: {e}") from None


def _mask_token(args, loaded) -> int:
    """`train --mask-token`, checked against the target's vocabulary, or the tokenizer's choice."""
    from tevjax.loading import mask_token_for

    if args.mask_token is None:
        try:
            return mask_token_for(loaded.target_cfg, loaded.tokenizer)
        except ValueError as e:
            raise CliError(f"{e} (--mask-token ID)") from None
    if args.mask_token >= loaded.target_cfg.vocab_size:
        raise CliError(f"--mask-token {args.mask_token} is not in the target's vocabulary "
                       f"[0, {loaded.target_cfg.vocab_size})")
    return args.mask_token


def cmd_data(args) -> int:
    import jax

    from tevjax.loading import load_target
    from tevjax.models.dflash import default_target_layer_ids
    from tevjax.train.rollout import RolloutConfig, check_data_out, generate_data

    if args.out.exists() and not args.out.is_dir():
        raise CliError(f"--out {str(args.out)!r} is a file, not a directory")
    if args.heldout_records is not None and args.heldout_records > args.heldout:  # records answer held-out prompts
        raise CliError(f"--heldout-records {args.heldout_records} exceeds --heldout {args.heldout}: the records "
                       "answer held-out prompts")
    mesh = _mesh(args, default_all=False)
    if jax.process_count() == 1:
        # Before the target loads. A multi-host job reads --out only after `generate_data` has
        # checked that every host sees one directory, so there the same check comes then.
        check_data_out(args.out, args.resume)
    loaded = load_target(args.target, dtype="float32", mesh=mesh)
    for note in loaded.notes:
        print(f"tevjax: note: {note}", file=sys.stderr)
    n_layers = loaded.target_cfg.num_layers
    taps = args.taps
    if taps is None:
        taps = tuple(sorted(set(default_target_layer_ids(n_layers, 5)) | {n_layers - 1})) if n_layers >= 4 \
            else (n_layers // 2,)
    cfg = RolloutConfig(num_prompts=args.num_prompts, heldout_prompts=args.heldout,
                        heldout_records=min(64, args.heldout) if args.heldout_records is None else args.heldout_records,
                        max_new_tokens=args.max_new_tokens, max_prompt_tokens=args.max_prompt_tokens,
                        batch_size=args.batch_size, taps=taps, seed=args.seed, responses=args.responses,
                        turns=args.turns, exclusion=args.exclusion)
    manifest = generate_data(loaded, cfg, args.out, resume=args.resume, progress=not args.no_progress,
                             log=lambda line: print(line, file=sys.stderr, flush=True),
                             train_shards=args.train_shards, mesh=mesh)
    shards = manifest["shards"].values()
    print(json.dumps({"out": str(args.out), "complete": manifest["complete"],
                      "records": sum(s["records"] for s in shards),
                      "response_tokens": sum(s["response_tokens"] for s in shards),
                      "timings": manifest["timings"]}))
    return 0


def _mesh(args, *, default_all: bool):
    """The --mesh device mesh (after joining a multi-host job), or None for one device when
    neither --mesh nor a multi-host job asks for one and `default_all` is False."""
    from tevjax.sharding import make_mesh, parse_mesh

    distributed = _join(args)
    if not (args.mesh or distributed or default_all):
        return None
    try:
        sizes = parse_mesh(args.mesh) if args.mesh else {}
        return make_mesh(sizes.get("data"), sizes.get("model", 1), expert=sizes.get("expert", 1))
    except ValueError as e:
        raise CliError(str(e) if str(e).startswith("--mesh") else f"--mesh {args.mesh or ''}: {e}") from None


def _join(args) -> bool:
    """Joins the multi-host job that the flags or the environment ask for (once); whether one
    was joined."""
    from tevjax.multihost import HEARTBEAT_TIMEOUT_S, JOIN_TIMEOUT_S, initialize_distributed

    try:
        joined = initialize_distributed(args.coordinator, args.num_processes, args.process_id,
                                        log=lambda m: print(f"tevjax: {m}", file=sys.stderr, flush=True),
                                        timeout_s=args.join_timeout or JOIN_TIMEOUT_S,
                                        heartbeat_timeout_s=args.heartbeat_timeout or HEARTBEAT_TIMEOUT_S)
    except ValueError as e:
        raise CliError(str(e)) from None
    # Without a job to join (no --coordinator, JAX_COORDINATOR_ADDRESS, SLURM or Open MPI) these
    # would be read by nothing, and the command would run alone on this host.
    if not joined:
        _refuse_unread(args, ("num_processes", "process_id", "join_timeout", "heartbeat_timeout"),
                       "no multi-host job to join", "give --coordinator, --num-processes and --process-id (or set "
                       "JAX_COORDINATOR_ADDRESS)")
    return joined


# `train`'s --exit-* flags that only the exit loss reads, and their defaults where given none
# (--exit-anchors' default depends on --anchors; --exit-sequences' is None, all sequences).
EXIT_DEFAULTS = {"exit_weight": "w", "exit_budget": 8, "exit_temperature": 1.0, "exit_top_k": 0, "exit_top_p": 1.0,
                 "exit_min_p": 0.0, "exit_anchors": None, "exit_sequences": None}


def cmd_train(args) -> int:
    from tevjax.train.objectives import EXIT_WEIGHTS

    if args.exit_lambda == 0:
        _refuse_unread(args, EXIT_DEFAULTS, "read only by the exit loss, which --exit-lambda 0 turns off",
                       "give --exit-lambda above 0")
    _fill_defaults(args, EXIT_DEFAULTS)
    if args.until is not None and args.until > args.steps:
        raise CliError(f"--until {args.until} is past --steps {args.steps}: the run ends at step {args.steps} "
                       "anyway; give --until at most --steps, or more --steps")
    if args.exit_weight not in EXIT_WEIGHTS:
        raise CliError(f"--exit-weight {args.exit_weight!r} is not one of {', '.join(EXIT_WEIGHTS)}")
    if not args.data.is_dir():
        raise CliError(f"--data {str(args.data)!r}: " + ("a file, not a `tevjax data` directory" if args.data.exists()
                                                         else "no such directory"))
    from tevjax.train.run import check_run_out

    if jax_process_count() == 1:
        # Before the target loads (as `cmd_data`'s --out); a multi-host job checks it in `train`,
        # once every host is known to see one directory.
        check_run_out(args.out, args.resume)
    if args.exit_anchors is not None and args.exit_anchors > args.anchors:  # a subset of the anchors
        raise CliError(f"--exit-anchors {args.exit_anchors} exceeds --anchors {args.anchors}: the trees of the exit "
                       f"loss grow from a subset of the anchors")
    if args.init is not None and not Path(args.init).is_dir():
        raise CliError(f"--init {args.init!r}: no such drafter directory")
    if args.init is not None and args.draft_vocab:
        raise CliError("--draft-vocab chooses a fresh drafter's vocabulary; an --init drafter keeps its own")
    if args.init is not None and args.mask_token is not None:
        raise CliError("--mask-token chooses a fresh drafter's mask token; an --init drafter keeps its own")
    if args.init is not None and args.taps is not None:
        raise CliError("--taps chooses a fresh drafter's target layers; an --init drafter keeps its own")
    if args.init is not None and args.block_size is not None:
        raise CliError("--block-size chooses a fresh drafter's block size; an --init drafter keeps its own")
    if args.init is not None and args.layers is not None:  # checked before the target is loaded
        from tevjax.models.config import read_config_json

        try:
            have = int(read_config_json(args.init, what="--init DFlash config")[0]["num_hidden_layers"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CliError(f"--init {args.init!r}: unreadable config.json ({e})") from None
        if args.layers < have:
            raise CliError(f"--layers {args.layers}: the --init drafter already has {have} layers, "
                           f"and layers can only be added")
    from flax import nnx

    from tevjax.convert.dflash_ckpt import load_dflash
    from tevjax.loading import load_target
    from tevjax.models.dflash import DFlashConfig, DFlashDrafter, draft_vocab_from_counts, grow_drafter
    from tevjax.train.rollout import read_manifest
    from tevjax.train.run import train
    from tevjax.train.step import TrainConfig

    # Before the target loads: a setting TrainConfig refuses is named by its flag, at once.
    try:
        cfg = TrainConfig(steps=args.steps, batch_size=args.batch, anchors=args.anchors, seq_len=args.seq_len,
                          lr=args.lr, warmup=args.warmup, weight_decay=args.weight_decay,
                          gamma=args.gamma or None, distill=args.distill, exit_lambda=args.exit_lambda,
                          exit_weight=args.exit_weight,
                          exit_budget=args.exit_budget, exit_anchors=args.exit_anchors or min(8, args.anchors),
                          exit_sequences=args.exit_sequences, exit_temperature=args.exit_temperature,
                          exit_top_k=args.exit_top_k, exit_top_p=args.exit_top_p, exit_min_p=args.exit_min_p,
                          seed=args.seed)
    except (TypeError, ValueError) as e:
        flags = {"batch_size": "batch"}
        raise CliError(re.sub(r"TrainConfig\.(\w+)", lambda m: "--" + flags.get(m[1], m[1]).replace("_", "-"),
                              str(e))) from None
    manifest = read_manifest(args.data)
    stored = tuple(manifest["rollout"]["taps"])
    if args.taps is not None and any(t not in stored for t in args.taps):
        raise CliError(f"--taps {','.join(map(str, args.taps))}: --data {str(args.data)!r} stores the target layers "
                       f"{','.join(map(str, stored))} only (regenerate with `tevjax data --taps ...`)")
    mesh = _mesh(args, default_all=True)
    loaded = load_target(args.target, dtype=args.dtype, mesh=mesh)
    if manifest["target_config"]["vocab_size"] != loaded.target_cfg.vocab_size or \
            manifest["target_config"]["num_layers"] != loaded.target_cfg.num_layers:
        raise CliError(f"--data {str(args.data)!r} was generated by another target ({manifest['target']!r})")
    if args.init is not None:
        _, drafter = load_dflash(args.init, loaded.target_cfg, dtype=args.dtype, param_dtype="float32")
        if args.layers is not None and args.layers > drafter.cfg.num_layers:
            drafter = grow_drafter(drafter, args.layers, rngs=nnx.Rngs(args.seed))
    else:
        taps = args.taps or stored
        vocab_size = loaded.target_cfg.vocab_size
        if args.draft_vocab > vocab_size:
            raise CliError(f"--draft-vocab {args.draft_vocab} exceeds the target's vocabulary ({vocab_size})")
        dcfg = DFlashConfig.for_target(loaded.target_cfg, num_layers=args.layers or 1,
                                       block_size=args.block_size or 16, mask_token_id=_mask_token(args, loaded),
                                       target_layer_ids=taps, dtype=args.dtype, param_dtype="float32",
                                       draft_vocab_size=args.draft_vocab or None)
        vocab = None
        if args.draft_vocab:
            from tevjax.train.dataset import TrainData

            counts = TrainData(args.data, "train").token_counts(vocab_size)
            vocab = draft_vocab_from_counts(counts, args.draft_vocab, always=loaded.eos_ids, never=(dcfg.mask_token_id,))
        drafter = DFlashDrafter(dcfg, rngs=nnx.Rngs(args.seed), draft_vocab=vocab)
    state = train(loaded.target, drafter, args.data, args.out, cfg, target_name=args.target, resume=args.resume,
                  until=args.until, mesh=mesh, checkpoint_every_s=args.checkpoint_every,
                  eval_every_s=args.eval_every, progress=not args.no_progress,
                  log=lambda line: print(line, file=sys.stderr, flush=True))
    step = int(state.step)
    print(json.dumps({"run": str(args.out), "step": step, "steps": args.steps}))
    if step < (args.steps if args.until is None else args.until):
        # Only a signal (SIGTERM, a first Ctrl-C) ends a run early without an error. Exit 0 would
        # read as done: `train && train export` would export a partly trained drafter, and a
        # preempted batch job would not be requeued.
        print(f"tevjax: interrupted at step {step} of {args.steps}, with a checkpoint of step {step}: rerun "
              "the same command with --resume to go on", file=sys.stderr)
        return EXIT_INTERRUPTED
    return 0


def cmd_export(args) -> int:
    from tevjax.train.run import export_run

    dcfg = export_run(args.run_dir, args.drafter_dir, dtype=args.dtype)
    print(json.dumps({"drafter": str(args.drafter_dir), "layers": dcfg.num_layers,
                      "target_layer_ids": list(dcfg.target_layer_ids), "dtype": args.dtype}))
    return 0


def cmd_eval(args) -> int:
    from tevjax.evaluate import evaluate, format_table, load_eval_prompts

    _check_verifier(args.verifier, autoregressive=False)  # eval measures the baseline itself
    _check_fallback_rounds(args, off_by_default=True)
    _note_truncation(args)
    mesh = _mesh(args, default_all=False)
    texts = load_eval_prompts(args.prompts, args.num_prompts, seed=args.seed)
    if len(texts) < args.num_prompts:  # the table's count alone did not say that fewer were measured
        print(f"tevjax: note: --prompts {args.prompts} holds {len(texts)} prompts, fewer than --num-prompts "
              f"{args.num_prompts}: measuring those {len(texts)}", file=sys.stderr)
    from tevjax.loading import load_models
    from tevjax.multihost import check_same

    check_same("the prompts", texts)  # in a multi-host job: the same package, or file, on every host

    models = load_models(args.target, args.drafter, mesh=mesh)
    _moe_dispatch(args, models.target)
    for note in models.notes:
        print(f"tevjax: note: {note}", file=sys.stderr)
    _check_corpus(args, models.ngrams)
    result = evaluate(models, texts, budgets=args.budgets, temperature=args.temperature, top_k=args.top_k,
                      top_p=args.top_p, min_p=args.min_p, verifier=args.verifier,
                      max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, seed=args.seed,
                      lookup=args.lookup, corpus=args.corpus, fallback_below=args.fallback_below or 0.0,
                      fallback_rounds=args.fallback_rounds or FALLBACK_ROUNDS,
                      log=lambda line: print(line, file=sys.stderr, flush=True), mesh=mesh)
    result["prompts"] = args.prompts
    if args.json:
        print(json.dumps(result))
    else:
        print(format_table(result))
    if result.get("mismatches"):
        raise CliError(f"{result['mismatches']} greedy outputs differ from autoregressive decoding")
    return 0


def cmd_demo(args) -> int:
    from tevjax import demo

    if args.skip_models:
        _refuse_unread(args, (*DEMO_DEFAULTS, "lookup", "corpus"),
                       "read only by the model part, which --skip-models leaves out", "leave out --skip-models")
    _fill_defaults(args, DEMO_DEFAULTS)
    _check_lookup(args)
    mismatches = demo.main(max_new_tokens=args.max_new_tokens, budget=args.budget, lookup=args.lookup,
                           corpus=args.corpus,
                           samples=args.samples,
                           repeats=args.repeats, skip_models=args.skip_models)
    if mismatches:
        raise CliError(f"{mismatches} greedy outputs differ from autoregressive decoding")
    return 0


def main(argv: list[str] | None = None, *, exit_at_once: bool = False) -> int:
    """The CLI; returns the exit status. `exit_at_once` (the `tevjax` script): a Ctrl-C that reached
    Python anywhere but in the decoder's agreed stop ends the process here, with os._exit, after
    flushing. Such a Ctrl-C can land while XLA compiles on its own thread (JAX stops waiting for it),
    and the interpreter's teardown would then destroy the XLA client under that compile: a segfault
    (exit 139) in about half of the Ctrl-Cs during `tevjax data`. The work this would lose is
    already settled: data shards are written whole or not at all, and training waits for its
    checkpoints in flight before the exception reaches here."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    # `tevjax [--debug] train export RUN DIR` is its own (hidden) subcommand.
    first = next((i for i, a in enumerate(argv) if not a.startswith("-")), None)
    if first is not None and argv[first: first + 2] == ["train", "export"]:
        argv = [*argv[:first], "train-export", *argv[first + 2:]]
    args = parser.parse_args(argv)
    try:
        if hasattr(args, "coordinator"):
            # A multi-host job is joined before any check, so that a check one host fails (a file
            # only the others have) ends the job at once (`_failed`) instead of leaving them
            # waiting for it in jax.distributed's initialization (300 s).
            if _join(args):
                from tevjax.multihost import check_same

                own = ("process_id", "coordinator", "debug", "func")  # each host's own, or not a setting
                check_same("the command line (other than --process-id, --coordinator and --debug)",
                           {k: v for k, v in vars(args).items() if k not in own})
        return args.func(args)
    except KeyboardInterrupt as e:
        print("tevjax: interrupted", file=sys.stderr)
        # The decoder's stop (`Interrupted`) is agreed by every host of a multi-host job, which all
        # exit together and in order; any other interrupt (a second Ctrl-C) reached this host only.
        engine = sys.modules.get("tevjax.decode.engine")
        if engine is not None and isinstance(e, engine.Interrupted):
            return EXIT_INTERRUPTED
        code = _failed("interrupted", EXIT_INTERRUPTED)
        if exit_at_once:
            for stream in (sys.stdout, sys.stderr):  # None where its descriptor was closed (`>&-`)
                with contextlib.suppress(Exception):  # a closed pipe must not cost the exit itself
                    stream.flush()
            os._exit(code)
        return code
    except (CliError, ValueError, FileNotFoundError, FileExistsError, OSError) as e:
        if args.debug:
            raise
        print(f"tevjax: error: {e}", file=sys.stderr)
        return _failed(str(e), EXIT_USAGE)
    except Exception as e:  # noqa: BLE001 - the CLI never shows a raw traceback unless asked
        if args.debug:
            raise
        print(f"tevjax: internal error: {type(e).__name__}: {e} (rerun with --debug for the traceback)",
              file=sys.stderr)
        return _failed(f"{type(e).__name__}: {e}", 1)


def _failed(why: str, code: int) -> int:
    """`code`, after ending the rest of a multi-host job this process belongs to (which it joined
    through tevjax.multihost, so that module is loaded if it did): the other processes would
    otherwise wait in their next collective for this one."""
    multihost = sys.modules.get("tevjax.multihost")
    if multihost is not None:
        multihost.abort_job(why, code)  # returns only outside a multi-host job
    return code


if __name__ == "__main__":
    sys.exit(main(exit_at_once=True))
