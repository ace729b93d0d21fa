"""Pipeline stages in different worker processes: worker 0 drives, the others serve.

    tfdist launch --workers W [--devices_per_worker D] -- python -m experiments.train \\
        --strategy=pipeline --pipeline_stages=S --microbatches=M

How: TensorFlow's distributed runtime runs one program over the devices of every
task of a cluster (the single-client model of its ParameterServerStrategy). Worker
0 connects to the cluster (tf.config.experimental_connect_to_cluster) and builds
the same pipeline as in one process (placement.py, schedule.py), with the stage
devices named by task; the other workers only start a TensorFlow server and keep
it up until worker 0 ends. Each stage's variables, optimizer slots and ops then
live in the worker process that holds its device, and the boundary activations
and their gradients move between processes as TensorFlow's Send/Recv over gRPC.
Each task runs its part of the step's graph with its own executor, so stages in
different processes compute at the same time, which is the point of a pipeline.
Why TensorFlow's runtime and not tfdist's rings or MPI: a stage's ops, the
crossing tensors and their order are already one TensorFlow graph, which the
runtime partitions per task; moving activations outside it would cut the step
into one numpy_function per crossing (see docs/benchmarks.md).

Layout: W workers, D local devices each, S stages (S divides W). The W/S groups of
S consecutive workers each hold one pipeline per local device: replica (g, d) runs
stage k on task g*S + k, device d. Every stage's gradients are summed over the
replicas on replica 0's device of that stage (schedule.apply_gradients), so
W/S x D replicas train one model. D = 1: pipelines across nodes, replicated
across node groups; D > 1: each worker's devices are in-node data-parallel
replicas of its stage (the hybrid: split across nodes, replicate within).

How the workers end: a serving worker polls worker 0's server port; when it
closes, worker 0 has ended. Worker 0 first writes, through a TensorFlow op placed
on each worker (so it runs in that worker's process), the exit status it ends
with into a file in that worker's private dir (TMPDIR/tfdist-UID, 0700; the same
user runs every worker, as for the ring's secret file): 0 after a finished run, 4 after a
preemption checkpoint. A worker that finds no such file when worker 0's port
closes knows worker 0 failed and exits 3. A shut port counts as worker 0's end once
it has stayed shut for 3 s, or at once after status 4 (wait_until_gone says why). A
serving worker holds SIGTERM until worker 0 has ended: worker 0's preemption
checkpoint reads the variables it serves.
"""

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import signal
import stat
import tempfile
import time

import tensorflow as tf

from tfdist import cluster, devices as devices_lib, rendezvous
from tfdist.errors import (EXIT_CLUSTER_ERROR, EXIT_PREEMPTED, ClusterError, UsageError,
                           require)
from tfdist.parallel import watchdog
from tfdist.parallel.pipeline.parallelism import PipelineParallelism

log = logging.getLogger("tfdist")
DRIVER_RANK = 0
POLL_SECONDS = 0.5
# Worker 0 has ended when its port stays shut this long: one failed check is not enough
# (a connection can time out on a loaded machine while worker 0 is alive, and a serving
# worker that left then would end a healthy job with exit 3).
GONE_AFTER_SECONDS = 3.0


def check_layout(num_stages: int, tf_config: cluster.TFConfig) -> None:
    workers = tf_config.num_workers
    require(workers % num_stages == 0,
            f"--pipeline_stages={num_stages} does not divide the {workers} workers of this "
            f"cluster ({', '.join(tf_config.worker_addresses)}): each stage needs its own "
            f"worker, and W/S groups of S workers each hold a replica of the pipeline. Use "
            f"{num_stages * max(1, workers // num_stages)} workers or a --pipeline_stages "
            f"that divides {workers}.")


def private_dir() -> str:
    """This user's directory for the files worker 0 and a serving worker exchange: in the
    temp dir, but this uid's and 0700, so another local user can neither read the
    configuration, fake a status nor plant a symbolic link where a worker writes."""
    return os.path.join(tempfile.gettempdir(), f"tfdist-{os.getuid()}")


def ensure_private_dir() -> str:
    path = private_dir()
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise UsageError(f"{path} must be a directory of uid {os.getuid()} that only it can "
                         f"use (mode 0700), but it is uid {info.st_uid}, "
                         f"{stat.filemode(info.st_mode)}: remove it, or set TMPDIR elsewhere.")
    return path


