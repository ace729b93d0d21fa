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

import re

import tensorflow as tf
from tensorflow.experimental import dtensor

from tfdist import quiet
from tfdist.errors import UsageError
from tfdist.parallel.dtensor import mesh as mesh_lib
from tfdist.parallel.dtensor import rewrites, sharding, update
from tfdist.train import accumulation, step as step_math


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
            yield tf.nest.map_structure(self.pack, batch)

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


def replicated(mesh):
    """fn(DTensor) -> its full value on every device: what the host-side metrics read
    (every client then updates them with the whole global batch)."""
    return lambda tensor: dtensor.relayout(
        tensor, dtensor.Layout.replicated(mesh, tensor.shape.rank))


def outputs_on_host(outputs):
    return tf.nest.map_structure(lambda t: local_value(t), outputs)


def make_train_step(model, optimizer, slots, global_batch_size: int, on_outputs=None,
                    accumulation_steps: int = 1, update_layouts=None,
                    gradients_sharded: bool = False):
    """The loss is Keras' compiled loss on the whole (logical) global batch: one
    program over the mesh, so no replica scaling is involved. on_outputs (the
    metrics' update, plain TF variables) runs after the DTensor program, on the
    gathered (y, y_pred, w). With accumulation_steps=K the batch is computed in K
    micro-batches, each holding 1/K of every device's shard (micro_batches).
    update_layouts ({path: layout}) are where the update runs (zero.py); with
    gradients_sharded (ZeRO stage 2 and 3) each micro-batch's gradients are sliced to them
    as soon as they exist, so an accumulated sum is held in slices too (stage 2; stage 3
    refuses accumulation, zero.check_accumulation)."""
    with_outputs = on_outputs is not None
    del global_batch_size
    variables = model.trainable_variables
    layouts = [sharding.layout_of(v) for v in variables]
    targets = [(update_layouts or {}).get(v.path, layout) for v, layout in zip(variables, layouts)]
    gather = replicated(layouts[0].mesh)
    weight = (1.0 if accumulation_steps == 1
              else accumulation.weight_of_each(model, accumulation_steps))

    def loss_and_grads(x, y, w):
        # This body runs only while tracing: the few ops DTensor cannot run are rewritten
        # (rewrites.py); everything else is TensorFlow's own.
        with rewrites.dtensor_runnable_ops():
            with tf.GradientTape() as tape:
                loss, y_pred = step_math.forward_loss(model, x, y, w, training=True)
                if weight != 1.0:   # a micro-batch's share of the batch's loss
                    loss = loss * tf.cast(weight, loss.dtype)
            grads = tape.gradient(loss, variables)
        if gradients_sharded:
            grads = [shard_gradient(g, layout, target)
                     for g, layout, target in zip(grads, layouts, targets)]
        return loss, grads, y_pred

    cut, join = micro_batches(layouts[0].mesh)
    loss_and_grads = accumulation.accumulate(loss_and_grads, accumulation_steps, cut, join)

    # Inline, not a nested tf.function: see update.py.
    @tf.function
    def sharded_step(batch):
        x, y, w = step_math.split_batch(batch)
        loss, grads, y_pred = loss_and_grads(x, y, w)
        # Gradients are brought to their variable's layout inside (a no-op when
        # DTensor's propagation already chose it).
        update.apply(optimizer, slots, grads, variables, layouts, targets, gradients_sharded)
        if not with_outputs:
            return loss
        return loss, tf.nest.map_structure(gather, step_math.outputs_of(y, y_pred, w))

    def train_step(iterator):
        result = sharded_step(next(iterator))
        if not with_outputs:
            return local_value(result)
        on_outputs(outputs_on_host(result[1]))
        return local_value(result[0])

    train_step = quiet.first_call_filtered(refusing_unrunnable_ops(train_step, model))
    train_step.sharded_step = sharded_step  # for graph inspection in tests
    return train_step


# DTensor (TF 2.21) has no layout propagation for some ops, and says so only when it first
# expands the traced step, before anything runs: "'tf.ReverseV2' op does not implement
# layout propagation. Please file a feature request to TF DTensor." Seen in keras-io models
# (benchmarks/results/conformance.md): the ops, and what in a Keras model uses them.
NO_LAYOUT_PROPAGATION = re.compile(r"'tf\.(\w+)' op does not implement layout propagation")
OP_USERS = {
    "TensorListFromTensor": "a recurrent layer (LSTM, GRU, SimpleRNN: their loop over time)",
    "ReverseV2": "a Bidirectional or go_backwards recurrent layer, or ops.flip",
    "MatrixDiagV3": "an image augmentation or ops.eye / ops.diag",
}


