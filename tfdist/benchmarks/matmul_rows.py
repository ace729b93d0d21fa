"""One thread's matrix multiply by rows: what cutting a batch into micro-batches costs.

    python -m tfdist.benchmarks.pinned python -m tfdist.benchmarks.matmul_rows [--seconds 2]

For rows in 256, 512, 2048: GFLOP/s of a Dense layer's three products, [rows, 2048] x
[2048, 2048] (forward), its input gradient (by the transpose) and its weight gradient, each in
a tf.function on one intra- and one inter-op thread. The pipeline overlap suite's micro-batches
are these rows (README, "Rechecked on a slower machine").
"""

import argparse
import os
import time

os.environ.update(TF_NUM_INTRAOP_THREADS="1", TF_NUM_INTEROP_THREADS="1",
                  TF_CPP_MIN_LOG_LEVEL=os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2"))
WIDTH = 2048
ROWS = (256, 512, 2048)


def gflops(product, rows: int, seconds: float) -> float:
    product()   # traced and warmed up outside the timing
    calls, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        product().numpy()
        calls += 1
    return 2 * rows * WIDTH * WIDTH * calls / (time.perf_counter() - start) / 1e9


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=2.0, help="timing per product")
    args = parser.parse_args(argv)
    import tensorflow as tf
    weights = tf.random.normal([WIDTH, WIDTH])
    print("| rows | forward GFLOP/s | input gradient GFLOP/s | weight gradient GFLOP/s |")
    print("|---|---|---|---|")
    for rows in ROWS:
        inputs, output_grads = tf.random.normal([rows, WIDTH]), tf.random.normal([rows, WIDTH])
        products = (tf.function(lambda: tf.matmul(inputs, weights)),
                    tf.function(lambda: tf.matmul(output_grads, weights, transpose_b=True)),
                    tf.function(lambda: tf.matmul(inputs, output_grads, transpose_a=True)))
        rates = [gflops(product, rows, args.seconds) for product in products]
        print(f"| {rows} | " + " | ".join(f"{rate:.1f}" for rate in rates) + " |", flush=True)


if __name__ == "__main__":
    main()