def marker_path(tf_config: cluster.TFConfig, task: int) -> str:
    """Where worker 0 writes the exit status of the job for worker `task` (on its host)."""
    job = hashlib.blake2b(",".join(tf_config.worker_addresses).encode(), digest_size=8).hexdigest()
    return os.path.join(private_dir(), f"pipeline-{job}-task{task}.status")


# With one inter-op thread the stages take turns instead of overlapping. Measured with
# TF_NUM_INTEROP_THREADS=1: 2 stage processes trained at 0.98x the speed of both stages in one
# process, each busy while the other idled. A 2-thread pool in worker 0's client configuration
# (which TensorFlow also gives the serving workers' eager contexts) makes them overlap. Neither
# the servers' own pool nor a larger process-wide compute pool did. Our reading: the pool
# that runs a stage's kernels also hands its sent tensors over, and a busy thread runs the work
# it queued itself first. docs/benchmarks.md, "Pipeline overlap". Intra-op threads stay as configured.
MIN_INTEROP_THREADS = 2


def inter_op_threads() -> int:
    """The inter-op pool size this process was configured with; 0 is TensorFlow's default
    (one per core). TF_NUM_INTEROP_THREADS applies when tf.config.threading says 0."""
    configured = tf.config.threading.get_inter_op_parallelism_threads()
    return configured or int(os.environ.get("TF_NUM_INTEROP_THREADS", "0") or 0)


def stage_inter_op_threads(configured: int) -> int:
    """At least MIN_INTEROP_THREADS; 0 (TensorFlow's default, one per core) stays 0."""
    return configured if configured <= 0 else max(configured, MIN_INTEROP_THREADS)


def ensure_transfer_thread(label: str) -> None:
    """Raises a one-thread inter-op pool to MIN_INTEROP_THREADS, before TensorFlow starts.
    Worker 0's setting is also what the serving workers' stages run with: TensorFlow sizes
    the pool of a remote worker's eager context from the client's configuration."""
    configured = inter_op_threads()
    wanted = stage_inter_op_threads(configured)
    if wanted == configured:
        return
    try:
        tf.config.threading.set_inter_op_parallelism_threads(wanted)
    except RuntimeError:   # TensorFlow already started in this process: too late to change
        log.warning("pipeline: %s: TensorFlow started before the pipeline with %d inter-op "
                    "thread(s), so its stages may take turns instead of overlapping; set "
                    "TF_NUM_INTEROP_THREADS=%d", label, configured, wanted)
        return
    log.warning("pipeline: %s: %d inter-op thread(s) raised to %d: a stage process needs one "
                "to hand its tensors to the other stages while it computes, or the stages "
                "cannot overlap (TF_NUM_INTRAOP_THREADS is unchanged)", label, configured,
                wanted)


def server_config(local_devices: int):
    """A standalone server makes its devices and thread pools from its ConfigProto, not
    from the process's logical-device configuration or TF_NUM_*_THREADS, which only the
    eager context reads: so they are given here, as the process was configured (the
    inter-op pool at least MIN_INTEROP_THREADS, for the transfers it serves)."""
    config = tf.compat.v1.ConfigProto(device_count={"CPU": local_devices})
    config.intra_op_parallelism_threads = int(os.environ.get("TF_NUM_INTRAOP_THREADS", "0"))
    config.inter_op_parallelism_threads = stage_inter_op_threads(inter_op_threads())
    return config


def config_path(tf_config: cluster.TFConfig, task: int) -> str:
    """Where a serving worker leaves the run configuration it was started with."""
    return marker_path(tf_config, task)[:-len(".status")] + ".config.json"


def described(config) -> dict:
    """A RunConfig as JSON values (what worker 0 compares with each worker's)."""
    return json.loads(json.dumps(dataclasses.asdict(config), default=str))


