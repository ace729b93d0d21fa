"""--strategy=dtensor: tensor parallel and 2-D (batch x model) hybrid via DTensor layouts.

    mesh.py        "batch=2,model=2" -> a dtensor.Mesh (local, or over all clients)
    layout_map.py  LayoutMap: regex over variable paths -> sharding spec, validated
    presets.py     --layout data | megatron | auto | a JSON/.py layout file
    auto_layout.py --layout=auto: an exact tensor-parallel layout read off the model
    layout_check.py  refuses a layout DTensor cannot run on convolutions, before any trace
    sharding.py    gives a built Keras model and its optimizer DTensor storage
    update.py      the exact optimizer update (SGD, momentum, Adam, AdamW) on shards
    step.py        batch-sharded inputs, the train and eval steps
    rewrites.py    the few TF ops DTensor cannot run (depthwise and pooling gradients,
                   float64 cross-entropy), rewritten while a step is traced
    checkpoint.py  sharded save / restore (restores onto any mesh)

Order (each step validated before the next touches TensorFlow state): devices,
mesh, layout map resolved against the model's variable paths and shapes, then
variables sharded, then the optimizer built on the sharded model.
"""

import collections
import logging
import math
import os
from typing import Dict

from tfdist import cluster, devices
from tfdist.errors import UsageError, require
from tfdist.parallel.base import Parallelism
from tfdist.parallel.dtensor.layout_map import UNSHARDED

log = logging.getLogger("tfdist")


