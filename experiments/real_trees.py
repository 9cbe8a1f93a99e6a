"""Real draft trees: the trees and target logits of the engine's own decoding rounds.

`capture_rounds` decodes each prompt with the unchanged `Decoder` (one jitted round per step,
`Decoder.step`) and, before every round, runs the round's first stages on the same state with the
engine's own stage functions: `draft` -> `draft_trees` -> `tree_pass`. The drafter is
deterministic and those stages read only the state, so the tree captured at the decoding budget is
exactly the tree the engine verifies in that round; after the step, `block_follows_tree` checks it
against the block the engine emitted. At other budgets the same draft logits build the tree the
decoder would have built at that budget in the same context ("same contexts" for a budget sweep).

Rounds are yielded one at a time, because a round's logits are large ([N, V] float32 per budget:
13 MB at budget 64 and V = 49,152) and the experiments reduce each one to a few numbers.
Costs: each captured round runs one extra tree pass per captured budget (the engine's own round
runs its pass again; it is not modified to hand its logits out).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import platform
import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tevjax.decode import engine
from tevjax.decode.engine import DecodeConfig, Decoder
from tevjax.tree import DraftTree
from tree_stats import block_follows_tree

__all__ = ["CapturedRound", "capture_rounds", "describe_drafter", "load_prompt_ids", "machine_facts", "versions"]


@dataclasses.dataclass
class CapturedRound:
    """One decoding round of one prompt, before verification (device arrays, batch axis removed)."""

    prompt: int  # index into the prompt list
    round: int  # 0-based round of that prompt's decoding
    context_len: int  # committed tokens (prompt + generated so far)
    trees: dict[int, DraftTree]  # by budget: the DDTree of that budget ([N] fields, N = budget + 1)
    logits: dict[int, jax.Array]  # by budget: [N, V] float32 target logits over that tree
    draft_logprob: dict[int, np.ndarray]  # by budget: [N] log q_depth(x_v); 0 at the root, -inf at padding
    horizon: int  # G = block_size - 1, the deepest a tree can reach


def _capture(tstate, dstate, state, *, tgd, dgd, budgets: tuple[int, ...]):
    """Draft once, then per budget the engine's DDTree and its target tree pass (no donation: the
    state goes on to the engine's own round)."""
    target = nnx.merge(tgd, tstate)
    drafter = nnx.merge(dgd, dstate)
    draft_logits = engine.draft(drafter, target, state.root, state.cache_len, state.drafter_cache)  # [1, G, Vd]
    log_q = jax.nn.log_softmax(draft_logits[0].astype(jnp.float32), axis=-1)  # [G, Vd]
    out = {}
    for budget in budgets:
        trees = engine.draft_trees(draft_logits, state.root, budget, drafter.vocab_ids())
        logits = engine.tree_pass(target, trees, state.cache_len, state.target_cache).logits  # [1, N, V]
        tree = jax.tree.map(lambda x: x[0], trees)
        # The drafter's probability of each node's token at its depth row (ranks siblings).
        index, _ = drafter.draft_index(tree.tokens)
        row = jnp.maximum(tree.depth - 1, 0)
        is_edge = tree.valid & (tree.parents >= 0)
        lp = jnp.where(is_edge, log_q[row, index], jnp.where(tree.valid, 0.0, -jnp.inf))
        out[budget] = (tree, logits[0].astype(jnp.float32), lp)
    return out


@functools.lru_cache(maxsize=8)
def _capture_fn(tgd, dgd, budgets: tuple[int, ...]):
    """One jitted `_capture` per (models, budgets), so that decoding again at another temperature
    (a new Decoder, hence new jitted rounds) reuses the capture's compilation."""
    return jax.jit(functools.partial(_capture, tgd=tgd, dgd=dgd, budgets=budgets))