def serve(tf_config: cluster.TFConfig, timeout: float, local_devices: int, config) -> int:
    """A serving worker: the TensorFlow server for the stages worker 0 places here, up
    until worker 0 ends; returns the exit status this process should end with."""
    label = f"worker {tf_config.rank} of {tf_config.num_workers}"
    ensure_private_dir()
    marker = marker_path(tf_config, tf_config.rank)
    if os.path.exists(marker):
        os.unlink(marker)   # a previous job's
    with open(config_path(tf_config, tf_config.rank), "w") as f:
        json.dump(described(config), f)   # worker 0 reads it before the first step
    rendezvous.wait_for_peers(tf_config, timeout)
    cluster.announce_grpc_server(tf_config.worker_addresses[tf_config.rank], "pipeline")
    tf.distribute.Server(tf.train.ClusterSpec(tf_config.cluster), job_name="worker",
                         task_index=tf_config.task_index, protocol="grpc",
                         config=server_config(local_devices), start=True)
    log.info("pipeline: %s serves its stages for worker 0", label)
    held = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: held.append(signum))
    try:
        wait_until_gone(tf_config.worker_addresses[DRIVER_RANK],
                        preempted=lambda: _status_text(marker) == str(EXIT_PREEMPTED))
    finally:
        signal.signal(signal.SIGTERM, previous)
        os.unlink(config_path(tf_config, tf_config.rank))
    return _status_left_for(marker, label)


def wait_until_gone(address: str, preempted=lambda: False) -> None:
    """Returns once nothing has answered at `address` for GONE_AFTER_SECONDS, or at the
    first shut port once `preempted()`: worker 0 leaves status 4 only after its preemption
    checkpoint, as its last act before it exits, so a shut port then is its end, not a slow
    connection. Without this a serving worker spent its 3 s after worker 0's checkpoint,
    past `tfdist launch`'s default 5 s --grace_period, and was SIGKILLed before it said how
    it ended. Status 0 gets no such shortcut: a process may run again after a finished run,
    and a stale 0 plus one failed connection would end a healthy serving worker."""
    shut_since = None
    while True:
        if rendezvous.unreachable([address]):
            if preempted():
                return
            shut_since = shut_since or time.monotonic()
            if time.monotonic() - shut_since >= GONE_AFTER_SECONDS:
                return
        else:
            shut_since = None
        time.sleep(POLL_SECONDS)


def _status_text(marker: str) -> str:
    try:
        with open(marker) as f:
            return f.read().strip()
    except OSError:
        return ""


def _status_left_for(marker: str, label: str) -> int:
    """The status worker 0 left in the marker; none (or an empty one: worker 0 clears it
    when a run starts) means it ended without finishing."""
    text = _status_text(marker)
    with contextlib.suppress(OSError):
        os.unlink(marker)
    if not text.isdigit():
        log.error("pipeline: %s: worker 0, which drives the pipeline, ended without "
                  "finishing (see its log); this worker ends too", label)
        return EXIT_CLUSTER_ERROR
    log.info("pipeline: %s: worker 0 ended with status %s; this worker ends too", label, text)
    return int(text)


_connected = []   # the cluster worker 0 joined: a process joins once, and runs may follow


def connect_driver(tf_config: cluster.TFConfig, timeout: float) -> None:
    """Worker 0: joins the cluster as its client (ops with no device stay local). A
    later run in the same process (the serving workers keep serving) reuses it."""
    if _connected:
        require(_connected[0] == tf_config.cluster,
                f"--strategy=pipeline: this process already drives the cluster "
                f"{_connected[0]}; TensorFlow joins one cluster per process.")
        return
    rendezvous.wait_for_peers(tf_config, timeout)
    cluster.announce_grpc_server(tf_config.worker_addresses[tf_config.rank], "pipeline")
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(tf_config.cluster), task_type="worker",
        task_id=tf_config.task_index, rpc_layer="grpc")
    tf.config.experimental_connect_to_cluster(resolver, job_name="worker",
                                              task_index=tf_config.task_index,
                                              make_master_device_default=False)
    _connected.append(tf_config.cluster)


def check_devices_per_worker(tf_config: cluster.TFConfig, expected: int) -> None:
    """Every worker must have worker 0's number of local devices (the same launch flags)."""
    counts = {task: 0 for task in range(tf_config.num_workers)}
    for device in tf.config.list_logical_devices("CPU"):
        task = device.name.split("/task:")[1].split("/")[0] if "/task:" in device.name else None
        if task is not None and int(task) in counts:
            counts[int(task)] += 1
    differing = {task: count for task, count in counts.items() if count != expected}
    if differing:
        shown = ", ".join(f"worker {task}: {count}" for task, count in sorted(differing.items()))
        raise UsageError(
            f"--strategy=pipeline across workers: worker 0 has {expected} local device(s), "
            f"but {shown}. Start every worker with the same --simulate_devices / "
            f"TFDIST_SIMULATE_DEVICES (`tfdist launch --devices_per_worker K` sets it for all).")


