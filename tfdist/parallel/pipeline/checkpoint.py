"""Pipeline checkpoints that restore onto another stage count, replica count or host layout.

What is saved: replica 0's whole model (its Keras structure does not depend on where
the stages are cut, so tf.train.Checkpoint names its variables the same for any S)
and every optimizer variable of replica 0's stage optimizers, keyed by its Keras
path less the optimizer's name. A slot's path names the model variable it belongs to
("adam/dense_1_kernel_momentum"), so the keys do not depend on the stage either; the counters every stage
optimizer has (iteration, learning_rate), equal in all that train variables, are
saved once, from the first of those. On restore the same keys are read into replica 0 of
whatever layout is restoring, and then copied to every other replica and to the
counters of every other stage (`spread_restored`), so all copies are equal again, as
after their initialisation.
"""

from typing import Dict

import tensorflow as tf

from tfdist.parallel.pipeline import copying


def _key(path: str) -> str:
    """The variable's Keras path without its optimizer's name, which Keras makes unique
    per process ("adam", "adam_2", ...): "dense_1_kernel_momentum", "iteration"."""
    return path.split("/", 1)[-1].replace("/", ".")


def _first_stage_variables(replica) -> Dict[str, object]:
    """Each optimizer variable by key, the shared counters from a stage with variables
    first: a stage without any (a Flatten alone) never applies, so its counters stay 0."""
    found = {}
    stages = sorted(replica.stages, key=lambda stage: not stage.variables)
    for stage in stages:
        for variable in stage.optimizer.variables:
            found.setdefault(_key(variable.path), variable)
    return found


def portable_objects(replicas) -> Dict:
    """The checkpoint objects: replica 0's model and its stage optimizers' state by path."""
    return {"model": replicas[0].model,
            "optimizer_state": {key: variable.value if hasattr(variable, "value") else variable
                                for key, variable in _first_stage_variables(replicas[0]).items()}}


def spread_restored(replicas) -> None:
    """After a restore into replica 0: every replica's weights and every stage optimizer's
    variables (the shared counters included) take replica 0's values."""
    weights = replicas[0].model.get_weights()
    state = _first_stage_variables(replicas[0])
    for replica in replicas:
        if replica is not replicas[0]:
            replica.model.set_weights(weights)
        for stage in replica.stages:
            for variable in stage.optimizer.variables:
                source = state[_key(variable.path)]
                if variable is not source:
                    variable.assign(source)


class HostCopy:
    """What a pipeline across workers saves, as copies on worker 0's host: the same keys as
    portable_objects(), so its checkpoints restore onto any layout, in one process or across
    workers, and back.

    Why copies: TensorFlow's checkpoint saver traces a new function for every save of
    variables that live in more than one task (tensorflow/python/checkpoint/
    functional_saver.py, MultiDeviceSaver.save: "this will cause a function re-trace on each
    save"), traced graphs are never freed (tensorflow#124972), and that grew both processes'
    memory by about 0.1 MB a save (800 saves of 2 remote variables: 711 -> 812 MB and
    709 -> 828 MB; reading the same variables 800 times: flat).
    Saved from worker 0 alone, the saver runs eagerly and nothing accumulates. The cost: a copy
    of replica 0's model and optimizer state in worker 0's memory, refreshed before each save
    (canary: tests/test_upstream_canaries.py::test_checkpoint_saver_retraces_for_several_tasks)."""

    def __init__(self, replicas, host_device: str):
        self.replicas = replicas
        with tf.device(host_device):
            # Same layers and names, user layers and trainable flags as the replicas'.
            self.model = copying.copy_model(replicas[0].model)
            self.optimizer_state = {
                key: tf.Variable(tf.zeros(variable.shape, variable.dtype), trainable=False,
                                 name=f"host_{key}")
                for key, variable in _first_stage_variables(replicas[0]).items()}

    def objects(self) -> Dict:
        return {"model": self.model, "optimizer_state": self.optimizer_state}

    def take(self) -> None:
        """Before a save: replica 0's values into the copies."""
        self.model.set_weights(self.replicas[0].model.get_weights())
        for key, variable in _first_stage_variables(self.replicas[0]).items():
            self.optimizer_state[key].assign(variable)

    def give(self) -> None:
        """After a restore into the copies: their values into replica 0 (then spread_restored)."""
        self.replicas[0].model.set_weights(self.model.get_weights())
        for key, variable in _first_stage_variables(self.replicas[0]).items():
            variable.assign(self.optimizer_state[key])
