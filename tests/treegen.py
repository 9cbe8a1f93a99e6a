"""Random draft trees, brute-force references and the chi-square test of the core tests."""

from __future__ import annotations

import itertools

import numpy as np
from scipy import stats as sps


def assign_tokens(parents: np.ndarray, vocab: int, rng: np.random.Generator, root_token: int = 0) -> np.ndarray:
    """Distinct tokens among siblings, drawn at random from [0, vocab)."""
    n = len(parents)
    tokens = np.zeros(n, np.int32)
    tokens[0] = root_token
    used: dict[int, list[int]] = {}
    for i in range(1, n):
        p = int(parents[i])
        if p < 0:
            continue
        taken = used.setdefault(p, [])
        free = [t for t in range(vocab) if t not in taken]
        tok = int(rng.choice(free))
        taken.append(tok)
        tokens[i] = tok
    return tokens


def chain(n: int) -> np.ndarray:
    return np.arange(n, dtype=np.int32) - 1


def star(n: int) -> np.ndarray:
    parents = np.zeros(n, np.int32)
    parents[0] = -1
    return parents


def random_parents(n: int, rng: np.random.Generator, max_children: int, bias: float = 0.0) -> np.ndarray:
    """Random recursive tree; `bias` > 0 prefers recent parents (deeper trees)."""
    parents = np.full(n, -1, np.int32)
    counts = np.zeros(n, int)
    for i in range(1, n):
        cand = np.array([j for j in range(i) if counts[j] < max_children])
        weights = np.exp(bias * cand / max(i, 1))
        p = int(rng.choice(cand, p=weights / weights.sum()))
        parents[i] = p
        counts[p] += 1
    return parents


def insert_padding(parents: np.ndarray, tokens: np.ndarray, positions: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Inserts padding slots (parent -1, garbage token) before the given original indices (>= 1).

    Returns the padded parents, tokens and the map old index -> new index.
    """
    n = len(parents)
    order: list[int | None] = []
    pos = sorted(positions)
    k = 0
    for i in range(n):
        while k < len(pos) and pos[k] == i:
            order.append(None)
            k += 1
        order.append(i)
    order.extend([None] * (len(pos) - k))
    new_index = {old: new for new, old in enumerate(order) if old is not None}
    new_parents = np.full(len(order), -1, np.int32)
    new_tokens = np.full(len(order), 12345, np.int32)  # garbage tokens at padding
    for new, old in enumerate(order):
        if old is None:
            continue
        new_tokens[new] = tokens[old]
        if parents[old] >= 0:
            new_parents[new] = new_index[int(parents[old])]
    return new_parents, new_tokens, np.array([new_index[i] for i in range(n)])


def softmax(z: np.ndarray) -> np.ndarray:
    z = z.astype(np.float64)
    m = np.max(z, axis=-1, keepdims=True)
    e = np.exp(z - m)
    return e / e.sum(axis=-1, keepdims=True)


def real_nodes(parents) -> np.ndarray:
    """[N] bool: the root and every node whose whole root path is real."""
    real = np.zeros(len(parents), bool)
    real[0] = True
    for i in range(1, len(parents)):
        real[i] = parents[i] >= 0 and real[parents[i]]
    return real


def target_probs(logits, temperature: float) -> np.ndarray:
    """p_v for every row in float64; point masses on the argmax at temperature 0."""
    if temperature == 0:
        return np.eye(logits.shape[-1])[np.argmax(logits, axis=-1)]
    return softmax(np.asarray(logits, np.float64) / temperature)


def brute_force_law(tokens, parents, logits, temperature: float):
    """Enumerates every target continuation of length (tree depth) + 1 over a tiny vocabulary.

    The continuation walks the tree: from node v the next token is drawn from p_v; if it matches a
    child the walk moves there, otherwise (or at a leaf) it exits at v with that token as the bonus.
    Tokens after the exit lie outside the tree, where the target law is not given; they are drawn
    uniformly, so each full sequence carries its tree-part probability times V^-(remaining).
    Returns (joint [N, V] law of (exit node, bonus token), P [N], rho [N]) in float64.
    """
    tokens = np.asarray(tokens)
    parents = np.asarray(parents)
    n, vocab = logits.shape
    real = real_nodes(parents)
    probs = target_probs(logits, temperature)
    child = {}
    for i in range(1, n):
        if real[i]:
            child[(int(parents[i]), int(tokens[i]))] = i
    depth = np.zeros(n, int)
    for i in range(1, n):
        if real[i]:
            depth[i] = depth[parents[i]] + 1
    horizon = int(depth.max()) + 1
    joint = np.zeros((n, vocab))
    reach = np.zeros(n)
    for z in itertools.product(range(vocab), repeat=horizon):
        v, p = 0, 1.0
        for t, tok in enumerate(z):
            p *= probs[v, tok]
            if p == 0.0:
                break
            nxt = child.get((v, tok))
            if nxt is None:
                joint[v, tok] += p * float(vocab) ** -(horizon - t - 1)
                break
            v = nxt
        else:
            raise AssertionError("a continuation of length depth + 1 must leave the tree")
    for v in range(n):
        # P(v): total mass of continuations that pass through v (exit at v or below it).
        below = [u for u in range(n) if real[u] and _is_ancestor(parents, v, u)]
        reach[v] = joint[below].sum() if real[v] else 0.0
    rho = np.where(reach > 0, joint.sum(axis=1) / np.where(reach > 0, reach, 1), 0.0)
    return joint, reach, rho


def _is_ancestor(parents, a: int, b: int) -> bool:
    while b >= 0:
        if b == a:
            return True
        b = int(parents[b])
    return False


def exact_joint(tokens, parents, logits, temperature: float) -> np.ndarray:
    """The canonical (exit node, bonus) law in closed form: w(v) * p_v^res(y), float64."""
    tokens = np.asarray(tokens)
    parents = np.asarray(parents)
    n, vocab = logits.shape
    real = real_nodes(parents)
    probs = target_probs(logits, temperature)
    prefix = np.zeros(n)
    prefix[0] = 1.0
    for i in range(1, n):
        if real[i]:
            prefix[i] = prefix[parents[i]] * probs[parents[i], tokens[i]]
    joint = np.zeros((n, vocab))
    for v in range(n):
        if not real[v]:
            continue
        row = probs[v].copy()
        for u in range(1, n):
            if real[u] and parents[u] == v:
                row[tokens[u]] = 0.0
        joint[v] = prefix[v] * row
    return joint


def chi2_pvalue(counts: np.ndarray, probs: np.ndarray, *, zero_draws: int = 0) -> float:
    """Pearson's chi-square p-value of observed `counts` against the law `probs` (same shape) over its
    outcomes of positive probability, cells expecting fewer than 5 pooled. More than `zero_draws`
    draws on outcomes of probability 0 reject outright (p = 0)."""
    counts, probs = np.asarray(counts, float).ravel(), np.asarray(probs, float).ravel()
    if counts[probs <= 0].sum() > zero_draws:
        return 0.0
    possible = probs > 0
    obs, expected = counts[possible], probs[possible] * counts.sum()
    keep = expected >= 5
    o, e = obs[keep], expected[keep]
    if not keep.all():
        o, e = np.append(o, obs[~keep].sum()), np.append(e, expected[~keep].sum())
    if len(e) < 2:
        return 1.0
    return float(sps.chi2.sf(np.sum((o - e) ** 2 / e), len(e) - 1))
