"""DTensor inputs and steps: batch-sharded packing, one train and one eval step.

Inputs: the global batch of step t must be the default run's (the same
examples; order inside a batch only changes summation order). This client
reads ONE input pipeline (pipeline g of G, see mesh.batch_groups) with batch
global/G, cuts it into its devices' consecutive batch shards and dtensor.packs
them with layout batch_sharded(mesh, "batch"). Single client: G = 1, the batch
is exactly the default run's. Clients that hold the same batch shards (a
`model` axis spanning clients) read the same pipeline.

Steps: the loss math is tfdist.train.step's (per-example loss summed / GLOBAL
batch). On batch-sharded logits the sum is a DTensor reduction, so the loss and
every gradient come out already summed over `batch`; no explicit all-reduce.
The step returns a replicated scalar; its local component is the global value.
"""

import tensorflow as tf
from tensorflow.experimental import dtensor

from tfdist.parallel.dtensor import mesh as mesh_lib
from tfdist.parallel.dtensor import sharding, update
from tfdist.train import step as step_math


class ShardedInputs:
    """Iterable of per-step tuples of batch-sharded DTensors (see module docstring)."""

    def __init__(self, dataset_fn, mesh):
        self.dataset_fn = dataset_fn
        self.mesh = mesh
        self.groups, self.group_id, self.coords = mesh_lib.batch_groups(mesh)

    def input_context(self) -> tf.distribute.InputContext:
        # num_replicas_in_sync=groups: each pipeline batches global/groups examples.
        return tf.distribute.InputContext(num_input_pipelines=self.groups,
                                          input_pipeline_id=self.group_id,
                                          num_replicas_in_sync=self.groups)

    def __iter__(self):
        for batch in self.dataset_fn(self.input_context()):
            yield tuple(self.pack(t) for t in batch)

    def pack(self, tensor):
        layout = dtensor.Layout.batch_sharded(self.mesh, mesh_lib.BATCH, tensor.shape.rank)
        pieces = tf.split(tensor, len(self.coords), axis=0)
        first = self.coords[0]
        components = [pieces[loc[mesh_lib.BATCH] - first]
                      for loc in self.mesh.local_device_locations()]
        return dtensor.pack(components, layout)


def local_value(tensor):
    """A replicated DTensor's value as a plain tensor (its first local component)."""
    return dtensor.unpack(tensor)[0]


def make_train_step(model, optimizer, slots, global_batch_size: int):
    # Inline, not a nested tf.function: see update.py.
    def loss_and_grads(x, y):
        with tf.GradientTape() as tape:
            logits = model(x, training=True)
            loss = tf.nn.compute_average_loss(
                step_math.per_example_loss(y, logits), global_batch_size=global_batch_size)
        return loss, tape.gradient(loss, model.trainable_variables)

    variables = model.trainable_variables
    layouts = [sharding.layout_of(v) for v in variables]

    @tf.function
    def sharded_step(x, y):
        loss, grads = loss_and_grads(x, y)
        # Gradients are brought to their variable's layout inside (a no-op when
        # DTensor's propagation already chose it).
        update.apply(optimizer, slots, grads, variables, layouts)
        return loss

    def train_step(iterator):
        x, y = next(iterator)
        return local_value(sharded_step(x, y))

    train_step.sharded_step = sharded_step  # for graph inspection in tests
    return train_step


def make_eval_step(model):
    sums = tf.function(step_math.replica_eval_step(model))

    def eval_step(iterator):
        return tuple(local_value(s) for s in sums(*next(iterator)))

    return eval_step
