"""Stage c: what a speculative round costs on Qwen3-4B/8B-shaped bf16 targets, and the speedup it implies.

Random-weight targets with the public Qwen3-4B and Qwen3-8B shapes (`common.targets`) and a 5-layer
DFlash drafter (block 16), all bf16 and drawn on the device inside one jit (`common.device_init`).
Random weights cost exactly what trained ones do: every pass is dense over its static shapes
(attention reads all cache slots under a mask), so only acceptance would differ, and acceptance
enters below only as the assumed tau.

For each (target, batch), after the engine's own prefill of a random `--prefix`-token prompt per row,
the round's stages are jitted one by one from `tevjax.decode.engine` and timed round-robin:

* AR step: `tree_pass` over `root_trees` (one token, no taps): the bare autoregressive step;
* tree pass at N = 17, 33, 65, 129 slots (budget N - 1), on the drafter's real DDTree trees, the
  drafter's tap layers requested;
* drafter block: `draft` (the block [root, MASK x 15] against the drafter's context cache);
* builder: `draft_trees` (log-softmax + DDTree) at each budget, on the drafter's logits;
* verify + commit: TEV (temperature 1) on that N's target logits, then `engine.commit` (target K/V
  moved, drafter context appended);
* round: one whole `Decoder.step` at budget 64 (N = 65): everything above plus the emit;
* AR round: one whole `Decoder.step` of the same engine without a drafter (what speculative
  decoding is compared against).

Target caches are donated and threaded from call to call, as the engine's donated state is. The
speedup table reads SR = tau x (AR round) / (round), the paper's definition (same runtime, same
machine, same run) with tau assumed: the round is the sum of its stages at each N, and the
measured whole round at N = 65.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from common import Deadline, device_init, drafter_config, ms_cell, stage_parser, stamp, targets, write
from tevjax.decode import engine
from tevjax.models.dflash import DFlashDrafter
from tevjax.models.transformer import ForwardOutput, Transformer
from tevjax.verifiers import verify
from verifier_latency import time_round_robin

TAUS = (3, 5, 7, 10)


def measure(target, drafter, *, batch, nodes, round_budget, prefix, iters, temperature, deadline) -> dict:
    """Medians and compile times of every stage for one (target, batch); skips what no longer fits."""
    cfg = engine.DecodeConfig(budget=max(nodes) - 1, verifier="tev", temperature=temperature,
                              max_new_tokens=128)
    big = engine.Decoder(target, drafter, cfg)  # sizes the caches for the largest tree
    rng = np.random.default_rng(batch)
    prompts = [rng.integers(0, target.cfg.vocab_size, prefix + 1).tolist() for _ in range(batch)]
    t0 = time.perf_counter()
    state0 = jax.block_until_ready(big.prefill(prompts))
    prefill_s = time.perf_counter() - t0
    tgd, tstate, dgd, dstate = big.tgd, big.tstate, big.dgd, big.dstate
    taps = drafter.cfg.target_layer_ids
    cache_len, root = state0.cache_len, state0.root
    fresh = lambda tree: jax.tree.map(jnp.copy, tree)  # noqa: E731 - every donated user gets its own buffers

    # Each target pass donates its cache and returns the new one (the engine's donated state); its
    # writes land at slots >= cache_len, so the prefix every call reads never changes.
    @functools.partial(jax.jit, donate_argnums=(1,))
    def step(tstate, cache, cache_len, root):
        out = engine.tree_pass(nnx.merge(tgd, tstate), engine.root_trees(root), cache_len, cache)
        return out.logits, out.cache

    @functools.partial(jax.jit, donate_argnums=(1,))
    def tree_pass(tstate, cache, cache_len, trees):
        out = engine.tree_pass(nnx.merge(tgd, tstate), trees, cache_len, cache, taps)
        return out.logits, out.hidden, out.final_hidden, out.cache

    @jax.jit
    def draft(tstate, dstate, dcache, cache_len, root, head):
        return engine.draft(nnx.merge(dgd, dstate), nnx.merge(tgd, tstate), root, cache_len, dcache, head)

    build = jax.jit(engine.draft_trees, static_argnums=2)

    @functools.partial(jax.jit, donate_argnums=(0,))
    def verify_commit(state, dstate, trees, logits, hidden, final_hidden):
        """The round after its tree pass: TEV on every row, then the engine's commit."""
        out = ForwardOutput(logits=logits, hidden=hidden, final_hidden=final_hidden, cache=state.target_cache)
        split = jax.vmap(jax.random.split)(state.keys)
        ver = jax.vmap(lambda k, t, l: verify(k, t, l, temperature, "tev"))(split[:, 1], trees, logits)
        target_cache, drafter_cache, _ = engine.commit(out, ver, state, nnx.merge(dgd, dstate), cfg, target.cfg)
        return dataclasses.replace(state, target_cache=target_cache, drafter_cache=drafter_cache, keys=split[:, 0])

    spec = engine.Decoder(target, drafter, dataclasses.replace(cfg, budget=round_budget))
    ar = engine.Decoder(target, None, cfg)
    box = {"cache": fresh(state0.target_cache), "vc": fresh(state0), "spec": fresh(state0),
           "ar": dataclasses.replace(fresh(state0), drafter_cache=None, draft_head=None)}

    def run_step():
        logits, box["cache"] = step(tstate, box["cache"], cache_len, root)
        return logits

    def run_tree(trees):
        def go():
            *outs, box["cache"] = tree_pass(tstate, box["cache"], cache_len, trees)
            return outs
        return go

    def run_vc(trees, outs):
        def go():
            box["vc"] = verify_commit(box["vc"], dstate, trees, *outs)
            return box["vc"].keys
        return go

    def run_round(name):
        decoder = spec if name == "spec" else ar
        def go():
            box[name] = decoder.step(box[name])
            return box[name].num_out
        return go

    trees, memo = {}, {}

    def draft_logits():
        # The drafter's real logits [B, G, V] for the builder (after "drafter block" compiled draft).
        if "logits" not in memo:
            memo["logits"] = draft(tstate, dstate, state0.drafter_cache, cache_len, root, state0.draft_head)
        return memo["logits"]

    def builder_item(n):
        logits = draft_logits()
        return lambda: build(logits, root, n - 1)

    def tree_item(n):
        trees[n] = build(draft_logits(), root, n - 1)
        return run_tree(trees[n])

    def vc_item(n):
        # The target logits and hidden states of this N's tree, from one (already compiled) pass.
        return run_vc(trees[n], tuple(tree_pass(tstate, fresh(state0.target_cache), cache_len, trees[n])[:3]))

    # (label, tokens per row and call, maker of the timed callable; its setup is not timed).
    items = [("AR step", 1, lambda: run_step),
             ("AR round (engine, no drafter)", 1, lambda: run_round("ar")),
             ("drafter block", drafter.cfg.block_size,
              lambda: lambda: draft(tstate, dstate, state0.drafter_cache, cache_len, root, state0.draft_head))]
    for n in nodes:
        items += [(f"builder, N = {n}", 0, functools.partial(builder_item, n)),
                  (f"tree pass, N = {n}", n, functools.partial(tree_item, n)),
                  (f"verify + commit, N = {n}", 0, functools.partial(vc_item, n))]
    items.append((f"round, N = {round_budget + 1}", round_budget + 1, lambda: run_round("spec")))

    compile_s, fns, skipped = {}, {}, []
    for label, _, make in items:
        # A compile takes seconds on a GPU: stop while the slowest one so far still fits twice.
        n = label.rsplit("= ", 1)[-1]
        if (fns and not deadline.fits(2 * max(compile_s.values()) + 5)) or (
                label.startswith("verify") and int(n) not in trees):
            skipped.append(label)
            continue
        fn = make()
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        compile_s[label] = time.perf_counter() - t0
        fns[label] = fn
    times = time_round_robin(fns, lambda i: (), iters, warmup=2)
    return {"ms": {k: np.asarray(v) * 1e3 for k, v in times.items()}, "compile_s": compile_s,
            "tokens": {label: tok for label, tok, _ in items}, "skipped": skipped, "prefill_s": prefill_s,
            "capacity": state0.target_cache.capacity}


