"""The device mesh: "batch=2,model=2" over local devices, or over all clients' devices.

Single client: the mesh spans this process's devices (simulated CPUs or GPUs).
Multi-client (DTENSOR_* set, e.g. by `tfdist launch --dtensor`): every process
calls dtensor.initialize_accelerator_system once and the mesh spans every
client's devices, client c owning global device ids [c*K, (c+1)*K). TF refuses
to shut the accelerator system down in multi-client mode, so it stays up for the
life of the process (initialised at most once).
"""

import logging
import os
from typing import List, Optional, Tuple

from tfdist import cluster
from tfdist.errors import UsageError, require

log = logging.getLogger("tfdist")

BATCH = "batch"
MODEL = "model"
Axes = List[Tuple[str, int]]
_initialized = []  # device type the accelerator system was initialised with, at most one


def is_initialized() -> bool:
    """Whether this process has initialised DTensor's accelerator system (tfdist does
    it once, for one device type)."""
    return bool(_initialized)


def parse_mesh(spec: Optional[str], num_devices: int) -> Axes:
    """'batch=2,model=2' -> [('batch', 2), ('model', 2)]; None -> batch=N,model=1."""
    if spec is None or not str(spec).strip():
        return [(BATCH, num_devices), (MODEL, 1)]
    axes = []
    for part in str(spec).split(","):
        name, eq, size = part.strip().partition("=")
        name = name.strip()
        # ASCII digits only: str.isdigit() also accepts "²", which int() cannot read.
        size = size.strip()
        require(eq and name.isidentifier() and size.isascii() and size.isdigit()
                and int(size) >= 1,
                f"--mesh must look like \"batch=2,model=2\" (axis=size, sizes >= 1), "
                f"got {spec!r} (bad part {part.strip()!r}).")
        require(name not in dict(axes), f"--mesh {spec!r} names axis {name!r} twice.")
        axes.append((name, int(size)))
    require(BATCH in dict(axes),
            f"--mesh {spec!r} has no {BATCH!r} axis; inputs are split along it. Add "
            f"{BATCH}=1 for pure tensor parallelism (e.g. \"{BATCH}=1,{MODEL}=4\").")
    return axes


def mesh_size(axes: Axes) -> int:
    size = 1
    for _, n in axes:
        size *= n
    return size


def describe(axes: Axes) -> str:
    return ",".join(f"{name}={size}" for name, size in axes)


def check_size(axes: Axes, device_names: List[str], where: str) -> None:
    require(mesh_size(axes) == len(device_names),
            f"--mesh {describe(axes)} has {mesh_size(axes)} devices, but {where} has "
            f"{len(device_names)}: {', '.join(device_names[:8])}"
            f"{' ...' if len(device_names) > 8 else ''}. Make the product of the axis sizes "
            f"equal {len(device_names)} (or change --simulate_devices / --devices_per_worker).")


def _dtensor_name(device: str) -> str:
    """'/cpu:0' -> 'CPU:0' (the form dtensor.create_mesh takes)."""
    kind, _, index = device.strip("/").rpartition("/")[-1].partition(":")
    return f"{kind.upper()}:{index}"


def device_type(local_devices: List[str]) -> str:
    return "GPU" if any("gpu" in d.lower() for d in local_devices) else "CPU"


def build_local_mesh(axes: Axes, local_devices: List[str]):
    from tensorflow.experimental import dtensor
    check_size(axes, local_devices, "this process")
    kind = device_type(local_devices)
    return dtensor.create_mesh(axes, devices=[_dtensor_name(d) for d in local_devices],
                               device_type=kind)


def initialize_multi_client(kind: str) -> None:
    """Joins the DTensor clients (once per process; DTENSOR_* are read by TF)."""
    from tensorflow.experimental import dtensor
    if _initialized:
        require(_initialized[0] == kind,
                f"DTensor was already initialised for {_initialized[0]} in this process; "
                f"it cannot be re-initialised for {kind}.")
        return
    clients = cluster.validate_dtensor_env(os.environ)
    if clients is not None and clients.num_clients > 1:
        cluster.announce_grpc_server(clients.jobs[clients.client_id], "dtensor")
    dtensor.initialize_accelerator_system(kind)
    _initialized.append(kind)


def build_distributed_mesh(axes: Axes, local_devices: List[str], env):
    """The mesh over every client's devices (call after initialize_multi_client)."""
    from tensorflow.experimental import dtensor
    kind = device_type(local_devices)
    initialize_multi_client(kind)
    total = dtensor.num_global_devices(kind)
    require(mesh_size(axes) == total,
            f"--mesh {describe(axes)} has {mesh_size(axes)} devices, but the {env.num_clients} "
            f"DTensor clients have {total} {kind} devices in all "
            f"({dtensor.num_local_devices(kind)} per client). Make the product of the axis "
            f"sizes equal {total}.")
    return dtensor.create_distributed_mesh(axes, device_type=kind)


def axes_of(mesh) -> dict:
    return {name: mesh.dim_size(name) for name in mesh.dim_names}


def batch_groups(mesh) -> Tuple[int, int, List[int]]:
    """How this client's devices split the global batch.

    Returns (groups, group_id, local_coords): the global batch is read by `groups`
    input pipelines; this client runs pipeline `group_id`, whose batch it splits
    over the consecutive batch coordinates `local_coords` of its devices.
    """
    coords = sorted({loc[BATCH] for loc in mesh.local_device_locations()})
    per_client = len(coords)
    batch = mesh.dim_size(BATCH)
    if coords != list(range(coords[0], coords[0] + per_client)) or coords[0] % per_client:
        raise UsageError(
            f"This client's devices hold batch shards {coords} of {batch}; DTensor input "
            f"needs each client to hold an aligned, consecutive block of batch shards. Put "
            f"the {BATCH!r} axis first in --mesh.")
    return batch // per_client, coords[0] // per_client, coords