def refusing_unrunnable_ops(step, model):
    """step (train, eval or predict), whose first call turns DTensor's refusal of an op
    into a UsageError naming the op and the layers that use it. Nothing has run then:
    DTensor expands the whole step program before executing it, so the model is untouched."""
    called = []

    def run(batches):
        if called:
            return step(batches)
        try:
            result = step(batches)
        except tf.errors.OpError as error:
            match = NO_LAYOUT_PROPAGATION.search(str(error))
            if match is None:
                raise
            op = match.group(1)
            raise UsageError(
                f"--strategy=dtensor cannot run model '{model.name}': DTensor (TensorFlow "
                f"{tf.__version__}) has no layout propagation for the op {op}, which "
                f"{OP_USERS.get(op, 'one of its layers')} uses; the step stopped before it "
                f"ran, the model is unchanged. Train it with mirrored or "
                f"multi_worker_mirrored (data parallel), or pipeline.") from None
        called.append(True)
        return result

    return run


def micro_batches(mesh):
    """(cut, join) for accumulation.accumulate on batch-sharded tensors.

    DTensor cannot split a tensor along a sharded axis ("Spliting over sharded
    dimension is not supported", TF 2.21), and a micro-batch of consecutive examples
    would sit on a few devices only. So micro-batch k takes the k-th piece of every
    device's shard: the batch seen as (devices, K, m, ...) with devices on `batch`,
    which is every device's own memory reshaped, no communication. join is its
    inverse: the micro-batches' outputs back in the batch's order."""
    devices = mesh.dim_size(mesh_lib.BATCH)

    def sharded_first(tensor, rank):
        return dtensor.relayout(tensor, dtensor.Layout(
            [mesh_lib.BATCH] + [dtensor.UNSHARDED] * (rank - 1), mesh))

    def cut(tensor, steps):
        rest = tensor.shape[1:]
        grouped = tf.reshape(tensor, [devices, steps, -1, *rest])
        grouped = sharded_first(grouped, grouped.shape.rank)
        return [sharded_first(tf.reshape(grouped[:, k], [-1, *rest]), tensor.shape.rank)
                for k in range(steps)]

    def join(pieces):
        rest = pieces[0].shape[1:]
        stacked = tf.stack([tf.reshape(p, [devices, -1, *rest]) for p in pieces], axis=1)
        return tf.reshape(sharded_first(stacked, stacked.shape.rank), [-1, *rest])

    return cut, join


def make_predict_step(model, mesh):
    """fn(x batch) -> plain y_pred: the batch is given to every device whole
    (replicated: any batch size), the outputs gathered."""
    gather = replicated(mesh)

    @tf.function
    def sharded_predict(x):
        with rewrites.dtensor_runnable_ops():
            return tf.nest.map_structure(gather, model(x, training=False))

    def predict(x):
        packed = tf.nest.map_structure(
            lambda t: dtensor.copy_to_mesh(t, dtensor.Layout.replicated(mesh, t.shape.rank)), x)
        return tf.nest.map_structure(local_value, sharded_predict(packed))

    return quiet.first_call_filtered(refusing_unrunnable_ops(predict, model))   # grappler's lines


def shard_gradient(grad, layout, target):
    """A dense gradient reduced to its variable's `layout`, then sliced to `target`.

    Through `layout` first: relayout straight to `target` lets DTensor's layout
    propagation carry the slice back into the backward pass, where ops it cannot shard
    fail ("TransposeOp SPMD needs communication is not supported yet", attention's
    transposes in the transformer). The all-reduce and the slice after it may be fused
    into a reduce-scatter by DTensor; either way the sum is the same. An embedding's
    IndexedSlices stay slices: update.densify squares them before they are summed, as
    Keras does."""
    if grad is None or isinstance(grad, tf.IndexedSlices) or target == layout:
        return grad
    return dtensor.relayout(dtensor.relayout(grad, layout), target)


def make_eval_step(model, on_outputs=None):
    gather = replicated(sharding.layout_of(model.variables[0]).mesh)

    @tf.function
    def sharded_eval(batch):
        x, y, w = step_math.split_batch(batch)
        with rewrites.dtensor_runnable_ops():
            loss, y_pred = step_math.forward_loss(model, x, y, w, training=False)
        return loss, tf.nest.map_structure(gather, step_math.outputs_of(y, y_pred, w))

    def eval_step(iterator):
        loss, outputs = sharded_eval(next(iterator))
        if on_outputs is not None:
            on_outputs(outputs_on_host(outputs))
        return local_value(loss)

    return quiet.first_call_filtered(refusing_unrunnable_ops(eval_step, model))   # grappler's lines
