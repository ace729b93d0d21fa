"""Putting a built Keras 3 model and its optimizer onto a mesh, variable by variable.

Mechanism: a built Keras variable keeps its storage in a tf.Variable (the
private attribute `_value`, which `.value` returns and every read and
assign goes through). We replace that tf.Variable by a dtensor.DVariable with
the variable's layout, holding the same values. Forward, backward and the
optimizer's assigns then run as DTensor SPMD programs on the shards.

Why the order matters, and what made momentum drift: the Keras optimizer must
be built AFTER the model is sharded (it keys slots by the backing variable's
id), and every optimizer variable must be a DVariable too. A slot left as a
plain tf.Variable on one device is, inside a DTensor function, treated as a
replicated resource: each of the mesh's N device programs runs its own
read-modify-write on the same buffer. Measured: `iterations` advanced by 4 per
step on a 4-device mesh; momentum's `m = 0.9*m - lr*g` was applied on top of
another device's already-updated m, in a racy order (exact at step 1, where m
is 0, then off by ~5e-3). SGD has no slot, hence it matched. Adam's bias
correction read the over-counted step and diverged. So here slots take their
parameter's layout and `iterations` / `learning_rate` become replicated
DVariables: each device then updates only its own shard, once, which is the
single-device arithmetic shard by shard. That alone made the MLP exact; the
transformer on a batch-sharded mesh needed a second fix, in the update rule
itself (update.py: read each slot once, never read back after a write).

Private Keras API (no public way to give an existing Keras variable DTensor
storage: keras.distribution has no TF backend, its distribution_lib says
"DO NOT USE"; upstream: keras-team/keras#18473 "DTensor support in TF
backend", open): `keras.Variable._value`. tests/test_dtensor.py::
test_keras_variable_storage_canary fails if Keras stops routing reads and
assigns through it.
"""

from typing import Dict, Mapping, Sequence

import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor

from tfdist.errors import UsageError
from tfdist.parallel.dtensor import update
from tfdist.parallel.dtensor.layout_map import UNSHARDED
from tfdist.train import keras_fixes


def make_layout(spec: Sequence[str], mesh) -> dtensor.Layout:
    return dtensor.Layout([UNSHARDED if a == UNSHARDED else a for a in spec], mesh)


def local_components(value: np.ndarray, layout: dtensor.Layout):
    """This client's shards of the full array `value`, in mesh.local_devices() order."""
    mesh = layout.mesh
    components = []
    for location in mesh.local_device_locations():
        index = []
        for dim, axis in enumerate(layout.sharding_specs):
            if axis == UNSHARDED:
                index.append(slice(None))
                continue
            size = value.shape[dim] // mesh.dim_size(axis)
            start = location[axis] * size
            index.append(slice(start, start + size))
        components.append(tf.constant(value[tuple(index)]))
    return components


def pack(value, layout: dtensor.Layout):
    """A DTensor with `layout` from the full value (every client passes the same value)."""
    value = np.asarray(value)
    return dtensor.pack(local_components(value, layout), layout)


class ShardedVariable(dtensor.DVariable):
    """A DVariable whose numpy() is the full value (gathered), as a tf.Variable's is.

    Keras' `Variable.numpy()` / `Model.get_weights()` call it; a plain DVariable
    refuses to copy a sharded value to the host.

    `compute_layout` (--zero_stage=3, zero.py): the layout the model's ops read the
    variable in, when it is stored in another (a slice over `batch`). Every read that
    converts it to a tensor (how Keras layers read their weights) is relayouted to it: the
    parameter is gathered where a layer uses it, and the gradient of that relayout takes
    the gradient back to the slice. Explicit reads (read_value(), the optimizer update,
    checkpoints) see the stored slice.
    """

    compute_layout = None

    def _dense_var_to_tensor(self, dtype=None, name=None, as_ref=False):
        value = super()._dense_var_to_tensor(dtype=dtype, name=name, as_ref=as_ref)
        if self.compute_layout is None or as_ref:
            return value
        return gathered(value, self.compute_layout, self.layout)

    def numpy(self):
        value = self.read_value()
        rank = value.shape.rank
        full = dtensor.relayout(value, dtensor.Layout.replicated(dtensor.fetch_layout(value).mesh, rank))
        return dtensor.unpack(full)[0].numpy()

    def assign(self, value, *args, **kwargs):
        """A full value given eagerly (Keras' load_weights and set_weights, after training)
        is packed into this variable's layout first: DTensor's assign takes only DTensors."""
        if tf.executing_eagerly() and not dtensor.is_dtensor(value):
            value = pack(np.asarray(value, self.dtype.as_numpy_dtype), self.layout)
        return super().assign(value, *args, **kwargs)


