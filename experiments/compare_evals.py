"""Two arms of `tevjax eval --json` runs on the same prompts, compared paired over prompts.

Each arm is one or more JSON files written by `tevjax eval --json` (an arm's budgets may come from
separate runs). For every budget that both arms hold, it prints each arm's tau with its 95%
interval, and the relative gain of arm B over arm A with its 95% interval. Both are
delta-method intervals with prompts as the units (`tevjax.stats`). Pairing removes the spread
between prompts, which is most of tau's variance. The runs must cover the same prompts (the same
set, count, token limit, temperature and seed, and, where both files keep it, the same digest of
the prompt texts: counts pair by position; sampled arms also the same truncation), the files of one arm
must share its decoding configuration (verifier, chains, fallback, truncation), and every row must hold
the per-prompt counts (`prompt_emitted`, `prompt_rounds`) that `tevjax eval` keeps since 2026-12-05.

    python experiments/compare_evals.py \
        --a experiments/results/heldout256_alone_b8_b16_t0.json --label-a "drafter alone" \
        --b experiments/results/heldout256_default_b8_t0.json \
            experiments/results/heldout256_default_b16_t0.json --label-b "default" \
        --out experiments/results/heldout256_chains_gain.md
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import emit  # noqa: E402

from tevjax.stats import paired_gain, q95, tau_se  # noqa: E402

# What two runs must share for their prompts, and so their per-prompt counts, to pair.
SAME = ("prompts", "num_prompts", "max_new_tokens", "temperature", "seed")
# A truncation makes another target law, as another temperature does (`truncation.py` never pairs its
# settings), so sampled runs must share it too; greedy outputs do not depend on it. Checked wherever both
# files hold it (files made before truncated sampling do not).
TRUNCATION = ("top_k", "top_p", "min_p")
# An arm is one decoding configuration, even when its budgets come from separate runs: a file decoded with
# other chains, another verifier or fallback would be reported under the arm's one label. Checked where both
# files hold the field (run-level values: a row's own `lookup` is the run's capped at its budget).
ARM = ("verifier", "lookup", "corpus", "fallback_below", "fallback_rounds")
# The digest of the prompt texts that `tevjax eval` writes (`tevjax.evaluate.prompts_digest`): counts pair
# by position, and one --prompts spec can name other texts (an edited file, another directory). Checked
# wherever both files hold it (older files do not).
DIGEST = "prompts_sha256"


class CompareError(ValueError):
    """A file or a pair of runs that cannot be compared; the message names which and why."""


def load_arm(paths: list[str]) -> tuple[dict, dict[int, dict], tuple[str, str] | None, tuple[str, dict]]:
    """(the runs' shared settings, {budget: row}, (a file, its prompt digest) or None, (the first file, its
    run)) for one arm's files."""
    settings, rows, digest, first = None, {}, None, None
    for path in paths:
        try:
            run = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise CompareError(f"{path}: no such file") from None
        except OSError as e:  # a directory, no permission
            raise CompareError(f"{path}: cannot be read ({e.strerror})") from None
        except json.JSONDecodeError as e:
            raise CompareError(f"{path}: not JSON ({e.msg} at line {e.lineno})") from None
        if not isinstance(run, dict) or "budgets" not in run or any(k not in run for k in SAME):
            raise CompareError(f"{path}: not the output of `tevjax eval --json`")
        these = {k: run[k] for k in SAME}
        if settings is not None and these != settings:
            raise CompareError(f"{path}: other prompts or settings than {paths[0]} ({_differences(settings, these)})")
        settings = these
        if first is None:
            first = (path, run)
        else:
            _check_shared(ARM, first, path, run, "one arm's files must be one decoding configuration")
            _check_law(first, path, run)
        digest = _check_digest(digest, path, run)
        for row in run["budgets"]:
            if "prompt_emitted" not in row or "prompt_rounds" not in row:
                raise CompareError(f"{path}: budget {row['budget']} has no per-prompt counts "
                                   "(made before `tevjax eval` kept them; run it again)")
            if row["budget"] in rows:
                raise CompareError(f"{path}: budget {row['budget']} is in two files of the same arm")
            rows[row["budget"]] = row
    return settings, rows, digest, first


def _check_shared(keys: tuple[str, ...], seen: tuple[str, dict], path: str, run: dict, why: str) -> None:
    """Refuses `run` (from `path`) where it differs from `seen` (a file and its run) in one of `keys` that both hold."""
    other, ref = seen
    diff = [f"{k} {run[k]!r}" for k in keys if k in ref and k in run and ref[k] != run[k]]
    if diff:
        theirs = ", ".join(f"{k} {ref[k]!r}" for k in keys if k in ref and k in run and ref[k] != run[k])
        raise CompareError(f"{path}: {', '.join(diff)}, {other}: {theirs}; {why}")


