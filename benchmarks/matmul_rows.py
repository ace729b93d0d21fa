"""One thread's matrix multiply by rows: what cutting a batch into micro-batches costs.

    python -m benchmarks.pinned python -m benchmarks.matmul_rows \
        [--seconds 2] [--widths 2048,2064] [--rows 256,320,512,2048] [--framework torch]

For each width W and row count: GFLOP/s of a Dense layer's three products, [rows, W] x
[W, W] (forward), its input gradient (by the transpose) and its weight gradient, each in
a tf.function on one intra- and one inter-op thread. The pipeline overlap suite's micro-batches
are these rows (docs/benchmarks.md, "Rechecked on a slower machine").

Why more than one width: on a 2-core AVX2 EPYC (Zen 3) the forward product and the input
gradient ran at half speed at 256-288 rows when W was 2048 and not when it was 2000 or 2064
(docs/benchmarks.md, "A power-of-two width"), so the width, not only the row count, decides what a
micro-batch costs there. `--framework torch` times the same three products in PyTorch (one
thread), for the side-by-side comparison with it (torch is an optional benchmark extra).
"""

import argparse
import os
import time

os.environ.update(TF_NUM_INTRAOP_THREADS="1", TF_NUM_INTEROP_THREADS="1", OMP_NUM_THREADS="1",
                  TF_CPP_MIN_LOG_LEVEL=os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2"))
WIDTHS = (2048,)
ROWS = (256, 512, 2048)


MIN_CALLS = 10   # a short --seconds on a loaded machine still times more than one call


def gflops(product, rows: int, width: int, seconds: float) -> float:
    product()   # traced and warmed up outside the timing
    calls, start = 0, time.perf_counter()
    while calls < MIN_CALLS or time.perf_counter() - start < seconds:
        product().numpy()
        calls += 1
    return 2 * rows * width * width * calls / (time.perf_counter() - start) / 1e9


def shown(rate: float) -> str:
    """One decimal, but never a positive rate printed as 0.0 (a tiny size under load)."""
    return f"{rate:.1f}" if rate >= 1 else f"{rate:.3g}"


def positive_ints(text: str) -> tuple:
    try:
        values = tuple(int(part) for part in text.split(","))
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(
            f"expected positive integers separated by commas, got {text!r}")
    return values


def tensorflow_products(width: int, rows: int) -> tuple:
    """The forward product, the input gradient and the weight gradient, in tf.functions."""
    import tensorflow as tf
    weights = tf.random.normal([width, width])
    inputs, output_grads = tf.random.normal([rows, width]), tf.random.normal([rows, width])
    return (tf.function(lambda: tf.matmul(inputs, weights)),
            tf.function(lambda: tf.matmul(output_grads, weights, transpose_b=True)),
            tf.function(lambda: tf.matmul(inputs, output_grads, transpose_a=True)))


def torch_products(width: int, rows: int) -> tuple:
    """The same three products in PyTorch on one thread."""
    import torch
    torch.set_num_threads(1)
    weights = torch.randn(width, width)
    inputs, output_grads = torch.randn(rows, width), torch.randn(rows, width)
    return (lambda: inputs @ weights, lambda: output_grads @ weights.t(),
            lambda: inputs.t() @ output_grads)


FRAMEWORKS = {"tensorflow": tensorflow_products, "torch": torch_products}


def rates(width: int, rows: int, seconds: float, framework: str = "tensorflow") -> list:
    """GFLOP/s of the forward product, the input gradient and the weight gradient."""
    return [gflops(product, rows, width, seconds)
            for product in FRAMEWORKS[framework](width, rows)]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=2.0, help="timing per product (at least MIN_CALLS = 10 calls whatever this says)")
    parser.add_argument("--widths", type=positive_ints, default=WIDTHS,
                        help="layer widths W, comma-separated")
    parser.add_argument("--rows", type=positive_ints, default=ROWS,
                        help="row counts (micro-batch sizes), comma-separated")
    parser.add_argument("--framework", choices=sorted(FRAMEWORKS), default="tensorflow")
    args = parser.parse_args(argv)
    if args.framework == "torch":
        from benchmarks.torch_pipeline import torch_missing
        if torch_missing():
            parser.error("--framework torch needs torch: pip install torch "
                         "--index-url https://download.pytorch.org/whl/cpu")
    print("| width | rows | forward GFLOP/s | input gradient GFLOP/s | weight gradient GFLOP/s |")
    print("|---|---|---|---|---|")
    for width in args.widths:
        for rows in args.rows:
            row = rates(width, rows, args.seconds, args.framework)
            print(f"| {width} | {rows} | " + " | ".join(shown(rate) for rate in row) + " |",
                  flush=True)


if __name__ == "__main__":
    main()
