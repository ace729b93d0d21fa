r"""Benchmarks, written as CSV and markdown (and PNG where there is a curve).

    python -m benchmarks --suite=loop --out_dir=benchmarks/results

Suites:
  loop       tfdist's training loop against a hand-written strategy.run loop
             (same model, strategy and data); the goal is a ratio >= 0.95.
  allreduce  nccl-tests-style all-reduce bandwidth, 1 MB to 64 MB, across
             --workers processes started with `tfdist launch`, for each
             --collectives choice (default auto,ring,tcp,shm,mpi,mpi_tcp): TF's
             auto, ring (nccl only where there are GPUs), tfdist's tcp ring, its
             shared-memory shm, and MPI_Allreduce (--collective=mpi, under
             `tfdist launch --mpi`) over Open MPI's shared memory (mpi) and TCP
             only (mpi_tcp); the mpi ones are skipped where MPI is not installed.
  throughput 2 workers (no --collective flag: the fastest, chosen; TF's auto, tcp, shm, mpi) vs 1
             worker, one thread each, on a compute-bound MLP, and PyTorch DDP gloo
             when torch is installed.
  network    the throughput suite's 2 workers per collective (auto, tcp, shm, mpi), in
             `tfdist launch`'s private network against --network=host, alternating.
  bubble     pipeline step time against micro-batches M and stages S, next to the
             GPipe bubble formula (S-1)/(M+S-1).
  scaling    step time, examples/s, speedup and efficiency (speedup / devices)
             of each --scaling_modes contender (MODE:DEVICES) against default
             on 1 device, each run a fresh experiments.train process; also a
             PNG of speedup against devices. About 6 minutes here with
             --steps=30 --trials=3.
  memory     the planner's gradients + activations estimate for one device
             against TensorFlow's allocator peak over one training step.
  input      the input pipeline's ms per batch (worker 0 of 2, one thread),
             vectorised against the element-by-element stream it replaced.
  soak       2 workers (tfdist launch) train --steps (default 20,000) of the mlp on
             synthetic data per --collectives choice, with --model_dir and
             --checkpoint_every (default 200); threads, RSS and open files of each
             worker, sampled from /proc after the first step and until it exits.
  chaos      an uninterrupted 2-worker run, then the same command under
             --max_restarts=KILLS with --kills (default 10) seeded SIGKILLs of a random worker;
             final weights against the uninterrupted run, examples trained twice
             (counted), steps recomputed. --checkpoint_every defaults to 20 here.
  pipeline_overlap  2 stage processes (M=8, every schedule) against 1 process, one
             thread each, next to each schedule's formula and to what 2 independent
             processes at once reach (the cores' ceiling). MLP 128-2048x5-10, global
             batch 16384; default --steps=6 --trials=3 (about 30 minutes here).
  torch_pipeline    tfdist's gpipe / 1f1b across 2 processes and DTensor megatron
             tensor parallelism against torch.distributed pipelining and tensor
             parallelism, 2 processes x 1 thread (torch optional).
  conformance  third-party Keras models (keras.applications, keras-hub, keras-io
             architectures) x every mode, 8 steps with Adam and SGD against plain Keras
             on one device: each cell exact, refused, announced or SILENT MISMATCH
             (exit 1 if any). --models / --modes pick a slice (names, or a family:
             keras.applications, keras-hub, keras-io); writes conformance.json and .md.
Benchmarks are not tests: quote their medians, measured side by side in one run.
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app, flags  # noqa: E402

from tfdist import config as cfg  # noqa: E402
from benchmarks import scaling  # noqa: E402  (no TensorFlow: it runs subprocesses)
from tfdist.errors import UsageError  # noqa: E402
from tfdist.train import progress  # noqa: E402

FLAGS = flags.FLAGS
SUITES = ("loop", "allreduce", "throughput", "network", "bubble", "scaling", "memory", "remat", "input", "soak",
          "chaos", "api_fit", "keras_distribution", "pipeline_overlap", "torch_pipeline",
          "conformance", "zero")
flags.DEFINE_string("suite", "loop", f"One of: {', '.join(SUITES)}.")
flags.DEFINE_string("out_dir", "benchmarks/results", "Where CSV/markdown/PNG go.")
flags.DEFINE_integer("steps", 300, "Steps per trial (the first is not timed); soak and chaos: "
                     "steps of each job (their default: 20,000; (3 * kills + 2) * checkpoint_every).")
flags.DEFINE_integer("trials", 5, "Alternating trials per contender; medians are reported.")
flags.DEFINE_integer("simulate_devices", 2, "Simulated CPU devices (loop suite).")
flags.DEFINE_integer("workers", 2, "Worker processes (allreduce suite).")
flags.DEFINE_string("collectives", "auto,ring,tcp,shm", "allreduce and soak: implementations to "
                    "compare (allreduce's default: auto,ring,tcp,shm,mpi,mpi_tcp).")
flags.DEFINE_string("sizes_mb", "1,2,4,8,16,32,64", "allreduce: message sizes in MB.")
flags.DEFINE_integer("bytes_per_pack", 0, "throughput: also run 2 workers with this pack size.")
flags.DEFINE_string("scaling_modes", scaling.DEFAULT_CONTENDERS,
                    "scaling: MODE:DEVICES contenders; modes default, mirrored, dtensor, "
                    "dtensor_megatron, pipeline. default:1 (the baseline) always runs.")
flags.DEFINE_integer("run_timeout", 600, "scaling: seconds before one training process is "
                     "killed and reported; soak and chaos: per launched job (their default: "
                     "300 s + 0.1 s per step, chaos + 120 s per kill).")
flags.DEFINE_integer("checkpoint_every", 0, "soak and chaos: --checkpoint_every of the training "
                     "job (0: the suite's default, soak 200, chaos 20).")
flags.DEFINE_integer("kills", 10, "chaos: SIGKILLs in a row; the job runs with --max_restarts=KILLS.")
flags.DEFINE_integer("chaos_seed", 0, "chaos: seeds which worker is killed and at which step.")
flags.DEFINE_string("chaos_collective", "auto", "chaos: the job's --collective.")
flags.DEFINE_string("models", "all", "conformance: models or families, comma-separated.")
flags.DEFINE_string("modes", "all", "conformance: modes, comma-separated.")
flags.DEFINE_bool("worker", False, "Internal: this process is one worker of a launched group.")


def loop_configs():
    """A small model (overhead-bound) and a compute-bound MLP, both on mirrored."""
    small = cfg.RunConfig(strategy="mirrored", simulate_devices=FLAGS.simulate_devices,
                          model=cfg.ModelConfig(name="mlp"), data=cfg.DataConfig(name="digits"),
                          global_batch_size=64, optimizer="sgd", log_every=10**9)
    large = cfg.RunConfig(strategy="mirrored", simulate_devices=FLAGS.simulate_devices,
                          model=cfg.ModelConfig(name="mlp", hidden_sizes=(1024, 1024)),
                          data=cfg.DataConfig(name="synthetic", synthetic_shape=(784,)),
                          global_batch_size=512, optimizer="sgd", log_every=10**9)
    return [small, large]


def run_loop_suite():
    from benchmarks import loop_overhead
    return [loop_overhead.compare(c, FLAGS.steps, FLAGS.trials) for c in loop_configs()]


def allreduce_worker():
    """One worker of the group: sweeps sizes; the chief prints the rows as JSON lines."""
    import json
    from benchmarks import allreduce
    from tfdist.parallel import multi_worker
    collective = allreduce.VARIANTS[FLAGS.collectives][0]   # mpi_tcp: mpi, held to TCP
    config = cfg.RunConfig(strategy="multi_worker_mirrored", collective=collective,
                           simulate_devices=0)
    parallel = multi_worker.build_multi_worker(config)
    rows = allreduce.sweep(parallel, FLAGS.collectives,
                           cfg.parse_ints(FLAGS.sizes_mb, "sizes_mb"))
    if parallel.is_chief:
        for row in rows:
            print("ROW " + json.dumps(row), flush=True)


def run_allreduce_suite():
    """Launches one worker group per collective implementation; collects the chief's rows."""
    import json
    import subprocess
    from benchmarks import allreduce   # TF only inside its functions: not imported here
    rows = []
    names = allreduce.parse_collectives(_given_or("collectives", allreduce.DEFAULT_COLLECTIVES),
                                        given=FLAGS["collectives"].present)
    for collective in names:
        command = allreduce.launch_command(sys.executable, FLAGS.workers, collective,
                                           FLAGS.sizes_mb)
        result = subprocess.run(command, capture_output=True, text=True, timeout=1800)
        if result.returncode != 0:
            raise UsageError(f"allreduce workers for {collective} failed:\n{result.stdout[-2000:]}")
        rows += [json.loads(line.split("ROW ", 1)[1]) for line in result.stdout.splitlines()
                 if "ROW " in line]
    return rows


