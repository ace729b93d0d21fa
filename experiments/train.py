r"""Train a Keras model with any tfdist strategy. Flags in, results out.

    python -m experiments.train                      # the default experiment
    python -m experiments.train --strategy=mirrored --simulate_devices=4 \
        --model=cnn --optimizer=momentum --train_steps=200 --results_json=/tmp/r.json

This file only parses flags and calls tfdist.run; the library never reads FLAGS.
"""

import logging
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # before TensorFlow is imported

from absl import app, flags  # noqa: E402

import tfdist  # noqa: E402
from tfdist import config as cfg, parallel  # noqa: E402
from tfdist.errors import (EXIT_CLUSTER_ERROR, EXIT_PREEMPTED, EXIT_USAGE_ERROR,  # noqa: E402
                           ClusterError, Preempted, UsageError)
from tfdist.train import progress  # noqa: E402
from tfdist.parallel import mpi  # noqa: E402

FLAGS = flags.FLAGS

# Mode and devices.
flags.DEFINE_string("strategy", "mirrored",
                    "default, one_device, mirrored, multi_worker_mirrored, dtensor, pipeline.")
flags.DEFINE_integer("simulate_devices", int(os.environ.get("TFDIST_SIMULATE_DEVICES", cfg.AUTO)),
                     "Split the CPU into N logical devices (0: don't; -1: 2 when no GPU). "
                     "Default from $TFDIST_SIMULATE_DEVICES, which `tfdist launch` sets.")
flags.DEFINE_integer("num_gpus", cfg.AUTO, "GPUs to use (-1: all visible).")
flags.DEFINE_string("cross_device_ops", "auto",
                    "mirrored all-reduce: auto, nccl, hierarchical_copy, reduction_to_one_device.")
flags.DEFINE_integer("num_packs", 1, "Gradient packs for nccl / hierarchical_copy.")
flags.DEFINE_string("collective", "fastest", "multi_worker_mirrored all-reduce: fastest (tfdist "
                    "picks the fastest exact one for the layout and logs why: shm for one-device "
                    "CPU workers on one host, mpi under an MPI launch, nccl on GPUs, else auto), "
                    "auto, ring, nccl (TF's), tcp (tfdist's ring over sockets; CPU workers), shm (tfdist's, through "
                    "shared memory; CPU workers on one host), or mpi (MPI_Allreduce through "
                    "mpi4py; start the workers with mpirun, srun --mpi=pmix or tfdist launch --mpi).")
flags.DEFINE_integer("bytes_per_pack", 0, "multi_worker_mirrored gradient pack size (0: TF's choice).")
flags.DEFINE_integer("collective_timeout", 300,
                     "Seconds to wait for peers to join, for a collective, or to notice a dead peer.")
# Model parallelism.
flags.DEFINE_string("mesh", None, 'dtensor mesh, e.g. "batch=2,model=2" (default: all devices on batch).')
flags.DEFINE_string("layout", "data", "dtensor layout: data, megatron, auto (tfdist shards what stays "
                    "exact in any model and prints the table), or a JSON/.py layout file.")
flags.DEFINE_bool("layout_strict", False, "dtensor: a variable no layout rule matches is an error.")
flags.DEFINE_integer("pipeline_stages", 2, "pipeline: stages, one device each.")
flags.DEFINE_integer("microbatches", 1, "pipeline: micro-batches per step.")
flags.DEFINE_string("pipeline_split", None, "pipeline: layer names that begin stages 2..S.")
flags.DEFINE_string("pipeline_schedule", "gpipe",
                    "pipeline: gpipe, 1f1b, interleaved_1f1b (Megatron-LM's, with "
                    "--virtual_stages; --microbatches a multiple of --pipeline_stages) or "
                    "zero_bubble (ZB-H1: backward split into input and weight gradients).")
flags.DEFINE_integer("virtual_stages", 1, "pipeline, interleaved_1f1b: model chunks per device "
                     "(the model is cut into pipeline_stages x virtual_stages chunks).")
# Model.
flags.DEFINE_string("model", "cnn", "mlp, cnn, resnet, transformer, or MODULE:FUNCTION (your "
                    "function returning an uncompiled Keras model; give --loss).")
flags.DEFINE_string("hidden_sizes", "100,50", "mlp hidden widths.")
flags.DEFINE_string("filters", "32,64", "cnn / resnet widths.")
flags.DEFINE_integer("num_layers", 2, "transformer blocks.")
flags.DEFINE_integer("d_model", 64, "transformer width.")
flags.DEFINE_integer("num_heads", 4, "transformer attention heads.")
flags.DEFINE_integer("d_ff", 256, "transformer MLP width.")
# Data.
flags.DEFINE_string("dataset", "digits", "digits, text, synthetic, tfds:NAME, or MODULE:FUNCTION "
                    "(your function returning (train, test): tf.data.Datasets of unbatched "
                    "(features, label[, weight]) examples or tuples of NumPy arrays).")
