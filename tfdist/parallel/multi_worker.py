"""multi_worker_mirrored: data parallelism across processes (TF_CONFIG or Slurm).

A peer of `mirrored`: the same StrategyParallelism step, over
tf.distribute.MultiWorkerMirroredStrategy. What this module adds:
- the cluster comes from a validated TF_CONFIG, or from Slurm's variables;
- --collective / --bytes_per_pack become CommunicationOptions; --collective_timeout
  bounds the rendezvous in which workers wait for each other to start
  (tfdist.rendezvous) and, through one watchdog thread per process
  (tfdist.parallel.watchdog), every step, eval step and agreement between the
  workers, so nothing hangs (TF's own per-collective timeout costs a thread per
  collective, which a long job runs out of);
- on a CPU host, each worker's simulated CPUs become replicas (TF would use one);
- --collective=tcp sums gradients with tfdist's own TCP ring (tcp_ring.py)
  instead of TF's gRPC collectives, which are slow on CPU; --collective=shm
  sums them through shared memory when every worker is on this host (shm_ring.py);
  --collective=mpi sums them with MPI_Allreduce, and forms the cluster from the
  MPI world that mpirun or srun started (mpi.py);
- --collective=fastest, the default, picks the fastest exact one for the layout it
  runs on (choose_collective) and logs which and why;
- Keras `fit` is repaired for this strategy (keras_fit_fix).
TensorFlow allows one such strategy per process, so it is built once and reused.
"""

import contextlib
import dataclasses
import importlib.util
import logging
import os
import re

import numpy as np
import tensorflow as tf

from tfdist import cluster, devices, rendezvous
from tfdist.errors import ClusterError, UsageError, require
from tfdist.parallel import mpi, ring_auth, shm_ring, tcp_ring, watchdog
from tfdist.parallel.strategy import StrategyParallelism
from tfdist.train import keras_fixes, sparse_rows, step as step_math

log = logging.getLogger("tfdist")
COLLECTIVES = {
    "auto": tf.distribute.experimental.CommunicationImplementation.AUTO,
    "ring": tf.distribute.experimental.CommunicationImplementation.RING,
    "nccl": tf.distribute.experimental.CommunicationImplementation.NCCL,
    # tcp: gradients go over tfdist's ring; TF's own (rare) collectives stay on auto
    "tcp": tf.distribute.experimental.CommunicationImplementation.AUTO,
    "shm": tf.distribute.experimental.CommunicationImplementation.AUTO,   # same, on one host
    "mpi": tf.distribute.experimental.CommunicationImplementation.AUTO,   # same, MPI_Allreduce
}
# tfdist's step hands the gradients to its own all-reduce (ring_replica_step)
TFDIST_COLLECTIVES = ("tcp", "shm", "mpi")
RING_COLLECTIVES = ("tcp", "shm")     # ... over tfdist's authenticated TCP ring
_built = {}  # options -> the process's one MultiWorkerMirroredStrategy
PEER_FAILURES = (tf.errors.UnavailableError, tf.errors.AbortedError,
                 tf.errors.DeadlineExceededError, tf.errors.CancelledError)


def cluster_from_environment() -> cluster.TFConfig:
    """The validated cluster: TF_CONFIG if set, else Slurm's variables, else an error."""
    if os.environ.get("TF_CONFIG"):
        tf_config = cluster.parse_tf_config(os.environ["TF_CONFIG"])
    elif "SLURM_PROCID" in os.environ:
        task = cluster.from_slurm_env(os.environ)
        tf_config = cluster.parse_tf_config(cluster.build_tf_config(task.hosts, task.index))
    else:
        under_mpi = (f" This process was started by {mpi.launcher_of(os.environ)}: add "
                     f"--collective=mpi to form the cluster from the MPI world."
                     if mpi.launcher_of(os.environ) else "")
        raise UsageError(
            "--strategy=multi_worker_mirrored needs a cluster: set TF_CONFIG (see "
            "`tfdist tf-config`), run under Slurm's srun, or start the workers with "
            "`tfdist launch --workers N -- python -m experiments.train ...`." + under_mpi)
    if tf_config.rank is None:
        raise UsageError(f"This task is {tf_config.task_type}:{tf_config.task_index}; "
                         f"only chief and worker tasks train under multi_worker_mirrored.")
    return tf_config


