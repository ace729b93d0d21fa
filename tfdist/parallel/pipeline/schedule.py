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
activation (forward) and its gradient (backward). A schedule is, per device,
the order of its forward and backward ops (device_orders); each op gets a
control dependency on the device's previous op (the stage's, with one stage
per device), which is what imposes the order on TensorFlow's dataflow executor
(across devices, ops run as soon as their inputs arrive).
When several tensors cross a cut (partition.py), each is sent forward, and the
gradient of each float computed one is sent back; integer and boolean tensors
(a padding mask) and model inputs get none. Orders:
- gpipe: all M forwards, then all M backwards (GPipe's flush); a stage holds
  the activations of all M micro-batches.
- 1f1b: S-k-1 warm-up forwards, then one forward / one backward (PipeDream-
  flush); stage k holds at most min(S-k, M) micro-batches' activations.
- interleaved_1f1b (--virtual_stages=V): Megatron-LM's interleaved 1F1B. The
  model is cut into S*V chunks, chunk c on device c mod S; a device's order
  mixes its V chunks (interleaved_order), so the control dependencies chain the
  ops of a DEVICE, not of a chunk. Bubble (S-1)/(V*M) of the ideal step, for
  more held activations: device d holds up to min(2(S-d-1) + (V-1)S + 1, VM)
  chunk micro-batches (each 1/V of a stage), all VM when M == S (Megatron runs
  all forwards first then). M must be a multiple of S; V=1 is exactly 1f1b.
- zero_bubble (ZB-H1, Qi et al. 2023): the backward split into B (the gradient
  for the stage's inputs, what goes back to stage k-1) and W (the gradient for
  its variables); 1F1B's order with stage k deferring k W ops into the bubble
  at the end (zero_bubble_order). A micro-batch is held from F to W: min(S, M)
  on every stage, the peak 1F1B has on stage 0. Bubble (S-1)(F+B-W)/(M(F+B+W))
  of the ideal, (S-1)/(3M) when F, B and W cost the same.
  How B and W share one backward: B builds ONE tape.gradient for the inputs and
  the variables; the ops only the variable gradients need (the dW matmuls, bias
  and embedding gradients) get, when W's turn comes, a control input from the
  op before W on the device, so the executor runs them in W's slot. Nothing is
  computed twice: B + W are exactly the fused backward (tests count the FLOPs).
Every schedule runs each chunk's backward (or W) ops in micro-batch order, so
all give the same numbers. peak_live and simulate (pure Python) replay a
schedule's orders and report what each device holds and the bubble.

Hybrid: with R replicas the stage-k gradient sums of all replicas are added on
replica 0's stage-k device and every replica's stage-k optimizer applies that
same sum, so the copies stay identical (same ops on the same values).

Names: boundary tensors go through `tf.identity` ops named BOUNDARY_ACTIVATION
and BOUNDARY_GRADIENT (and a replica's accumulated gradients STAGE_GRADIENT,
their sum over replicas GRADIENT_SUM, the micro-batch loss MICROBATCH_LOSS;
the batch is read and split under the name scope INPUT), which lets tests
recognise every cross-device edge of the placed graph.
"""

import collections
import dataclasses
from typing import Dict, List, Sequence, Tuple

import tensorflow as tf

from tfdist import config as config_lib
from tfdist.errors import require
from tfdist.train import sparse_rows, step as step_math

BOUNDARY_ACTIVATION = "pipeline_boundary_activation"
BOUNDARY_GRADIENT = "pipeline_boundary_gradient"
STAGE_GRADIENT = "pipeline_stage_gradient"
GRADIENT_SUM = "pipeline_replica_gradient_sum"
MICROBATCH_LOSS = "pipeline_microbatch_loss"
INPUT = "pipeline_input"
FORWARD, BACKWARD = "forward", "backward"
BACKWARD_INPUT, BACKWARD_WEIGHT = "backward_input", "backward_weight"   # zero_bubble's B, W


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


def zero_bubble_order(num_stages: int, microbatches: int, stage: int) -> List[Tuple[str, int]]:
    """ZB-H1: 1F1B's order with the backward split into B and W, stage k deferring k W ops.

    Stage k runs min(S-k, M) forwards (1F1B's warm-up and its first forward), then per
    micro-batch B, the oldest deferred W once k are waiting, and the next forward; the
    k deferred W ops end the step, in the bubble where stage k waits for stage 0 in 1F1B
    (the B chain back to stage 0 no longer waits for W on the way). W runs in
    micro-batch order (the same sums); each stage holds min(S, M) micro-batches."""
    forwards = min(num_stages - stage, microbatches)
    order = [(FORWARD, m) for m in range(forwards)]
    waiting = collections.deque()
    for b in range(microbatches):
        order.append((BACKWARD_INPUT, b))
        waiting.append(b)
        if len(waiting) > stage:
            order.append((BACKWARD_WEIGHT, waiting.popleft()))
        if forwards < microbatches:
            order.append((FORWARD, forwards))
            forwards += 1
    return order + [(BACKWARD_WEIGHT, m) for m in waiting]


# Per-stage orders of (FORWARD | BACKWARD, micro-batch): the fused-backward schedules with one
# chunk per device (tests/test_pipeline_parallel.py and the Colab notebook iterate these two).
SCHEDULES = {"gpipe": gpipe_order, "1f1b": one_f_one_b_order}
_PER_STAGE = dict(SCHEDULES, zero_bubble=zero_bubble_order)


def interleaved_order(num_stages: int, microbatches: int, device: int,
                      virtual_stages: int) -> List[Tuple[str, int, int]]:
    """Megatron-LM's interleaved 1F1B on one device: [(kind, chunk, micro-batch)].

    As Megatron's forward_backward_pipelining_with_interleaving: the device's i-th
    forward is for its local chunk j = (i mod SV) // S, micro-batch (i // SV) * S + i mod S
    (groups of S micro-batches go through one chunk, then the next); its i-th backward
    is for local chunk V-1-j of the same micro-batch. Warm-up: 2(S-d-1) + (V-1)S forwards,
    or all VM when M == S; then one forward, one backward; then the rest of the backwards.
    Local chunk j of device d is model chunk j*S + d. V=1 is 1F1B (Megatron's
    non-interleaved schedule)."""
    if virtual_stages == 1:
        return [(kind, device, m)
                for kind, m in one_f_one_b_order(num_stages, microbatches, device)]
    config_lib.validate_pipeline_schedule(config_lib.INTERLEAVED, num_stages, microbatches,
                                          virtual_stages)
    total, group = microbatches * virtual_stages, num_stages * virtual_stages
    if microbatches == num_stages:
        warmup = total
    else:
        warmup = min((num_stages - device - 1) * 2 + (virtual_stages - 1) * num_stages, total)

    def op(kind, i):
        local = (i % group) // num_stages
        if kind != FORWARD:
            local = virtual_stages - 1 - local
        return kind, local * num_stages + device, (i // group) * num_stages + i % num_stages

    order = [op(FORWARD, i) for i in range(warmup)]
    for i in range(total - warmup):
        order += [op(FORWARD, warmup + i), op(BACKWARD, i)]
    return order + [op(BACKWARD, i) for i in range(total - warmup, total)]


def device_orders(schedule: str, num_stages: int, microbatches: int,
                  virtual_stages: int = 1) -> List[List[Tuple[str, int, int]]]:
    """Per device d < S, its ops in order: (kind, model chunk, micro-batch). Every schedule
    but interleaved_1f1b has one chunk per device (chunk d on device d)."""
    if schedule == config_lib.INTERLEAVED:
        return [interleaved_order(num_stages, microbatches, d, virtual_stages)
                for d in range(num_stages)]
    config_lib.validate_pipeline_schedule(schedule, num_stages, microbatches, virtual_stages)
    require(schedule in _PER_STAGE, f"Unknown --pipeline_schedule {schedule!r}. Valid choices: "
                                    f"{', '.join(config_lib.PIPELINE_SCHEDULES)}.")
    return [[(kind, d, m) for kind, m in _PER_STAGE[schedule](num_stages, microbatches, d)]
            for d in range(num_stages)]


def _releases(kind: str, schedule_kinds: set) -> bool:
    """The op after which a chunk no longer holds a micro-batch's activations."""
    return kind == BACKWARD_WEIGHT or (kind == BACKWARD and BACKWARD_WEIGHT not in schedule_kinds)


@dataclasses.dataclass
class ScheduleStats:
    """What simulate() found: per device the most chunk micro-batches held at once
    (forward built, last backward op not yet), and with op costs the step's timing."""
    peak_live: List[int]
    makespan: float          # time of the last op's end, each device running its order
    work: float              # busy time per device (equal on every device)

    @property
    def bubble(self) -> float:
        """Idle time as a fraction of the ideal (bubble-free) step: (makespan - work) / work."""
        return (self.makespan - self.work) / self.work


def simulate(schedule: str, num_stages: int, microbatches: int, virtual_stages: int = 1,
             costs: Sequence[float] = (1.0, 1.0, 1.0)) -> ScheduleStats:
    """Replays a schedule in pure Python as the step runs it: each device its order, an
    op starting when the device is free and its inputs exist (free communication).

    costs = (F, B, W) of one STAGE per micro-batch (a chunk costs 1/V of that); a fused
    backward costs B + W. Raises RuntimeError if the orders deadlock."""
    f, b, w = (c / virtual_stages for c in costs)
    duration = {FORWARD: f, BACKWARD: b + w, BACKWARD_INPUT: b, BACKWARD_WEIGHT: w}
    orders = device_orders(schedule, num_stages, microbatches, virtual_stages)
    kinds = {kind for order in orders for kind, _, _ in order}
    chunks = num_stages * virtual_stages
    done = {}           # ("act" | "grad" | "weight", chunk, m) -> finish time
    clock = [0.0] * num_stages
    live, peak = [0] * num_stages, [0] * num_stages
    position = [0] * num_stages
    while any(position[d] < len(orders[d]) for d in range(num_stages)):
        progressed = False
        for d in range(num_stages):
            while position[d] < len(orders[d]):
                kind, c, m = orders[d][position[d]]
                needs = _needs(kind, c, m, chunks)
                if any(key not in done for key in needs):
                    break
                start = max([clock[d]] + [done[key] for key in needs])
                clock[d] = start + duration[kind]
                done[_makes(kind, c, m)] = clock[d]
                if kind == FORWARD:
                    live[d] += 1
                    peak[d] = max(peak[d], live[d])
                elif _releases(kind, kinds):
                    live[d] -= 1
                position[d] += 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"pipeline schedule {schedule!r} deadlocks at "
                               f"{[order[p:p + 1] for order, p in zip(orders, position)]}")
    return ScheduleStats(peak, max(clock), microbatches * sum(costs))


def _needs(kind: str, c: int, m: int, chunks: int) -> list:
    if kind == FORWARD:
        return [("act", c - 1, m)] if c else []
    if kind == BACKWARD_WEIGHT:
        return [("grad", c, m)]
    return [("act", c, m)] + ([("grad", c + 1, m)] if c < chunks - 1 else [])


def _makes(kind: str, c: int, m: int) -> tuple:
    return ("act" if kind == FORWARD else "weight" if kind == BACKWARD_WEIGHT else "grad", c, m)


def peak_live(schedule: str, num_stages: int, microbatches: int,
              virtual_stages: int = 1) -> List[int]:
    """Per device, the most chunk micro-batches whose forward activations it holds at once."""
    return simulate(schedule, num_stages, microbatches, virtual_stages).peak_live


def live_bound(schedule: str, num_stages: int, microbatches: int, virtual_stages: int = 1,
               device: int = 0) -> int:
    """Each schedule's stated activation-memory bound on `device`, in chunk micro-batches
    (tests hold peak_live to it)."""
    S, M, V, d = num_stages, microbatches, virtual_stages, device
    if schedule == "gpipe":
        return M
    if schedule == "zero_bubble":
        return min(S, M)
    if schedule == config_lib.INTERLEAVED and V > 1:
        return V * M if M == S else min(2 * (S - d - 1) + (V - 1) * S + 1, V * M)
    return min(S - d, M)   # 1f1b, and interleaved_1f1b with V = 1


class _ReplicaRun:
    """The tensors of one replica's step, filled in as the schedule's ops are built.

    act[(k, m)] is the list of tensors chunk k sends for micro-batch m (the
    micro-batch loss, alone, for the last chunk; the features for k = -1) and
    grad[(k, m)] the gradients coming back for them (None where none flows).
    A chunk is a stage, or with virtual stages one of a device's V chunks."""

    def __init__(self, stages, x_parts, y_parts, w_parts, loss_fn, replica):
        self.stages, self.y_parts, self.w_parts, self.replica = stages, y_parts, w_parts, replica
        self.loss_fn = loss_fn
        self.predictions = {}   # m -> the last stage's output (for the metrics)
        num_stages = len(stages)
        self.act = {(-1, m): x for m, x in enumerate(x_parts)}
        self.grad = {(num_stages - 1, m): None for m in range(len(x_parts))}  # d loss/d act
        self.tapes = {}
        self.deferred = {}      # (k, m) -> (variable gradients, the ops only they need): B ran
        self.split = {}         # (k, m) -> (B's ops, W's ops) of zero_bubble's one backward
        self.gates = {}         # (k, m) -> the ops W's ops were ordered after
        self.sums = [None] * num_stages     # per chunk: variable gradients, summed over m
        self.previous = {}      # per DEVICE: outputs of its last scheduled op
        self.live = collections.Counter()   # per device: micro-batches held (built F, not
        self.peak = collections.Counter()   # yet the op that frees them); and the most

    def ready(self, kind: str, k: int, m: int) -> bool:
        if kind == FORWARD:
            return (k - 1, m) in self.act
        if kind == BACKWARD_WEIGHT:
            return (k, m) in self.deferred
        return (k, m) in self.act and (k, m) in self.grad

    def build(self, kind: str, k: int, m: int) -> None:
        stage = self.stages[k]
        scope = f"replica_{self.replica}_stage_{k}_{kind}"
        build = {FORWARD: self._forward, BACKWARD: self._backward,
                 BACKWARD_INPUT: self._backward_input, BACKWARD_WEIGHT: self._backward_weight}
        # The control dependency on the device's previous op is what imposes the order.
        with tf.device(stage.device), tf.name_scope(scope), \
                tf.control_dependencies(self.previous.get(stage.device, [])):
            outputs = build[kind](stage, m)
        self.previous[stage.device] = outputs
        if kind == FORWARD:
            self.live[stage.device] += 1
            self.peak[stage.device] = max(self.peak[stage.device], self.live[stage.device])
        elif kind in (BACKWARD, BACKWARD_WEIGHT):
            self.live[stage.device] -= 1

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

    def _gradients(self, stage, m: int) -> Tuple[list, list]:
        """(variable gradients, input gradients) of chunk k for micro-batch m: one
        backward through its tape, from the gradients that came back for what it sent."""
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
        return grads[:len(stage.variables)], grads[len(stage.variables):]

    def _accumulate(self, stage, var_grads) -> None:
        # Backward (or W) ops run in micro-batch order in every schedule: the same sums.
        k = stage.index
        self.sums[k] = var_grads if self.sums[k] is None else [
            accumulate(a, b) for a, b in zip(self.sums[k], var_grads)]

    def _sent(self, stage, m: int) -> list:
        """The input gradients chunk k sends back for micro-batch m (once computed)."""
        return [g for g in self.grad.get((stage.index - 1, m)) or [] if g is not None]

    def _backward(self, stage, m: int) -> list:
        var_grads, input_grads = self._gradients(stage, m)
        self._accumulate(stage, var_grads)
        if stage.index > 0:
            self.grad[(stage.index - 1, m)] = self._send_back(stage, input_grads)
        return self._sent(stage, m) or _dense(var_grads) or self.previous.get(stage.device, [])

    def _backward_input(self, stage, m: int) -> list:
        """zero_bubble's B: the whole backward is built once, here; what only the variable
        gradients need is recorded and held back until W (_backward_weight)."""
        graph = None if tf.executing_eagerly() else tf.compat.v1.get_default_graph()
        before = len(graph.get_operations()) if graph is not None else 0
        var_grads, input_grads = self._gradients(stage, m)
        if stage.index > 0:
            self.grad[(stage.index - 1, m)] = self._send_back(stage, input_grads)
        sent = self._sent(stage, m)
        created = [] if graph is None else graph.get_operations()[before:]
        b_ops, held = _split_ops(_flat(var_grads), sent, created)
        self.split[(stage.index, m)] = (b_ops, held)
        self.deferred[(stage.index, m)] = (var_grads, held)
        # Nothing sent (chunk 0, or only integer inputs): B has no work; keep the chain.
        return sent or self.previous.get(stage.device, [])

    def _backward_weight(self, stage, m: int) -> list:
        """zero_bubble's W: the variable-gradient ops built by B start after the device's
        previous op, and the micro-batch's gradients join the sums (micro-batch order)."""
        var_grads, held = self.deferred.pop((stage.index, m))
        gate = [t.op for t in self.previous.get(stage.device, [])]
        self.gates[(stage.index, m)] = gate
        for op in _first(held):
            # Private, no public API to order an op after its creation (tf.control_dependencies
            # only covers ops created inside it); canary: test_pipeline_schedules.py::
            # test_add_control_input_canary.
            op._add_control_inputs(gate)
        self._accumulate(stage, var_grads)
        return _dense(var_grads) or self.previous.get(stage.device, [])   # no variables: the chain

    def _send_back(self, stage, input_grads) -> list:
        """One entry per tensor stage k-1 sent: the gradient, or None for an integer one."""
        grads = iter(input_grads)
        return [tf.identity(next(grads), name=BOUNDARY_GRADIENT) if wanted else None
                for wanted in stage.differentiable_inputs]


def _dense(grads) -> list:
    return [g.values if isinstance(g, tf.IndexedSlices) else g for g in grads]


def _flat(grads) -> list:
    out = []
    for g in grads:
        out += [g.values, g.indices] if isinstance(g, tf.IndexedSlices) else [g]
    return out


def _split_ops(weight_tensors, input_tensors, new_ops) -> Tuple[list, list]:
    """(B's, W's) ops among `new_ops` (those one tape.gradient created): what
    `input_tensors` (which B sends now) need, and what only `weight_tensors` need."""
    new = set(new_ops)

    def ancestors(tensors):
        seen, stack = set(), [t.op for t in tensors]
        while stack:
            op = stack.pop()
            if op in seen or op not in new:
                continue
            seen.add(op)
            stack += [t.op for t in op.inputs] + list(op.control_inputs)
        return seen

    for_inputs = ancestors(input_tensors)
    weight_only = ancestors(weight_tensors) - for_inputs
    return ([op for op in new_ops if op in for_inputs],
            [op for op in new_ops if op in weight_only])


def _first(ops) -> list:
    """The ops of `ops` that no other one of them feeds: gating these gates all of them."""
    among = set(ops)
    return [op for op in ops if not any(t.op in among for t in op.inputs)
            and not any(c in among for c in op.control_inputs)]


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


def run_replica(stages, x_parts, y_parts, w_parts, loss_fn, schedule: str, replica: int = 0,
                virtual_stages: int = 1, stats: Dict = None):
    """Builds one replica's forward and backward ops in schedule order.

    `stages` are the S * V chunks (V = virtual_stages; chunk c on device c mod S).
    Returns (micro-batch losses, per chunk its variable gradients summed over m,
    the last stage's outputs per micro-batch). `stats`, if given, receives
    "peak_live": per device (index d < S) the most micro-batches whose activations
    were held at once while the ops were built (what simulate() predicts).
    """
    run = _ReplicaRun(stages, x_parts, y_parts, w_parts, loss_fn, replica)
    num_stages, microbatches = len(stages), len(x_parts)
    num_devices = num_stages // virtual_stages
    pending = device_orders(schedule, num_devices, microbatches, virtual_stages)
    while any(pending):
        progressed = False
        for d in range(num_devices):  # each device builds its next op once its inputs exist
            while pending[d] and run.ready(*pending[d][0]):
                run.build(*pending[d].pop(0))
                progressed = True
        if not progressed:
            raise RuntimeError(f"pipeline schedule {schedule!r} deadlocked: {pending}")
    if stats is not None:
        stats["peak_live"] = [run.peak[stages[d].device] for d in range(num_devices)]
        stats["split"], stats["gates"] = run.split, run.gates
    losses = [run.act[(num_stages - 1, m)][0] for m in range(microbatches)]
    grads = []
    for stage, sums in zip(stages, run.sums):
        with tf.device(stage.device):
            # Named so the hybrid's transfer of it to replica 0 is recognisable.
            grads.append([_named(resolve(g), STAGE_GRADIENT) for g in sums])
    return losses, grads, [run.predictions[m] for m in range(microbatches)]


def _zeros_if_none(grad, source):
    return tf.zeros_like(source) if grad is None else grad  # unused on this path


def accumulate(total, grad):
    """total + grad over micro-batches and replicas, in batch order.

    Dense gradients are summed as they come (one running sum per variable). Sparse
    ones (tf.IndexedSlices, embedding lookups) are collected as parts and combined
    once, by `resolve`: Keras' optimizers apply IndexedSlices row by row (Adam's
    second moment squares each row before duplicate rows add up), so one device's
    rows must be rebuilt, not their dense sum (tfdist/train/sparse_rows.py)."""
    if any(isinstance(g, (SparseParts, tf.IndexedSlices)) for g in (total, grad)):
        return SparseParts(_parts(total) + _parts(grad))
    return total + grad


def _parts(grad) -> list:
    return list(grad) if isinstance(grad, SparseParts) else [grad]


class SparseParts(list):
    """The IndexedSlices gradients of one variable, one per micro-batch and replica."""


def resolve(total):
    """A gradient sum ready to apply: sparse parts combined as one device's rows."""
    return sparse_rows.add_parts(total) if isinstance(total, SparseParts) else total


def _sum(parts):
    """Sum of one gradient over replicas, in replica order."""
    total = parts[0]
    for part in parts[1:]:
        total = accumulate(total, part)
    return resolve(total)


def apply_gradients(replicas, replica_grads, clip=None) -> None:
    """Sums stage-k gradients over replicas on replica 0's device; every copy applies the sum.

    `clip(all stages' gradients)`, if given, clips them as the user's optimizer would
    (clipnorm, clipvalue, global_clipnorm: the global norm spans every stage), and the
    stage optimizers, built with clipping off, apply the result."""
    totals = []
    for k in range(len(replicas[0].stages)):
        per_replica = [grads[k] for grads in replica_grads]
        with tf.device(replicas[0].stages[k].device):
            totals.append([resolve(g) for g in per_replica[0]] if len(per_replica) == 1 else [
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
                    on_outputs=None, clip=None, virtual_stages: int = 1, loss_device=None):
    """Returns a tf.function step(iterator) -> global-batch loss; on_outputs (the
    metrics' update) gets the step's (y, y_pred, w).

    `loss_fn(y, y_pred, w)` is one micro-batch's share of the global loss; the shares
    are summed on `loss_device` (see summed_on)."""

    @tf.function
    def train_step(iterator):
        losses, replica_grads, outputs = [], [], []
        for r, replica in enumerate(replicas):
            with tf.name_scope(INPUT):
                # R consecutive per-replica batches make one global step
                x_parts, y_parts, w_parts = split_microbatches_of(next(iterator), microbatches)
            replica_losses, grads, predictions = run_replica(
                replica.stages, x_parts, y_parts, w_parts, loss_fn, schedule, r,
                virtual_stages)
            losses.extend(replica_losses)
            replica_grads.append(grads)
            outputs.extend(zip(y_parts, predictions, w_parts))
        apply_gradients(replicas, replica_grads, clip)
        if on_outputs is not None:
            on_outputs(tuple(_concat(column) for column in zip(*outputs)))
        return summed_on(loss_device, losses)

    return train_step


def summed_on(device, losses):
    """The sum of `losses`, computed on `device` when one is given.

    Why: the losses are computed on the last stage's device, and a step's result lives
    where the op that made it ran. In the cross-worker pipeline that is a stage worker,
    which keeps about 3 KB of every result it held for good (TensorFlow's remote
    handles; measured with 2 workers, mlp, batch 64: the serving worker grew 48 KB per
    evaluation of 16 batches, and 3.1 KB a training step at --microbatches=1; summed on
    the driver, 0.3 KB per evaluation and 0.04 KB a step). The cross-worker pipeline
    sums on its driver's host. The identity is what moves it: tf.add_n of one tensor
    (one micro-batch, or the eval step's one replica) is that tensor, no op at all.
    """
    if device is None:
        return tf.add_n(losses)
    with tf.device(device):
        return tf.identity(tf.add_n(losses))


def make_eval_step(replicas, loss_fn, on_outputs=None, loss_device=None):
    """Returns a tf.function step(iterator) -> the global batch's loss; on_outputs
    gets (y, y_pred, w). `loss_fn(y, y_pred, w)` is one replica batch's share; the
    shares are summed on `loss_device` (see summed_on)."""

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
        return summed_on(loss_device, losses)

    return eval_step
