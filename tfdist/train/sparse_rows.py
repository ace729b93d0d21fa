"""How the rows of a sparse gradient add up when a batch is split.

An `Embedding` (or any `take`/`gather` of a variable) gets a `tf.IndexedSlices`
gradient: one row per looked-up index, duplicates not summed. Keras' optimizers
apply those rows one by one (Adam's second moment squares each row before rows
of the same index add up), so the update depends on which rows the gradient
holds, not only on their sum. One device computes the rows of the whole batch;
a split (replicas, workers, micro-batches) computes each part's rows, and how
the parts' rows combine decides whether the update equals one device's:

- Rows the batch chooses (token ids looked up per example): one device holds
  every example's rows, so the parts' rows are concatenated.
- Rows the batch does not choose (a position table looked up with
  `ops.arange(sequence_length)`): one device holds each such row once, carrying
  the whole batch's sum; every part holds the same rows with its share of the
  sum, so the parts' values are added row by row, keeping the rows.

Concatenating both kinds (what tf.distribute's all-reduce of IndexedSlices and
Keras do) made a keras-io text transformer under Adam end 44-51% off one device.

Which kind a gradient's rows are is read from the traced graph: rows whose
indices are computed only from constants and variable values are the batch's
choice of none ("shared"); anything else (the batch, a random op, a shape)
counts as chosen by the batch, which is what every mode did before. When the
same table is looked up both ways, TensorFlow's gradient is the concatenation of
the two lookups' IndexedSlices; it is split back into its parts here.
"""

from typing import Callable, List, Sequence, Tuple

import tensorflow as tf

from tfdist.errors import UsageError

# Ops whose value is the same in every replica, worker and micro-batch of a step.
# Variables are read before the step's update, and mirrored replicas hold equal values.
_SAME_EVERYWHERE = frozenset({"Const", "HostConst", "ReadVariableOp", "VarHandleOp"})
_CONCAT = "ConcatV2"


def rows_follow_the_batch(indices) -> bool:
    """False when `indices` is computed only from constants and variable values.

    True for anything else, including an eager tensor (no graph to read) and any
    stateful op on the way (iterators, random ops), the cautious answer. A kind read
    inside a nested function and handed out by carry_kinds takes precedence."""
    known = _CARRIED.get(_key(indices))
    if known is not None:
        return known
    op = getattr(indices, "op", None)
    if op is None or not hasattr(op, "graph"):
        return True
    seen, pending = set(), [op]
    while pending:
        op = pending.pop()
        if (op.graph, op.name) in seen or op.type in _SAME_EVERYWHERE:
            continue
        seen.add((op.graph, op.name))
        captured = _captured_value(op)
        if captured is not None:   # a value the function took from outside it
            if hasattr(captured, "op"):
                pending.append(captured.op)   # a tensor of the enclosing graph: read on
            continue                          # an eager constant: the same everywhere
        if op.op_def.is_stateful or not op.inputs:
            return True   # a placeholder (the batch), an iterator, a random op, ...
        pending.extend(t.op for t in op.inputs)
    return False


def _captured_value(op):
    """What a function's placeholder stands for when the function captured it (an eager
    constant, e.g. positions computed with ops.arange outside the traced call, or a
    tensor of the enclosing graph); None for any other op (the batch is an argument)."""
    if op.type != "Placeholder" or op.outputs[0].dtype == tf.resource:
        return None
    for external, internal in getattr(op.graph, "captures", ()):
        if internal is op.outputs[0]:
            return external
    return None


# ------------------------------------------------------------------ nested functions
# Kinds read inside a nested (XLA-compiled) function, keyed by the graph tensor of the
# indices it returned: the caller's graph sees only the function call.
_CARRIED = {}


def _key(tensor):
    try:
        return tensor.ref()
    except (AttributeError, TypeError):
        return None


def recording_kinds(fn):
    """fn(*args) -> (loss, grads, y_pred), which also records, while it is traced, the
    kind of each sparse gradient's rows in `recorded.kinds` (position -> bool)."""
    def recorded(*args):
        loss, grads, y_pred = fn(*args)
        kinds = {}
        for position, grad in enumerate(grads):
            if isinstance(grad, tf.IndexedSlices):
                parts = segments(grad)
                if len(parts) > 1:
                    raise UsageError(
                        f"--jit_compile: the sparse gradient of trainable variable "
                        f"#{position} mixes rows chosen by the batch with rows it does not "
                        f"choose (one table looked up both ways); an XLA-compiled step "
                        f"cannot hand both kinds to the all-reduce. Drop --jit_compile.")
                kinds[position] = parts[0][0]
        recorded.kinds = kinds
        return loss, grads, y_pred
    recorded.kinds = {}
    return recorded


def carry_kinds(compiled):
    """Calls `compiled` (a tf.function of recording_kinds) and registers the kinds it
    recorded for the sparse gradients it returned."""
    def call(*args):
        loss, grads, y_pred = compiled(*args)
        kinds = compiled.python_function.kinds
        if len(_CARRIED) > 4096:   # one entry per sparse gradient per trace; traces are few
            _CARRIED.clear()
        for position, grad in enumerate(grads):
            if isinstance(grad, tf.IndexedSlices) and position in kinds:
                _CARRIED[_key(grad.indices)] = kinds[position]
        return loss, grads, y_pred
    return call


Segment = Tuple[bool, tf.IndexedSlices]   # (rows follow the batch, the rows)


