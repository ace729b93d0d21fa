"""Pipeline schedules: one training step of S stages x M micro-batches x R replicas.

Why a step is the full-batch step: each micro-batch's loss is its per-example
losses summed and divided by the GLOBAL batch (as in tfdist.train.step), so
the sum over micro-batches and replicas of their gradients is the gradient of
the global-batch mean loss. Gradients are accumulated per stage in float32 and
applied once per step; the reported loss is the sum of the micro-batch losses.

How it runs: stage k of replica r is recorded on its own GradientTape per
micro-batch, under tf.device(stage device). A backward op is
`tape.gradient(stage output, variables + [stage input], output_gradients=grad
of stage output)`, so the only tensors that cross devices are the boundary
activation (forward) and its gradient (backward). A schedule is, per stage,
the order of its forward and backward ops; each op gets a control dependency
on the stage's previous op, which is what imposes the order on TensorFlow's
dataflow executor (across stages, ops run as soon as their inputs arrive).
When several tensors cross a cut (partition.py), each is sent forward, and the
gradient of each float computed one is sent back; integer and boolean tensors
(a padding mask) and model inputs get none. Orders:
- gpipe: all M forwards, then all M backwards (GPipe's flush); a stage holds
  the activations of all M micro-batches.
- 1f1b: S-k-1 warm-up forwards, then one forward / one backward (PipeDream-
  flush); stage k holds at most min(S-k, M) micro-batches' activations.
Backward ops run in micro-batch order in both, so both give the same numbers.

Hybrid: with R replicas the stage-k gradient sums of all replicas are added on
replica 0's stage-k device and every replica's stage-k optimizer applies that
same sum, so the copies stay identical (same ops on the same values).

Names: boundary tensors go through `tf.identity` ops named BOUNDARY_ACTIVATION
and BOUNDARY_GRADIENT (and a replica's accumulated gradients STAGE_GRADIENT,
their sum over replicas GRADIENT_SUM, the micro-batch loss MICROBATCH_LOSS;
the batch is read and split under the name scope INPUT), which lets tests
recognise every cross-device edge of the placed graph.
"""

from typing import List, Tuple

import tensorflow as tf

from tfdist.train import step as step_math

BOUNDARY_ACTIVATION = "pipeline_boundary_activation"
BOUNDARY_GRADIENT = "pipeline_boundary_gradient"
STAGE_GRADIENT = "pipeline_stage_gradient"
GRADIENT_SUM = "pipeline_replica_gradient_sum"
MICROBATCH_LOSS = "pipeline_microbatch_loss"
INPUT = "pipeline_input"
FORWARD, BACKWARD = "forward", "backward"


def split_microbatches(tensor, microbatches: int) -> list:
    return tf.split(tensor, microbatches, axis=0) if microbatches > 1 else [tensor]


def gpipe_order(num_stages: int, microbatches: int, stage: int) -> List[Tuple[str, int]]:
    """GPipe: every forward, then every backward (all M activations held at once)."""
    del num_stages, stage
    return ([(FORWARD, m) for m in range(microbatches)]
            + [(BACKWARD, m) for m in range(microbatches)])


def one_f_one_b_order(num_stages: int, microbatches: int, stage: int) -> List[Tuple[str, int]]:
    """1F1B (PipeDream-flush): S-k-1 warm-up forwards, then alternate one forward and
    one backward; stage k never holds more than min(S - k, M) micro-batches' activations."""
    warmup = min(num_stages - stage - 1, microbatches)
    order = [(FORWARD, m) for m in range(warmup)]
    for b in range(microbatches):
        if warmup + b < microbatches:
            order.append((FORWARD, warmup + b))
        order.append((BACKWARD, b))
    return order


SCHEDULES = {"gpipe": gpipe_order, "1f1b": one_f_one_b_order}


