"""Would choosing the tree size per round pay? An exact greedy simulation with measured round costs.

A round's tree at budget B holds the B best nodes by estimated reach (the drafter's path
probabilities and the lookup chains' calibrated estimates, `merge_chain`'s scores), numbered best
first, so the tree at any smaller budget b is its first b + 1 nodes. A decoder could therefore pick
b per round from those estimates: the expected block of the first b nodes is 1 + the sum of their
reach estimates, and a smaller tree costs less. This script asks whether that pays on this machine,
for the shipped drafter with both lookup chains (the CLI's default path), greedy:

1. **Round costs.** Each held-out prompt is decoded with AR and with the default path at every
   budget of `--budgets`, back to back; a budget's round cost is its seconds per round over AR's
   seconds per token (AR steps per round), pooled over prompts. Greedy outputs must equal AR's.
2. **Trees.** The same prompts are decoded once more, one token per step (plain target steps), and
   before every step the default path's tree at the largest budget is built from that state with
   the engine's own stage functions (`draft`, `draft_trees`, `merge_lookups`), with its
   scores. Greedy decoding's output does not depend on the trees, so every position's tree is the
   one a decoder would verify if a round started there, and which of its nodes the target accepts
   follows from the output alone.
3. **Simulation.** A policy picks a tree size each round; the round emits the accepted path
   within those nodes plus the bonus token and costs that size's measured round cost. Fixed
   budgets are policies too: their simulated tau is checked against the decoded tau of step 1.
   The adaptive policy picks, among the measured sizes, the one with the most expected tokens per
   unit of cost (1 + the sum of the first b reach estimates, over the round cost at b).

    nice -n 19 python experiments/adaptive_budget.py        # results/adaptive_budget.md (+ .json)
    python experiments/adaptive_budget.py --num-prompts 4 --max-new-tokens 32 --out /tmp/ab.md
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import emit  # noqa: E402  experiments/report.py


def measure_costs(models, prompts, budgets, max_new_tokens):
    """Per budget: decoded tau and round cost in AR steps (pooled), and whether outputs equal AR's."""
    from tevjax.decode.engine import DecodeConfig, Decoder

    base = dict(max_new_tokens=max_new_tokens, eos_ids=models.eos_ids)
    decoders = {"ar": Decoder(models.target, None, DecodeConfig(**base))}
    for b in budgets:
        decoders[b] = Decoder(models.target, models.drafter, DecodeConfig(budget=b, lookup=b, corpus=b, **base),
                              ngrams=models.ngrams)
    names = list(decoders)
    runs = {m: {"tokens": 0, "seconds": 0.0, "rounds": 0, "outputs": []} for m in names}
    for i, p in enumerate(prompts):
        for m in names[i % len(names):] + names[: i % len(names)]:
            decoders[m].compile([p])
            t0 = time.perf_counter()
            g = decoders[m].generate([p])[0]
            runs[m]["seconds"] += time.perf_counter() - t0
            runs[m]["tokens"] += len(g.tokens)
            runs[m]["rounds"] += g.rounds
            runs[m]["outputs"].append(g.tokens)
    step = runs["ar"]["seconds"] / runs["ar"]["tokens"]
    return {b: {"tau": runs[b]["tokens"] / runs[b]["rounds"], "cost": runs[b]["seconds"] / runs[b]["rounds"] / step,
                "speedup": (runs[b]["tokens"] / runs[b]["seconds"]) / (runs["ar"]["tokens"] / runs["ar"]["seconds"]),
                "equal": sum(o == a for o, a in zip(runs[b]["outputs"], runs["ar"]["outputs"]))}
            for b in budgets}, runs["ar"]["outputs"]


def capture_trees(models, prompts, budget, max_new_tokens):
    """Per prompt: (output tokens, [positions, N] tree tokens, parents and reach scores), the tree at
    each position built from the state after the output's first `position` tokens."""
    import jax
    from flax import nnx

    from tevjax.decode import engine
    from tevjax.decode.engine import DecodeConfig, Decoder

    cfg = DecodeConfig(budget=budget, lookup=budget, corpus=budget, max_new_tokens=max_new_tokens,
                       eos_ids=models.eos_ids)
    dec = Decoder(models.target, models.drafter, cfg, ngrams=models.ngrams)

    def step(tstate, dstate, state, ngrams):
        target, drafter = nnx.merge(dec.tgd, tstate), nnx.merge(dec.dgd, dstate)
        logits = engine.draft(drafter, target, state.root, state.cache_len, state.drafter_cache, state.draft_head)
        trees, scores = engine.draft_trees(logits, state.root, budget, drafter.vocab_ids(), with_scores=True)
        trees, scores = engine.merge_lookups(trees, scores, state.history, state.cache_len, ngrams, cfg,
                                             with_scores=True)
        split = jax.vmap(jax.random.split)(state.keys)
        plain, _ = engine._settle(target, drafter, state, engine.root_trees(state.root), "tev", split[:, 0],
                                  split[:, 1], cfg)
        return (trees.tokens[0], trees.parents[0], scores[0]), plain

    run = jax.jit(step, donate_argnums=(2,))
    out = []
    for p in prompts:
        state, got = dec.prefill([p]), []
        while not bool(np.asarray(state.done)[0]):
            tree, state = run(dec.tstate, dec.dstate, state, dec.ngrams)
            got.append([np.asarray(x) for x in tree])
        tokens = np.asarray(state.out)[0, : int(np.asarray(state.num_out)[0])]
        out.append((tokens, *(np.stack([g[k] for g in got]) for k in range(3))))
    return out