def segments(grad: tf.IndexedSlices) -> List[Segment]:
    """The gradient's rows as consecutive segments of one kind each.

    One segment, unless TensorFlow concatenated lookups of both kinds (two uses of
    one table): then one per lookup, in the gradient's row order."""
    parts = _concatenated_parts(grad)
    kinds = [rows_follow_the_batch(part.indices) for part in parts]
    if len(set(kinds)) == 1:
        return [(kinds[0], grad)]
    return list(zip(kinds, parts))


def _concatenated_parts(grad: tf.IndexedSlices) -> List[tf.IndexedSlices]:
    """The IndexedSlices that TensorFlow's gradient aggregation concatenated into
    `grad` (values and indices concatenated part by part along axis 0), or [grad]."""
    values_op, indices_op = _through_identities(grad.values), _through_identities(grad.indices)
    if not (values_op.type == _CONCAT == indices_op.type
            and len(values_op.inputs) == len(indices_op.inputs)
            and _is_axis_zero(values_op.inputs[-1]) and _is_axis_zero(indices_op.inputs[-1])):
        return [grad]
    return [tf.IndexedSlices(values, indices, grad.dense_shape)
            for values, indices in zip(values_op.inputs[:-1], indices_op.inputs[:-1])]


def _through_identities(tensor):
    """The op that computed `tensor`, past tf.identity copies (device moves, names)."""
    op = tensor.op
    while op.type == "Identity":
        op = op.inputs[0].op
    return op


def _is_axis_zero(axis) -> bool:
    value = tf.get_static_value(axis)
    return value is not None and int(value) == 0


def _joined(parts: Sequence[tf.IndexedSlices], dense_shape) -> tf.IndexedSlices:
    if len(parts) == 1:
        return parts[0]
    return tf.IndexedSlices(tf.concat([p.values for p in parts], 0),
                            tf.concat([p.indices for p in parts], 0), dense_shape)


# ------------------------------------------------------------------ across replicas

def reduce_across(grads: Sequence, all_reduce: Callable[[list, list], list],
                  variables: Sequence = None) -> list:
    """The gradients summed over the replicas as one device's would be.

    `all_reduce(items, owners)` must return, in order, each dense item summed and
    each IndexedSlices item gathered (every replica's rows, concatenated in replica
    order): what tf.distribute's all_reduce(SUM) does; `owners[i]` is the variable
    item i belongs to (None without `variables`), for messages. Shared rows go
    through it as their dense values (summed row by row), rows the batch chose as
    IndexedSlices. None gradients stay None. It is called even with no items."""
    items, owners, rebuilders = [], [], []
    for grad, variable in zip(grads, variables or [None] * len(grads)):
        before = len(items)
        rebuilders.append(_pack(grad, items))
        owners += [variable] * (len(items) - before)
    reduced = iter(all_reduce(items, owners))
    return [rebuild(reduced) for rebuild in rebuilders]


def _pack(grad, items: list) -> Callable:
    """Appends what `grad` sends to `items`; returns fn(iterator of results) -> the sum."""
    if grad is None:
        return lambda reduced: None
    if not isinstance(grad, tf.IndexedSlices):
        items.append(grad)
        return lambda reduced: next(reduced)
    parts = segments(grad)
    items.extend(rows if follows else rows.values for follows, rows in parts)

    def rebuild(reduced):
        summed = [next(reduced) if follows else
                  tf.IndexedSlices(next(reduced), rows.indices, rows.dense_shape)
                  for follows, rows in parts]
        return _joined(summed, grad.dense_shape)
    return rebuild


# ------------------------------------------------------------------ across micro-batches

def add_parts(parts: Sequence):
    """One variable's gradient over a batch from its parts' gradients (micro-batches,
    replicas), in batch order: dense ones summed, sparse rows combined by kind."""
    parts = list(parts)
    if not any(isinstance(p, tf.IndexedSlices) for p in parts):
        total = parts[0]
        for part in parts[1:]:
            total = total + part
        return total
    if not all(isinstance(p, tf.IndexedSlices) for p in parts):
        # One lookup is sparse and another dense (never from the same graph twice);
        # every row is kept, as one device's dense gradient would be applied.
        return _joined([_as_rows(p) for p in parts], _as_rows(parts[0]).dense_shape)
    per_part = [segments(p) for p in parts]
    if len({len(s) for s in per_part}) != 1:
        return _joined(parts, parts[0].dense_shape)
    combined = [_combine_segment([s[i] for s in per_part]) for i in range(len(per_part[0]))]
    return _joined(combined, parts[0].dense_shape)


def _combine_segment(same_segment: List[Segment]) -> tf.IndexedSlices:
    follows = [f for f, _ in same_segment]
    rows = [r for _, r in same_segment]
    if all(follows) or any(follows):
        # Chosen by the batch (or classified differently by two traces: keep every row).
        return _joined(rows, rows[0].dense_shape)
    values = rows[0].values
    for part in rows[1:]:
        values = values + part.values
    return tf.IndexedSlices(values, rows[0].indices, rows[0].dense_shape)


def _as_rows(grad) -> tf.IndexedSlices:
    if isinstance(grad, tf.IndexedSlices):
        return grad
    rows = tf.range(tf.shape(grad, out_type=tf.int64)[0])
    return tf.IndexedSlices(grad, rows, tf.shape(grad, out_type=tf.int64))
