"""Device meshes and the one table of sharding rules.

tevjax names the axes of its arrays logically (batch, vocab, embed, heads, ...) and maps those names
to the axes of a device mesh here, and only here. Training today is data parallel: the batch is
split over `data`, every parameter and the optimizer state are replicated, and XLA inserts the
all-reduce of the gradients (this is what "pmapped across GPUs" means with current JAX: `pmap` is
legacy and implemented on jit + shard_map; one jit over a mesh is the modern form).

Multi-host: call `initialize_distributed` first (it runs `jax.distributed.initialize` when
coordinator flags or the usual cluster environment variables are present); the mesh then spans
every process's devices and each process feeds its own slice of the global batch
(`global_batch_array`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

__all__ = ["LOGICAL_RULES", "batch_sharding", "global_batch_array", "initialize_distributed", "logical_spec",
           "make_mesh", "parse_mesh", "replicated"]

# Logical axis name -> mesh axis (None: replicated). The one table every sharded array reads.
LOGICAL_RULES: Mapping[str, str | None] = {
    "batch": "data",
    "sequence": None,
    "vocab": None,
    "embed": None,
    "heads": None,
    "kv_heads": None,
    "mlp": None,
    "cache_slots": None,
    "layers": None,
}


def logical_spec(*names: str | None) -> PartitionSpec:
    """PartitionSpec for an array whose axes carry these logical names (None: not sharded)."""
    unknown = [n for n in names if n is not None and n not in LOGICAL_RULES]
    if unknown:
        raise ValueError(f"unknown logical axis {unknown[0]!r}; known: {sorted(LOGICAL_RULES)}")
    return PartitionSpec(*(None if n is None else LOGICAL_RULES[n] for n in names))


def parse_mesh(text: str) -> dict[str, int]:
    """'data=2,model=1' -> {"data": 2, "model": 1}, with one-line errors."""
    out: dict[str, int] = {}
    for part in text.replace(" ", "").split(","):
        if not part:
            continue
        name, _, size = part.partition("=")
        if name not in ("data", "model") or not size.isdigit() or int(size) < 1:
            raise ValueError(f"--mesh {text!r}: expected entries like data=2,model=1 with positive sizes")
        out[name] = int(size)
    return out


def make_mesh(data: int | None = None, model: int = 1, devices=None) -> Mesh:
    """A (data, model) mesh over `devices` (default: all devices of all processes); `data` None
    takes every device not used by `model`."""
    devices = list(jax.devices() if devices is None else devices)
    if data is None:
        if len(devices) % model:
            raise ValueError(f"model={model} does not divide the {len(devices)} devices")
        data = len(devices) // model
    if data * model != len(devices):
        raise ValueError(f"mesh data={data} x model={model} needs {data * model} devices, {len(devices)} are present")
    return Mesh(np.asarray(devices).reshape(data, model), ("data", "model"))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def batch_sharding(mesh: Mesh, ndim: int) -> NamedSharding:
    """Leading (batch) axis over `data`, the rest replicated."""
    return NamedSharding(mesh, logical_spec("batch", *([None] * (ndim - 1))))


def global_batch_array(mesh: Mesh, local: np.ndarray) -> jax.Array:
    """A global array, batch-sharded over `data`, from this process's slice of the global batch
    (the whole batch in a single-process run)."""
    return jax.make_array_from_process_local_data(batch_sharding(mesh, local.ndim), local)


def initialize_distributed(coordinator: str | None = None, num_processes: int | None = None,
                           process_id: int | None = None) -> bool:
    """Runs `jax.distributed.initialize` for a multi-host job; returns whether it did.

    With explicit flags they are used; otherwise JAX's cluster auto-detection runs when one of
    the usual variables is set (JAX_COORDINATOR_ADDRESS, SLURM_JOB_ID, OMPI_COMM_WORLD_SIZE, ...).
    A single-host run without them does nothing.
    """
    if coordinator is not None:
        if num_processes is None or process_id is None:
            raise ValueError("--coordinator needs --num-processes and --process-id")
        jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                                   process_id=process_id)
        return True
    if any(v in os.environ for v in ("JAX_COORDINATOR_ADDRESS", "SLURM_JOB_ID", "OMPI_COMM_WORLD_SIZE")):
        jax.distributed.initialize()
        return True
    return False
