r"""Benchmarks, written as CSV and markdown (and PNG where there is a curve).

    python -m experiments.benchmark --suite=loop --out_dir=benchmarks/results

Suites:
  loop   tfdist's training loop against a hand-written strategy.run loop
         (same model, strategy and data); the goal is a ratio >= 0.95.
Benchmarks are not tests: quote their medians, measured side by side in one run.
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app, flags  # noqa: E402

from tfdist import config as cfg  # noqa: E402
from tfdist.errors import UsageError  # noqa: E402
from tfdist.train import progress  # noqa: E402

FLAGS = flags.FLAGS
SUITES = ("loop",)
flags.DEFINE_string("suite", "loop", f"One of: {', '.join(SUITES)}.")
flags.DEFINE_string("out_dir", "benchmarks/results", "Where CSV/markdown/PNG go.")
flags.DEFINE_integer("steps", 300, "Steps per trial (the first is not timed).")
flags.DEFINE_integer("trials", 5, "Alternating trials per contender; medians are reported.")
flags.DEFINE_integer("simulate_devices", 2, "Simulated CPU devices.")


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
    from tfdist.benchmarks import loop_overhead
    return [loop_overhead.compare(c, FLAGS.steps, FLAGS.trials) for c in loop_configs()]


def main(argv):
    del argv
    progress.configure_logging()
    try:
        if FLAGS.suite not in SUITES:
            raise UsageError(f"Unknown --suite {FLAGS.suite!r}. Valid choices: {', '.join(SUITES)}.")
        from tfdist import devices
        devices.simulate_cpus(FLAGS.simulate_devices)
        rows = run_loop_suite()
    except UsageError as error:
        print(f"tfdist: error: {error}", file=sys.stderr)
        sys.exit(2)
    from tfdist.benchmarks import report
    print(report.write_all(rows, FLAGS.out_dir, FLAGS.suite))


if __name__ == "__main__":
    app.run(main)