class _ReplicaRun:
    """The tensors of one replica's step, filled in as the schedule's ops are built.

    act[(k, m)] is the list of tensors stage k sends for micro-batch m (the
    micro-batch loss, alone, for the last stage; the features for k = -1) and
    grad[(k, m)] the gradients coming back for them (None where none flows)."""

    def __init__(self, stages, x_parts, y_parts, w_parts, loss_fn, replica):
        self.stages, self.y_parts, self.w_parts, self.replica = stages, y_parts, w_parts, replica
        self.loss_fn = loss_fn
        self.predictions = {}   # m -> the last stage's output (for the metrics)
        num_stages = len(stages)
        self.act = {(-1, m): x for m, x in enumerate(x_parts)}
        self.grad = {(num_stages - 1, m): None for m in range(len(x_parts))}  # d loss/d act
        self.tapes = {}
        self.sums = [None] * num_stages     # per stage: variable gradients, summed over m
        self.previous = [[] for _ in stages]  # per stage: outputs of its last scheduled op

    def ready(self, kind: str, k: int, m: int) -> bool:
        if kind == FORWARD:
            return (k - 1, m) in self.act
        return (k, m) in self.act and (k, m) in self.grad

    def build(self, kind: str, k: int, m: int) -> None:
        stage = self.stages[k]
        scope = f"replica_{self.replica}_stage_{k}_{kind}"
        # The control dependency on the stage's previous op is what imposes the order.
        with tf.device(stage.device), tf.name_scope(scope), \
                tf.control_dependencies(self.previous[k]):
            outputs = self._forward(stage, m) if kind == FORWARD else self._backward(stage, m)
        self.previous[k] = outputs

    def _forward(self, stage, m: int) -> list:
        k, last = stage.index, stage.index == len(self.stages) - 1
        received = self.act[(k - 1, m)]
        tape = tf.GradientTape()  # watches the stage's variables as they are read
        with tape:
            for h in _differentiable(received, stage.differentiable_inputs) if k > 0 else []:
                tape.watch(h)
            out = run_stage(stage, received, last, training=True)
            if last:
                self.predictions[m] = out
                out = [tf.identity(self.loss_fn(self.y_parts[m], out, self.w_parts[m]),
                                   name=MICROBATCH_LOSS)]
            else:
                out = [tf.identity(t, name=BOUNDARY_ACTIVATION) for t in out]
        self.tapes[(k, m)] = tape
        self.act[(k, m)] = out
        return out

    def _backward(self, stage, m: int) -> list:
        k, last = stage.index, stage.index == len(self.stages) - 1
        inputs = _differentiable(self.act[(k - 1, m)], stage.differentiable_inputs) if k else []
        sources = list(stage.variables) + inputs
        if last:   # d loss / d loss = 1
            targets, output_grads = self.act[(k, m)], None
        else:
            pairs = [(t, g) for t, g, wanted in zip(self.act[(k, m)], self.grad[(k, m)],
                                                     stage.differentiable_outputs) if wanted]
            targets, output_grads = [t for t, _ in pairs], [g for _, g in pairs]
        tape = self.tapes.pop((k, m))
        grads = (tape.gradient(targets, sources, output_gradients=output_grads) if targets
                 else [None] * len(sources))  # only integer tensors sent: nothing flows back
        grads = [_zeros_if_none(g, v) for g, v in zip(grads, sources)]
        var_grads = grads[:len(stage.variables)]
        # Backward ops run in micro-batch order in every schedule: the same sums.
        self.sums[k] = var_grads if self.sums[k] is None else [
            accumulate(a, b) for a, b in zip(self.sums[k], var_grads)]
        if k > 0:
            self.grad[(k - 1, m)] = self._send_back(stage, grads[len(stage.variables):])
        sent = [g for g in self.grad.get((k - 1, m)) or [] if g is not None]
        return sent or [g.values if isinstance(g, tf.IndexedSlices) else g for g in var_grads]

    def _send_back(self, stage, input_grads) -> list:
        """One entry per tensor stage k-1 sent: the gradient, or None for an integer one."""
        grads = iter(input_grads)
        return [tf.identity(next(grads), name=BOUNDARY_GRADIENT) if wanted else None
                for wanted in stage.differentiable_inputs]


