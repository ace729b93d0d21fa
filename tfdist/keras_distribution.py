"""keras.distribution on the TensorFlow backend, through tfdist's DTensor mode.

    import tfdist
    tfdist.enable_keras_distribution()          # before the program builds its mesh
    mesh = keras.distribution.DeviceMesh((2, 2), ["batch", "model"])
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map["dense.*kernel"] = (None, "model")
    keras.distribution.set_distribution(
        keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch"))
    model = make_model(); model.compile(...)
    model.fit(x, y, batch_size=16)              # Keras' own call: sharded, equal to one device

Keras 3's TensorFlow `distribution_lib.py` is a prototype ("DO NOT USE",
keras-team/keras#18473): `get_device_count`, `distribute_tensor`,
`distribute_data_input`, `initialize`, `num_processes` and `process_id` are
missing, `distribute_value` is a TODO, its mesh needs an accelerator system nobody
initialises and its `list_devices` sees only this process's devices. `enable()`
installs tfdist's versions into that (private) module, which Keras' public
keras.distribution functions call at run time (BACKEND_FUNCTIONS; canaries in
tests/test_keras_distribution.py). Across processes, `initialize()` joins them as
DTensor clients (Keras' arguments, KERAS_DISTRIBUTION_*, or the DTENSOR_* that
`tfdist launch --dtensor` sets); then devices and meshes are global, as on JAX.

Training: on the TF backend Keras creates plain variables whatever the
distribution, and its train step knows nothing of sharded ones. So under a set
distribution `model.fit`, `evaluate` and `predict` are routed to one
tfdist.Strategy per distribution object, which shards the built model in place
at its first call and runs tfdist's exact steps:
- DataParallel  -> dtensor, mesh batch=N, layout "data" (every variable replicated).
  Not "mirrored": tf.distribute mirrors only variables created in its own scope,
  and Keras code builds the model under keras.distribution's scope, before tfdist
  sees it; dtensor adopts a built model.
- ModelParallel -> dtensor on the DeviceMesh's axes, the distribution's
  batch_dim_name renamed to tfdist's "batch" and the other axis to "model", with
  the LayoutMap's variable keys (Keras' matching rules, tfdist/parallel/dtensor/
  keras_layouts.py). `<layer path>/output` keys are Keras' activation layouts:
  Keras' Layer.__call__ asks for them and calls distribute_tensor, which relayouts
  the activation on tfdist's mesh inside the sharded step.
A LayoutMap key that matches no variable is a warning, as in Keras (tfdist's own
--layout makes it an error; programs written for keras.distribution rely on Keras'
rule). Data: every process gives the whole data (auto_shard_dataset=True, Keras'
default) and tfdist feeds each its share of every global batch; a Dataset is never
shuffled (as Keras), arrays with tfdist's seeded order. Mixed precision: a global
mixed_bfloat16 policy trains (float32 variables, bfloat16 compute).
Without a distribution every call is Keras' own, unless the model is a
tfdist.Strategy's (compiled in its scope): the same wrappers route it to that
Strategy (tfdist/api.py).
"""

import contextlib
import math
import os
import threading
from typing import Dict, Optional, Tuple

from tfdist import api, keras_calls
from tfdist.errors import UsageError, require
from tfdist.parallel.dtensor import keras_layouts   # no TensorFlow at import
from tfdist.parallel.dtensor.layout_map import LayoutMap

TFDIST_BATCH, TFDIST_MODEL = "batch", "model"
ACTIVATION_SUFFIX = "/output"   # Keras' key for a layer's output layout
BACKEND_FUNCTIONS = ("get_device_count", "distribute_tensor", "distribute_value",
                     "distribute_data_input", "initialize", "num_processes", "process_id",
                     "list_devices", "_to_backend_mesh")

_state = threading.local()      # the route of the tfdist call running in this thread
_strategies: Dict[int, Tuple[object, object, "Route"]] = {}   # id(distribution) -> cached
_training_options = {"accumulation_steps": 1}   # enable()'s, for every distribution's Strategy
_keras_backend: Dict[str, object] = {}                        # Keras' own backend functions