def accepted_depths(output, position, tokens, parents):
    """[N] depth of each node on the greedy path from `position` (the target's output), else -1."""
    depth = np.full(len(tokens), -1)
    depth[0] = 0
    for v in range(1, len(tokens)):
        p = parents[v]
        if p >= 0 and depth[p] >= 0 and position + depth[p] < len(output) and output[position + depth[p]] == tokens[v]:
            depth[v] = depth[p] + 1
    return depth


def simulate(trees, choose):
    """(tokens, rounds, cost) of decoding every prompt with `choose(reach [N]) -> (nodes, cost)`."""
    tokens = rounds = 0
    cost = 0.0
    for output, tree_tokens, parents, scores in trees:
        pos = 0
        while pos < len(output):
            reach = np.where(parents[pos] >= 0, np.exp(scores[pos]), 0.0)
            reach[0] = 1.0
            nodes, c = choose(reach)
            depth = accepted_depths(output, pos, tree_tokens[pos], parents[pos])[:nodes]
            block = min(int(depth.max()) + 1, len(output) - pos)
            pos, tokens, rounds, cost = pos + block, tokens + block, rounds + 1, cost + c
    return tokens, rounds, cost


def report(costs, sims, args, seconds) -> list[str]:
    lines = ["# Choosing the tree size per round: an exact greedy simulation with measured round costs", "",
             f"Command: `python experiments/adaptive_budget.py --num-prompts {args.num_prompts} --max-new-tokens "
             f"{args.max_new_tokens} --budgets {' '.join(map(str, args.budgets))}` ({time.strftime('%Y-%m-%d')}, "
             f"{seconds / 60:.1f} min in all). Machine: {platform.processor() or platform.machine()}, "
             f"{platform.platform()}. SmolLM2-135M-Instruct (fp32), the shipped drafter with both lookup chains "
             f"(chains as long as the budget), greedy TEV, held-out prompts {args.first}-"
             f"{args.first + args.num_prompts - 1}, "
             "batch 1. Round cost: seconds per round over AR's seconds per token, decoded back to back per prompt "
             "in a rotated order. Simulated: every position's tree at the largest budget, teacher-forced (see the "
             "script's docstring); speed is simulated tokens per unit of measured cost, relative to fixed budget 8.",
             "", "| policy | decoded tau | decoded speedup vs AR | round cost (AR steps) | simulated tau "
             "| simulated speed vs budget 8 |", "|---|---:|---:|---:|---:|---:|"]
    ref = sims["budget 8"]["rate"]
    for name, sim in sims.items():
        b = sim.get("budget")
        decoded = costs.get(b) if b is not None else None
        cols = (f"{decoded['tau']:.3f} | {decoded['speedup']:.3f}x | {decoded['cost']:.2f}" if decoded
                else "- | - | -")
        lines.append(f"| {name} | {cols} | {sim['tau']:.3f} | {sim['rate'] / ref:.3f} |")
    same = [f"{b}: {c['equal']} of {args.num_prompts}" for b, c in costs.items()]
    lines += ["", f"Greedy outputs equal to AR's, by budget: {', '.join(same)}."]
    return lines


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=24)
    parser.add_argument("--first", type=int, default=16, help="first held-out prompt (0-15 are the headline ones)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--budgets", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "adaptive_budget.md"))
    args = parser.parse_args(argv)
    if args.num_prompts < 1 or args.max_new_tokens < 1 or args.first < 0:
        parser.error("--num-prompts and --max-new-tokens must be >= 1, --first >= 0")
    if any(b < 1 for b in args.budgets) or 8 not in args.budgets:
        parser.error(f"--budgets must be >= 1 and include 8 (the reference), got {args.budgets}")
    args.budgets = sorted(set(args.budgets))
    return args


def main() -> None:
    args = parse_args()
    from tevjax.convert.tokenizer import chat_prompt_ids
    from tevjax.evaluate import load_eval_prompts
    from tevjax.loading import load_models

    t0 = time.perf_counter()
    models = load_models("smollm2")
    texts = load_eval_prompts("heldout", args.first + args.num_prompts)[args.first:]
    prompts = [chat_prompt_ids(models.tokenizer, t) for t in texts]
    costs, ar_outputs = measure_costs(models, prompts, args.budgets, args.max_new_tokens)
    print(json.dumps({str(k): v for k, v in costs.items()}), flush=True)
    trees = capture_trees(models, prompts, max(args.budgets), args.max_new_tokens)
    assert [list(t[0]) for t in trees] == ar_outputs, "teacher-forced outputs differ from AR's"
    sizes = {b + 1: costs[b]["cost"] for b in args.budgets}
    sims = {}
    for b in args.budgets:
        n, r, c = simulate(trees, lambda reach, b=b: (b + 1, sizes[b + 1]))
        sims[f"budget {b}"] = {"budget": b, "tau": n / r, "rate": n / c}

    def adaptive(reach):
        expected = np.cumsum(reach)
        nodes = max(sizes, key=lambda n: expected[n - 1] / sizes[n])
        return nodes, sizes[nodes]

    n, r, c = simulate(trees, adaptive)
    sims["adaptive (most expected tokens per cost)"] = {"tau": n / r, "rate": n / c}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"args": vars(args), "costs": {str(k): v for k, v in costs.items()},
                                                    "simulated": sims}, indent=1))
    emit(report(costs, sims, args, time.perf_counter() - t0), out)


if __name__ == "__main__":
    main()