def check_same_flags(tf_config: cluster.TFConfig, config) -> None:
    """Every serving worker must have been started with worker 0's flags: it serves what
    worker 0 places, so another model or layout there means the launch was not one job.
    Each worker's configuration is read on its own host, by an op placed there."""
    mine = described(config)
    for task in range(1, tf_config.num_workers):
        with tf.device(f"/job:worker/replica:0/task:{task}/device:CPU:0"):
            theirs = json.loads(tf.io.read_file(config_path(tf_config, task)).numpy())
        differing = sorted(key for key in set(mine) | set(theirs) if mine.get(key) != theirs.get(key))
        if differing:
            key = differing[0]
            raise UsageError(
                f"--strategy=pipeline across workers: worker {task} "
                f"({tf_config.worker_addresses[task]}) was started with other flags than "
                f"worker 0: {key}={theirs.get(key)!r} there, {mine.get(key)!r} on worker 0"
                f"{f' (and {len(differing) - 1} more)' if len(differing) > 1 else ''}. Start "
                f"every worker with the same command (`tfdist launch` does).")


def tell_workers(tf_config: cluster.TFConfig, status) -> None:
    """Worker 0's last word to each serving worker: the status it ends with, written
    on that worker's host by an op that runs in that worker's process. Read back before
    returning: remote eager ops may run asynchronously, and worker 0 exits right after
    (without the read, a worker sometimes found no status and ended a finished job
    with exit 3)."""
    for task in range(tf_config.num_workers):
        if task == DRIVER_RANK:
            continue
        path = marker_path(tf_config, task)
        with tf.device(f"/job:worker/replica:0/task:{task}/device:CPU:0"):
            tf.io.write_file(path, tf.constant(str(status)))
            written = tf.io.read_file(path).numpy().decode()
        if written != str(status):
            raise ClusterError(f"worker 0 could not leave its status for worker {task} in "
                               f"{path} (read back {written!r}).")


def peer_failure(error: Exception, tf_config: cluster.TFConfig) -> ClusterError:
    from tfdist.parallel.multi_worker import peer_failure_summary
    return ClusterError(
        f"worker 0 of {tf_config.num_workers} (the pipeline's driver): a stage worker died or "
        f"stopped answering ({type(error).__name__}: {peer_failure_summary(error.message)}). "
        f"Check the other workers' logs; `tfdist launch --max_restarts R` restarts the group.")


class CrossWorkerPipeline(PipelineParallelism):
    """The pipeline as worker 0 drives it: stages on other workers' devices, every step and
    agreement bounded by --collective_timeout, and the serving workers told how it ended."""

    def __init__(self, device_names, num_stages, microbatches, split, schedule_name,
                 virtual_stages: int, tf_config: cluster.TFConfig, timeout: float):
        super().__init__(device_names, num_stages, microbatches, split, schedule_name,
                         virtual_stages)
        self.tf_config = tf_config
        # Worker 0's CPU: the steps return their loss here, not on a stage worker
        # (schedule.summed_on says why), and checkpoints copy the stages here
        self.host_device = f"/job:worker/replica:0/task:{tf_config.task_index}/device:CPU:0"
        self.watchdog = watchdog.for_process(
            timeout, f"worker 0 of {tf_config.num_workers} (the pipeline's driver)")
        self._ending = EXIT_CLUSTER_ERROR   # until finish() or a preemption says otherwise
        self._told = False
        with self.watchdog.guard("clearing the stage workers' exit status"):
            tell_workers(tf_config, "")   # no word yet (a previous run's in this process said 0)

    def guard(self, what: str):
        return self.watchdog.guard(what)

    # Everything below that reads or writes a stage's variables waits on the worker that
    # holds them, and TensorFlow's remote reads have no deadline of their own: a stage
    # worker stopped (SIGSTOP, a hung host) at an epoch's end left worker 0 waiting in
    # sync_to_user_model for good, its watchdog idle (seen in 1 of 24 runs of the
    # stopped-worker test). So each is guarded, like the steps.

    def adopt(self, model):
        with self.watchdog.guard("placing the model's stages on the stage workers"):
            return super().adopt(model)

    def sync_hyperparameters(self, optimizer) -> None:
        with self.watchdog.guard("setting the stage optimizers' learning rate"):
            super().sync_hyperparameters(optimizer)

    def sync_to_user_model(self, model, trained_model) -> None:
        with self.watchdog.guard("reading the trained weights from the stage workers"):
            super().sync_to_user_model(model, trained_model)

    def checkpoint_objects(self, model, optimizer):
        """Copies on worker 0's host of what the pipeline saves (checkpoint.HostCopy says why)."""
        from tfdist.parallel.pipeline import checkpoint as pipeline_checkpoint
        with self.watchdog.guard("copying the stages' variables for checkpoints"):
            self._host_copy = pipeline_checkpoint.HostCopy(self.replicas, self.host_device)
        return self._host_copy.objects()

    def saving(self) -> None:
        with self.watchdog.guard("reading every stage for a checkpoint"):
            self._host_copy.take()

    def restored(self) -> None:
        with self.watchdog.guard("giving the stage workers the restored checkpoint"):
            self._host_copy.give()
            super().restored()

    def make_train_step(self, model, optimizer, global_batch_size, jit_compile,
                        on_outputs=None):
        return self._guarded(super().make_train_step(
            model, optimizer, global_batch_size, jit_compile, on_outputs), "a training step")

    def make_eval_step(self, model, on_outputs=None):
        return self._guarded(super().make_eval_step(model, on_outputs), "an eval step")

    def _guarded(self, step, what: str):
        return self.watchdog.guard_each_call(step, what)

    def any_process(self, flag: bool) -> bool:
        """One driver decides for the job; a preemption it decides on is how it ends."""
        if flag:
            self._ending = EXIT_PREEMPTED
        return flag

    @contextlib.contextmanager
    def translate_failures(self):
        from tfdist.parallel.multi_worker import PEER_FAILURES
        try:
            yield
        except PEER_FAILURES as error:
            raise peer_failure(error, self.tf_config) from None

    def finish(self) -> None:
        self._ending = 0

    def close(self) -> None:
        """Tells the serving workers the status worker 0 ends with (nothing after a
        failure: a worker may be gone, and no word means exit 3 to them)."""
        if not self._told and self._ending != EXIT_CLUSTER_ERROR:
            self._told = True
            with self.watchdog.guard("telling the stage workers the run has ended"):
                tell_workers(self.tf_config, self._ending)
        super().close()


