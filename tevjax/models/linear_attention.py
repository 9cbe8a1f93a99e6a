"""Gated delta-rule linear attention (Gated DeltaNet, as in Qwen3-Next's linear layers) over a
block whose tokens form a sequence or a tree, as pure functions.

The recurrence, per value head, with a state S [Dk, Dv] and for each token t (key k_t and query
q_t unit-normed, the query also scaled by Dk^-1/2; decay g_t <= 0 in log space; beta_t in (0, 1))::

    S   <- exp(g_t) S
    S   <- S + k_t (beta_t (v_t - S^T k_t))^T          the delta rule: write the correction
    o_t  = S^T q_t

A block of T tokens is computed at once in the WY ("UT transform") form: with c_i the summed
decay of token i's sequence since the block began, A[i, j] = beta_i (k_i . k_j) exp(c_i - c_j)
over the strictly earlier tokens j of i's sequence, and (I + A) X = [beta v, beta k exp(c)]
solved by forward substitution (A is strictly lower triangular),

    v_new = X_v - X_k S0
    o_i   = exp(c_i) q_i S0 + sum_{j <= i in i's sequence} (q_i . k_j) exp(c_i - c_j) v_new_j.

Row i of that system reads only the rows of i's own earlier tokens. So the same formula serves a
tree: "the earlier tokens of i's sequence" are its ancestors (`mask`, ancestor-or-self, as the tree
pass's attention mask), node indices put parents before children, and every node gets the output
its root-to-node path would get as a sequence, without a [T, Dk, Dv] state per node. A causal run
passes the lower triangle. The state after a sequence (`final=True`) is

    S_T = exp(c_T) S0 + sum_j exp(c_T - c_j) k_j v_new_j^T.

A token with g = 0 and beta = 0 leaves the state as it was, which is how padding is kept out.
Everything is float32. Shape letters: the legend in `tevjax/__init__.py` (Hv value heads, Hk key
heads, Dk and Dv their widths, C conv channels, W the conv width).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["causal_conv", "commit_path", "gated_delta", "gated_delta_chunked", "l2_normalize", "last_inputs",
           "tree_conv"]

_HI = jax.lax.Precision.HIGHEST


def l2_normalize(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """x / sqrt(sum(x^2) + eps) over the last axis, in float32 (the FLA kernels' form, which
    transformers follows)."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def gated_delta(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, state: jax.Array,
                mask: jax.Array, *, final: bool = False) -> tuple[jax.Array, jax.Array | None]:
    """One block of the gated delta rule (see the module docstring).

    q, k [B, T, Hv, Dk] (unit-normed; q also scaled; one per value head); v [B, T, Hv, Dv]; g, beta
    [B, T, Hv]; state [B, Hv, Dk, Dv], the state before the block; mask [B, T, T] bool, token i's ancestor-or-self
    tokens (a causal run: the lower triangle), whose indices must come before i's.
    -> (out [B, T, Hv, Dv] float32, the state after the block's sequence when `final`, else None;
    `final` needs `mask` to be one sequence, the lower triangle).
    """
    f32 = jnp.float32
    q, k, v, g, beta, state = (x.astype(f32) for x in (q, k, v, g, beta, state))
    t = q.shape[1]
    m = mask.astype(bool)[:, None]  # [B, 1, T, T]
    strict = m & ~jnp.eye(t, dtype=bool)
    c = jnp.einsum("bij,bjh->bhi", mask.astype(f32), g, precision=_HI)  # [B, Hv, T] summed decay of each sequence
    # exp(c_i - c_j) only where j is on i's sequence (there it is <= 1); 0 elsewhere, without an overflow.
    pair = jnp.where(m, jnp.exp(jnp.where(m, c[..., :, None] - c[..., None, :], 0.0)), 0.0)  # [B, Hv, T, T]
    kk = jnp.einsum("bihd,bjhd->bhij", k, k, precision=_HI)
    bh = jnp.swapaxes(beta, 1, 2)  # [B, Hv, T]
    a = jnp.where(strict, bh[..., :, None] * kk * pair, 0.0)
    lhs = a + jnp.eye(t, dtype=f32)
    rhs = jnp.concatenate([jnp.swapaxes(v * beta[..., None], 1, 2),
                           jnp.swapaxes(k * (beta * jnp.exp(jnp.swapaxes(c, 1, 2)))[..., None], 1, 2)], axis=-1)
    x = jax.lax.linalg.triangular_solve(lhs, rhs, left_side=True, lower=True, unit_diagonal=True)  # [B, Hv, T, Dv + Dk]
    dv = v.shape[-1]
    u, w = x[..., :dv], x[..., dv:]
    v_new = u - jnp.einsum("bhtk,bhkv->bhtv", w, state, precision=_HI)  # [B, Hv, T, Dv]
    qk = jnp.einsum("bihd,bjhd->bhij", q, k, precision=_HI) * pair
    qs = jnp.swapaxes(q, 1, 2) * jnp.exp(c)[..., None]  # [B, Hv, T, Dk]
    out = (jnp.einsum("bhtk,bhkv->bhtv", qs, state, precision=_HI)
           + jnp.einsum("bhij,bhjv->bhiv", qk, v_new, precision=_HI))
    out = jnp.swapaxes(out, 1, 2)
    if not final:
        return out, None
    last = c[..., -1:]  # [B, Hv, 1]
    kd = jnp.swapaxes(k, 1, 2) * jnp.exp(last - c)[..., None]  # [B, Hv, T, Dk]
    new = state * jnp.exp(last)[..., None] + jnp.einsum("bhtk,bhtv->bhkv", kd, v_new, precision=_HI)
    return out, new