# ------------------------------------------------------------------------------ enable

def enable(simulate_devices: Optional[int] = None, accumulation_steps: int = 1):
    """Makes keras.distribution work on the TensorFlow backend (idempotent).

    simulate_devices: split the host CPU into that many logical devices first
    (default: $TFDIST_SIMULATE_DEVICES, which `tfdist launch --devices_per_worker`
    sets); must come before TensorFlow initialises its devices.
    accumulation_steps: compute each batch of Keras' model.fit in that many
    micro-batches, one update (tfdist/train/accumulation.py): Keras' own
    `gradient_accumulation_steps` updates once every K batches, which tfdist's steps
    do not reproduce, so it is refused.
    Returns the names of the backend functions tfdist provides."""
    import keras
    require_tensorflow_backend(keras.backend.backend())
    require(isinstance(accumulation_steps, int) and accumulation_steps > 0,
            f"tfdist.enable_keras_distribution(accumulation_steps={accumulation_steps!r}): "
            f"give a whole number > 0 of micro-batches per batch.")
    _training_options["accumulation_steps"] = accumulation_steps
    _simulate(simulate_devices)
    _install_backend_functions()
    keras_calls.install(router=api.KERAS_ROUTER, distribution_routes=ROUTES)
    return BACKEND_FUNCTIONS


def require_tensorflow_backend(backend: str) -> None:
    if backend != "tensorflow":
        raise ValueError(
            f"tfdist.enable_keras_distribution() provides keras.distribution for the "
            f"TensorFlow backend, but Keras runs on KERAS_BACKEND={backend!r}. Set "
            f"KERAS_BACKEND=tensorflow before importing keras (the {backend} backend has "
            f"its own distribution support, if any).")


def _simulate(simulate_devices: Optional[int]) -> None:
    if simulate_devices is None:
        env = os.environ.get("TFDIST_SIMULATE_DEVICES", "").strip()
        if not env:
            return
        if not env.isdigit():
            raise ValueError(f"TFDIST_SIMULATE_DEVICES must be an integer >= 0, got {env!r}.")
        simulate_devices = int(env)
    if simulate_devices > 0:
        from tfdist import devices
        devices.simulate_cpus(simulate_devices)


def _backend_module():
    # Private: keras.src.backend.tensorflow.distribution_lib is the module Keras'
    # public keras.distribution functions call (keras-team/keras#18473: the TF
    # backend lacks these functions). Canary: test_keras_distribution.py.
    from keras.src.backend.tensorflow import distribution_lib
    return distribution_lib


def _install_backend_functions() -> None:
    module = _backend_module()
    if "list_devices" not in _keras_backend:
        _keras_backend["list_devices"] = module.list_devices
    for name in BACKEND_FUNCTIONS:
        setattr(module, name, globals()[name])


# ------------------------------------------------------------------------------ backend

def get_device_count(device_type=None):
    """The number of devices of that type (Keras: the default type when None)."""
    return len(list_devices(device_type))


def num_processes():
    from tensorflow.experimental import dtensor
    return dtensor.num_clients()


def process_id():
    from tensorflow.experimental import dtensor
    return dtensor.client_id()


def initialize(job_addresses=None, num_processes=None, process_id=None):
    """Joins this process to the others as a DTensor client: from Keras' arguments or
    its KERAS_DISTRIBUTION_* variables (keras.distribution.initialize reads them
    first), else from DTENSOR_* (what `tfdist launch --dtensor` sets).

    One process has nothing to join. DTensor needs every process's address (a
    JAX-style coordinator address alone is not enough)."""
    if num_processes is None and job_addresses is None and process_id is None:
        from tfdist import cluster
        env = cluster.validate_dtensor_env(os.environ)
        if env is None or env.num_clients == 1:
            return
        job_addresses, num_processes, process_id = ",".join(env.jobs), env.num_clients, \
            env.client_id
    if not num_processes or int(num_processes) == 1:
        return
    addresses = [a.strip() for a in (job_addresses or "").split(",") if a.strip()]
    if len(addresses) != int(num_processes):
        raise ValueError(
            f"keras.distribution.initialize on TensorFlow needs the address of every "
            f"process (DTensor clients connect to each other): job_addresses="
            f"{job_addresses!r} has {len(addresses)}, but num_processes={num_processes}.")
    if process_id is None or not 0 <= int(process_id) < int(num_processes):
        raise ValueError(f"process_id={process_id!r} must be in [0, {num_processes}).")
    os.environ.update(DTENSOR_CLIENT_ID=str(int(process_id)),
                      DTENSOR_NUM_CLIENTS=str(int(num_processes)),
                      DTENSOR_JOB_NAME="worker", DTENSOR_JOBS=",".join(addresses))
    from tfdist.parallel.dtensor import mesh as mesh_lib
    mesh_lib.initialize_multi_client(_local_device_type())