def stage_table(name, batch, r) -> list[str]:
    med = lambda k: float(np.median(r["ms"][k]))  # noqa: E731
    base = med("AR step") if "AR step" in r["ms"] else None
    lines = [f"### {name}, batch {batch}", "",
             f"Prefill (compile + run) {r['prefill_s']:.1f} s; cache capacity {r['capacity']} slots.", "",
             "| stage | tokens per row | median ms (p10-p90) | x AR step | compile + first call s |",
             "|---|---:|---:|---:|---:|"]
    for label, ms in r["ms"].items():
        ratio = f"{med(label) / base:.2f}" if base else "-"
        lines.append(f"| {label} | {r['tokens'][label] or '-'} | {ms_cell(ms)} | {ratio} | {r['compile_s'][label]:.1f} |")
    if r["skipped"]:
        lines.append(f"\nNot run (time budget): {', '.join(r['skipped'])}.")
    return lines + [""]


def speedup_rows(name, batch, r, nodes, round_n, block_size) -> list[str]:
    ms = {k: float(np.median(v)) for k, v in r["ms"].items()}
    ar = ms.get("AR round (engine, no drafter)", ms.get("AR step"))
    rows = []
    if ar is None or "drafter block" not in ms:
        return rows
    for n in nodes:
        parts = [ms.get(f"{s}, N = {n}") for s in ("builder", "tree pass", "verify + commit")]
        if None in parts:
            continue
        total = ms["drafter block"] + sum(parts)
        candidates = [("sum of stages", total)]
        if n == round_n and f"round, N = {n}" in ms:
            candidates.append(("measured round", ms[f"round, N = {n}"]))
        for how, t in candidates:
            # A round emits the accepted path plus the bonus: at most min(N, block size) tokens, so a
            # larger tau is impossible.
            sr = " | ".join(f"{tau * ar / t:.2f}" if tau <= min(n, block_size) else "-" for tau in TAUS)
            rows.append(f"| {name} | {batch} | {n} | {how} | {t:.2f} | {ar:.2f} | {t / ar:.2f} | {sr} |")
    return rows