def build_cross_worker_pipeline(config, tf_config: cluster.TFConfig) -> CrossWorkerPipeline:
    """Worker 0: the pipeline over every worker's devices. Any other worker: serves its
    stages until worker 0 ends, then ends this process with worker 0's status (it has
    nothing else to run: worker 0 alone runs the user's program, single-client)."""
    check_layout(config.pipeline_stages, tf_config)
    simulate = 0 if config.simulate_devices == devices_lib.AUTO else config.simulate_devices
    ensure_transfer_thread(f"worker {tf_config.rank} of {tf_config.num_workers}")
    local = devices_lib.configure(simulate, config.num_gpus)   # before this task's server
    require(all("gpu" not in d.lower() for d in local),
            "--strategy=pipeline across workers places stages on CPU devices only in this "
            "version; on GPU hosts run the pipeline inside one process per host.")
    watch = watchdog.for_process(config.collective_timeout,
                                 f"worker {tf_config.rank} of {tf_config.num_workers}")
    if tf_config.rank != DRIVER_RANK:
        end_serving_worker(serve(tf_config, config.collective_timeout, len(local), config))
    first_run = not _connected
    with watch.guard("joining the cluster"):
        connect_driver(tf_config, config.collective_timeout)
    check_devices_per_worker(tf_config, len(local))
    if first_run:   # the serving workers were started with the flags of worker 0's first run;
        check_same_flags(tf_config, config)   # later runs of its process are its own to choose
    devices = cluster.pipeline_stage_devices(tf_config.num_workers, len(local),
                                             config.pipeline_stages)
    log.info("pipeline across %d workers: %d stage(s) x %d replica(s) (%d per worker group x "
             "%d local device(s))", tf_config.num_workers, config.pipeline_stages,
             len(devices) // config.pipeline_stages, tf_config.num_workers // config.pipeline_stages,
             len(local))
    # --accumulation_steps=K: K times the micro-batches, still one update per batch.
    return CrossWorkerPipeline(devices, config.pipeline_stages,
                               config.microbatches * config.accumulation_steps,
                               config.pipeline_split, config.pipeline_schedule,
                               config.virtual_stages, tf_config, config.collective_timeout)


def end_serving_worker(status: int) -> None:
    """A serving worker's end: its logs out, then exit without TensorFlow's teardown
    (which would wait for the departed worker 0 at the coordination service)."""
    logging.shutdown()
    import sys
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
