"""What cutting a batch into micro-batches costs one thread, and what batching the weight
gradients would win back.

    python -m benchmarks.pinned python -m benchmarks.microbatch_cost \
        [--width 2048] [--layers 2] [--rows 2048,4096] [--microbatches 8] [--repeats 7]

For each global row count: one stage of `--layers` Dense(W -> W) products, forward and
backward (input and weight gradients), timed three ways on one intra- and one inter-op
thread, each in a tf.function, alternating, medians:
  whole            the whole batch at once (what one device computes);
  summed           M micro-batches, each one's weight gradients added into the sums (what
                   a pipeline stage computes: tfdist/parallel/pipeline/schedule.py);
  batched_weights  M micro-batches for the forward and input gradients, then one weight-
                   gradient product per layer over all of them (inputs and output gradients
                   concatenated), the lever a deferred weight gradient would give.
The pipeline overlap suite's 2 stages in one process run at 0.82-0.91x of one process
(docs/benchmarks.md, "Pipeline overlap across worker processes"); this splits that cost.
"""

import argparse
import os
import statistics
import time

os.environ.update(TF_NUM_INTRAOP_THREADS="1", TF_NUM_INTEROP_THREADS="1", OMP_NUM_THREADS="1",
                  TF_CPP_MIN_LOG_LEVEL=os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2"))

from benchmarks.matmul_rows import positive_ints  # noqa: E402  (after the thread settings)

WAYS = ("whole", "summed", "batched_weights")


def stage_steps(width: int, layers: int, rows: int, microbatches: int) -> dict:
    """way -> a tf.function running the stage's forward and backward that way."""
    import tensorflow as tf
    kernels = [tf.random.normal([width, width], stddev=0.02) for _ in range(layers)]
    inputs, output_grads = tf.random.normal([rows, width]), tf.random.normal([rows, width])

    def forward(h):
        kept = []
        for kernel in kernels:
            kept.append(h)
            h = tf.matmul(h, kernel)
        return kept

    def backward(kept, grad):
        """[(layer input, gradient of its output)] per layer, and the input gradient."""
        pairs = []
        for kernel, h in zip(reversed(kernels), reversed(kept)):
            pairs.append((h, grad))
            grad = tf.matmul(grad, kernel, transpose_b=True)
        return pairs[::-1], grad

    def weight_grads(pairs):
        return [tf.matmul(h, g, transpose_a=True) for h, g in pairs]

    def checksum(weights, input_grads):
        # a scalar that reads every result, so no product is pruned or left unfinished
        return tf.add_n([tf.reduce_sum(w) for w in weights] +
                        [tf.reduce_sum(g) for g in input_grads])

    @tf.function
    def whole():
        pairs, input_grad = backward(forward(inputs), output_grads)
        return checksum(weight_grads(pairs), [input_grad])

    @tf.function
    def summed():
        sums, input_grads = None, []
        for x, dy in zip(tf.split(inputs, microbatches), tf.split(output_grads, microbatches)):
            pairs, input_grad = backward(forward(x), dy)
            grads = weight_grads(pairs)
            sums = grads if sums is None else [a + b for a, b in zip(sums, grads)]
            input_grads.append(input_grad)
        return checksum(sums, input_grads)

    @tf.function
    def batched_weights():
        per_microbatch, input_grads = [], []
        for x, dy in zip(tf.split(inputs, microbatches), tf.split(output_grads, microbatches)):
            pairs, input_grad = backward(forward(x), dy)
            per_microbatch.append(pairs)
            input_grads.append(input_grad)
        layer_pairs = [(tf.concat([p[i][0] for p in per_microbatch], 0),
                        tf.concat([p[i][1] for p in per_microbatch], 0)) for i in range(layers)]
        return checksum(weight_grads(layer_pairs), input_grads)

    return {"whole": whole, "summed": summed, "batched_weights": batched_weights}


def median_ms(steps: dict, repeats: int) -> dict:
    """way -> median milliseconds a call, the ways alternating call by call."""
    for step in steps.values():
        step().numpy()   # traced and warmed up outside the timing
    times = {way: [] for way in steps}
    for _ in range(repeats):
        for way, step in steps.items():
            start = time.perf_counter()
            step().numpy()
            times[way].append(time.perf_counter() - start)
    return {way: 1e3 * statistics.median(t) for way, t in times.items()}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--rows", type=positive_ints, default=(2048, 4096))
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    for name in ("width", "layers", "microbatches", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    uneven = [rows for rows in args.rows if rows % args.microbatches]
    if uneven:
        parser.error(f"--rows {','.join(map(str, uneven))} not divisible by "
                     f"--microbatches {args.microbatches}")
    print(f"one thread, {args.layers} Dense({args.width} -> {args.width}) products, forward and "
          f"backward, M={args.microbatches}; ms a call (median of {args.repeats}), x = whole / way\n")
    print("| rows | whole ms | summed ms | summed x | batched_weights ms | batched_weights x |")
    print("|---|---|---|---|---|---|")
    for rows in args.rows:
        ms = median_ms(stage_steps(args.width, args.layers, rows, args.microbatches), args.repeats)
        print(f"| {rows} | {ms['whole']:.1f} | {ms['summed']:.1f} | {ms['whole'] / ms['summed']:.3f} "
              f"| {ms['batched_weights']:.1f} | {ms['whole'] / ms['batched_weights']:.3f} |")


if __name__ == "__main__":
    main()