def report(header, results, nodes, round_n, block_size, notes) -> list[str]:
    lines = header + ["## Implied speedup", "",
                      "SR = tau x (AR round ms) / (round ms): the speedup over autoregressive decoding in the "
                      "same engine if the drafter reached mean output-block length tau (bonus included). "
                      "Break-even tau = round / AR round; '-' where tau exceeds what a round can emit "
                      "(min(N, block size) tokens).", "",
                      "| target | batch | N | round | round ms | AR round ms | break-even tau | "
                      + " | ".join(f"SR @ tau {t}" for t in TAUS) + " |",
                      "|---|---:|---:|---|---:|---:|---:|" + "---:|" * len(TAUS)]
    for (name, batch), r in results.items():
        lines += speedup_rows(name, batch, r, nodes, round_n, block_size)
    lines += ["", "## Stages", ""]
    for (name, batch), r in results.items():
        lines += stage_table(name, batch, r)
    return lines + notes


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = stage_parser(__doc__, 175.0)
    ap.add_argument("--iters", type=int, default=None, help="timed round-robin rounds")
    args = ap.parse_args(argv)
    deadline = Deadline(args.budget_s)
    if args.tiny:
        # One tiny target at one batch: every stage compiles once, which is what costs time on CPU.
        models, batches, nodes, round_budget, prefix, iters = targets(True)[:1], (2,), (5, 9), 8, 16, 5
    else:
        models, batches, nodes, round_budget, prefix, iters = targets(False), (1, 8), (17, 33, 65, 129), 64, 1024, 20
    iters = args.iters or iters
    temperature = 1.0
    described = ", ".join(f"{n} ({c.num_layers} layers, D = {c.hidden_size}, V = {c.vocab_size:,}, "
                          f"{c.num_params / 1e6:,.0f}M parameters)" for n, c in models)
    dcfg = drafter_config(models[0][1], args.tiny)
    header = stamp("GPU stage c: engine costs and implied speedup", argv, [
        f"- Targets: {described}; random weights, {models[0][1].dtype}, drawn on the device.",
        f"- Drafter: DFlash, {dcfg.num_layers} layers, block {dcfg.block_size}, same dtype. Prompt {prefix + 1} "
        f"random tokens per row; temperature {temperature}, verifier TEV; {iters} timed round-robin rounds "
        "after 2 warm-up rounds.", ""])

    results, notes, built = {}, [], {}
    order = [(name, cfg, b) for b in batches for name, cfg in models]  # batch 1 of every target first
    for name, cfg, batch in order:
        if results and not deadline.fits(30):
            notes.append(f"Not run (time budget): {name} at batch {batch}.")
            continue
        if name not in built:
            t0 = time.perf_counter()
            target = device_init(Transformer, cfg, seed=0)
            drafter = device_init(DFlashDrafter, drafter_config(cfg, args.tiny), seed=1)
            built[name] = (target, drafter)
            notes.append(f"{name}: random target + drafter initialised on the device in {time.perf_counter() - t0:.1f} s.")
        target, drafter = built[name]
        results[(name, batch)] = measure(target, drafter, batch=batch, nodes=nodes, round_budget=round_budget,
                                         prefix=prefix, iters=iters, temperature=temperature, deadline=deadline)
        print(f"{name} batch {batch}: " + ", ".join(f"{k} {np.median(v):.2f} ms"
                                                    for k, v in results[(name, batch)]["ms"].items()), flush=True)
        write(args.out, report(header, results, nodes, round_budget + 1, dcfg.block_size, notes))
    lines = report(header, results, nodes, round_budget + 1, dcfg.block_size, notes)
    write(args.out, lines)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