flags.DEFINE_string("data_dir", None, "tensorflow-datasets data dir.")
flags.DEFINE_integer("seq_len", 64, "text: characters per example.")
flags.DEFINE_string("synthetic_shape", "28,28,1", "synthetic: example shape.")
flags.DEFINE_integer("synthetic_classes", 10, "synthetic: classes.")
flags.DEFINE_integer("synthetic_examples", 8192, "synthetic: training examples.")
flags.DEFINE_integer("shuffle_buffer", 0, "0: the whole training split.")
flags.DEFINE_string("sharding", "auto", "Across workers: auto (file-level when a file-backed "
                    "dataset's files divide over the workers, else data-level), file, data.")
# Training.
flags.DEFINE_integer("global_batch_size", 64, "Examples per step over all replicas.")
flags.DEFINE_integer("train_steps", 0, "Steps to train (0: use --epochs).")
flags.DEFINE_integer("epochs", 0, f"Epochs (0 with --train_steps=0: {cfg.DEFAULT_EPOCHS}).")
flags.DEFINE_float("learning_rate", None, "Default per optimizer: "
                   + ", ".join(f"{k} {v}" for k, v in cfg.DEFAULT_LEARNING_RATES.items()))
flags.DEFINE_string("optimizer", "adam", "momentum (SGD with 0.9), or any Keras optimizer: "
                    + ", ".join(cfg.KERAS_OPTIMIZERS) + ".")
flags.DEFINE_string("loss", None, "A Keras loss identifier (e.g. mse, "
                    "sparse_categorical_crossentropy); registry models default to "
                    "sparse categorical cross-entropy from logits.")
flags.DEFINE_string("metrics", None, "Comma-separated Keras metric identifiers (e.g. "
                    "accuracy,auc); registry models default to accuracy.")
flags.DEFINE_integer("seed", 0, "Seeds weights and the data order.")
flags.DEFINE_string("trainer", "loop", "loop (tfdist's) or fit (Keras model.fit).")
flags.DEFINE_string("mixed_precision", None, "mixed_bfloat16 or mixed_float16 (off by default).")
flags.DEFINE_bool("jit_compile", False, "XLA-compile the forward and backward pass.")
flags.DEFINE_enum("batch_statistics", "global", list(cfg.BATCH_STATISTICS),
                  "Data parallel: BatchNormalization by the global batch's statistics "
                  "(one device's math) or per_replica (cheaper, not exact).")
flags.DEFINE_integer("accumulation_steps", 1, "Gradient accumulation: each global batch in K "
                     "micro-batches, one optimizer update (less activation memory; the same "
                     "numbers as the whole batch at once).")
flags.DEFINE_enum("remat", None, list(cfg.REMAT_MODES), "Activation recomputation (Keras' "
                  "RematScope modes, applied to the built model): layers keep only their "
                  "inputs and run again in the backward pass (less activation memory, more "
                  "compute; the same numbers).")
flags.DEFINE_list("remat_layers", [], "--remat=list_of_layers: the names of the layers to "
                  "recompute.")
flags.DEFINE_integer("remat_threshold", 1024, "--remat=larger_than: recompute layers whose "
                     "output has more values per example than this.")
flags.DEFINE_integer("zero_stage", 0, "Sharded data parallelism (ZeRO) over the data-parallel "
                     "devices: 0 replicates; 1 shards the optimizer state, 2 also the "
                     "gradients, 3 also the parameters (--strategy=dtensor; the same numbers).")
# Outputs.
flags.DEFINE_string("model_dir", None, "Checkpoints and TensorBoard logs; rerun to resume.")
flags.DEFINE_integer("checkpoint_every", 0, "Save every N steps (0: at the end and on SIGTERM).")
flags.DEFINE_integer("keep_checkpoints", 3, "Checkpoints kept in --model_dir.")
flags.DEFINE_string("results_json", None, "Write the results JSON here.")
flags.DEFINE_string("save_model", None, "Write the trained model to PATH.keras (plain Keras "
                    "loads it on one device).")
flags.DEFINE_string("export_dir", None, "Export the trained model as a SavedModel to DIR.")
flags.DEFINE_integer("eval_every", 0, "Evaluate every N steps (0: at the end only).")
flags.DEFINE_integer("log_every", 50, "Steps between log lines and TensorBoard scalars.")
flags.DEFINE_string("profile_steps", None, "START,STOP: profiler trace of those steps.")


