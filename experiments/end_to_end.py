"""End-to-end decoding benchmark: AR vs DDTree+predraw vs DDTree+TEV on offline prompt sets.

For each cell (dataset x method x tree budget x temperature; columns `B` and `T` of the table and
the JSON) on the embedded SmolLM2-135M-Instruct target (fp32, CPU, SmolLM2 chat template) and a
DFlash drafter; AR is the same `Decoder` without a drafter:

* tau: mean output-block length per draft-verify round, bonus token included
  (sum of block lengths / rounds, over every prompt and repeat of the cell);
* SR: AR time per output token / method time per output token. Both are measured in this process
  on the same prompts, interleaved prompt by prompt (each prompt runs every method back to back,
  in an order rotated per prompt and repeat), so machine noise hits all methods alike. The time of
  one prompt is prefill + generation (host sync included) of an already compiled `Decoder`;
  per-token time of a repeat = sum of its prompts' times / sum of their tokens; the cell reports
  the median over repeats and the SR range over repeats (SR of repeat r pairs AR's repeat r);
* tokens/s = 1 / (median time per output token);
* memory: the peak process RSS over the cell's timed runs (Linux VmHWM, reset via
  /proc/self/clear_refs before each run and read after it, outside the timed window; where that is
  not possible, the process-wide `resource.getrusage` high-water mark), and per (method, budget,
  temperature) on the longest prompt, outside timing: the bytes of all live jax buffers after
  prefill and the temporaries XLA allocates for the compiled generation loop;
* the target tree-pass cost ratio: the engine's `tree_pass` stage over budget + 1 slots (a DDTree,
  the drafter's taps requested) / over the root alone (the AR step), same cache capacity, timed
  round-robin in the same run.

At temperature 0 every method's tokens must equal AR's token for token (lossless greedy decoding):
any mismatch is printed loudly, listed in the results file, and makes the script exit with status 1.
At temperature 1 each prompt uses a fixed seed; repeats with the same seed must reproduce the same tokens.

    JAX_PLATFORMS=cpu python experiments/end_to_end.py            # full run (30-60 min, 2 CPU cores)
    JAX_PLATFORMS=cpu python experiments/end_to_end.py --quick    # ~3 min smoke run, writes to /tmp
    python experiments/end_to_end.py --drafter DIR --prompts 5 --max-new-tokens 64 --budgets 16 64
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import os
import resource
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tevjax.convert.tokenizer import chat_prompt_ids
from tevjax.decode import engine
from tevjax.decode.engine import DecodeConfig, Decoder
from tevjax.loading import load_models
from tevjax.models.cache import KVCache

sys.path.insert(0, str(Path(__file__).resolve().parent))
from real_trees import describe_drafter, machine_facts  # noqa: E402  experiments/real_trees.py
from report import require_positive  # noqa: E402
from tevjax.prompts import DATASETS, load_prompt_sets  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "end_to_end.md"
QUICK_RESULTS = Path("/tmp/end_to_end_quick.md")
LABELS = {"ar": "AR", "predraw": "DDTree+predraw", "tev": "DDTree+TEV"}
SPEC_METHODS = ("predraw", "tev")
ALL = "all"  # pooled over datasets


# ------------------------------------------------------------------------------------- memory


def reset_peak_rss() -> bool:
    """Resets the kernel's RSS high-water mark of this process (Linux >= 4.0); False if it can't."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def peak_rss_mb() -> float:
    """VmHWM (peak RSS since start or the last reset), else getrusage's process-wide peak."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return process_maxrss_mb()


def process_maxrss_mb() -> float:
    """`resource.getrusage` high-water mark of the whole process (ru_maxrss is in KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def live_buffer_mb() -> float:
    return sum(a.nbytes for a in jax.live_arrays()) / 2**20


def tree_mb(tree) -> float:
    return sum(x.nbytes for x in jax.tree_util.tree_leaves(tree) if hasattr(x, "nbytes")) / 2**20


def device_memory(decoder: Decoder, prompt: list[int]) -> dict[str, float | None]:
    """Live jax buffers after prefill, the decode state's size, and XLA's memory analysis of the
    compiled generation loop, for this prompt's shapes (untimed; one extra prefill).

    The analysis comes from `Decoder.compiled_loop`; compiling again for known shapes hits
    jax's compilation cache.
    """
    state = decoder.prefill([prompt])
    out: dict[str, float | None] = {"live_mb": live_buffer_mb(), "state_mb": tree_mb(state), "temp_mb": None}
    try:
        ma = decoder.compiled_loop(state).memory_analysis()
        if ma is not None:
            out["temp_mb"] = float(ma.temp_size_in_bytes) / 2**20
    except Exception as e:  # noqa: BLE001 - memory analysis is best effort (backend-dependent)
        print(f"  (no XLA memory analysis: {type(e).__name__}: {e})", flush=True)
    del state
    return out


# ------------------------------------------------------------------------------------- tree-pass cost


def tree_pass_costs(target, drafter, capacity: int, prefix: int, sizes: list[int],
                    calls: int) -> dict[int, list[float]]:
    """Seconds of the engine's `tree_pass` stage (logits included) over n tree slots, for each n in `sizes`.

    n = 1 is the autoregressive step (`root_trees`, no taps, as a Decoder without a drafter); n > 1
    is a speculative round's target pass over a DDTree of budget n - 1 (`draft_trees` on random
    draft logits, built outside the timing) with the drafter's tap layers requested. The root sits
    at slot `prefix` of a `capacity`-slot cache. The cache is donated and threaded through the
    calls (as in the engine) so no call pays for a cache copy. Round-robin over sizes so that
    machine noise is shared.
    """
    tgd, tstate = nnx.split(target)
    taps = drafter.cfg.target_layer_ids

    # Donation is safe: each call's returned cache replaces the argument, nothing else holds it.
    @functools.partial(jax.jit, donate_argnums=(1,), static_argnames=("taps",))
    def timed_pass(tstate, cache, trees, cache_len, taps):
        out = engine.tree_pass(nnx.merge(tgd, tstate), trees, cache_len, cache, taps)
        return out.logits, out.hidden, out.cache

    cache = KVCache.init(target.cfg, 1, capacity)
    cache_len = jnp.asarray([prefix], jnp.int32)
    key_root, key_draft = jax.random.split(jax.random.key(0))
    root = jax.random.randint(key_root, (1,), 0, target.cfg.vocab_size, jnp.int32)
    g, v = drafter.cfg.block_size - 1, target.cfg.vocab_size
    draft_logits = 4.0 * jax.random.normal(key_draft, (1, g, v))  # [1, G, V]
    inputs = {n: (engine.root_trees(root), ()) if n == 1 else (engine.draft_trees(draft_logits, root, n - 1), taps)
              for n in sizes}
    times: dict[int, list[float]] = {n: [] for n in sizes}
    for i in range(calls + 2):  # two warm-up rounds (compile + first dispatch)
        for n in sizes:
            trees, n_taps = inputs[n]
            t0 = time.perf_counter()
            logits, _, cache = timed_pass(tstate, cache, trees, cache_len, taps=n_taps)
            jax.block_until_ready(logits)
            if i >= 2:
                times[n].append(time.perf_counter() - t0)
    return times


# ------------------------------------------------------------------------------------- runs


@dataclasses.dataclass
class Run:
    tokens: list[int]
    seconds: float  # prefill + generation of one prompt
    rounds: int
    block_total: int  # sum of output-block lengths (bonus included), = tau * rounds
    rss_mb: float  # peak RSS during the run (see `reset_peak_rss`)


def method_keys(budgets: list[int]) -> list[tuple[str, int]]:
    return [("ar", 0)] + [(m, b) for b in budgets for m in SPEC_METHODS]


def make_decoders(models, keys, temperature: float, max_new: int, capacity: int, lookup: int | None = None,
                  corpus: int | None = None) -> dict:
    """One Decoder per (method, budget); `lookup` and `corpus` as `tevjax eval`'s (None: chains as long
    as the budget, the corpus chain where the drafter has a table)."""
    from tevjax.evaluate import corpus_for, lookup_for

    decoders = {}
    for method, budget in keys:
        ar = method == "ar"  # the baseline: a Decoder without a drafter (verifier and budget unused)
        spec = {"verifier": method, "budget": budget, "lookup": lookup_for(budget, lookup),
                "corpus": corpus_for(budget, corpus, models.ngrams)}
        cfg = DecodeConfig(**({} if ar else spec), temperature=temperature,
                           max_new_tokens=max_new, eos_ids=models.eos_ids, capacity=capacity)
        decoders[(method, budget)] = Decoder(models.target, None if ar else models.drafter, cfg,
                                             ngrams=models.ngrams)
    return decoders


def bucket_representatives(decoder: Decoder, prompts: list[list[int]]) -> list[list[int]]:
    """One prompt per distinct prefill bucket (the fixed capacity makes the loop compile once)."""
    reps = {}
    for p in prompts:
        reps.setdefault(decoder.shapes([len(p)])[0], p)
    return list(reps.values())


def run_once(decoder: Decoder, prompt: list[int], seed: int) -> Run:
    reset_peak_rss()
    t0 = time.perf_counter()
    g = decoder.generate([prompt], seed=seed)[0]  # results() syncs to host
    seconds = time.perf_counter() - t0
    return Run(tokens=g.tokens, seconds=seconds, rounds=g.rounds, block_total=round(g.tau * g.rounds),
               rss_mb=peak_rss_mb())


def first_difference(a: list[int], b: list[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


# ------------------------------------------------------------------------------------- aggregation


def summarize(runs, datasets, keys, temperatures, repeats):
    """runs[(temperature, ds, method, budget)] = list over prompts of lists over repeats of Run -> cell rows."""
    rows = []
    for t in temperatures:
        for ds in [*datasets, ALL]:
            dss = datasets if ds == ALL else [ds]

            def per_token(key, r):
                cells = [runs[(t, d, *key)] for d in dss]
                secs = sum(p[r].seconds for c in cells for p in c)
                toks = sum(len(p[r].tokens) for c in cells for p in c)
                return secs / max(toks, 1), toks

            ar_pt = [per_token(("ar", 0), r)[0] for r in range(repeats)]
            for key in keys:
                pts = [per_token(key, r) for r in range(repeats)]
                pt = np.array([x[0] for x in pts])
                all_runs = [run for d in dss for p in runs[(t, d, *key)] for run in p]
                rounds = sum(x.rounds for x in all_runs)
                sr_r = np.array(ar_pt) / pt
                rows.append({
                    "T": t, "dataset": ds, "method": key[0], "B": key[1],
                    "tau": sum(x.block_total for x in all_runs) / max(rounds, 1),
                    "sr": float(np.median(ar_pt) / np.median(pt)),
                    "sr_lo": float(sr_r.min()), "sr_hi": float(sr_r.max()),
                    "tok_s": float(1.0 / np.median(pt)),
                    "ms_tok": float(1e3 * np.median(pt)),
                    "ms_round": float(1e3 * sum(x.seconds for x in all_runs) / max(rounds, 1)),
                    "tokens": int(sum(len(x.tokens) for x in all_runs)),
                    "rounds": int(rounds),
                    "rss_mb": max(x.rss_mb for x in all_runs),
                })
    return rows


def plot(rows, datasets, temperatures, budgets, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = [*datasets, ALL] if len(datasets) > 1 else datasets
    fig, axes = plt.subplots(2, len(cols), figsize=(3.6 * len(cols), 6.4), squeeze=False)
    styles = {"predraw": dict(marker="s", linestyle="--"), "tev": dict(marker="o", linestyle="-")}
    colors = {t: c for t, c in zip(temperatures, ["tab:blue", "tab:red", "tab:green", "tab:purple"])}
    for j, ds in enumerate(cols):
        for method in SPEC_METHODS:
            for t in temperatures:
                sel = sorted((r for r in rows if r["dataset"] == ds and r["method"] == method and r["T"] == t),
                             key=lambda r: r["B"])
                if not sel:
                    continue
                b = [r["B"] for r in sel]
                label = f"{LABELS[method]}, T={t:g}"
                axes[0, j].plot(b, [r["tau"] for r in sel], color=colors[t], label=label, **styles[method])
                sr = np.array([r["sr"] for r in sel])
                err = np.array([sr - [r["sr_lo"] for r in sel], [r["sr_hi"] for r in sel] - sr])
                axes[1, j].errorbar(b, sr, yerr=np.maximum(err, 0), color=colors[t], label=label,
                                    capsize=3, **styles[method])
        axes[0, j].set_title("all datasets (pooled)" if ds == ALL else ds)
        taus = [r["tau"] for r in rows if r["dataset"] == ds]
        axes[0, j].set_ylim(min(0.9, min(taus) - 0.1), max(1.1, max(taus) * 1.05))
        axes[1, j].axhline(1.0, color="gray", lw=0.8)
        axes[1, j].set_ylim(bottom=0)
        axes[1, j].set_xlabel("tree budget B")
        for ax in axes[:, j]:
            ax.set_xscale("log", base=2)
            ax.set_xlim(min(budgets) / 1.5, max(budgets) * 1.5)
            ax.set_xticks(budgets, [str(b) for b in budgets])
            ax.minorticks_off()
            ax.grid(alpha=0.3)
    axes[0, 0].set_ylabel("tau (tokens / round, bonus incl.)")
    axes[1, 0].set_ylabel("speedup SR vs AR (same run)")
    axes[0, -1].legend(fontsize=8)
    fig.suptitle("SmolLM2-135M-Instruct fp32 on CPU: DDTree with predraw vs TEV (SR = 1: autoregressive)")
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


# ------------------------------------------------------------------------------------- main


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--drafter", default=None, help="DFlash checkpoint directory (default as load_models: "
                   "the project's trained drafter if present, else a fresh untrained one)")
    p.add_argument("--datasets", nargs="+", default=list(DATASETS), choices=list(DATASETS))
    # Defaults sized for ~30-60 min on 2 shared CPU cores with an untrained drafter (tau ~ 1):
    # about 8 s of decoding per (prompt, new token, repeat) over all 18 methods x temperatures.
    p.add_argument("--prompts", type=int, default=2, help="prompts per dataset")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--budgets", type=int, nargs="+", default=[8, 16, 32, 64])
    p.add_argument("--lookup", type=int, default=None,
                   help="context-lookup chain length, capped at each budget (default: the budget; 0: off)")
    p.add_argument("--corpus", type=int, default=None,
                   help="corpus-lookup chain length, capped at each budget (default: the budget where the drafter "
                        "has a corpus table; 0: off)")
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    p.add_argument("--repeats", type=int, default=2, help="timed repeats per prompt and method (medians)")
    p.add_argument("--seed", type=int, default=0, help="gsm_symbolic seed and base of the sampling seeds")
    p.add_argument("--tree-pass-calls", type=int, default=15, help="timed calls per size for the tree-pass ratio")
    p.add_argument("--quick", action="store_true",
                   help="~3 min smoke run: 1 prompt per dataset, 8 new tokens, budget 8, 1 repeat; "
                        f"writes {QUICK_RESULTS} unless --out is given")
    p.add_argument("--out", type=Path, default=None, help=f"results markdown (default {RESULTS}); the plot "
                   "goes next to it as .png, raw numbers as .json")
    args = p.parse_args(argv)
    if args.quick:
        args.prompts, args.max_new_tokens, args.budgets, args.repeats, args.tree_pass_calls = 1, 8, [8], 1, 3
    if args.out is None:
        args.out = QUICK_RESULTS if args.quick else RESULTS
    require_positive(p, args, "prompts", "max_new_tokens", "repeats", "tree_pass_calls")
    if any(b < 1 for b in args.budgets) or any(not 0 <= t < float("inf") for t in args.temperatures):
        p.error("budgets must be >= 1 and temperatures finite and >= 0")
    for flag in ("lookup", "corpus"):
        if getattr(args, flag) is not None and getattr(args, flag) < 0:
            p.error(f"--{flag} must be >= 0, got {getattr(args, flag)}")
    args.budgets = sorted(set(args.budgets))
    # Once each, in the order given: a repeated temperature decoded every prompt again into the same
    # cells (its runs appended after the first pass's, so its checks read the first pass's runs and its tau
    # pooled both), and a repeated dataset was decoded twice and counted twice in the pooled row.
    args.temperatures = list(dict.fromkeys(args.temperatures))
    args.datasets = list(dict.fromkeys(args.datasets))
    return args


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    started = time.perf_counter()
    date = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    load_start = os.getloadavg()

    try:
        prompt_sets = load_prompt_sets(args.datasets, args.prompts, seed=args.seed)
    except FileNotFoundError as e:  # a prompt set's package (gsm: the experiments extra)
        print(f"end_to_end.py: error: {e}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    models = load_models("smollm2", args.drafter, dtype="float32")
    print(f"loaded SmolLM2-135M-Instruct (fp32) + tokenizer + drafter in {time.perf_counter() - t0:.1f} s", flush=True)
    drafter_desc = describe_drafter(models, args.drafter)
    corpus_desc = ("off" if models.ngrams is None or args.corpus == 0 else "as long as the budget"
                   if args.corpus is None else f"of {args.corpus} (capped at the budget)")
    print(f"drafter: {drafter_desc}", flush=True)

    ids = {ds: [chat_prompt_ids(models.tokenizer, p.text) for p in ps] for ds, ps in prompt_sets.items()}
    all_ids = [p for ds in args.datasets for p in ids[ds]]
    for ds in args.datasets:
        print(f"{ds}: " + ", ".join(f"{p.id} ({len(i)} tok)" for p, i in zip(prompt_sets[ds], ids[ds])), flush=True)

    # One cache capacity for every method and prompt (the largest any of them needs), so that each
    # Decoder's generation loop compiles exactly once; prefill compiles once per prompt bucket.
    probe = Decoder(models.target, models.drafter, DecodeConfig(
        verifier="tev", budget=max(args.budgets), max_new_tokens=args.max_new_tokens, eos_ids=models.eos_ids))
    capacity = probe.shapes([len(p) for p in all_ids])[1]
    del probe
    print(f"cache capacity {capacity} slots for every method", flush=True)

    # Target tree-pass cost: the engine's tree pass over budget + 1 slots vs the root alone.
    prefix = int(np.median([len(p) for p in all_ids]))
    sizes = [1] + [b + 1 for b in args.budgets]
    tp = tree_pass_costs(models.target, models.drafter, capacity, prefix, sizes, args.tree_pass_calls)
    tp_med = {n: float(np.median(v)) for n, v in tp.items()}
    tree_pass = {b: {"ms": 1e3 * tp_med[b + 1], "ratio": tp_med[b + 1] / tp_med[1],
                     "ratio_lo": float(np.percentile(tp[b + 1], 10) / tp_med[1]),
                     "ratio_hi": float(np.percentile(tp[b + 1], 90) / tp_med[1])} for b in args.budgets}
    print(f"target forward, 1 token: {1e3 * tp_med[1]:.1f} ms; "
          + ", ".join(f"B+1={b + 1}: {tree_pass[b]['ms']:.1f} ms ({tree_pass[b]['ratio']:.2f}x)" for b in args.budgets),
          flush=True)

    keys = method_keys(args.budgets)
    runs: dict = {}
    memory: dict = {}
    compile_s: dict = {}
    mismatches: list[str] = []
    nondeterministic: list[str] = []
    longest = max(all_ids, key=len)
    can_reset_rss = reset_peak_rss()
    n_timed = len(args.temperatures) * args.repeats * len(all_ids) * len(keys)
    done_timed, timed_start = 0, None

    for temperature in args.temperatures:
        decoders = make_decoders(models, keys, temperature, args.max_new_tokens, capacity, args.lookup, args.corpus)
        reps = bucket_representatives(decoders[("ar", 0)], all_ids)
        for key, dec in decoders.items():
            c = sum(dec.compile([p]) for p in reps)
            compile_s[(temperature, *key)] = c
            print(f"T={temperature:g} compiled {LABELS[key[0]]}{f' B={key[1]}' if key[1] else ''} "
                  f"({len(reps)} prefill buckets) in {c:.1f} s", flush=True)
            memory[(temperature, *key)] = device_memory(dec, longest)

        for r in range(args.repeats):
            if timed_start is None:
                timed_start = time.perf_counter()
            for di, ds in enumerate(args.datasets):
                for pi, prompt in enumerate(ids[ds]):
                    seed = args.seed + 1000 * di + pi
                    order = keys[(r + pi) % len(keys):] + keys[:(r + pi) % len(keys)]
                    for key in order:
                        run = run_once(decoders[key], prompt, seed)
                        runs.setdefault((temperature, ds, *key), [[] for _ in ids[ds]])[pi].append(run)
                        done_timed += 1
                    # Losslessness (temperature 0) and seed reproducibility (every temperature), checked as we go.
                    ar = runs[(temperature, ds, "ar", 0)][pi][r]
                    for key in keys:
                        this = runs[(temperature, ds, *key)][pi]
                        where = f"T={temperature:g} {ds} {prompt_sets[ds][pi].id} {LABELS[key[0]]} B={key[1]} repeat {r}"
                        if temperature == 0 and key[0] != "ar" and this[r].tokens != ar.tokens:
                            i = first_difference(this[r].tokens, ar.tokens)
                            msg = (f"{where}: tokens differ from AR at position {i} "
                                   f"({len(this[r].tokens)} vs {len(ar.tokens)} tokens)")
                            mismatches.append(msg)
                            print(f"!!!!!! T=0 MISMATCH: {msg}", file=sys.stderr, flush=True)
                        if r > 0 and this[r].tokens != this[0].tokens:
                            nondeterministic.append(where)
                            print(f"!!! same seed, different tokens: {where}", file=sys.stderr, flush=True)
                    line = ", ".join(
                        f"{LABELS[k[0]]}{f'/{k[1]}' if k[1] else ''} "
                        f"{len(runs[(temperature, ds, *k)][pi][r].tokens) / runs[(temperature, ds, *k)][pi][r].seconds:.1f}"
                        for k in keys)
                    print(f"T={temperature:g} rep {r} {ds} {prompt_sets[ds][pi].id}: tok/s {line}", flush=True)
            elapsed = time.perf_counter() - timed_start
            print(f"  timed runs {done_timed}/{n_timed}; {elapsed / 60:.1f} min of timing so far, "
                  f"about {elapsed / done_timed * (n_timed - done_timed) / 60:.1f} min of timing left "
                  f"(plus compiles)", flush=True)
        del decoders

    rows = summarize(runs, args.datasets, keys, args.temperatures, args.repeats)
    total_min = (time.perf_counter() - started) / 60
    load_end = os.getloadavg()

    # ---------------------------------------------------------------- results file
    command = "python experiments/end_to_end.py" + (" " + " ".join(argv) if argv else "")
    lines = [
        "# End-to-end decoding: AR vs DDTree+predraw vs DDTree+TEV",
        "",
        f"- Date: {date}; wall time {total_min:.1f} min.",
        f"- Command: `{command}`",
        f"- Machine: {machine_facts()}. Load average (1/5/15 min) at start "
        f"{'/'.join(f'{x:.1f}' for x in load_start)}, at end {'/'.join(f'{x:.1f}' for x in load_end)} "
        "(the machine is shared: absolute speeds are noisy, same-run ratios less so).",
        "- Target: SmolLM2-135M-Instruct (embedded default, `load_models(\"smollm2\")`), float32, SmolLM2 chat "
        "template (with its default system prompt), batch 1.",
        f"- Drafter: {drafter_desc}; context-lookup chain "
        f"{'as long as the budget' if args.lookup is None else f'of {args.lookup} (capped at the budget)'}"
        f"{' (off)' if args.lookup == 0 else ''}; corpus-lookup chain {corpus_desc}.",
        f"- Prompts: {args.prompts} per dataset ({', '.join(args.datasets)}); max {args.max_new_tokens} new tokens "
        f"(EOS stops earlier); {args.repeats} timed repeat(s) per prompt and method; cache capacity {capacity} for "
        f"every method; T = 1 seeds: {args.seed} + 1000 x dataset index + prompt index.",
        "",
        "Prompt sets: MT-Bench first turns (evenly spaced question ids, all categories), HumanEval stubs "
        "(evenly spaced, wrapped in a one-line instruction), reasoning-gym `gsm_symbolic` "
        f"(seed {args.seed}). Prompts used:",
        "",
    ]
    for ds in args.datasets:
        lines.append(f"- {ds}: " + ", ".join(f"{p.id} ({len(i)} tokens)" for p, i in zip(prompt_sets[ds], ids[ds])))
    lines += [
        "",
        "## Losslessness check (T = 0: every method's tokens equal AR's)",
        "",
    ]
    if 0.0 in args.temperatures:
        if mismatches:
            lines.append(f"**FAILED: {len(mismatches)} mismatch(es):**")
            lines += [f"- {m}" for m in mismatches]
        else:
            n_cmp = args.repeats * len(all_ids) * (len(keys) - 1)
            lines.append(f"Passed: all {n_cmp} speculative generations at T = 0 equal AR's tokens exactly.")
    else:
        lines.append("Not run (T = 0 not among the temperatures).")
    if nondeterministic:
        lines += ["", f"**Same seed gave different tokens across repeats in {len(nondeterministic)} case(s):**"]
        lines += [f"- {m}" for m in nondeterministic]
    lines += [
        "",
        "## Results",
        "",
        "tau = sum of output-block lengths (bonus included) / rounds. SR = AR ms per token / method ms per token, "
        "medians over repeats, same process, prompts interleaved; [range] = min-max of the per-repeat SR. "
        "Time = prefill + generation per prompt. tree-pass = target forward over B+1 tokens / over 1 token "
        "(10-90% range). peak RSS = highest process RSS during the cell's timed runs "
        f"({'VmHWM, reset before each run' if can_reset_rss else 'process-wide getrusage high-water mark'}); "
        "per (method, B, T) on the longest prompt: live MB = all live jax buffers after prefill (weights of "
        "target and drafter + the decode state), state MB = the decode state (KV caches, drafter context), "
        "XLA temp MB = temporaries of the compiled generation loop.",
        "",
        "| dataset | T | method | B | tau | SR [range] | tok/s | ms/token | ms/round | tree-pass | peak RSS MB | live MB | state MB | XLA temp MB |",
        "|---|---|---|---:|---:|---|---:|---:|---:|---|---:|---:|---:|---:|",
    ]
    for row in rows:
        key = (row["T"], row["method"], row["B"])
        mem = memory[key]
        tpc = tree_pass.get(row["B"]) if row["method"] != "ar" else None
        lines.append(
            f"| {row['dataset']} | {row['T']:g} | {LABELS[row['method']]} | {row['B'] or '-'} | {row['tau']:.3f} | "
            f"{row['sr']:.3f} [{row['sr_lo']:.3f}-{row['sr_hi']:.3f}] | {row['tok_s']:.2f} | {row['ms_tok']:.0f} | "
            f"{row['ms_round']:.0f} | "
            + (f"{tpc['ratio']:.2f}x ({tpc['ratio_lo']:.2f}-{tpc['ratio_hi']:.2f})" if tpc else "1x")
            + f" | {row['rss_mb']:.0f} | {mem['live_mb']:.0f} | {mem['state_mb']:.1f} | "
            + (f"{mem['temp_mb']:.1f}" if mem["temp_mb"] is not None else "n/a") + " |")
    lines += [
        "",
        f"Target forward (logits included) at a {prefix}-token prefix, cache capacity {capacity}: 1 token "
        f"{1e3 * tp_med[1]:.1f} ms; " + "; ".join(f"{b + 1} tokens {tree_pass[b]['ms']:.1f} ms" for b in args.budgets)
        + f" (medians of {args.tree_pass_calls} round-robin calls).",
        "",
        "Compile seconds (prefill buckets + generation loop, excluded from all timings): "
        + "; ".join(f"T={k[0]:g} {LABELS[k[1]]}{f' B={k[2]}' if k[2] else ''} {v:.0f}" for k, v in compile_s.items())
        + ".",
        "",
        f"Process peak RSS (getrusage ru_maxrss) at the end: {process_maxrss_mb():.0f} MB.",
        "",
        f"![tau and SR vs B]({args.out.with_suffix('.png').name})",
        "",
    ]
    if not models.drafter_trained and args.drafter is None:
        lines += [
            "With an untrained drafter almost every drafted token is rejected: tau stays near 1 and each round "
            "pays for the drafter, the tree build and a (B+1)-token target pass to emit about one token, so "
            "SR < 1. This measures the overhead of the pipeline, not what a trained drafter would give.",
            "",
        ]
    table = "\n".join(lines)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(table + "\n")
    plot(rows, args.datasets, args.temperatures, args.budgets, args.out.with_suffix(".png"))
    raw = {
        "date": date, "command": command, "machine": machine_facts(), "drafter": drafter_desc,
        "drafter_trained": models.drafter_trained, "capacity": capacity, "args": {
            k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "prompts": {ds: [p.id for p in ps] for ds, ps in prompt_sets.items()},
        "rows": rows, "tree_pass": tree_pass, "tree_pass_1_token_ms": 1e3 * tp_med[1],
        "memory": [{"T": k[0], "method": k[1], "B": k[2], **v} for k, v in memory.items()],
        "compile_s": [{"T": k[0], "method": k[1], "B": k[2], "seconds": v} for k, v in compile_s.items()],
        "mismatches": mismatches, "nondeterministic": nondeterministic,
        "runs": [{"T": k[0], "dataset": k[1], "method": k[2], "B": k[3], "prompt": pi, "repeat": r,
                  "tokens": len(x.tokens), "seconds": x.seconds, "rounds": x.rounds, "block_total": x.block_total,
                  "rss_mb": x.rss_mb}
                 for k, ps in runs.items() for pi, p in enumerate(ps) for r, x in enumerate(p)],
    }
    args.out.with_suffix(".json").write_text(json.dumps(raw, indent=1) + "\n")
    print()
    print(table)
    print(f"wrote {args.out}, {args.out.with_suffix('.png')} and {args.out.with_suffix('.json')} "
          f"({total_min:.1f} min)")
    if mismatches:
        print(f"!!!!!! {len(mismatches)} T=0 MISMATCH(ES) WITH AR: see above", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
