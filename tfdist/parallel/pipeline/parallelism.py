"""The pipeline mode on this process's devices: PipelineParallelism (stages, replicas,
the schedule's step) and the layout check it needs; tfdist.parallel.pipeline builds it,
and tfdist.parallel.pipeline.cluster extends it across workers."""


import collections
import logging
from typing import Dict, List

import tensorflow as tf

from tfdist import config as config_lib
from tfdist.errors import require
from tfdist.parallel.base import Parallelism, add_bytes
from tfdist.parallel.pipeline import placement, schedule
from tfdist.parallel.pipeline.partition import Partition, partition_model, refuse_uncuttable
from tfdist.train import clipping, split_state

log = logging.getLogger("tfdist")


class PipelineParallelism(Parallelism):
    name = "pipeline"
    # The driving process's CPU, where a step's returned loss is summed (None: wherever
    # TensorFlow places it: in one process every device is local). CrossWorkerPipeline
    # sets it (schedule.summed_on says why).
    host_device = None

    def __init__(self, device_names: List[str], num_stages: int, microbatches: int,
                 split=None, schedule_name: str = "gpipe", virtual_stages: int = 1):
        # Also checked by RunConfig; here for PipelineParallelism built by hand.
        config_lib.validate_pipeline_schedule(schedule_name, num_stages, microbatches,
                                              virtual_stages)
        self.devices = device_names
        self.num_stages = num_stages
        self.microbatches = microbatches
        self.split = split
        self.schedule = schedule_name
        self.virtual_stages = virtual_stages   # model chunks per device (interleaved_1f1b)
        self.num_replicas = len(device_names) // num_stages
        self.partition: Partition = None
        self.replicas: List[placement.PlacedReplica] = []

    def replica_devices(self, replica: int) -> List[str]:
        return self.devices[replica * self.num_stages:(replica + 1) * self.num_stages]

    def validate_global_batch(self, global_batch_size: int) -> None:
        super().validate_global_batch(global_batch_size)
        per_replica = global_batch_size // self.num_replicas
        require(per_replica % self.microbatches == 0,
                f"The per-replica batch of {per_replica} examples (--global_batch_size="
                f"{global_batch_size} over {self.num_replicas} replica(s)) is not divisible "
                f"by the {self._microbatches_given()}. Use a per-replica batch that is a "
                f"multiple of {self.microbatches}.")

    def _microbatches_given(self) -> str:
        """The micro-batch count as the user asked for it (microbatches x accumulation)."""
        steps = self.accumulation_steps
        if steps == 1:
            return f"--microbatches={self.microbatches}"
        return (f"{self.microbatches} micro-batches of --microbatches="
                f"{self.microbatches // steps} x --accumulation_steps={steps}")

    def build_model_and_optimizer(self, model_fn, optimizer_fn):
        """Partitions model_fn()'s model; each replica is a copy placed stage by stage.

        Returns replica 0's model (full weights in single-device order) and a
        StageOptimizers holding every stage optimizer.
        """
        # On the host: the whole model never has to fit on one accelerator.
        with tf.device("/cpu:0"):
            reference = model_fn()
        refuse_uncuttable(reference)
        self._refuse_batch_statistics(reference)
        self._refuse_state_updates(reference)
        self._refuse_inexact_losses(reference)
        self.reference = reference
        self.partition = partition_model(reference, self.num_stages, self.split,
                                         self.virtual_stages)
        log.info("%s", self.partition.describe())
        self.replicas = [placement.place_replica(reference, self.partition,
                                                 self.replica_devices(r), optimizer_fn)
                         for r in range(self.num_replicas)]
        return self.replicas[0].model, placement.StageOptimizers(self.replicas)

    def adopt(self, model):
        """Cuts the user's compiled model into stages; every replica trains a placed
        copy with one optimizer per stage (each a fresh copy of the compiled one)."""
        from tfdist.parallel.base import require_compiled
        require_compiled(model)
        optimizer = model.optimizer
        # Private Keras attributes, no public getter (keras-team/keras#16274); canary:
        # tests/test_dtensor_optimizers.py::test_keras_weight_decay_decision_canary.
        require(not getattr(optimizer, "_exclude_from_weight_decay", None) and not getattr(
                    optimizer, "_exclude_from_weight_decay_pattern", None),
                "--strategy=pipeline: exclude_from_weight_decay is not carried over to the "
                "stage optimizers (their copies are made from the optimizer's config); "
                "remove it, or train with dtensor or a tf.distribute mode.")
        self.clip_like = optimizer   # clipping is on the global gradient (schedule.py)
        return self.build_model_and_optimizer(
            lambda: model, lambda: clipping.unclipped_copy(optimizer))

    def make_predict_step(self, user_model, model):
        """The user's model, synced after every epoch, on the host (no stages needed)."""
        self.sync_to_user_model(user_model, model)
        return tf.function(lambda x: user_model(x, training=False), reduce_retracing=True)

    def sync_hyperparameters(self, optimizer) -> None:
        """Each stage optimizer copies the user's optimizer's learning rate (a schedule
        is each optimizer's own, evaluated at its own, equal, iteration count)."""
        if isinstance(optimizer.get_config()["learning_rate"], dict):   # a serialized schedule
            return
        rate = float(optimizer.learning_rate)
        for replica in self.replicas:
            for stage in replica.stages:
                if float(stage.optimizer.learning_rate) != rate:
                    stage.optimizer.learning_rate = rate

    def replica_models(self, model) -> dict:
        return {f"replica {r}": replica.model for r, replica in enumerate(self.replicas)}

    def sync_to_user_model(self, model, trained_model) -> None:
        model.set_weights(trained_model.get_weights())

    def checkpoint_objects(self, model, optimizer) -> Dict:
        """Replica 0's model and stage-optimizer state, keyed so that another stage or
        replica count restores them (pipeline/checkpoint.py); restored() copies them on."""
        from tfdist.parallel.pipeline import checkpoint as pipeline_checkpoint
        return pipeline_checkpoint.portable_objects(self.replicas)

    def restored(self) -> None:
        from tfdist.parallel.pipeline import checkpoint as pipeline_checkpoint
        pipeline_checkpoint.spread_restored(self.replicas)

    def _refuse_batch_statistics(self, model) -> None:
        """BatchNorm over a micro-batch (or one replica's batch) is not the full-batch math;
        at any depth, unless frozen (then it runs on its moving statistics: exact)."""
        if self.microbatches == 1 and self.num_replicas == 1:
            return
        norms = split_state.batch_statistics_layers(model)
        require(not norms,
                f"Model '{model.name}' has BatchNormalization ({', '.join(norms[:3])}"
                f"{', ...' if len(norms) > 3 else ''}), which would normalise each of the "
                f"--microbatches={self.microbatches} micro-batches of each of the "
                f"{self.num_replicas} replica(s) on its own statistics, not the global "
                f"batch's. Use --microbatches=1 with as many devices as stages, freeze it "
                f"(trainable=False: inference mode), or a model without BatchNorm.")

    def _refuse_state_updates(self, model) -> None:
        """A weight its forward pass writes would be written once per micro-batch and
        replica copy, each from its part of the batch."""
        if self.microbatches == 1 and self.num_replicas == 1:
            return
        writers = split_state.layers_writing_weights(model)
        require(not writers,
                f"Model '{model.name}': layer {'; '.join(writers[:3])}"
                f"{'; ...' if len(writers) > 3 else ''} in its training call. Under "
                f"--strategy=pipeline each of the --microbatches={self.microbatches} "
                f"micro-batches of each of the {self.num_replicas} replica(s) would write "
                f"it from its own part of the batch, not once from the global batch as one "
                f"device does. Use --microbatches=1 with as many devices as stages, or "
                f"train with mirrored, multi_worker_mirrored or dtensor.")

    def distribute(self, dataset_fn):
        context = tf.distribute.InputContext(num_input_pipelines=1, input_pipeline_id=0,
                                             num_replicas_in_sync=self.num_replicas)
        return dataset_fn(context)

    def make_train_step(self, model, optimizer, global_batch_size, jit_compile,
                        on_outputs=None):
        require(not jit_compile, "--jit_compile is not supported by --strategy=pipeline yet "
                                 "(each stage would need its own XLA cluster).")
        loss_fn = self._share_of_loss(self.microbatches * self.num_replicas)
        clip = getattr(self, "clip_like", None)
        if clip is not None and not (clip.clipnorm or clip.clipvalue or clip.global_clipnorm):
            clip = None
        return schedule.make_train_step(
            self.replicas, self.microbatches, loss_fn, self.schedule, on_outputs,
            clip=None if clip is None else lambda grads: clipping.clip_like_keras(grads, clip),
            virtual_stages=self.virtual_stages, loss_device=self.host_device)

    def make_eval_step(self, model, on_outputs=None):
        return schedule.make_eval_step(self.replicas, self._share_of_loss(self.num_replicas),
                                       on_outputs, loss_device=self.host_device)

    def _share_of_loss(self, parts: int):
        """loss_fn(y, y_pred, w): one of `parts` equal pieces of the global batch's loss.
        Keras' compiled loss on the piece is the piece's mean (divided by `parts` to
        make the sum of pieces the global mean) or, for `sum` losses, its sum."""
        reference = self.reference
        means = split_state.loss_reductions(reference)[0] != "sum" if reference.loss else True
        scale = 1.0 / parts if means else 1.0

        def loss_fn(y, y_pred, w):
            loss = reference.compute_loss(x=None, y=y, y_pred=y_pred, sample_weight=w)
            return loss * tf.cast(scale, loss.dtype)

        return loss_fn

    def _refuse_inexact_losses(self, model) -> None:
        reductions = split_state.loss_reductions(model)
        kinds = {r == "sum" for r in reductions}
        require(model.loss is not None,
                f"Model '{model.name}' is not compiled with a loss; compile it "
                f"(model.compile(optimizer=..., loss=...)) before training it in a pipeline.")
        require(all(r in split_state.EXACT_REDUCTIONS for r in reductions) and len(kinds) == 1,
                f"Model '{model.name}' has losses with reductions {reductions}; a pipeline "
                f"splits every batch into micro-batches and replicas, which is exact for losses "
                f"that all reduce by 'sum_over_batch_size' (Keras' default) or all by 'sum'.")
        require(not model.losses,
                f"Model '{model.name}' adds {len(model.losses)} regularisation or add_loss "
                f"term(s) to its loss; under --strategy=pipeline each stage would need its "
                f"own share of them, which tfdist does not compute yet. Remove the "
                f"regularizers, or use mirrored, multi_worker_mirrored or dtensor.")

    def param_bytes_per_device(self, model, optimizer) -> Dict[str, int]:
        totals = collections.Counter()
        variables = [v for replica in self.replicas for v in replica.model.variables]
        for variable in variables + list(optimizer.variables):
            backing = getattr(variable, "value", variable)  # Keras Variable -> tf.Variable
            add_bytes(totals, backing.device, backing)
        return dict(totals)


def validate_layout(num_devices: int, num_stages: int, device_names: List[str]) -> None:
    shown = ", ".join(device_names)
    require(num_stages <= num_devices,
            f"--pipeline_stages={num_stages} is more than the {num_devices} device(s) "
            f"available ({shown}); each stage needs its own device.")
    require(num_devices % num_stages == 0,
            f"{num_devices} devices ({shown}) do not divide into replicas of "
            f"--pipeline_stages={num_stages} stages; pipeline x data-parallel needs "
            f"devices = stages x replicas. Use --simulate_devices (or --num_gpus) that is "
            f"a multiple of {num_stages}.")
