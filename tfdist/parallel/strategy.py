"""tf.distribute modes: default, one_device, mirrored (and the multi-worker peer).

This is the one module that turns a strategy name into a tf.distribute strategy.
All of them share `StrategyParallelism`: a step is `strategy.run` of the
per-replica math in tfdist.train.step, and the replica losses are summed (each is
already divided by the global batch).
"""

import collections
from typing import Dict, List

import tensorflow as tf

from tfdist import devices
from tfdist.errors import UsageError, require
from tfdist.parallel.base import Parallelism, add_bytes
from tfdist.train import batch_stats, step as step_math

SUM = tf.distribute.ReduceOp.SUM


class StrategyParallelism(Parallelism):
    """Any tf.distribute strategy behind the Parallelism interface."""

    def __init__(self, name: str, strategy: tf.distribute.Strategy, device_names: List[str],
                 batch_statistics: str = batch_stats.GLOBAL):
        self.name = name
        self.strategy = strategy
        self.devices = device_names
        self.num_replicas = strategy.num_replicas_in_sync
        self.batch_statistics = batch_statistics

    def scope(self):
        return self.strategy.scope()

    def adopt(self, model):
        """The user's model itself; its variables must come from scope() (Keras'
        own rule for tf.distribute: build and compile the model inside the scope)."""
        outside = [v.path for v in model.variables
                   if not self.strategy.extended.variable_created_in_scope(v.value)]
        require(not outside,
                f"Model '{model.name}' was built outside the scope of strategy '{self.name}' "
                f"({len(outside)} variable(s), e.g. {outside[0] if outside else ''}), so its "
                f"variables are not replicated. Build and compile it inside the scope: "
                f"`with strategy.scope(): model = ...; model.compile(...)`.")
        if self.batch_statistics == batch_stats.GLOBAL:
            batch_stats.use_global_statistics(model, self.num_replicas, self.name)
        else:
            batch_stats.announce_per_replica(model, self.num_replicas, self.name)
        return super().adopt(model)

    def distribute(self, dataset_fn):
        return self.strategy.distribute_datasets_from_function(dataset_fn)

    def make_train_step(self, model, optimizer, global_batch_size, jit_compile,
                        on_outputs=None):
        if jit_compile and self.num_replicas > 1:
            _refuse_synchronized_norms_under_xla(model, self.num_replicas,
                                                 self.batch_statistics)
        del global_batch_size  # the replicas' equal batches make Keras' loss scaling exact
        replica_step = step_math.make_replica_train_step(model, optimizer, jit_compile,
                                                         self.accumulation_steps)
        return self._summing_step(replica_step, on_outputs)

    def make_eval_step(self, model, on_outputs=None):
        return self._summing_step(step_math.replica_eval_step(model), on_outputs)

    def _summing_step(self, replica_step, on_outputs):
        """step(iterator) -> the replicas' summed loss; on_outputs (the metrics' update)
        gets this process's (y, y_pred, w), its replicas' batches concatenated."""
        strategy = self.strategy

        @tf.function
        def step(iterator):
            losses, outputs = strategy.run(replica_step, args=(next(iterator),))
            if on_outputs is not None:
                on_outputs(local_concat(strategy, outputs))
            return strategy.reduce(SUM, losses, axis=None)

        return step

    def param_bytes_per_device(self, model, optimizer) -> Dict[str, int]:
        totals = collections.Counter()
        for variable in list(model.variables) + list(optimizer.variables):
            backing = getattr(variable, "value", variable)  # Keras Variable -> tf variable
            components = getattr(backing, "values", (backing,))  # a mirrored copy per device
            for component in components:
                add_bytes(totals, component.device, component)
        return dict(totals)


def local_concat(strategy, per_replica):
    """This process's replicas' values of a structure, concatenated along the batch."""
    def concat(value):
        parts = strategy.experimental_local_results(value)
        return parts[0] if len(parts) == 1 else tf.concat(parts, axis=0)
    return tf.nest.map_structure(concat, per_replica)


def _refuse_synchronized_norms_under_xla(model, num_replicas: int,
                                         batch_statistics: str) -> None:
    """A synchronized BatchNorm all-reduces inside the step; XLA clusters cannot."""
    norms = [layer.name for layer in batch_stats.batch_norm_layers(model)
             if layer.synchronized or batch_statistics == batch_stats.GLOBAL]
    require(not norms,
            f"--jit_compile cannot compile model '{model.name}' on {num_replicas} replicas: its "
            f"BatchNormalization layers ({', '.join(norms[:3])}{', ...' if len(norms) > 3 else ''}) "
            f"all-reduce the global batch's statistics inside the step, which an XLA cluster "
            f"cannot hold. Drop --jit_compile, or use one device, or keep per-replica "
            f"statistics (--batch_statistics=per_replica, BatchNormalization(synchronized="
            f"False); not the one-device math).")


def build_default(config) -> StrategyParallelism:
    """No distribution: TensorFlow's default strategy on the first device."""
    local = devices.configure(config.simulate_devices, config.num_gpus)
    return StrategyParallelism("default", tf.distribute.get_strategy(), local[:1])


def build_one_device(config) -> StrategyParallelism:
    local = devices.configure(config.simulate_devices, config.num_gpus)
    return StrategyParallelism("one_device", tf.distribute.OneDeviceStrategy(local[0]), local[:1])


def cross_device_ops(name: str, num_packs: int, device_names: List[str]):
    """Builds the all-reduce implementation named by --cross_device_ops."""
    on_gpus = all("gpu" in d.lower() for d in device_names)
    if name == "auto":
        name = "nccl" if on_gpus else "reduction_to_one_device"
    if name in ("nccl", "hierarchical_copy") and not on_gpus:
        raise UsageError(
            f"--cross_device_ops={name} needs GPUs, but the devices are "
            f"{', '.join(device_names)}. Use reduction_to_one_device (or auto) on CPUs.")
    if name == "reduction_to_one_device":
        if num_packs != 1:
            raise UsageError(f"--num_packs={num_packs} only applies to nccl and "
                             f"hierarchical_copy, not reduction_to_one_device.")
        return tf.distribute.ReductionToOneDevice()
    if name == "nccl":
        return tf.distribute.NcclAllReduce(num_packs=num_packs)
    return tf.distribute.HierarchicalCopyAllReduce(num_packs=num_packs)


def build_mirrored(config) -> StrategyParallelism:
    """Data parallelism over every local device (GPUs, or simulated CPUs)."""
    local = devices.configure(config.simulate_devices, config.num_gpus)
    ops = cross_device_ops(config.cross_device_ops, config.num_packs, local)
    strategy = tf.distribute.MirroredStrategy(local, cross_device_ops=ops)
    return StrategyParallelism("mirrored", strategy, local, config.batch_statistics)