def config_from_flags() -> cfg.RunConfig:
    profile = cfg.parse_ints(FLAGS.profile_steps, "profile_steps") if FLAGS.profile_steps else None
    if profile is not None and len(profile) != 2:
        raise UsageError(f"--profile_steps must be START,STOP, got {FLAGS.profile_steps!r}.")
    return cfg.RunConfig(
        strategy=FLAGS.strategy, simulate_devices=FLAGS.simulate_devices,
        num_gpus=FLAGS.num_gpus, cross_device_ops=FLAGS.cross_device_ops,
        num_packs=FLAGS.num_packs, collective=FLAGS.collective,
        bytes_per_pack=FLAGS.bytes_per_pack, collective_timeout=FLAGS.collective_timeout,
        mesh=FLAGS.mesh, layout=FLAGS.layout, layout_strict=FLAGS.layout_strict,
        pipeline_stages=FLAGS.pipeline_stages, microbatches=FLAGS.microbatches,
        pipeline_split=tuple(FLAGS.pipeline_split.split(",")) if FLAGS.pipeline_split else None,
        pipeline_schedule=FLAGS.pipeline_schedule, virtual_stages=FLAGS.virtual_stages,
        model=cfg.ModelConfig(
            name=FLAGS.model, hidden_sizes=cfg.parse_ints(FLAGS.hidden_sizes, "hidden_sizes"),
            filters=cfg.parse_ints(FLAGS.filters, "filters"), num_layers=FLAGS.num_layers,
            d_model=FLAGS.d_model, num_heads=FLAGS.num_heads, d_ff=FLAGS.d_ff),
        data=cfg.DataConfig(
            name=FLAGS.dataset, data_dir=FLAGS.data_dir, seq_len=FLAGS.seq_len,
            synthetic_shape=cfg.parse_ints(FLAGS.synthetic_shape, "synthetic_shape"),
            synthetic_classes=FLAGS.synthetic_classes,
            synthetic_examples=FLAGS.synthetic_examples, shuffle_buffer=FLAGS.shuffle_buffer,
            sharding=FLAGS.sharding),
        global_batch_size=FLAGS.global_batch_size, train_steps=FLAGS.train_steps,
        epochs=FLAGS.epochs, learning_rate=FLAGS.learning_rate, optimizer=FLAGS.optimizer,
        loss=FLAGS.loss, metrics=_names(FLAGS.metrics), save_model=FLAGS.save_model,
        export_dir=FLAGS.export_dir,
        seed=FLAGS.seed, model_dir=FLAGS.model_dir, checkpoint_every=FLAGS.checkpoint_every,
        keep_checkpoints=FLAGS.keep_checkpoints, results_json=FLAGS.results_json,
        eval_every=FLAGS.eval_every, log_every=FLAGS.log_every, profile_steps=profile,
        mixed_precision=FLAGS.mixed_precision, jit_compile=FLAGS.jit_compile,
        trainer=FLAGS.trainer, batch_statistics=FLAGS.batch_statistics,
        accumulation_steps=FLAGS.accumulation_steps, remat=FLAGS.remat,
        remat_layers=tuple(FLAGS.remat_layers), remat_threshold=FLAGS.remat_threshold,
        zero_stage=FLAGS.zero_stage)


def _names(text):
    return None if text is None else tuple(n.strip() for n in text.split(",") if n.strip())


def summary(results: dict) -> str:
    accuracy = results["eval_accuracy"]
    accuracy_text = "n/a" if accuracy is None else f"{accuracy:.2%}"
    final = results["final_loss"]
    final_text = "n/a (already trained)" if final is None else f"{final:.4f}"
    return (f"tfdist: {results['strategy']} x{results['num_replicas']} | {results['model']} on "
            f"{results['dataset']} | {results['steps']} steps | final loss "
            f"{final_text} | eval accuracy {accuracy_text} | "
            f"{results['examples_per_sec']:.0f} examples/s | {results['train_seconds']:.1f} s")


def parse_flags(argv):
    """absl's parser, with a bad flag value (e.g. --train_steps=abc) reported like every
    other user mistake: one paragraph and exit 2 (absl itself exits 1)."""
    try:
        return FLAGS(argv)
    except flags.Error as error:
        print(f"tfdist: error: {error}. See --helpshort for the flags.", file=sys.stderr)
        sys.exit(EXIT_USAGE_ERROR)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {' '.join(argv[1:])}")
    progress.configure_logging()
    spans_processes, code = False, 0
    try:
        config = config_from_flags()
        spans_processes = parallel.spanned_cluster(config.strategy) is not None
        print(summary(tfdist.run(config)))   # refuses a wrong cluster, locks --model_dir first
    except UsageError as error:
        print(f"tfdist: error: {error}", file=sys.stderr)
        code = EXIT_USAGE_ERROR
    except Preempted as error:
        print(f"tfdist: {error}", file=sys.stderr)
        code = EXIT_PREEMPTED
    except ClusterError as error:
        print(f"tfdist: cluster error: {error}", file=sys.stderr)
        code = EXIT_CLUSTER_ERROR
    exit_process(code, spans_processes)


def exit_process(code: int, spans_processes: bool) -> None:
    """Everything is written and flushed by now. A process of a multi-process run then
    skips TensorFlow's teardown: it waits at the coordination service's shutdown
    barrier for its peers (measured: a worker outlived the chief by 8 s after a
    300-step run, 40 s after 10,000 steps, logging heartbeat errors meanwhile),
    which delays every job end and every preemption."""
    if not spans_processes:
        sys.exit(code)
    if code in (0, EXIT_PREEMPTED):   # every rank got here (after agreeing on the step):
        mpi.finalize()                # MPI's clean end; a no-op without --collective=mpi
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)
