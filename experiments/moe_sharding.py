"""A routed MLP over devices: split each expert's width, split the experts, or both?

`tevjax.sharding` splits a routed MLP (`SparseMoE`) in one of three ways, chosen by the mesh:

* width (`--mesh model=4`): every device holds every expert, a quarter of each one's width;
* experts (`--mesh expert=4`): each device holds E / 4 whole experts (expert parallelism);
* both (`--mesh expert=2,model=2`): half of the experts per pair of devices, each width halved.

Every device of the group holds the same N tokens, so in each layout a device runs what it holds on
every token and the layer ends in one all-reduce of [N, D] partial sums. This compiles one routed
layer of Qwen3-30B-A3B (E = 128 experts of width 768, k = 8 per token, D = 2048, bfloat16) for 4
forced CPU devices from its shapes alone (no weights are made, nothing runs) and reads from each
compiled program the bytes its collectives move and what each device holds of the experts. Both
dispatches: "dense" (every expert on every token) and "ragged" (tokens grouped by expert), each
as tevjax traces it (on the mesh: per device, under `shard_map`) and as XLA's partitioner splits
it when the mesh is not in context. N = 68 tokens is a tree pass of 4 rows at budget 16;
2,048 a prefill chunk.

    python experiments/moe_sharding.py
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

if "XLA_FLAGS" not in os.environ:  # before jax is imported
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from lm_head_sharding import collective_bytes  # noqa: E402  experiments/ (scripts run from this folder)
from moe_dispatch import positive  # noqa: E402
from report import emit  # noqa: E402
from tevjax.models.layers import SparseMoE  # noqa: E402
from tevjax.sharding import TARGET_AXES, logical_sharding, make_mesh, traced_on  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "moe_sharding.md"
LAYOUTS = (("width", dict(model=4)), ("experts", dict(model=1, expert=4)), ("both", dict(model=2, expert=2)))


def main():
    parser = argparse.ArgumentParser()
    for name, default in (("experts", 128), ("per-token", 8), ("width", 2048), ("expert-width", 768)):
        parser.add_argument(f"--{name}", type=positive, default=default)
    parser.add_argument("--tokens", type=positive, nargs="+", default=[68, 2048])
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    if args.per_token > args.experts:
        parser.error(f"--per-token {args.per_token} is more than --experts {args.experts}")
    for name in ("experts", "expert_width"):  # each layout splits one or both 4 ways
        if getattr(args, name) % 4:
            parser.error(f"--{name.replace('_', '-')} {getattr(args, name)} does not split over 4 devices")
    if len(jax.devices()) != 4:
        parser.error(f"needs 4 devices (XLA_FLAGS=--xla_force_host_platform_device_count=4), found "
                     f"{len(jax.devices())}")
    e, k, d, i = args.experts, args.per_token, args.width, args.expert_width
    abstract = nnx.eval_shape(lambda: SparseMoE(d, i, e, k, norm_topk_prob=True, dtype="bfloat16",
                                                param_dtype="bfloat16", rngs=nnx.Rngs(0)))
    whole = e * 3 * d * i * 2  # the experts' bytes in bfloat16
    rows = []
    for layout, sizes in LAYOUTS:
        mesh = make_mesh(1, devices=jax.devices(), **sizes)
        for dispatch, on_mesh in (("dense", True), ("dense", False), ("ragged", True), ("ragged", False)):
            abstract.dispatch = dispatch
            graphdef, state = nnx.split(abstract)

            def placed(path, leaf):  # each parameter's sharding from the table (`TARGET_AXES`)
                name = "layers.mlp." + ".".join(str(p.key) for p in path if hasattr(p, "key"))
                axes = TARGET_AXES[name][1:]  # less the stacked layers' axis
                return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=logical_sharding(mesh, axes, leaf.shape))

            params = jax.tree_util.tree_map_with_path(placed, state)
            gate = next(x for path, x in jax.tree_util.tree_flatten_with_path(params)[0] if "gate_proj" in str(path))
            held = 3 * math.prod(gate.sharding.shard_shape(gate.shape)) * 2  # gate, up and down: bf16
            call = lambda st, x, g=graphdef: nnx.merge(g, st)(x)  # noqa: E731
            fn = traced_on(call, mesh) if on_mesh else call
            for n in args.tokens:
                x = jax.ShapeDtypeStruct((n, d), jnp.bfloat16, sharding=logical_sharding(mesh, (None, None)))
                total, kinds = collective_bytes(jax.jit(fn).lower(params, x).compile().as_text())
                how = f"{dispatch}, {'on the mesh' if on_mesh else 'partitioner'}"
                detail = ", ".join(f"{kind} {b / 1024:.0f}" for kind, b in sorted(kinds.items())) or "none"
                rows.append(f"| {layout} ({', '.join(f'{a}={s}' for a, s in sizes.items())}) | {how} | {n:,} | "
                            f"{total / 1024:,.0f} | {total / (n * d * 4):.1f} | {detail} | 1/{whole // held} |")
                print(rows[-1], flush=True)
    lines = [
        "# A routed MLP over 4 devices: width-, expert- or both-split",
        "",
        f"One Qwen3-30B-A3B routed layer (E = {e} experts of width {i}, k = {k} per token, D = {d}, bfloat16), "
        f"compiled for 4 forced CPU devices, jax {jax.__version__}, from shapes alone. Command: "
        "`python experiments/moe_sharding.py`.",
        "",
        "KiB moved: the summed result sizes of the compiled program's collectives, exact and deterministic; "
        "what a GPU would pay over its interconnect per layer. x [N, D]: that in units of one float32 "
        "[N, D] array, what one all-reduce of the layer's partial sums moves. Held: each device's share of the "
        f"experts' weights ({whole / 2**20:,.0f} MiB in all).",
        "",
        "| layout (mesh) | dispatch | N tokens | KiB moved | x [N, D] | by collective (KiB) | held |",
        "|---|---|---:|---:|---:|---|---:|",
        *rows,
        "",
        "How to read: every layout holds a quarter of the experts per device and moves one [N, D] "
        "all-reduce per layer with either dispatch as tevjax traces it, so the choice between them is "
        "about the matmuls each device "
        "runs (whole experts keep each product as wide as the expert; a width split of 768 over 4 leaves "
        "192 columns) and how evenly the routing loads the devices, which needs a multi-GPU run to "
        "measure. The partitioner rows are what each dispatch moves without its per-device form (a jit "
        "without the mesh in context): the grouped one all-reduces the [N * k, I] and [N * k, D] rows of "
        "its three products, and the dense one, split both ways, sums over `expert` and `model` in two steps.",
    ]
    emit(lines, args.out)


if __name__ == "__main__":
    main()
