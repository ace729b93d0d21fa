"""TensorFlow ops DTensor (TF 2.21) cannot run, rewritten while a DTensor step is traced.

Each rewrite keeps the function Keras' TensorFlow backend calls (by attribute, at call
time: keras/src/backend/tensorflow/nn.py) and computes the same values with ops
DTensor lays out; `dtensor_runnable_ops()` swaps them in for the length of a trace.
The three below: depthwise/separable convolutions' gradients, average pooling's
gradient, and a float64 sparse softmax cross-entropy.

Depthwise and separable convolutions: the same forward, a gradient DTensor can run.

DTensor (TF 2.21) has no layout rule for the gradients of TensorFlow's depthwise
convolution ('DepthwiseConv2dNativeBackpropFilter' and '...BackpropInput' "do not
implement layout propagation"), so any model with a trainable DepthwiseConv1D/2D
or SeparableConv1D/2D (MobileNet, EfficientNet, ConvNeXt, Xception) failed at its
first step, even fully replicated. The forward op itself runs (batch-sharded).

So while the DTensor train step is traced, `tf.nn.depthwise_conv2d` keeps its
forward op but gets a custom gradient: the vector-Jacobian product of the same
convolution written as a sum over the filter's taps of strided slices times the
filter, which is slices, multiplies and sums, all of which DTensor lays out. The
forward values are TensorFlow's own; the gradients equal the native ones up to
float32 summation order (measured 1e-7 relative). `tf.nn.separable_conv2d` is
TensorFlow's own composition (that depthwise convolution, then a 1x1 conv2d),
rewritten so its depthwise part takes the same path.

Why a swap of public TF functions: Keras' TensorFlow backend calls
`tf.nn.depthwise_conv2d` and `tf.nn.separable_conv2d` by attribute at call time
(keras/src/backend/tensorflow/nn.py), and tf.RegisterGradient cannot replace a
registered gradient. The swap lasts only while the step's Python body runs (its
trace), in this thread's call. Canary: tests/test_dtensor_auto_layout.py::
test_keras_calls_the_rewritten_functions.
Only channels_last (NHWC) with "SAME"/"VALID" padding is rewritten (what Keras uses
on CPU and by default); layout_check refuses the rest before any trace.

Average pooling has the same gap: 'AvgPoolGrad' "does not implement layout
propagation" (DenseNet's transition blocks failed at their first step). Its forward
stays TensorFlow's `tf.nn.avg_pool`; its gradient is that of the same average
written as a depthwise convolution with a constant filter of ones divided by the
number of inputs each window covers (what TF divides by, padding excluded), through
`as_taps`. Keras' TF backend calls `tf.nn.avg_pool` by attribute too; the canary
above checks it.

Sparse softmax cross-entropy in float64: DTensor computes
`tf.nn.sparse_softmax_cross_entropy_with_logits` as 0 (or -inf after Keras' log of
probabilities) when float64 logits are split along their classes; float32 is right,
and reductions, softmax and logsumexp over a split axis are right in float64 too
(tests/test_dtensor_auto_layout.py::test_dtensor_float64_sparse_cross_entropy_canary).
Keras calls it for SparseCategoricalCrossentropy with or without logits, so a float64
model whose last Dense was split trained on a loss of 0.0. For float64 logits it is
rewritten as log-sum-exp minus the label's logit (a product with a one-hot made by a
comparison: tf.one_hot's DTensor expansion fails on split classes too), with the native
op's gradient (softmax minus one-hot); other dtypes keep the native op.
"""

import contextlib
import threading

import tensorflow as tf

_lock = threading.RLock()
_depth = [0]   # nested entries (a step traced inside another's trace) swap once
# The tf.nn functions rewritten (the registry), each kept here as TensorFlow's own.
REWRITTEN = ("depthwise_conv2d", "separable_conv2d", "avg_pool",
             "sparse_softmax_cross_entropy_with_logits")
_NATIVE = {name: getattr(tf.nn, name) for name in REWRITTEN}
_native_depthwise = _NATIVE["depthwise_conv2d"]
_native_separable = _NATIVE["separable_conv2d"]
_native_avg_pool = _NATIVE["avg_pool"]
_native_sparse_cross_entropy = _NATIVE["sparse_softmax_cross_entropy_with_logits"]


def native(name):
    return _NATIVE[name]


@contextlib.contextmanager
def dtensor_runnable_ops():
    """tf.nn's functions above replaced by their rewrites, inside (a DTensor step's trace)."""
    with _lock:
        _depth[0] += 1
        for name in REWRITTEN:
            setattr(tf.nn, name, globals()[name])   # this module's function of that name
        try:
            yield
        finally:
            _depth[0] -= 1
            if not _depth[0]:
                for name in REWRITTEN:
                    setattr(tf.nn, name, _NATIVE[name])


def rewritable(data_format, padding) -> bool:
    return data_format in (None, "NHWC") and padding in ("SAME", "VALID")


def depthwise_conv2d(input, filter, strides, padding, data_format=None,  # noqa: A002 (TF's names)
                     dilations=None, name=None):
    if not rewritable(data_format, padding):
        return _native_depthwise(input, filter, strides, padding, data_format=data_format,
                                 dilations=dilations, name=name)
    dilations = tuple(dilations or (1, 1))

    @tf.custom_gradient
    def convolve(x, kernel):
        y = _native_depthwise(x, kernel, strides, padding, data_format=data_format,
                              dilations=dilations, name=name)

        def gradient(dy):
            with tf.GradientTape() as tape:
                tape.watch([x, kernel])
                same = as_taps(x, kernel, strides, padding, dilations)
            return tape.gradient(same, [x, kernel], output_gradients=dy)

        return y, gradient

    # Read Keras variables outside: custom_gradient refuses variables read inside.
    return convolve(tf.convert_to_tensor(input), tf.convert_to_tensor(filter))