def gathered(value, compute_layout, stored_layout):
    """`value` relayouted to `compute_layout`; its gradient goes back to `stored_layout`,
    except an embedding's IndexedSlices, which stay slices (DTensor's own Relayout
    gradient densifies them, and Keras' Adam squares each slice before the rows are
    summed: update.densify). Eagerly (a read outside the step) no gradient is taken, and
    tf.custom_gradient's eager path cannot copy a sharded DTensor."""
    if tf.executing_eagerly():
        return dtensor.relayout(value, compute_layout)

    @tf.custom_gradient
    def relayout(tensor):
        def gradient(upstream):
            if isinstance(upstream, tf.IndexedSlices):
                return upstream
            # Summed in the compute layout first, then sliced: straight to the slice, DTensor
            # carries the slice back into the backward pass (step.shard_gradient says where).
            return dtensor.relayout(dtensor.relayout(upstream, compute_layout), stored_layout)
        return dtensor.relayout(tensor, compute_layout), gradient
    return relayout(value)


def give_dtensor_storage(variable, layout: dtensor.Layout) -> None:
    """Replaces a built Keras variable's tf.Variable by a DVariable with `layout`."""
    backing = variable.value  # the tf.Variable (Keras Variable.value)
    if not isinstance(backing, tf.Variable):
        raise UsageError(f"Variable {variable.path!r} has no tf.Variable storage to shard "
                         f"(got {type(backing).__name__}); build the model first.")
    sharded = ShardedVariable(pack(backing.numpy(), layout), trainable=backing.trainable,
                                name=backing.name.split(":")[0])
    variable._value = sharded  # private Keras API, see the module docstring


def shard_model(model, specs: Mapping[str, Sequence[str]], mesh) -> Dict[str, dtensor.Layout]:
    """Gives every model variable DTensor storage, and every tensor a layer holds
    outside its variables a replicated copy on the mesh; returns {path: layout}."""
    layouts = {}
    for variable in model.variables:
        layouts[variable.path] = make_layout(specs[variable.path], mesh)
        give_dtensor_storage(variable, layouts[variable.path])
    replicate_layer_constants(model, mesh)
    return layouts


def replicate_layer_constants(model, mesh) -> None:
    """Copies the plain tensors layers keep as attributes onto the mesh, replicated.

    Keras' Normalization keeps its mean and variance as eager tensors, not
    variables (computed once in build or after adapt; keras.applications'
    EfficientNet and ConvNeXt start with one). A traced step captures them as
    inputs, and DTensor (TF 2.21) accepts only scalars and small integer tensors as
    regular inputs: every such model failed at its first step with "got a regular
    tensor for input N ... but was expecting a DTensor", even fully replicated.
    Replicated, they are the same values on every device."""
    for layer in keras_fixes.all_layers(model):
        for name, value in list(vars(layer).items()):
            if _plain_eager_tensor(value):
                layout = dtensor.Layout.replicated(mesh, value.shape.rank)
                setattr(layer, name, dtensor.copy_to_mesh(value, layout))


def _plain_eager_tensor(value) -> bool:
    # Scalars are left alone: DTensor broadcasts those itself.
    return (isinstance(value, tf.Tensor) and not isinstance(value, tf.Variable)
            and hasattr(value, "numpy") and (value.shape.rank or 0) > 0
            and not dtensor.is_dtensor(value))


def build_sharded_optimizer(optimizer_fn, model, layouts: Mapping[str, dtensor.Layout], mesh):
    """Builds the optimizer on the sharded model; each slot takes the layout `layouts`
    gives its parameter (the parameter's own, or under --zero_stage its slice, zero.py).

    Slots are recorded as Keras creates them through the public
    `add_variable_from_reference(reference_variable, ...)`; any other optimizer
    variable (iterations, learning_rate) becomes a replicated DVariable.
    """
    optimizer = optimizer_fn()
    update.check_supported(optimizer, model.trainable_variables)  # before any step is traced
    references, slots = {}, {}
    create_slot = optimizer.add_variable_from_reference

    def recording(reference_variable, *args, **kwargs):
        slot = create_slot(reference_variable, *args, **kwargs)
        name = kwargs.get("name", args[0] if args else None)
        references[id(slot)] = reference_variable.path
        slots[(reference_variable.path, name)] = slot
        return slot

    optimizer.add_variable_from_reference = recording
    try:
        optimizer.build(model.trainable_variables)
    finally:
        del optimizer.add_variable_from_reference  # back to the class method
    for variable in optimizer.variables:
        path = references.get(id(variable))
        if path is not None:
            layout = layouts[path]
        else:
            layout = dtensor.Layout.replicated(mesh, len(variable.shape))
        give_dtensor_storage(variable, layout)
    return optimizer, slots


def layout_of(variable) -> dtensor.Layout:
    return dtensor.fetch_layout(variable.value)


def shard_shapes(variable):
    """[(device, shape)] of this client's actual shards of a sharded Keras variable."""
    components = dtensor.unpack(variable.value.read_value())
    return [(c.device, tuple(c.shape)) for c in components]