class DTensorParallelism(Parallelism):
    name = "dtensor"

    def __init__(self, config, mesh, env):
        from tfdist.parallel.dtensor import mesh as mesh_lib
        self.config = config
        self.mesh = mesh
        self.env = env
        self.axes = mesh_lib.axes_of(mesh)
        self.num_replicas = self.axes[mesh_lib.BATCH]
        self.devices = [str(d) for d in mesh.local_devices()]
        self.is_chief = env is None or env.client_id == 0
        self.layouts = {}
        self.specs = {}
        self.slots = {}
        self.update_layouts = {}   # {path: where its slots live and its update runs}
        self.zero = None           # zero.ZeroPlan, once the model is known

    def finish(self) -> None:
        """Multi-client: every client leaves together. A client that exits while
        another still runs a collective cancels it ("Function was cancelled before
        it was started", seen when client 0 exited first)."""
        if self.env is not None and self.env.num_clients > 1:
            from tensorflow.experimental import dtensor
            timeout_ms = int(1000 * self.config.collective_timeout)
            dtensor.barrier(self.mesh, "tfdist-finish", timeout_in_ms=timeout_ms)
            leader_leaves_last(self.env.client_id, self.env.num_clients, timeout_ms)

    def validate_global_batch(self, global_batch_size: int) -> None:
        if global_batch_size % self.num_replicas:
            raise UsageError(
                f"--global_batch_size={global_batch_size} is not divisible by the mesh's "
                f"batch axis of size {self.num_replicas} (mesh {self.describe_mesh()}). "
                f"Use a multiple of {self.num_replicas}.")

    def describe_mesh(self) -> str:
        return ",".join(f"{a}={s}" for a, s in self.axes.items())

    def adopt(self, model):
        """Shards the user's compiled model in place (its variables get DTensor storage)
        and builds its optimizer on the shards."""
        from tfdist.parallel.base import require_compiled
        require_compiled(model)
        require(not model.optimizer.built,
                f"The optimizer of model '{model.name}' is already built (it has slots for "
                f"unsharded variables); compile the model with a new optimizer before "
                f"training it under --strategy=dtensor.")
        return self.build_model_and_optimizer(lambda: model, lambda: model.optimizer)

    def build_model_and_optimizer(self, model_fn, optimizer_fn):
        from tfdist.parallel.dtensor import layout_check, presets, sharding, zero
        from tfdist.parallel.dtensor import mesh as mesh_lib
        model = model_fn()  # built unsharded (same seed, same values), then moved
        layout_map = presets.layout_map_for(self.config.layout, self.config.model.name,
                                            model=model, mesh_axes=self.axes)
        self.specs = layout_map.resolve(
            [(v.path, tuple(v.shape)) for v in model.variables], self.axes,
            strict=self.config.layout_strict)
        sharded = sum(1 for spec in self.specs.values() if any(a != "unsharded" for a in spec))
        log.info("dtensor: mesh %s, layout %s: %d of %d variables sharded",
                 self.describe_mesh(), self.config.layout, sharded, len(self.specs))
        # The one check of every layout (files, presets, dicts, keras LayoutMaps), before
        # any variable moves or any step is traced: DTensor's own errors come at the step.
        layout_check.check(model, self.specs, layout_check.keras_activation_layouts())
        # --zero_stage adds the batch axis to the layouts (zero.py), where they still run
        shapes = {v.path: tuple(v.shape) for v in model.variables}
        self.zero = zero.plan(self.config.zero_stage, self.specs, shapes,
                              self.axes[mesh_lib.BATCH],
                              trainable={v.path for v in model.trainable_variables})
        zero.announce(self.zero, shapes, self.axes[mesh_lib.BATCH])
        own_specs, self.specs = self.specs, self.zero.param_specs
        self.layouts = sharding.shard_model(model, self.specs, self.mesh)
        for variable in model.variables:   # stage 3: layers read their parameters gathered
            if self.specs[variable.path] != own_specs[variable.path]:
                variable.value.compute_layout = sharding.make_layout(own_specs[variable.path],
                                                                     self.mesh)
        self.update_layouts = {path: sharding.make_layout(spec, self.mesh)
                               for path, spec in self.zero.update_specs.items()}
        optimizer, self.slots = sharding.build_sharded_optimizer(
            optimizer_fn, model, self.update_layouts, self.mesh)
        return model, optimizer

    def distribute(self, dataset_fn):
        from tfdist.parallel.dtensor.step import ShardedInputs
        return ShardedInputs(dataset_fn, self.mesh)

    def make_train_step(self, model, optimizer, global_batch_size, jit_compile,
                        on_outputs=None):
        if jit_compile:
            raise UsageError("--jit_compile is not supported with --strategy=dtensor (DTensor "
                             "compiles its own SPMD program); drop the flag.")
        from tfdist.parallel.dtensor import step
        return step.make_train_step(model, optimizer, self.slots, global_batch_size,
                                    on_outputs, self.accumulation_steps,
                                    self.update_layouts, self.zero.gradients_sharded)

    def make_eval_step(self, model, on_outputs=None):
        from tfdist.parallel.dtensor import step
        return step.make_eval_step(model, on_outputs)

    def make_predict_step(self, user_model, model):
        from tfdist.parallel.dtensor import step
        return step.make_predict_step(model, self.mesh)

    def param_bytes_per_device(self, model, optimizer) -> Dict[str, int]:
        """Bytes of this client's actual shards, per device (other clients report theirs)."""
        from tfdist.parallel.dtensor import sharding
        totals = collections.Counter()
        for variable in list(model.variables) + list(optimizer.variables):
            itemsize = variable.value.dtype.size
            for device, shape in sharding.shard_shapes(variable):
                totals[device] += math.prod(shape) * itemsize
        return dict(totals)

    def gradient_bytes_per_device(self, model) -> Dict[str, int]:
        """Bytes of the gradients on each local device, in the layout the update reads them
        (the variable's own, or under --zero_stage=2 and 3 its slice), from the layouts."""
        layouts = (self.update_layouts if self.zero is not None and self.zero.gradients_sharded
                   else self.layouts)
        per_device = sum(math.prod(local_shape(layouts[v.path], v.shape)) * v.value.dtype.size
                         for v in model.trainable_variables)
        return {device: per_device for device in self.devices}


