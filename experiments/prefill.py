"""Prefill throughput and peak memory on the embedded SmolLM2: tevjax against transformers (torch, CPU).

For each prompt length in `--sizes` and each implementation, a fresh subprocess (so that its peak
RSS is its own) loads the model, prepares, then times `--repeats` prefills of the same prompt:

* `tevjax`: `Decoder.prefill` of a `Decoder` without a drafter (the target's K/V cache filled in
  causal chunks of `DecodeConfig.prefill_chunk` tokens; no logits), compiled ahead from shapes
  (`Decoder.compile`), one untimed prefill first; the cache capacity is what `tevjax generate`
  allocates for the prompt with `--max-new-tokens` (default 32);
* `tevjax+drafter`: the same with the (fresh, untrained) DFlash drafter, whose context cache the
  prefill also fills: what `tevjax generate` runs (opt-in, `--impls`);
* `onepass`: the prefill tevjax had before (one target pass over the whole prompt under a [T, T]
  causal block mask, jitted once per length), the baseline of the change; skipped above
  `--onepass-max` tokens (an 8,159-token prompt did not finish in 590 s and peaked at 10.4 GB);
* `transformers`: `AutoModelForCausalLM` (float32, its default attention) over the converted
  directory tevjax reads, `model(ids, use_cache=True, logits_to_keep=1)` under `torch.inference_mode`:
  the prefill step of `generate` (the KV cache filled, logits of the last token only); one untimed
  call first.

Reported per (length, implementation): median prefill tokens/s and the p10-p90 range over the
repeats, and the process's peak RSS (`ru_maxrss`: load, compilation and prefill together) next to
its peak before the first prefill. The tevjax/transformers ratio pairs the two subprocesses of the
same length run back to back: ratio of medians, with the range min(tevjax)/max(transformers) ..
max(tevjax)/min(transformers) over the repeats. Both frameworks use every host core.

    nice -n 19 python experiments/prefill.py      # 512, 2048, 8159: experiments/results/prefill.md (+ .json)
    nice -n 19 python experiments/prefill.py --sizes 8159 --chunk 2048 --out /tmp/prefill_8k.md

Levers measured on 2 quiet cores (same-run, 2,048 tokens unless stated):

* chunk size: 183 / 238 / 279 / 282 tok/s with chunks of 256 / 512 / 1024 / 2048 (the projections
  and MLP are matmuls with chunk rows); 8,159 tokens: 70.7 tok/s with 256, ~130 with 1024 or 2048.
  The default became 1024 (a larger chunk pads more of the last one).
* `causal_attention` layout: the G query heads of a kv head stacked as one [G*T, Dh] operand per
  key block, 35-40% faster attention than per-head products at S = 8192.
* `causal_attention` tiles: queries in tiles of 512, keys in blocks of 512, and the blocks a whole
  tile sees unmasked. One layer over 8,192 tokens (chunks of 1,024) took 0.75-0.94 s against
  0.99-1.12 s with one tile, blocks of 256 and every block masked (torch's SDPA ~0.7 s); the
  8,159-token prefill went from 144 to 205-210 tok/s (0.75x to 1.02-1.05x of transformers, two
  runs). Each change alone was within noise: blocks of 128 / 512 / 1024, query tiles without the unmasked blocks,
  unmasked blocks without tiles (0-10%).
* not kept: keys pre-transposed to [K, Dh, S] once per layer (slower), and XLA:CPU's
  `--xla_cpu_use_onednn`, `--xla_cpu_use_xnnpack` and `--xla_cpu_prefer_vector_width` (within
  run-to-run noise).

The raw measurements (every repeat) go to the report's name with `.json`, rewritten after each
subprocess, so a run cut short keeps what it measured. A subprocess past `--timeout` is reported as
not finished, with the time it was given.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import emit  # noqa: E402  experiments/report.py

IMPLS = ("tevjax", "tevjax+drafter", "onepass", "transformers")
# Filler for a realistic chat prompt; the content does not change the cost, only the length does.
FILLER = ("Please summarise the following notes on speculative decoding for a short report. "
          "A small drafter proposes several tokens, the large target checks them in one pass, "
          "and every accepted token saves one sequential step of the target model. ")


def _prompt_ids(hf_dir: Path, length: int) -> list[int]:
    """A chat-formatted user request cut to exactly `length` tokens."""
    from tevjax.convert.tokenizer import chat_prompt_ids, load_tokenizer

    tok = load_tokenizer(hf_dir)
    text = FILLER * max(1, length // 40)
    while len(ids := chat_prompt_ids(tok, text)) < length:
        text += FILLER * max(1, (length - len(ids)) // 40)
    return ids[:length]


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


# ------------------------------------------------------------------------------- one measurement


def worker(impl: str, length: int, repeats: int, max_new_tokens: int, chunk: int) -> dict:
    """Loads, prepares and times `repeats` prefills of a `length`-token prompt in this process."""
    from tevjax.convert.embedded import prepare_smollm2

    hf_dir = prepare_smollm2()
    ids = _prompt_ids(hf_dir, length)
    times, info = [], {}
    t0 = time.perf_counter()
    if impl == "transformers":
        import torch
        import transformers

        model = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
        info["load_s"] = time.perf_counter() - t0
        info["attention"] = model.config._attn_implementation
        info["threads"] = torch.get_num_threads()
        x = torch.tensor([ids])

        def prefill():
            with torch.inference_mode():
                return model(x, use_cache=True, logits_to_keep=1).logits
    else:
        import jax
        import jax.numpy as jnp
        from flax import nnx

        from tevjax.convert.hf import load_hf_target
        from tevjax.decode import DecodeConfig, Decoder
        from tevjax.loading import SMOLLM2_MASK_TOKEN, fresh_drafter
        from tevjax.models import KVCache, causal_mask

        target_cfg, target = load_hf_target(hf_dir, dtype="float32")
        drafter = fresh_drafter(target_cfg, mask_token_id=SMOLLM2_MASK_TOKEN) if impl == "tevjax+drafter" else None
        dec = Decoder(target, drafter, DecodeConfig(max_new_tokens=max_new_tokens, prefill_chunk=chunk))
        info["load_s"] = time.perf_counter() - t0
        info["threads"] = os.cpu_count()
        t1 = time.perf_counter()
        if impl == "onepass":
            tp, capacity = dec.shapes([length])

            @jax.jit
            def one_pass(tstate, tokens):
                """The previous `_prefill`: prompt[:-1] padded to Tp in one pass, [Tp, Tp] causal mask."""
                model = nnx.merge(dec.tgd, tstate)
                positions = jnp.arange(tp, dtype=jnp.int32)[None]
                return model(tokens, positions, KVCache.init(model.cfg, 1, capacity), jnp.zeros((1,), jnp.int32),
                             causal_mask(tp)[None], compute_logits=False).cache

            tokens = np.zeros((1, tp), np.int32)
            tokens[0, : length - 1] = ids[:-1]
            tokens = jnp.asarray(tokens)
            one_pass.lower(dec.tstate, tokens).compile()

            def prefill():
                return jax.block_until_ready(one_pass(dec.tstate, tokens))
        else:
            dec.compile([ids])

            def prefill():
                return jax.block_until_ready(dec.prefill([ids]))
        info["compile_s"] = time.perf_counter() - t1
    info["rss_before_mb"] = _peak_rss_mb()
    t1 = time.perf_counter()
    out = prefill()  # untimed: first-call allocations
    info["first_s"] = time.perf_counter() - t1
    del out
    for _ in range(repeats):
        t1 = time.perf_counter()
        out = prefill()
        times.append(time.perf_counter() - t1)
        del out
    info.update(impl=impl, tokens=length, times_s=times, peak_rss_mb=_peak_rss_mb(), load_avg=os.getloadavg()[0])
    return info


def _run_worker(impl: str, length: int, args) -> dict:
    cmd = [sys.executable, __file__, "--worker", impl, "--sizes", str(length), "--repeats", str(args.repeats),
           "--max-new-tokens", str(args.max_new_tokens), "--chunk", str(args.chunk)]
    print(f"[{time.strftime('%H:%M:%S')}] {impl} at {length} tokens ...", flush=True)
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        print(f"    did not finish in {args.timeout:.0f} s", flush=True)
        return dict(impl=impl, tokens=length, timeout_s=args.timeout)
    if proc.returncode != 0:
        raise SystemExit(f"{impl} at {length} tokens failed:\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["wall_s"] = time.perf_counter() - t0
    med = float(np.median(result["times_s"]))
    print(f"    {length / med:.1f} tok/s (median {med:.2f} s), peak RSS {result['peak_rss_mb']:.0f} MB", flush=True)
    return result


# ------------------------------------------------------------------------------------- the report


def main() -> None:
    from tevjax.decode import DecodeConfig

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[512, 2048, 8159], help="prompt tokens")
    ap.add_argument("--impls", nargs="+", default=["tevjax", "transformers", "onepass"], choices=IMPLS)
    ap.add_argument("--repeats", type=int, default=3, help="timed prefills per process")
    ap.add_argument("--max-new-tokens", type=int, default=32, help="sizes tevjax's cache as generate would")
    ap.add_argument("--chunk", type=int, default=DecodeConfig.prefill_chunk, help="DecodeConfig.prefill_chunk (default: the library default)")
    ap.add_argument("--onepass-max", type=int, default=2048, help="skip `onepass` above this many tokens")
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds per subprocess")
    ap.add_argument("--worker", choices=IMPLS, help=argparse.SUPPRESS)
    default_out = Path(__file__).parent / "results" / "prefill.md"
    ap.add_argument("--out", default=str(default_out))
    ap.add_argument("--from-json", help="write the report of a run's raw measurements (its .json) without measuring")
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.sizes[0], args.repeats, args.max_new_tokens, args.chunk)))
        return
    if args.repeats < 1:
        raise SystemExit("--repeats must be >= 1")

    t_start = time.perf_counter()
    raw_path = Path(args.out).with_suffix(".json")
    results: dict[tuple[int, str], dict] = {}
    if args.from_json:
        raw = json.loads(Path(args.from_json).read_text())
        out, argv, nice = args.out, raw["argv"], raw["nice"]
        args = ap.parse_args(argv)  # the measuring run's settings
        args.out = out
        results = {(r["tokens"], r["impl"]): r for r in raw["results"]}
        raw_path.write_text(json.dumps(raw, indent=1) + "\n")
        total = "total run: see the raw file's wall_s"
    else:
        argv, nice = sys.argv[1:], os.nice(0)
        raw_path.parent.mkdir(parents=True, exist_ok=True)
        for length in args.sizes:
            for impl in args.impls:
                if impl == "onepass" and length > args.onepass_max:
                    continue
                results[(length, impl)] = _run_worker(impl, length, args)
                raw_path.write_text(json.dumps(dict(argv=argv, nice=nice, results=list(results.values())),
                                               indent=1) + "\n")
        total = f"total run {time.perf_counter() - t_start:.0f} s"
    unfinished = {key: r for key, r in results.items() if "timeout_s" in r}
    results = {key: r for key, r in results.items() if "timeout_s" not in r}

    import jax  # the device line only
    import torch
    import transformers

    dev = jax.devices()[0]
    cmd = "python " + " ".join([Path(sys.argv[0]).as_posix()] + argv)
    lines = [
        "# Prefill: tevjax (chunked) against transformers on SmolLM2-135M-Instruct",
        "",
        f"Command: `{cmd}` ({total}).",
        f"Device: {dev.platform}, {os.cpu_count()} host cores, {platform.processor() or platform.machine()}; "
        f"jax {jax.__version__}, torch {torch.__version__}, transformers {transformers.__version__}; float32 "
        f"weights and compute, batch 1. This script ran at niceness {nice}; the load average column is the "
        f"host's 1-minute load at the end of each subprocess (about 2 means the 2 cores were this "
        f"script's alone, higher means other jobs shared them and absolute figures are noisy); each "
        f"length's implementations ran back to back. Raw measurements: `{raw_path.name}`.",
        f"tevjax: `Decoder.prefill`, chunks of {args.chunk} tokens, cache capacity as `generate` allocates "
        f"for --max-new-tokens {args.max_new_tokens}. transformers: `model(ids, use_cache=True, logits_to_keep=1)`"
        f" (attention: {next((r['attention'] for r in results.values() if 'attention' in r), '-')}). "
        f"{args.repeats} timed prefills per process after one untimed one.",
        "",
        "| prompt tokens | implementation | median tok/s | p10-p90 tok/s | median s | first call s |"
        " peak RSS MB | peak RSS before prefill MB | load avg |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for (length, impl), r in results.items():
        t = np.asarray(r["times_s"])
        p10, p50, p90 = np.percentile(length / t, [10, 50, 90])
        lines.append(f"| {length} | {impl} | {p50:.1f} | {p10:.1f}-{p90:.1f} | {np.median(t):.2f} |"
                     f" {r['first_s']:.2f} | {r['peak_rss_mb']:.0f} | {r['rss_before_mb']:.0f} | {r['load_avg']:.1f} |")
    for (length, impl), r in unfinished.items():
        lines.append(f"| {length} | {impl} | did not finish in {r['timeout_s']:.0f} s | | | | | | |")
    lines += ["", "## Same-run ratios (tok/s of the first / the second; range over the repeats)", "",
              "| prompt tokens | ratio | median ratio | range |", "|---:|---|---:|---:|"]
    for length in args.sizes:
        for a, b in (("tevjax", "transformers"), ("tevjax", "onepass"), ("tevjax+drafter", "transformers")):
            if (length, a) in results and (length, b) in results:
                ta, tb = np.asarray(results[(length, a)]["times_s"]), np.asarray(results[(length, b)]["times_s"])
                lines.append(f"| {length} | {a} / {b} | {np.median(tb) / np.median(ta):.2f} |"
                             f" {tb.min() / ta.max():.2f}-{tb.max() / ta.min():.2f} |")
    goals = []
    for length in args.sizes:
        tev, ref = results.get((length, "tevjax")), results.get((length, "transformers"))
        if (length, "tevjax") in unfinished:
            # Compile, one untimed and `repeats` timed prefills did not fit: each took > timeout / (repeats + 1).
            bound = length * (args.repeats + 1) / unfinished[(length, "tevjax")]["timeout_s"]
            goals.append(f"* {length} tokens: tevjax did not finish {args.repeats + 1} prefills in "
                         f"{unfinished[(length, 'tevjax')]['timeout_s']:.0f} s, so its tok/s is below {bound:.1f}"
                         + (f" against transformers' {length / np.median(ref['times_s']):.1f}: NOT met." if ref else "."))
        if (length, "transformers") in unfinished:
            bound = length * (args.repeats + 1) / unfinished[(length, "transformers")]["timeout_s"]
            goals.append(f"* {length} tokens: transformers did not finish {args.repeats + 1} prefills in "
                         f"{unfinished[(length, 'transformers')]['timeout_s']:.0f} s either (below {bound:.1f} tok/s): "
                         f"the comparison at this length is not measured.")
        if tev and ref and length >= 2048:
            ta, tb = np.median(tev["times_s"]), np.median(ref["times_s"])
            goals.append(f"* {length} tokens: tevjax tok/s >= transformers': {'met' if ta <= tb else 'NOT met'}"
                         f" ({tb / ta:.2f}x).")
        if tev and length >= 8000:
            rss = tev["peak_rss_mb"]
            goals.append(f"* {length} tokens: tevjax peak RSS < 3 GB: {'met' if rss < 3072 else 'NOT met'} ({rss:.0f} MB).")
    if goals:
        lines += ["", "## Goals", "", *goals]
    lines.append("")
    emit(lines, args.out)


if __name__ == "__main__":
    main()