def capture_rounds(models, prompts: Sequence[Sequence[int]], *, decode_budget: int, budgets: Sequence[int],
                   temperature: float, max_new_tokens: int, seed: int, max_rounds: int | None = None,
                   verifier: str = "tev", engine_log: list | None = None) -> Iterator[CapturedRound]:
    """Decodes every prompt (batch 1, seed `seed` + prompt index, `verifier` at `temperature`,
    DDTree budget `decode_budget`) and yields each round's trees at `budgets` before the round
    runs. At most `max_rounds` rounds per prompt (None: until EOS or `max_new_tokens`).

    After the consumer hands control back, the round runs in the engine; with `engine_log`, one
    dict per round is appended to it: prompt, round, `block` (tokens the engine emitted) and
    `follows_tree` (that block can come from verifying the captured decode-budget tree).
    """
    budgets = tuple(sorted(set(int(b) for b in budgets) | {int(decode_budget)}))
    # Prefill buckets of 128 tokens (the engine's default is 64): held-out prompts range over
    # hundreds of tokens, and each distinct bucket costs a prefill compile.
    cfg = DecodeConfig(verifier=verifier, budget=max(budgets), temperature=float(temperature),
                       max_new_tokens=int(max_new_tokens), eos_ids=models.eos_ids, prompt_bucket=128)
    # One cache capacity for every prompt, the largest any prompt needs with the largest captured
    # tree, so the round and the capture compile once (the prefill once per prompt bucket).
    capacity = Decoder(models.target, models.drafter, cfg).shapes([len(p) for p in prompts])[1]
    cfg = dataclasses.replace(cfg, budget=int(decode_budget), capacity=capacity)
    decoder = Decoder(models.target, models.drafter, cfg)
    capture = _capture_fn(decoder.tgd, decoder.dgd, budgets)
    horizon = models.drafter.cfg.block_size - 1
    for i, prompt in enumerate(prompts):
        state = decoder.prefill([list(prompt)], seed=seed + i)
        r = 0
        while not bool(np.asarray(state.done)[0]) and (max_rounds is None or r < max_rounds):
            got = capture(decoder.tstate, decoder.dstate, state)
            context_len = int(np.asarray(state.cache_len)[0]) + 1  # the root is committed too
            num_out = int(np.asarray(state.num_out)[0])
            rnd = CapturedRound(
                prompt=i, round=r, context_len=context_len,
                trees={b: t for b, (t, _, _) in got.items()},
                logits={b: lg for b, (_, lg, _) in got.items()},
                draft_logprob={b: np.asarray(lp) for b, (_, _, lp) in got.items()},
                horizon=horizon,
            )
            yield rnd
            state = decoder.step(state)
            new = np.asarray(state.out)[0, num_out: int(np.asarray(state.num_out)[0])].tolist()
            tree = rnd.trees[int(decode_budget)]
            del rnd, got  # the consumer is done with them: free the logits before the next capture
            ok = block_follows_tree(np.asarray(tree.tokens), np.asarray(tree.parents), np.asarray(tree.valid), new)
            if engine_log is not None:
                engine_log.append({"prompt": i, "round": r, "block": len(new), "follows_tree": bool(ok)})
            r += 1


# ------------------------------------------------------------------------------------- inputs and facts


def load_prompt_ids(tokenizer, spec: str, n: int) -> tuple[list[str], list[list[int]]]:
    """The first `n` prompts of `spec` (see `tevjax.evaluate.load_eval_prompts`: heldout = the
    shipped drafter's held-out ShareGPT prompts) as (texts, chat-template token ids)."""
    from tevjax.convert.tokenizer import chat_prompt_ids
    from tevjax.evaluate import load_eval_prompts

    if tokenizer is None:
        raise ValueError("this target has no tokenizer: the experiment's prompts are text")
    texts = load_eval_prompts(spec, n)
    if len(texts) < n:
        raise ValueError(f"--prompts {spec}: only {len(texts)} prompts available, {n} requested")
    return texts, [chat_prompt_ids(tokenizer, t) for t in texts]


def describe_drafter(models, drafter_dir: str | os.PathLike | None) -> str:
    """One line naming the drafter and whether it is trained (an untrained one keeps C_p near 0)."""
    if drafter_dir is not None:
        desc = f"DFlash checkpoint `{drafter_dir}`"
    elif models.drafter_trained:
        desc = "the project's shipped SmolLM2 DFlash drafter"
    else:
        desc = ("a freshly initialised, UNTRAINED DFlash drafter (seed 0): no --drafter was given and no "
                "trained drafter ships with the package, so trees hold almost no target mass")
    c = models.drafter.cfg
    vocab = "full vocabulary" if models.drafter.vocab_ids() is None else f"draft vocabulary {c.draft_vocab_size}"
    return f"{desc}; {c.num_layers} layer(s), block size {c.block_size}, {vocab}"


def machine_facts() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    d = jax.devices()[0]
    return (f"{cpu}; {os.cpu_count()} CPU cores; jax {jax.__version__} on {d.platform}; "
            f"Python {platform.python_version()}; {platform.system()} {platform.release()}")


def versions() -> dict[str, str]:
    import flax
    import matplotlib

    import tevjax

    out = {"python": platform.python_version(), "jax": jax.__version__, "flax": flax.__version__,
           "numpy": np.__version__, "matplotlib": matplotlib.__version__,
           "tevjax": getattr(tevjax, "__version__", "0.1.0")}
    try:
        out["git"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                    cwd=Path(__file__).resolve().parent, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return out