def run_stage(stage, received, last: bool, training: bool):
    """Stage k on what it received (the features for stage 0, else the list of boundary
    tensors): the model's output for the last stage, else the list of tensors it sends,
    those it computed and those it hands on (PlacedStage.sends)."""
    out = stage.model(_as_stage_input(received) if stage.index else received,
                      training=training)
    if last:
        return out
    computed = _as_list(out)
    return [received[i] if handed_on else computed[i] for handed_on, i in stage.sends]


def _as_list(tensors) -> list:
    return list(tensors) if isinstance(tensors, (list, tuple)) else [tensors]


def _as_stage_input(tensors: list):
    """The sub-model of a stage takes one boundary tensor as itself, several as a list."""
    return tensors[0] if len(tensors) == 1 else list(tensors)


def _differentiable(tensors: list, mask) -> list:
    return [t for t, wanted in zip(tensors, mask) if wanted]


def run_replica(stages, x_parts, y_parts, w_parts, loss_fn, schedule: str, replica: int = 0):
    """Builds one replica's forward and backward ops in schedule order.

    Returns (micro-batch losses, per stage its variable gradients summed over m,
    the last stage's outputs per micro-batch).
    """
    run = _ReplicaRun(stages, x_parts, y_parts, w_parts, loss_fn, replica)
    num_stages, microbatches = len(stages), len(x_parts)
    pending = [list(SCHEDULES[schedule](num_stages, microbatches, k)) for k in range(num_stages)]
    while any(pending):
        progressed = False
        for k in range(num_stages):  # each stage builds its next op once its inputs exist
            while pending[k] and run.ready(pending[k][0][0], k, pending[k][0][1]):
                kind, m = pending[k].pop(0)
                run.build(kind, k, m)
                progressed = True
        if not progressed:
            raise RuntimeError(f"pipeline schedule {schedule!r} deadlocked: {pending}")
    losses = [run.act[(num_stages - 1, m)][0] for m in range(microbatches)]
    grads = []
    for stage, sums in zip(stages, run.sums):
        with tf.device(stage.device):
            # Named so the hybrid's transfer of it to replica 0 is recognisable.
            grads.append([_named(g, STAGE_GRADIENT) for g in sums])
    return losses, grads, [run.predictions[m] for m in range(microbatches)]


def _zeros_if_none(grad, source):
    return tf.zeros_like(source) if grad is None else grad  # unused on this path


def accumulate(total, grad):
    """total + grad; IndexedSlices (embedding lookups) are concatenated, not densified.

    Why: Keras' optimizers apply IndexedSlices per slice (Adam's second moment
    squares each slice, not the sum of duplicate rows), so the one-device step,
    which gets one slice per looked-up token, is only reproduced by the same
    slices in the same order: micro-batch after micro-batch, replica after replica.
    """
    if isinstance(total, tf.IndexedSlices) or isinstance(grad, tf.IndexedSlices):
        total, grad = _as_slices(total), _as_slices(grad)
        return tf.IndexedSlices(tf.concat([total.values, grad.values], 0),
                                tf.concat([total.indices, grad.indices], 0),
                                total.dense_shape)
    return total + grad


def _as_slices(grad):
    if isinstance(grad, tf.IndexedSlices):
        return grad
    rows = tf.range(tf.shape(grad, out_type=tf.int64)[0])
    return tf.IndexedSlices(grad, rows, tf.shape(grad, out_type=tf.int64))


def _sum(parts):
    """Sum of one gradient over replicas, in replica order."""
    total = parts[0]
    for part in parts[1:]:
        total = accumulate(total, part)
    return total