def local_shape(layout, shape):
    """One device's shard shape of a tensor of `shape` in `layout` (DTensor's shards are
    equal, so every device holds this shape)."""
    return [size // layout.mesh.dim_size(axis) if axis != UNSHARDED else size
            for size, axis in zip(shape, layout.sharding_specs)]



def build_dtensor(config) -> DTensorParallelism:
    from tfdist.parallel.dtensor import mesh as mesh_lib
    require(config.trainer == "loop",
            f"--trainer={config.trainer} is not supported by --strategy=dtensor; use "
            f"--trainer=loop (Keras fit knows nothing of the sharded variables).")
    require(config.mixed_precision != "mixed_float16",
            "--mixed_precision=mixed_float16 is not supported by --strategy=dtensor: its "
            "dynamic loss scale (LossScaleOptimizer) has no exact sharded update. Use "
            "mixed_bfloat16 (float32 variables, bfloat16 compute, no loss scale).")
    from tfdist.parallel.dtensor import zero
    zero.check_accumulation(config.zero_stage, config.accumulation_steps)
    env = cluster.validate_dtensor_env(os.environ)
    multi_client = env is not None and env.num_clients > 1
    local = devices.configure(config.simulate_devices, config.num_gpus)
    if multi_client:
        # mesh size is only known once the clients have joined
        axes = mesh_lib.parse_mesh(config.mesh, len(local) * env.num_clients)
        zero.check_batch_axis(config.zero_stage, dict(axes)[mesh_lib.BATCH])
        mesh = mesh_lib.build_distributed_mesh(axes, local, env)
    else:
        axes = mesh_lib.parse_mesh(config.mesh, len(local))
        zero.check_batch_axis(config.zero_stage, dict(axes)[mesh_lib.BATCH])
        mesh = mesh_lib.build_local_mesh(axes, local)
    return DTensorParallelism(config, mesh, env if multi_client else None)


_finishes = [0]   # finish() calls in this process: every client makes the same number


def leader_leaves_last(client_id: int, num_clients: int, timeout_ms: int) -> None:
    """After the finish barrier: client 0, which hosts TensorFlow's coordination
    service, leaves only when every other client has its answer. Otherwise the barrier's
    reply to a client can be lost with client 0's server: the client fails with
    "UnavailableError: Failed to send RPC to coordination service ... Socket closed"
    after a finished run (the CI run of tests/test_stranger.py, dtensor 2 clients).
    TensorFlow's own teardown would wait at its shutdown barrier, but a multi-process
    run skips it (experiments/train.py exit_process: it takes seconds to minutes).
    Each other client, once through the barrier, sets a key in the service's key-value
    store; client 0 waits for every key. A client whose set gets no reply (client 0
    read the key and left) is done all the same: it is past the barrier."""
    # Private: TensorFlow has no public API for the coordination service's key-value
    # store (context.Context's calls below; no upstream issue asks for one, searched
    # 2026-12-07). tests/test_upstream_canaries.py pins their signatures.
    from tensorflow.python.eager import context
    from tensorflow.python.framework import errors
    _finishes[0] += 1
    prefix = f"tfdist-finish/{_finishes[0]}"
    ctx = context.context()
    if client_id != 0:
        try:
            ctx.set_config_key_value(f"{prefix}/{client_id}", "left")
        except errors.UnavailableError:
            pass
        return
    for other in range(1, num_clients):
        key = f"{prefix}/{other}"
        try:
            ctx.get_config_key_value(key, timeout_ms)
            ctx.delete_config_key_value(key)   # the store must not grow with the runs
        except (errors.DeadlineExceededError, errors.UnavailableError) as error:
            log.warning("dtensor client %d passed the finish barrier but did not say it "
                        "left within %d ms (%s); client 0 leaves anyway", other, timeout_ms,
                        type(error).__name__)