def _check_law(seen: tuple[str, dict], path: str, run: dict) -> None:
    """Refuses a sampled run whose truncation differs from `seen`'s (the same temperature, checked before)."""
    from tevjax.law import is_greedy  # here: jax loads only where a second file is read

    if not is_greedy(run["temperature"]):
        _check_shared(TRUNCATION, seen, path, run, "sampled runs must sample one target law (truncation)")


def _check_digest(seen: tuple[str, str] | None, path: str, run: dict) -> tuple[str, str] | None:
    """The first (file, prompt digest) seen; refuses a file whose prompt texts differ from it."""
    if DIGEST not in run:
        return seen
    if seen is not None and run[DIGEST] != seen[1]:
        raise CompareError(f"{path}: other prompt texts than {seen[0]} under the same settings "
                           f"(--prompts {run['prompts']!r} named other texts): the per-prompt counts would not pair")
    return seen or (path, run[DIGEST])


def _differences(a: dict, b: dict) -> str:
    return ", ".join(f"{k} {a[k]!r} vs {b[k]!r}" for k in SAME if a[k] != b[k])


def compare(arm_a: list[str], arm_b: list[str]) -> tuple[dict, list[dict]]:
    """(the shared settings, one result per budget both arms hold, in increasing budget)."""
    settings_a, rows_a, digest_a, first_a = load_arm(arm_a)
    settings_b, rows_b, digest_b, first_b = load_arm(arm_b)
    if settings_a != settings_b:
        raise CompareError(f"the arms ran on other prompts or settings ({_differences(settings_a, settings_b)})")
    _check_law(first_a, *first_b)
    if digest_a is not None and digest_b is not None:
        _check_digest(digest_a, digest_b[0], {DIGEST: digest_b[1], "prompts": settings_b["prompts"]})
    budgets = sorted(set(rows_a) & set(rows_b))
    if not budgets:
        raise CompareError(f"no budget in both arms (A: {sorted(rows_a)}, B: {sorted(rows_b)})")
    results = []
    for budget in budgets:
        a, b = rows_a[budget], rows_b[budget]
        counts = [a["prompt_emitted"], a["prompt_rounds"], b["prompt_emitted"], b["prompt_rounds"]]
        results.append({"budget": budget, "a": tau_se(*counts[:2]), "b": tau_se(*counts[2:]),
                        "gain": paired_gain(*counts)})
    return settings_a, results


def report(settings: dict, results: list[dict], label_a: str, label_b: str) -> list[str]:
    q = q95(settings["num_prompts"])  # t with n - 1 df, as the paired intervals (`tevjax.stats`)

    def tau(pair):
        t, se = pair
        return f"{t:.3f} [{t - q * se:.3f}, {t + q * se:.3f}]"

    lines = [f"# {label_b} against {label_a}, paired over prompts", "",
             f"`{shlex.join(['python', *sys.argv])}`", "",
             (f"{settings['num_prompts']} prompts of `{settings['prompts']}`, temperature {settings['temperature']}, "
              f"{settings['max_new_tokens']} new tokens, seed {settings['seed']}. tau with its 95% interval "
              "over prompts; the gain is tau_B / tau_A - 1 with its paired 95% interval (`tevjax.stats`)."), "",
             f"| budget | tau ({label_a}) | tau ({label_b}) | gain [95%] |", "|---:|---:|---:|---:|"]
    for r in results:
        g = r["gain"]
        lines.append(f"| {r['budget']} | {tau(r['a'])} | {tau(r['b'])} | "
                     f"{100 * g['gain']:+.1f}% [{100 * g['lo']:+.1f}, {100 * g['hi']:+.1f}] |")
    return lines


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--a", nargs="+", required=True, help="arm A's `tevjax eval --json` files")
    p.add_argument("--b", nargs="+", required=True, help="arm B's files")
    p.add_argument("--label-a", default="A")
    p.add_argument("--label-b", default="B")
    p.add_argument("--out", type=Path, default=None, help="also write the report here")
    return p, p.parse_args(argv)


def main(argv=None) -> list[dict]:
    parser, args = parse_args(argv)
    try:
        settings, results = compare(args.a, args.b)
    except CompareError as e:
        parser.error(str(e))
    emit(report(settings, results, args.label_a, args.label_b), args.out)
    return results


if __name__ == "__main__":
    main()