def gated_delta_chunked(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array,
                        state: jax.Array, *, chunk: int = 64) -> tuple[jax.Array, jax.Array]:
    """A causal run of any length T: `gated_delta` over chunks of `chunk` tokens under a
    `lax.scan`, each starting from the state the chunk before left. Shapes as `gated_delta`'s;
    -> (out [B, T, Hv, Dv] float32, the state after the T tokens). Padding up to a whole chunk has
    g = beta = 0 and so leaves the state alone."""
    b, t, h, dk = k.shape
    size = min(chunk, t)
    pad = -t % size
    if pad:
        q, k, v, g, beta = (jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2)) for x in (q, k, v, g, beta))
    n = (t + pad) // size

    def split(x):  # [B, n * size, ...] -> [n, B, size, ...]
        return jnp.moveaxis(x.reshape(b, n, size, *x.shape[2:]), 1, 0)

    tril = jnp.broadcast_to(jnp.tril(jnp.ones((size, size), bool)), (b, size, size))

    def body(s, xs):
        out, s = gated_delta(*xs, s, tril, final=True)
        return s, out

    state, out = jax.lax.scan(body, state.astype(jnp.float32), tuple(split(x) for x in (q, k, v, g, beta)))
    out = jnp.moveaxis(out, 0, 1).reshape(b, n * size, h, v.shape[-1])
    return out[:, :t], state


def causal_conv(x: jax.Array, conv_state: jax.Array, weight: jax.Array) -> jax.Array:
    """Depthwise causal convolution of a causal run: x [B, T, C] after the W - 1 earlier inputs
    `conv_state` [B, W - 1, C] (oldest first); weight [C, W], its last tap on the token itself.
    -> [B, T, C] float32 (before the activation)."""
    width = weight.shape[1]
    t = x.shape[1]
    xx = jnp.concatenate([conv_state.astype(jnp.float32), x.astype(jnp.float32)], axis=1)  # [B, W - 1 + T, C]
    w = weight.astype(jnp.float32)
    return sum(xx[:, j:j + t] * w[:, j] for j in range(width))


def tree_conv(x: jax.Array, conv_state: jax.Array, weight: jax.Array, mask: jax.Array, depth: jax.Array) -> jax.Array:
    """`causal_conv` over a tree: tap j of node i reads the input W - 1 - j steps up i's path, the
    ancestor at that depth (`mask` [B, T, T] ancestor-or-self, `depth` [B, T] from the root's 0),
    or, above the root, `conv_state`'s entry of the committed tokens before it. A causal run (mask
    the lower triangle, depth t) gets `causal_conv`'s result. -> [B, T, C] float32."""
    width = weight.shape[1]
    x, st, w = x.astype(jnp.float32), conv_state.astype(jnp.float32), weight.astype(jnp.float32)
    depth = depth.astype(jnp.int32)
    out = jnp.zeros(x.shape, jnp.float32)
    for j in range(width):
        up = width - 1 - j  # steps up the path
        if up == 0:
            src = x
        else:
            want = depth - up  # [B, T] the source's depth (negative: a committed token)
            pick = mask.astype(bool) & (depth[:, None, :] == want[:, :, None])  # [B, T, T] one-hot where want >= 0
            from_tree = jnp.einsum("bij,bjc->bic", pick.astype(jnp.float32), x, precision=_HI)
            slot = jnp.clip(width - 1 + want, 0, width - 2)  # conv_state index of a committed token
            from_state = jnp.take_along_axis(st, slot[..., None], axis=1)
            src = jnp.where((want >= 0)[..., None], from_tree, from_state)
        out = out + src * w[:, j]
    return out


def last_inputs(conv_state: jax.Array, x: jax.Array, count: jax.Array) -> jax.Array:
    """The conv state after the first `count` [B] of the inputs x [B, T, C] that follow
    `conv_state` [B, W - 1, C]: the last W - 1 of them all, per row."""
    xx = jnp.concatenate([conv_state, x.astype(conv_state.dtype)], axis=1)
    width = conv_state.shape[1]
    return jax.vmap(lambda row, n: jax.lax.dynamic_slice_in_dim(row, n, width, axis=0))(xx, count.astype(jnp.int32))


def commit_path(state: jax.Array, conv_state: jax.Array, x: jax.Array, k: jax.Array, v: jax.Array, gb: jax.Array,
                nodes: jax.Array, count: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One linear layer's state and conv state after a tree pass's accepted path.

    state [B, Hv, Dk, Dv], conv_state [B, W - 1, C]: before the tree pass; x [B, N, C] each node's
    conv input, k [B, N, Hk, Dk] its convolved keys (not yet normed), v [B, N, Hv, Dv] its values,
    gb [B, N, 2, Hv] its decay g and beta, as the tree pass computed them; nodes [B, M]
    the path (root first), of which the first `count` [B] are taken. The path is run as the
    sequence it is (`gated_delta` with `final`), so the state is the one a causal run over those
    tokens leaves, whatever else the tree held.
    """
    b, m = nodes.shape

    def take(a):
        idx = nodes.reshape(b, m, *([1] * (a.ndim - 2)))
        return jnp.take_along_axis(a, jnp.clip(idx, 0, a.shape[1] - 1), axis=1)

    h = v.shape[2]
    kp = l2_normalize(take(k))
    kp = jnp.repeat(kp, h // kp.shape[2], axis=2)
    gbp = take(gb)
    live = jnp.arange(m)[None, :, None] < count[:, None, None]
    g, beta = jnp.where(live, gbp[:, :, 0], 0.0), jnp.where(live, gbp[:, :, 1], 0.0)
    tril = jnp.broadcast_to(jnp.tril(jnp.ones((m, m), bool)), (b, m, m))
    _, new = gated_delta(jnp.zeros_like(kp), kp, take(v), g, beta, state, tril, final=True)
    return new, last_inputs(conv_state, take(x), count)