def _local_device_type() -> str:
    from tfdist import devices
    return "GPU" if devices.physical_gpus() else "CPU"


def _joined() -> bool:
    """True once this process is one of several DTensor clients."""
    from tfdist.parallel.dtensor import mesh as mesh_lib
    # tfdist's own record of the accelerator system it initialised (DTensor has no query)
    return mesh_lib.is_initialized() and num_processes() > 1


def list_devices(device_type=None):
    """Keras' list (this process's devices) until the processes have joined; then
    every client's devices ("cpu:0".."cpu:N-1", N the global count), as on JAX."""
    if not _joined():
        return _keras_list_devices(device_type)
    from tensorflow.experimental import dtensor
    kind = (device_type or _local_device_type()).upper()
    return [f"{kind.lower()}:{i}" for i in range(dtensor.num_global_devices(kind))]


def _keras_list_devices(device_type=None):
    return _keras_backend["list_devices"](device_type)


def _to_backend_mesh(device_mesh):
    """A dtensor.Mesh over the DeviceMesh's devices ("cpu:3" -> "CPU:3"), in its order;
    across joined processes, DTensor's mesh over every client's devices. (Keras'
    prototype calls create_distributed_mesh, which needs an initialised accelerator
    system even on one host.)"""
    from tensorflow.experimental import dtensor
    mesh_dims = list(zip(device_mesh.axis_names, device_mesh.shape))
    if _joined():
        return dtensor.create_distributed_mesh(mesh_dims, device_type=_local_device_type())
    names = [str(d) for d in device_mesh.devices.flatten()]
    kinds = {name.partition(":")[0].upper() for name in names}
    if len(kinds) != 1:
        raise ValueError(f"A DeviceMesh holds devices of one type; got {sorted(kinds)} "
                         f"in {names}.")
    return dtensor.create_mesh(mesh_dims, devices=[n.upper() for n in names],
                               device_type=kinds.pop())


def distribute_tensor(tensor, layout):
    """`tensor` with `layout` (a keras TensorLayout or a dtensor.Layout).

    Inside a routed tfdist call (Keras' Layer.__call__ asking for an `/output`
    layout) the activation is relayouted on tfdist's mesh; an eager plain tensor
    there (tfdist's checks before it shards the model) is left as it is. Anywhere
    else: a DTensor with the layout on the DeviceMesh."""
    route = _active_route()
    if route is not None:
        return route.relayout(tensor, layout)
    from tensorflow.experimental import dtensor
    backend_layout = getattr(layout, "backend_layout", layout)
    if dtensor.is_dtensor(tensor):
        return dtensor.relayout(tensor, backend_layout)
    return _to_mesh(tensor, backend_layout)


distribute_value = distribute_tensor   # Keras' TF prototype leaves it a TODO returning None


def distribute_data_input(per_process_batch, layout, batch_dim_name):
    """One process's batch as the global batch with `layout` (single process: the batch)."""
    if num_processes() > 1:
        raise NotImplementedError(
            "distribute_data_input across processes is not provided by tfdist yet; "
            "model.fit under a distribution feeds each process's share itself.")
    return distribute_tensor(per_process_batch, layout)