def _given_or(name, default):
    """The flag's value when given on the command line, else this suite's own default."""
    return getattr(FLAGS, name) if FLAGS[name].present else default


def run_soak_suite():
    """No TensorFlow in this process while the jobs run: the workers get the cores."""
    from benchmarks import soak
    steps = _given_or("steps", 20000)
    return soak.run_suite(soak.parse_collectives(FLAGS.collectives), steps,
                          FLAGS.checkpoint_every or 200, _given_or("run_timeout", 300 + 0.1 * steps))


def run_chaos_suite():
    from benchmarks import chaos
    checkpoint_every = FLAGS.checkpoint_every or 20
    steps = _given_or("steps", chaos.default_steps(FLAGS.kills, checkpoint_every))
    return chaos.run_suite(FLAGS.kills, steps, checkpoint_every, FLAGS.chaos_seed,
                           FLAGS.chaos_collective,
                           _given_or("run_timeout", chaos.default_timeout(FLAGS.kills, steps)))


def main(argv):
    del argv
    progress.configure_logging()
    try:
        if FLAGS.suite not in SUITES:
            raise UsageError(f"Unknown --suite {FLAGS.suite!r}. Valid choices: {', '.join(SUITES)}.")
        if FLAGS.worker:
            return allreduce_worker()
        if FLAGS.suite == "allreduce":
            rows = run_allreduce_suite()
        elif FLAGS.suite == "bubble":
            from benchmarks import bubble
            rows = bubble.bubble_rows(stages=(2, 4), microbatches=(1, 2, 4, 8))
        elif FLAGS.suite == "scaling":
            rows = scaling.run_suite(FLAGS.scaling_modes, FLAGS.steps, FLAGS.trials,
                                     FLAGS.run_timeout)
            print(scaling.write_report(rows, FLAGS.out_dir))
            return
        elif FLAGS.suite == "memory":
            from benchmarks import memory
            rows = memory.compare_all()
        elif FLAGS.suite == "remat":
            from benchmarks import remat   # no TensorFlow here: a process per measurement
            rows = remat.compare(_given_or("trials", 3))
        elif FLAGS.suite == "zero":
            from benchmarks import report, zero   # no TensorFlow here: it runs processes
            for name, table in zero.compare(_given_or("trials", 3)).items():
                print(report.write_all(table, FLAGS.out_dir, name))
            return
        elif FLAGS.suite == "input":
            os.environ.update(TF_NUM_INTRAOP_THREADS="1", TF_NUM_INTEROP_THREADS="1")
            from benchmarks import input_pipeline  # imports TF: after the thread limits
            rows = input_pipeline.compare(FLAGS.steps, FLAGS.trials)
        elif FLAGS.suite == "api_fit":
            from benchmarks import api_fit
            rows = api_fit.compare(FLAGS.steps, FLAGS.trials)
        elif FLAGS.suite == "keras_distribution":
            from benchmarks import keras_distribution_fit
            rows = keras_distribution_fit.compare(FLAGS.steps, FLAGS.trials)
        elif FLAGS.suite == "soak":
            rows = run_soak_suite()
        elif FLAGS.suite == "chaos":
            rows = run_chaos_suite()
        elif FLAGS.suite in ("pipeline_overlap", "torch_pipeline"):
            import importlib   # no TensorFlow here: the suites run training subprocesses
            # --steps and --trials only when given: each suite has its own defaults
            # (pipeline_overlap's batch of 16384 takes ~10 s a step in one process).
            given = [f"--{name}={getattr(FLAGS, name)}" for name in ("steps", "trials")
                     if FLAGS[name].present]
            importlib.import_module(f"benchmarks.{FLAGS.suite}").main(
                [*given, f"--out_dir={FLAGS.out_dir}"])
            return
        elif FLAGS.suite == "conformance":
            from benchmarks import conformance   # no TensorFlow here: it runs processes
            sys.exit(conformance.main([f"--models={FLAGS.models}", f"--modes={FLAGS.modes}",
                                       f"--out_dir={FLAGS.out_dir}"]))
        elif FLAGS.suite in ("throughput", "network"):
            from benchmarks import throughput
            rows = throughput.compare(FLAGS.steps, FLAGS.trials, FLAGS.bytes_per_pack,
                                      networks=FLAGS.suite == "network")
        else:
            from tfdist import devices
            devices.simulate_cpus(FLAGS.simulate_devices)
            rows = run_loop_suite()
    except UsageError as error:
        print(f"tfdist: error: {error}", file=sys.stderr)
        sys.exit(2)
    except scaling.ContenderFailed as error:
        print(f"tfdist: benchmark run failed: {error}", file=sys.stderr)
        sys.exit(1)
    from benchmarks import report
    print(report.write_all(rows, FLAGS.out_dir, FLAGS.suite))


if __name__ == "__main__":
    app.run(main)