def resolver_for(tf_config: cluster.TFConfig, num_gpus: int):
    spec = tf.train.ClusterSpec(tf_config.cluster)
    return tf.distribute.cluster_resolver.SimpleClusterResolver(
        spec, task_type=tf_config.task_type, task_id=tf_config.task_index,
        rpc_layer=tf_config.rpc_layer or "grpc", num_accelerators={"GPU": num_gpus})


def communication_options(config) -> tf.distribute.experimental.CommunicationOptions:
    """No timeout_seconds on purpose: with one, every TF collective starts a thread
    that sleeps that long (measured on TF 2.21: ~4 new threads per step of a bare
    MWMS loop, until the process cannot start threads). The watchdog bounds the
    waits instead (tfdist.parallel.watchdog)."""
    return tf.distribute.experimental.CommunicationOptions(
        bytes_per_pack=config.bytes_per_pack,
        implementation=COLLECTIVES[config.collective])


@contextlib.contextmanager
def simulated_cpu_replicas(count: int):
    """Makes each worker's `count` simulated CPUs its local replicas.

    On a host without accelerators TF's CollectiveAllReduceExtended always uses
    one CPU device per worker (its `_initialize_local_devices`, TODO b/126786766
    upstream), so `--devices_per_worker` could not be rehearsed. This overrides
    that private method while the strategy is built. Checked by
    tests/test_upstream_canaries.py.
    """
    from tensorflow.python.distribute import collective_all_reduce_strategy as cars
    extended = cars.CollectiveAllReduceExtended
    original = extended._initialize_local_devices

    def cpu_devices(self, cluster_resolver, worker_device):
        local, kind = original(self, cluster_resolver, worker_device)
        if kind != "CPU" or count <= 1:
            return local, kind
        return tuple(f"{worker_device}/device:CPU:{i}" for i in range(count)), "CPU"

    extended._initialize_local_devices = cpu_devices
    try:
        yield
    finally:
        extended._initialize_local_devices = original


def build_strategy(config, tf_config: cluster.TFConfig, local_devices):
    # TF's options, not the flag: tcp and shm build the same strategy (auto), so one reuses it.
    key = (COLLECTIVES[config.collective].name.lower(), config.bytes_per_pack,
           config.collective_timeout, tuple(local_devices))
    if key in _built:
        return _built[key]
    if _built:
        raise UsageError("TensorFlow allows one MultiWorkerMirroredStrategy per process; this "
                         f"process already built one with other options ({next(iter(_built))}).")
    # A taken port or a peer that never starts fails here, in Python, with a
    # message; inside TensorFlow either would hang (see tfdist.rendezvous).
    rendezvous.wait_for_peers(tf_config, config.collective_timeout)
    cluster.announce_grpc_server(tf_config.worker_addresses[tf_config.rank],
                                 "multi_worker_mirrored")
    gpus = sum(1 for d in local_devices if "gpu" in d)
    with simulated_cpu_replicas(0 if gpus else len(local_devices)):
        strategy = tf.distribute.MultiWorkerMirroredStrategy(
            cluster_resolver=resolver_for(tf_config, gpus),
            communication_options=communication_options(config))
    _built[key] = strategy
    return strategy