def apply_gradients(replicas, replica_grads, clip=None) -> None:
    """Sums stage-k gradients over replicas on replica 0's device; every copy applies the sum.

    `clip(all stages' gradients)`, if given, clips them as the user's optimizer would
    (clipnorm, clipvalue, global_clipnorm: the global norm spans every stage), and the
    stage optimizers, built with clipping off, apply the result."""
    totals = []
    for k in range(len(replicas[0].stages)):
        per_replica = [grads[k] for grads in replica_grads]
        with tf.device(replicas[0].stages[k].device):
            totals.append(per_replica[0] if len(per_replica) == 1 else [
                _named(_sum(parts), GRADIENT_SUM) for parts in zip(*per_replica)])
    if clip is not None:
        sizes = [len(total) for total in totals]
        flat = clip([g for total in totals for g in total])
        totals = [flat[sum(sizes[:k]):sum(sizes[:k + 1])] for k in range(len(sizes))]
    for k, total in enumerate(totals):
        for replica in replicas:
            stage = replica.stages[k]
            with tf.device(stage.device):
                stage.optimizer.apply(total, stage.variables)


def _named(grad, name):
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(tf.identity(grad.values, name=name),
                                tf.identity(grad.indices, name=name), grad.dense_shape)
    return tf.identity(grad, name=name)


def split_microbatches_of(batch, microbatches: int):
    """(x parts, y parts, w parts), one per micro-batch; any structure of features and labels."""
    x, y, w = step_math.split_batch(batch)
    if w is None:   # ones weigh like no weight (x * 1 == x)
        w = step_math.per_example_weight(tf.ones(tf.shape(tf.nest.flatten(y)[0])[:1]), y)

    def parts_of(structure):
        leaves = [split_microbatches(t, microbatches) for t in tf.nest.flatten(structure)]
        return [tf.nest.pack_sequence_as(structure, [leaf[m] for leaf in leaves])
                for m in range(microbatches)]

    return parts_of(x), parts_of(y), parts_of(w)


def _concat(parts):
    return tf.nest.map_structure(lambda *p: tf.concat(p, axis=0), *parts)


def make_train_step(replicas, microbatches: int, loss_fn, schedule: str = "gpipe",
                    on_outputs=None, clip=None):
    """Returns a tf.function step(iterator) -> global-batch loss; on_outputs (the
    metrics' update) gets the step's (y, y_pred, w).

    `loss_fn(y, y_pred, w)` is one micro-batch's share of the global loss."""

    @tf.function
    def train_step(iterator):
        losses, replica_grads, outputs = [], [], []
        for r, replica in enumerate(replicas):
            with tf.name_scope(INPUT):
                # R consecutive per-replica batches make one global step
                x_parts, y_parts, w_parts = split_microbatches_of(next(iterator), microbatches)
            replica_losses, grads, predictions = run_replica(
                replica.stages, x_parts, y_parts, w_parts, loss_fn, schedule, r)
            losses.extend(replica_losses)
            replica_grads.append(grads)
            outputs.extend(zip(y_parts, predictions, w_parts))
        apply_gradients(replicas, replica_grads, clip)
        if on_outputs is not None:
            on_outputs(tuple(_concat(column) for column in zip(*outputs)))
        return tf.add_n(losses)

    return train_step


def make_eval_step(replicas, loss_fn, on_outputs=None):
    """Returns a tf.function step(iterator) -> the global batch's loss; on_outputs
    gets (y, y_pred, w). `loss_fn(y, y_pred, w)` is one replica batch's share."""

    @tf.function
    def eval_step(iterator):
        losses, outputs = [], []
        for replica in replicas:
            x, y, w = step_math.split_batch(next(iterator))
            h = x
            for stage in replica.stages:
                with tf.device(stage.device):
                    h = run_stage(stage, h, stage is replica.stages[-1], training=False)
            with tf.device(replica.stages[-1].device):
                losses.append(loss_fn(y, h, w))
            outputs.append(step_math.outputs_of(y, h, w))
        if on_outputs is not None:
            on_outputs(tuple(_concat(column) for column in zip(*outputs)))
        return tf.add_n(losses)

    return eval_step