def _to_mesh(tensor, backend_layout):
    import tensorflow as tf
    from tensorflow.experimental import dtensor
    value = tf.convert_to_tensor(tensor)
    replicated = dtensor.Layout.replicated(backend_layout.mesh, rank=value.shape.rank)
    return dtensor.relayout(dtensor.copy_to_mesh(value, replicated), backend_layout)


# ------------------------------------------------------------------------------ routes

class Route:
    """How one keras Distribution runs in tfdist: the tfdist mesh spec, its axis
    renames (Keras name -> tfdist's), the variable layout, and the Strategy."""

    def __init__(self, mesh: str, renames: Dict[str, str], layout, strategy=None):
        self.mesh = mesh
        self.renames = renames
        self.layout = layout
        self.strategy = strategy

    def relayout(self, tensor, layout):
        import tensorflow as tf
        from tensorflow.experimental import dtensor
        if tf.executing_eagerly() and not dtensor.is_dtensor(tensor):
            return tensor
        axes = getattr(layout, "axes", None)
        if axes is None:   # already a dtensor.Layout
            return dtensor.relayout(tensor, layout)
        specs = [dtensor.UNSHARDED if a is None else self.renames.get(a, a) for a in axes]
        return dtensor.relayout(tensor, dtensor.Layout(specs, self.strategy.parallel.mesh))


def _active_route() -> Optional[Route]:
    return getattr(_state, "route", None)


@contextlib.contextmanager
def _running(route: Route):
    previous, _state.route = _active_route(), route
    try:
        yield
    finally:
        _state.route = previous


def strategy_for(distribution):
    """The tfdist.Strategy that runs Keras' calls under `distribution` (one per
    distribution object, built at its first call; `.last_result.losses` holds the
    last fit's per-step losses)."""
    return _route_for(distribution).strategy


def _route_for(distribution) -> Route:
    cached = _strategies.get(id(distribution))
    if cached is not None and cached[0] is distribution and \
            cached[1].config.accumulation_steps == _training_options["accumulation_steps"]:
        return cached[2]
    route = plan(distribution)
    options = dict(mesh=route.mesh, layout=route.layout, **_training_options)
    if _device_type(distribution) == "cpu":   # this process's share of the mesh
        options["simulate_devices"] = int(distribution.device_mesh.devices.size) // \
            num_processes()
    route.strategy = api.Strategy("dtensor", **options)
    route.strategy._routes_keras_calls = False   # its models follow the distribution's route
    _strategies[id(distribution)] = (distribution, route.strategy, route)
    return route


def _device_type(distribution) -> str:
    return str(distribution.device_mesh.devices.flatten()[0]).partition(":")[0].lower()


def plan(distribution) -> Route:
    """The tfdist mesh and layout of a keras Distribution, validated (no TF work)."""
    import keras
    mesh = distribution.device_mesh
    _check_mesh_size(mesh)
    axis_names, shape = list(mesh.axis_names), [int(s) for s in mesh.shape]
    if len(axis_names) > 2:
        raise ValueError(
            f"tfdist runs keras.distribution on a mesh of at most 2 axes (the batch axis "
            f"and one model axis); got axis_names={axis_names} with shape={tuple(shape)}.")
    batch = distribution.batch_dim_name
    if batch not in axis_names:
        raise ValueError(f"batch_dim_name={batch!r} is not an axis of the DeviceMesh "
                         f"(axis_names={axis_names}).")
    renames = {name: (TFDIST_BATCH if name == batch else TFDIST_MODEL) for name in axis_names}
    sizes = {renames[name]: size for name, size in zip(axis_names, shape)}
    sizes.setdefault(TFDIST_MODEL, 1)
    mesh_spec = ",".join(f"{axis}={sizes[axis]}" for axis in (TFDIST_BATCH, TFDIST_MODEL))
    if isinstance(distribution, keras.distribution.ModelParallel):
        layout = _variable_layout(distribution._layout_map, renames, mesh)
    elif isinstance(distribution, keras.distribution.DataParallel):
        layout = "data"
    else:
        raise ValueError(f"tfdist runs keras.distribution.DataParallel and ModelParallel; "
                         f"got {type(distribution).__name__}.")
    return Route(mesh_spec, renames, layout)