def separable_conv2d(input, depthwise_filter, pointwise_filter, strides, padding,  # noqa: A002
                     data_format=None, dilations=None, name=None):
    if not rewritable(data_format, padding):
        return _native_separable(input, depthwise_filter, pointwise_filter, strides, padding,
                                 data_format=data_format, dilations=dilations, name=name)
    depthwise = depthwise_conv2d(input, depthwise_filter, strides, padding,
                                 data_format=data_format, dilations=dilations)
    return tf.nn.conv2d(depthwise, pointwise_filter, [1, 1, 1, 1], padding="VALID",
                        data_format=data_format)


def avg_pool(input, ksize, strides, padding, data_format=None, name=None):  # noqa: A002
    """tf.nn.avg_pool with a gradient DTensor can run, for channels_last 1-D and 2-D
    pooling with "SAME"/"VALID" padding; anything else is TensorFlow's own op."""
    rank = input.shape.rank
    if rank not in (3, 4) or data_format not in (None, "NWC", "NHWC") or padding not in (
            "SAME", "VALID"):
        return _native_avg_pool(input, ksize, strides, padding, data_format=data_format,
                                name=name)
    spatial = rank - 2
    window, step = _per_spatial_dim(ksize, spatial), _per_spatial_dim(strides, spatial)

    @tf.custom_gradient
    def pool(x):
        y = _native_avg_pool(x, ksize, strides, padding, data_format=data_format, name=name)

        def gradient(dy):
            with tf.GradientTape() as tape:
                tape.watch(x)
                same = _average_as_taps(x, window, step, padding)
            return tape.gradient(same, x, output_gradients=dy)

        return y, gradient

    return pool(tf.convert_to_tensor(input))


def _per_spatial_dim(value, spatial):
    """tf.nn.avg_pool's ksize/strides (an int, or 1, N or N + 2 values) as N values."""
    values = [value] if isinstance(value, int) else list(value)
    if len(values) == spatial + 2:
        values = values[1:-1]
    return values * spatial if len(values) == 1 else values


def _average_as_taps(x, window, step, padding):
    """The average pooling of x (N[H]WC) as a depthwise convolution by ones / count."""
    if x.shape.rank == 3:      # 1-D: a 2-D pooling over a height of 1
        pooled = _average_as_taps(tf.expand_dims(x, 1), [1] + window, [1] + step, padding)
        return tf.squeeze(pooled, 1)
    channels = x.shape[-1]
    strides = [1, step[0], step[1], 1]
    ones = tf.ones(window + [channels, 1], x.dtype)
    sums = as_taps(x, ones, strides, padding, (1, 1))
    counts = as_taps(tf.ones([1] + list(x.shape[1:3]) + [1], x.dtype), ones[:, :, :1],
                     strides, padding, (1, 1))
    return sums / counts


def sparse_softmax_cross_entropy_with_logits(labels=None, logits=None, name=None):
    """tf.nn's, with float64 logits computed from ops DTensor runs right (module docstring)."""
    logits = tf.convert_to_tensor(logits)
    labels = tf.convert_to_tensor(labels)
    if logits.dtype != tf.float64:
        return _native_sparse_cross_entropy(labels=labels, logits=logits, name=name)

    @tf.custom_gradient
    def cross_entropy(values):
        # A comparison, not tf.one_hot: DTensor's OneHot expansion fails when its depth
        # axis is split ("SPMD expansion resulted in op output inconsistent with the
        # provided layout", keras ModelParallel on ResNet50's classes).
        classes = tf.range(values.shape[-1], dtype=labels.dtype)
        one_hot = tf.cast(tf.equal(labels[..., None], classes), values.dtype)
        loss = tf.reduce_logsumexp(values, axis=-1) - tf.reduce_sum(values * one_hot, axis=-1)

        def gradient(dloss):
            return dloss[..., None] * (tf.nn.softmax(values, axis=-1) - one_hot)

        return loss, gradient

    return cross_entropy(logits)


def as_taps(x, kernel, strides, padding, dilations):
    """The depthwise convolution (NHWC) as a sum over filter taps of strided slices of
    the padded input times that tap's weights; output channel c * M + m, as TF's."""
    _, height, width, channels = x.shape
    taps_h, taps_w, _, multiplier = kernel.shape
    stride_h, stride_w = strides[1], strides[2]
    out_h, pad_h = _output_and_padding(height, taps_h, stride_h, dilations[0], padding)
    out_w, pad_w = _output_and_padding(width, taps_w, stride_w, dilations[1], padding)
    padded = tf.pad(x, [[0, 0], list(pad_h), list(pad_w), [0, 0]])
    total = None
    for i in range(taps_h):
        for j in range(taps_w):
            top, left = i * dilations[0], j * dilations[1]
            window = padded[:, top:top + (out_h - 1) * stride_h + 1:stride_h,
                            left:left + (out_w - 1) * stride_w + 1:stride_w, :]
            term = window[..., None] * kernel[i, j]       # (batch, h, w, channels, multiplier)
            total = term if total is None else total + term
    return tf.reshape(total, [-1, out_h, out_w, channels * multiplier])


def _output_and_padding(size, taps, stride, dilation, padding):
    """TensorFlow's output size and (before, after) padding for one spatial dimension."""
    span = (taps - 1) * dilation + 1
    if padding == "VALID":
        return (size - span) // stride + 1, (0, 0)
    out = -(-size // stride)
    total = max((out - 1) * stride + span - size, 0)
    return out, (total // 2, total - total // 2)