def peer_failure_summary(message: str) -> str:
    """The lines of a TF error that say which task failed (not where in the graph)."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    telling = [i for i, line in enumerate(lines)
               if re.search(r"unhealthy|aborted|timed out|deadline|heartbeat|TcpRingError",
                            line, re.I)]
    chosen = lines[telling[0]:telling[0] + 2] if telling else lines[-1:]
    # A numpy_function's error carries the Python traceback's first line: not for users.
    return re.split(r"\s*Traceback \(most recent call last\)", " ".join(chosen))[0][:400]


class MultiWorkerParallelism(StrategyParallelism):
    """StrategyParallelism whose chief is worker 0 (non-chiefs write to scratch dirs)."""

    def __init__(self, strategy, local_devices, tf_config: cluster.TFConfig,
                 collective_timeout: float, batch_statistics: str = "global"):
        super().__init__("multi_worker_mirrored", strategy, local_devices, batch_statistics)
        self.tf_config = tf_config
        self.is_chief = tf_config.is_chief
        self.ring = None           # a TcpRing with --collective=tcp or shm (connect_ring)
        self.reducer = None        # what sums the gradients: the ring, shared memory on it, or MPI
        self.summer = None         # what sums agreements: the ring or MPI (None: TF's collectives)
        self._sum_fn = None
        self._setup_error = None   # a UsageError/ClusterError met while tracing the step
        self.watchdog = watchdog.for_process(
            collective_timeout, f"worker {tf_config.rank} of {tf_config.num_workers}")

    def guard(self, what: str):
        return self.watchdog.guard(what)

    def _guarded(self, step_fn, what: str):
        """step_fn under the watchdog: a peer that never answers ends this process (exit 3)."""
        def with_setup_errors(iterator):
            try:
                return step_fn(iterator)
            except Exception:
                if self._setup_error is not None:   # raised while tracing: see _map_shared_memory
                    raise self._setup_error from None
                raise
        guarded = self.watchdog.guard_each_call(with_setup_errors, what)
        guarded.step_fn = step_fn   # the tf.function itself: tests read the ops it traced
        return guarded

    def make_train_step(self, model, optimizer, global_batch_size, jit_compile,
                        on_outputs=None):
        return self._guarded(self._make_unguarded_train_step(
            model, optimizer, global_batch_size, jit_compile, on_outputs), "a training step")

    def make_eval_step(self, model, on_outputs=None):
        if self.summer is None:
            return self._guarded(super().make_eval_step(model, on_outputs), "an eval step")
        return self._guarded(self._summer_eval_step(model, on_outputs), "an eval step")

    def _summer_eval_step(self, model, on_outputs):
        """The eval step with its loss summed by tfdist's summer (the ring, or MPI), as
        the train step's is. strategy.reduce would run a TensorFlow all-reduce over gRPC
        whatever --collective says, and each leaks in TensorFlow (tensorflow#42616):
        about 1.2 KB per eval step here (a 2-worker fit with 40 validation batches grew
        120 KB an epoch with it, 73 KB without; docs/benchmarks.md, Soak)."""
        replica_step, summer = step_math.replica_eval_step(model), self.summer

        def total(loss):
            return summer.all_reduce(np.reshape(loss, [1]).astype(np.float32)).reshape(())

        @tf.function
        def eval_step(iterator):
            loss = self._run_local(replica_step, iterator, on_outputs)
            summed = tf.numpy_function(total, [loss], tf.float32, stateful=True)
            return tf.ensure_shape(summed, [])

        return eval_step

    def _run_local(self, replica_step, iterator, on_outputs):
        """Traced inside a step: replica_step on the next batch, on_outputs given its
        outputs; its loss. One local replica (check_tcp_ring_config), so its values are
        this worker's."""
        loss, outputs = self.strategy.experimental_local_results(
            self.strategy.run(replica_step, args=(next(iterator),)))[0]
        if on_outputs is not None:
            on_outputs(outputs)
        return loss

    def _make_unguarded_train_step(self, model, optimizer, global_batch_size, jit_compile,
                                   on_outputs):
        if self.reducer is None:
            return super().make_train_step(model, optimizer, global_batch_size, jit_compile,
                                           on_outputs)
        # Shared memory is mapped while the step is traced (when the summed buffer's
        # shapes, sparse gradients' included, are known), before anything runs.
        # Plain Python, not converted: autograph would try (and warn about) os.path.isdir.
        on_trace = (tf.autograph.experimental.do_not_convert(self._map_shared_memory)
                    if isinstance(self.reducer, shm_ring.SharedMemoryAllReduce) else None)
        replica_step = ring_replica_step(self.reducer, model, optimizer, jit_compile,
                                         self.tf_config.rank, self.tf_config.num_workers,
                                         on_trace, self.accumulation_steps)

        @tf.function
        def train_step(iterator):
            # The ring summed the loss too: every worker holds the global value.
            return self._run_local(replica_step, iterator, on_outputs)

        return train_step

    def _map_shared_memory(self, shapes, dtype) -> None:
        """The gradients' regions, before training: a full /dev/shm is a usage error here,
        not a failed step (a peer that fails to map ends this worker as a cluster error).
        This runs while the step is traced, where autograph would wrap the error in a
        StagingError with a traceback, so it is kept for _guarded to raise as it is."""
        try:
            self.reducer.prepare(shapes, dtype)
        except shm_ring.SharedMemoryUnavailable as error:
            self._setup_error = UsageError(f"--collective=shm: {error}")
        except tcp_ring.TcpRingError as error:
            self._setup_error = ClusterError(
                f"worker {self.tf_config.rank} of {self.tf_config.num_workers}: --collective=shm "
                f"could not share its memory with the other workers ({error}).")
        if self._setup_error is not None:
            raise self._setup_error

    def sum_over_replicas(self, value) -> np.ndarray:
        """Element-wise sum of a float32 value (scalar or vector) over every replica of
        the job, i.e. over the workers when each has one replica. Over tfdist's ring
        once it exists: the preemption check runs this at every step, and a gRPC
        all-reduce there cost 9% of the throughput benchmark's rate."""
        with self.watchdog.guard("an agreement between the workers"):
            return self._sum_unguarded(value)

    @property
    def workers_hold_own_outputs(self) -> bool:
        return self.tf_config.num_workers > 1

    def sum_over_workers(self, value) -> np.ndarray:
        """sum_over_replicas with each worker counted once, whatever its local replicas:
        only its first local replica contributes (exact, no division)."""
        with self.watchdog.guard("an agreement between the workers"):
            if self.summer is not None or self.num_replicas == self.tf_config.num_workers:
                return self._sum_unguarded(value)
            return self._first_replicas_sum(np.asarray(value, np.float32))

    def _first_replicas_sum(self, value) -> np.ndarray:
        if getattr(self, "_first_sum_fn", None) is None:
            strategy = self.strategy

            @tf.function
            def total(value):
                def mine():
                    context = tf.distribute.get_replica_context()
                    first = tf.equal(context.replica_id_in_sync_group % (
                        strategy.num_replicas_in_sync // self.tf_config.num_workers), 0)
                    return tf.where(first, value, tf.zeros_like(value))
                return strategy.reduce(tf.distribute.ReduceOp.SUM, strategy.run(mine), axis=None)

            self._first_sum_fn = total
        return self._first_sum_fn(tf.constant(np.asarray(value, np.float32))).numpy()

    def _sum_unguarded(self, value) -> np.ndarray:
        if self.summer is not None:
            value = np.asarray(value, np.float32)
            return self.summer.all_reduce(value.reshape(-1)).reshape(value.shape)
        if self._sum_fn is None:
            strategy = self.strategy

            @tf.function
            def total(value):
                per_replica = strategy.run(lambda: tf.identity(value))
                return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)

            self._sum_fn = total
        return self._sum_fn(tf.constant(np.asarray(value, np.float32))).numpy()

    def close(self) -> None:
        if isinstance(self.reducer, (shm_ring.SharedMemoryAllReduce, mpi.MpiAllReduce)):
            self.reducer.close()
        self.reducer = self.summer = None
        if self.ring is not None:
            self.ring.close()
            self.ring = None
        super().close()

    def any_process(self, flag: bool) -> bool:
        """A SUM all-reduce of the 0/1 flag (ReduceOp has no MAX), so every worker
        acts on the same step."""
        return bool(self.sum_over_replicas(1.0 if flag else 0.0) > 0)

    @contextlib.contextmanager
    def translate_failures(self):
        """A dead or stuck peer surfaces as one of these TF errors in the next
        collective (heartbeat loss, or --collective_timeout), or, in an agreement summed
        on the host outside a step (the metrics' sums at an epoch's end, the preemption
        check), as tfdist's ring error itself: say so plainly."""
        try:
            yield
        except (*PEER_FAILURES, tf.errors.UnknownError) as error:
            if isinstance(error, tf.errors.UnknownError) and "TcpRingError" not in error.message:
                raise
            raise self._peer_failure(type(error).__name__,
                                     peer_failure_summary(error.message)) from None
        except tcp_ring.TcpRingError as error:
            if isinstance(error, shm_ring.SharedMemoryUnavailable):   # a usage error, set-up time
                raise
            raise self._peer_failure(type(error).__name__, str(error)[:400]) from None

    def _peer_failure(self, kind: str, summary: str) -> ClusterError:
        return ClusterError(
            f"worker {self.tf_config.rank} of {self.tf_config.num_workers}: a peer died or "
            f"stopped answering during training ({kind}: {summary}). Check the other "
            f"workers' logs; `tfdist launch --max_restarts R` restarts the group.")


FASTEST = "fastest"


def choose_collective(config):
    """config with --collective=fastest replaced by the fastest exact collective for the
    layout this worker runs on (logged with the reason); any other value as it is.

    The rule, from what the planner measured (tfdist.plan.collectives.THROUGHPUT): GPUs
    sum over NCCL; tfdist's own all-reduces (2.1x TF's on one host) serve one CPU device
    per worker in tfdist's loop without float16 loss scaling (check_tcp_ring_config), as
    `mpi` when the user started the workers with MPI (mpi.chosen_launcher), as the
    fastest of tcp and shm when every worker is on this host; everything else keeps
    TensorFlow's own (auto), as do workers on several hosts, where tfdist's tcp ring needs
    $TFDIST_JOB_SECRET."""
    if config.collective != FASTEST:
        return config
    chosen, why = _fastest_collective(config)
    log.info("collective %s: %s (--collective=NAME picks another; auto is TensorFlow's own)",
             chosen, why)
    return dataclasses.replace(config, collective=chosen)


def _fastest_collective(config):
    from tfdist.plan import collectives as measured
    if config.simulate_devices <= 0 and config.num_gpus != 0 and devices.physical_gpus():
        return "nccl", "GPU workers"
    if config.simulate_devices > 1:
        return "auto", (f"{config.simulate_devices} devices per worker: tfdist's all-reduces "
                        f"sum one device per worker")
    if config.trainer != "loop":
        return "auto", f"--trainer={config.trainer}: tfdist's all-reduces serve its own loop"
    if config.mixed_precision == "mixed_float16":
        return "auto", "mixed_float16: its loss scale checks gradients before they are summed"
    launcher = mpi.chosen_launcher(os.environ)
    if launcher is not None:
        if importlib.util.find_spec("mpi4py") is None:
            return "auto", f"started by {launcher}, but mpi4py is not installed"
        return "mpi", f"started by {launcher}: MPI_Allreduce over its transport"
    hosts = [cluster.split_address(a)[0] for a in cluster_from_environment().worker_addresses]
    if not all(cluster.is_local_host(h) for h in hosts):
        return "auto", ("workers on several hosts (tfdist's --collective=tcp crosses hosts "
                        "with $TFDIST_JOB_SECRET set on every worker)")
    best = measured.fastest(RING_COLLECTIVES)
    return best, (f"CPU workers on this host, one device each: {best} trained "
                  f"{measured.THROUGHPUT[best] / measured.THROUGHPUT['auto']:.1f}x TensorFlow's "
                  f"own in the throughput benchmark")


def build_multi_worker(config) -> MultiWorkerParallelism:
    config = choose_collective(config)
    # Before TF's devices: MPI's launch decides the cluster (and a bad launch is a usage error).
    world = join_mpi_world(config) if config.collective == "mpi" else None
    tf_config = world.tf_config if world else cluster_from_environment()
    # One replica per worker unless asked (`tfdist launch --devices_per_worker K`).
    simulate = 0 if config.simulate_devices == devices.AUTO else config.simulate_devices
    local = devices.configure(simulate, config.num_gpus)
    if config.collective == "nccl" and not any("gpu" in d for d in local):
        raise UsageError(f"--collective=nccl needs GPUs, but this worker's devices are "
                         f"{', '.join(local)}. Use ring (or auto) on CPUs.")
    if config.collective in TFDIST_COLLECTIVES:
        check_tcp_ring_config(config, local)
    if config.collective in RING_COLLECTIVES:
        ring_secret(tf_config)   # a missing secret across hosts: exit 2 before any socket
    if config.collective == "shm":
        check_one_host(tf_config)
    strategy = build_strategy(config, tf_config, local)
    log.info("worker %d of %d (%s), %d local replica(s)", tf_config.rank,
             tf_config.num_workers, "chief" if tf_config.is_chief else "not chief", len(local))
    parallel = MultiWorkerParallelism(strategy, local, tf_config, config.collective_timeout,
                                      config.batch_statistics)
    if config.collective in RING_COLLECTIVES and tf_config.rank is not None:
        parallel.ring = parallel.summer = connect_ring(parallel, config.collective_timeout,
                                                       config.collective)
        parallel.reducer = (shm_ring.SharedMemoryAllReduce(parallel.ring)
                            if config.collective == "shm" else parallel.ring)
    if world is not None:
        parallel.reducer = parallel.summer = mpi.MpiAllReduce(world)
    return parallel


def join_mpi_world(config) -> mpi.World:
    """The MPI world and the TF cluster formed from it, within --collective_timeout:
    a rank that died at start-up leaves the others waiting inside MPI, where only
    the watchdog reaches them (exit 3)."""
    who = f"MPI rank {mpi.rank_hint(os.environ)}"
    guard = watchdog.for_process(config.collective_timeout, who).guard(
        "joining the MPI world (MPI_Init and the exchange of TensorFlow's ports)")
    with guard:
        return mpi.join_world(os.environ)


# ------------------------------------------------------------------- --collective=tcp / shm

def check_tcp_ring_config(config, local) -> None:
    """tfdist's own all-reduces (tcp, shm, mpi) sum one CPU device per worker, in its loop."""
    flag = f"--collective={config.collective}"
    require(len(local) == 1 and "gpu" not in local[0].lower(),
            f"{flag} sums the gradients of one CPU device per worker, but this "
            f"worker has {', '.join(local)}. Use --devices_per_worker 1 (--num_gpus=0), or "
            f"--collective=ring / nccl.")
    require(config.trainer == "loop",
            f"{flag} works with --trainer=loop (tfdist's step sends the gradients); "
            f"got --trainer={config.trainer}. Use --collective=auto with Keras fit.")
    require(config.mixed_precision != "mixed_float16",
            f"{flag} does not support --mixed_precision=mixed_float16 (the loss "
            "scale would check unsummed gradients); use mixed_bfloat16 or float32.")


def ring_secret(tf_config: cluster.TFConfig) -> bytes:
    """The job secret the ring's handshake proves (ring_auth.job_secret: a UsageError
    across hosts without $TFDIST_JOB_SECRET)."""
    return ring_auth.job_secret([cluster.split_address(a)[0] for a in tf_config.worker_addresses])


def check_one_host(tf_config: cluster.TFConfig) -> None:
    """Shared memory needs every worker on this machine."""
    hosts = [cluster.split_address(a)[0] for a in tf_config.worker_addresses]
    elsewhere = [h for h in hosts if not cluster.is_local_host(h)]
    require(not elsewhere,
            f"--collective=shm needs every worker on this host, but TF_CONFIG puts workers "
            f"on {', '.join(sorted(set(elsewhere)))}. Use --collective=tcp across hosts.")


def connect_ring(parallel: MultiWorkerParallelism, timeout: float,
                 collective: str = "tcp") -> tcp_ring.TcpRing:
    """Listens on a free port, learns every worker's port through one TF all-reduce,
    and connects the ring (hosts from TF_CONFIG), every link authenticated (ring_auth)."""
    tf_config = parallel.tf_config
    hosts = [cluster.split_address(a)[0] for a in tf_config.worker_addresses]
    # build_multi_worker checked the secret before any socket (ring_secret).
    auth = ring_auth.RingAuth(ring_secret(tf_config), ring_auth.job_id(tf_config.worker_addresses))
    spans_hosts = any(not cluster.is_local_host(host) for host in hosts)
    server = tcp_ring.listen(hosts[tf_config.rank], spans_hosts)   # its own address only
    ports = np.zeros(tf_config.num_workers, np.float32)
    ports[tf_config.rank] = server.getsockname()[1]   # < 2**24: exact in float32
    try:
        with parallel.translate_failures():  # a peer lost during the port exchange
            ports = [int(p) for p in parallel.sum_over_replicas(ports)]  # 1 per worker
        ring = tcp_ring.TcpRing.connect(tf_config.rank, hosts, ports, server, timeout, auth)
    except tcp_ring.TcpRingError as error:
        raise ClusterError(f"worker {tf_config.rank} of {tf_config.num_workers}: "
                           f"--collective={collective} could not connect its ring ({error}). "
                           f"Check that the workers can reach each other on any TCP port, "
                           f"or use --collective=auto.") from None
    finally:
        server.close()
    log.info("collective %s: ring of %d workers connected (ports %s)", collective, len(hosts),
             ports)
    return ring


def ring_replica_step(reducer, model, optimizer, jit_compile: bool, rank: int,
                      num_workers: int, on_trace=None, accumulation_steps: int = 1):
    """The replica step with gradients and loss summed in one buffer by `reducer`
    (a TcpRing, or a SharedMemoryAllReduce: both have all_reduce_arrays).

    Sparse gradients (tf.IndexedSlices from an embedding lookup) whose rows the
    batch chose are gathered, not summed dense: Keras applies IndexedSlices slice by
    slice (Adam's second moment squares each slice before slices of one row add up),
    so the dense sum would give another update than one device does (measured:
    1.25e-2 relative on the transformer's losses). Each worker writes its slices into
    its own block of a zero buffer n times as long, and the sum of those buffers is
    the concatenation of every worker's slices, exactly (x + 0 == x), which is what
    TF's own collectives do for IndexedSlices and what the one-device batch holds.
    Rows the batch did not choose (a position table) are summed row by row
    (tfdist/train/sparse_rows.py).
    `on_trace(shapes, dtype)`, if given, is called in Python while the step is traced,
    with the shapes of the arrays every step will sum and the dtype it sums them in.
    """
    loss_and_grads = step_math.make_loss_and_grads(model, optimizer, jit_compile,
                                                   accumulation_steps)
    variables = model.trainable_variables

    def sum_keeping_the_loss(*arrays):
        """The sums; the loss (last) copied, since it outlives the step and shared
        memory's sums are valid only until the next all-reduce (shm_ring)."""
        summed = reducer.all_reduce_arrays(*arrays)
        return summed[:-1] + [np.array(summed[-1], copy=True)]

    def replica_step(batch):
        x, y, w = step_math.split_batch(batch)
        loss, grads, y_pred = loss_and_grads(x, y, w)
        summed_loss = []

        def all_reduce(items, owners):
            """The items and the loss summed in one call of the reducer."""
            packed = [SparseBlocks(item, owner, rank, num_workers)
                      if isinstance(item, tf.IndexedSlices) else item
                      for item, owner in zip(items, owners)]
            tensors = [t for g in packed
                       for t in (g.tensors if isinstance(g, SparseBlocks) else [g])]
            tensors.append(loss)
            # One buffer dtype (tcp_ring.BufferLayout): float64 if any tensor is, so a
            # float64 model's sums keep float64; float32 tensors widen exactly.
            wide = tf.as_dtype(tcp_ring.buffer_dtype(t.dtype.as_numpy_dtype for t in tensors))
            if on_trace is not None:
                on_trace([tuple(t.shape) for t in tensors], wide.as_numpy_dtype)
            summed = tf.numpy_function(sum_keeping_the_loss,
                                       [tf.cast(t, wide) for t in tensors],
                                       [wide] * len(tensors), stateful=True)
            # Back to float64 where it was; everything else comes back float32, as it
            # always did (a float32 sum of a bfloat16 value keeps its digits).
            summed = [tf.cast(tf.ensure_shape(s, t.shape),
                              tf.float64 if t.dtype == tf.float64 else tf.float32)
                      for s, t in zip(summed, tensors)]
            summed_loss.append(summed[-1])
            return unpack_gradients(packed, summed[:-1])

        summed_grads = sparse_rows.reduce_across(grads, all_reduce, variables)
        with keras_fixes.gradients_already_summed(optimizer):
            optimizer.apply(summed_grads, variables)
        return summed_loss[0], step_math.outputs_of(y, y_pred, w)

    return replica_step


class SparseBlocks:
    """One worker's IndexedSlices as two tensors (values in float32, or float64 for a
    float64 table; indices in float32) padded with zeros into this worker's block of
    num_workers blocks, so a SUM gathers them."""

    def __init__(self, grad: tf.IndexedSlices, variable, rank: int, num_workers: int):
        rows = grad.values.shape[0]
        require(rows is not None,
                f"--collective=tcp/shm: the sparse gradient of {variable.path} has a dynamic "
                f"number of rows; batch with drop_remainder=True, or use --collective=auto.")
        require(variable.shape[0] < 2 ** 24,
                f"--collective=tcp/shm sends embedding row indices as float32, exact below "
                f"2**24 rows; {variable.path} has {variable.shape[0]}. Use --collective=auto.")
        before, after = rank * rows, (num_workers - 1 - rank) * rows
        padding = [[before, after]] + [[0, 0]] * (grad.values.shape.rank - 1)
        value_dtype = tf.float64 if grad.values.dtype == tf.float64 else tf.float32
        self.tensors = [tf.pad(tf.cast(grad.values, value_dtype), padding),
                        tf.pad(tf.cast(grad.indices, tf.float32), [[before, after]])]
        self.index_dtype, self.dense_shape = grad.indices.dtype, grad.dense_shape
        self.dtype = grad.values.dtype

    def gathered(self, values, indices) -> tf.IndexedSlices:
        return tf.IndexedSlices(tf.cast(values, self.dtype), tf.cast(indices, self.index_dtype),
                                self.dense_shape)


def unpack_gradients(packed, summed):
    """The summed tensors back into one gradient per variable (IndexedSlices where sparse)."""
    out, position = [], 0
    for grad in packed:
        if isinstance(grad, SparseBlocks):
            out.append(grad.gathered(summed[position], summed[position + 1]))
            position += 2
        else:
            out.append(summed[position])
            position += 1
    return out