def _check_mesh_size(mesh) -> None:
    size = int(mesh.devices.size)
    kind = str(mesh.devices.flatten()[0]).partition(":")[0].lower()
    count = get_device_count(kind)
    if size != count:
        raise ValueError(
            f"The DeviceMesh has {size} devices (shape={tuple(mesh.shape)}, "
            f"axis_names={list(mesh.axis_names)}), but TensorFlow has {count} {kind} "
            f"devices: {list_devices(kind)}. tfdist runs a distribution over all of them: "
            f"make the product of the mesh shape {count} (or simulate {size} devices: "
            f"TFDIST_SIMULATE_DEVICES={size}).")


def _variable_layout(layout_map, renames, mesh):
    """The LayoutMap's variable keys as tfdist's KerasLayoutMap (activation keys left
    to Keras' Layer.__call__), each TensorLayout's axes checked against the mesh."""
    rules = {}
    for key in layout_map:
        layout = layout_map[key]
        _check_axes(key, layout, mesh)
        if not key.endswith(ACTIVATION_SUFFIX):
            rules[key] = layout
    converted = keras_layouts.from_keras(rules, axis_names=renames)
    return KerasRulesLayoutMap(dict(converted.items()))


class KerasRulesLayoutMap(keras_layouts.KerasLayoutMap):
    """tfdist's KerasLayoutMap with keras.distribution's rule for a key that matches no
    variable: a warning (LayoutMap.resolve's), not tfdist's UsageError. Programs written
    for keras.distribution rely on it: keras-io's guide keeps a "d1/bias" key for a layer
    without bias, and keras-hub's maps cover a whole model family."""

    def resolve(self, variables, mesh_axes, strict: bool = False):
        return LayoutMap.resolve(self, variables, mesh_axes, strict=strict)


def _check_axes(key, layout, mesh) -> None:
    axes = tuple(getattr(layout, "axes", layout) or ())
    unknown = [a for a in axes if a is not None and a not in mesh.axis_names]
    if unknown:
        raise ValueError(f"LayoutMap key {key!r} shards over axis {unknown[0]!r}, which is "
                         f"not an axis of the DeviceMesh (axis_names={list(mesh.axis_names)}).")


# ------------------------------------------------------------------------------ the calls

def _is_dataset(x) -> bool:
    import tensorflow as tf
    return isinstance(x, tf.data.Dataset)


def _fit(distribution, model, a):
    if distribution.num_processes > 1 and not distribution.auto_shard_dataset:
        raise ValueError(
            "auto_shard_dataset=False (each process feeds its own shard) is not supported "
            "by tfdist yet: give every process the whole data with auto_shard_dataset=True "
            "and tfdist feeds each process its share of every global batch.")
    return _call(distribution, "fit", model, a)


def _call(distribution, name, model, arguments):
    """strategy.<name>(model, ...) of the distribution's Strategy, with Keras' arguments
    (tfdist.api.keras_call: a Dataset is not shuffled, as Keras never does), while Keras'
    Layer.__call__ may ask this route for activation layouts."""
    route = _route_for(distribution)
    with _running(route):
        return api.keras_call(route.strategy, name, model, arguments)


def _evaluate(distribution, model, a):
    return _call(distribution, "evaluate", model, a)


def _predict(distribution, model, a):
    return _call(distribution, "predict", model, a)


ROUTES = {"fit": _fit, "evaluate": _evaluate, "predict": _predict}


def bytes_per_device(model) -> Dict[str, int]:
    """device -> bytes of the model's variables on it (their actual shards)."""
    from tfdist.parallel.dtensor import sharding
    totals: Dict[str, int] = {}
    for variable in model.variables:
        for device, shape in sharding.shard_shapes(variable):
            totals[device] = totals.get(device, 0) + math.prod(shape) * variable.value.dtype.size
    return totals


__all__ = ["enable", "strategy_for", "plan", "bytes_per_device", "BACKEND_FUNCTIONS",
           "UsageError"]
