"""Canaries for the private TF/Keras code tfdist works around.

Each test pins the upstream behaviour a workaround depends on. When one fails,
upstream changed: revisit the workaround named in the test (maybe delete it).
"""

import inspect
import os
import subprocess
import sys

from keras.src.backend.tensorflow import trainer as keras_tf_trainer
from tensorflow.python.distribute import collective_all_reduce_strategy as cars

from helpers import REPO


def test_keras_symbolic_build_still_reduces_the_distributed_batch():
    """tfdist.train.keras_fixes.repair_fit_for_collective_strategies (keras#20585)."""
    source = inspect.getsource(keras_tf_trainer.TensorFlowTrainer._maybe_symbolic_build)
    assert "self.distribute_strategy.reduce(" in source
    assert "self._symbolic_build(data_batch=data_batch)" in source


def test_keras_log_reduction_still_uses_axis_0_under_multi_worker():
    """tfdist.train.keras_fixes.repair_keras_log_reduction (keras#20585)."""
    source = inspect.getsource(inspect.unwrap(keras_tf_trainer.reduce_per_replica))
    assert 'strategy.reduce("MEAN", v, axis=0)' in source
    assert callable(keras_tf_trainer._collective_all_reduce_multi_worker)


def test_tf_collective_strategy_still_uses_one_cpu_per_worker():
    """tfdist.parallel.multi_worker.simulated_cpu_replicas (TODO b/126786766 upstream)."""
    method = cars.CollectiveAllReduceExtended._initialize_local_devices
    assert list(inspect.signature(method).parameters) == ["self", "cluster_resolver",
                                                           "worker_device"]
    assert "num_local_devices = 1" in inspect.getsource(method)


def test_plain_keras_fit_still_breaks_under_multi_worker():
    """The upstream break itself, on 2 real workers: tfdist's fit repair is still needed."""
    env = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2")
    result = subprocess.run(
        [sys.executable, "-m", "tfdist.launch", "--workers", "2", "--", sys.executable,
         "tests/workers/keras_fit_upstream.py"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    assert "UPSTREAM-BREAK-PRESENT" in result.stdout, result.stdout[-3000:]
    assert "UPSTREAM-FIXED" not in result.stdout


def test_keras_backup_and_restore_still_has_the_pieces_tfdist_uses():
    """tfdist.train.keras_fixes.ChiefOnlyBackupAndRestore and backed_up_epoch."""
    import keras
    callback = keras.callbacks.BackupAndRestore("/tmp/unused-backup-dir")
    assert callable(callback._save_model)
    assert callback._training_metadata_path.endswith("training_metadata.json")
    assert '"epoch": self._current_epoch' in inspect.getsource(
        keras.callbacks.BackupAndRestore._save_model)


def test_keras_tf_optimizer_still_sums_gradients_in_update_step():
    """tfdist.train.keras_fixes.gradients_already_summed (keras-team/keras#19308)."""
    from keras.src.backend.tensorflow.optimizer import TFOptimizer
    source = inspect.getsource(TFOptimizer._backend_update_step)
    assert "self._all_reduce_sum_gradients(grads_and_vars)" in source
    assert list(inspect.signature(TFOptimizer._all_reduce_sum_gradients).parameters) == [
        "self", "grads_and_vars"]


def test_tf_still_takes_aligned_numpy_function_outputs_without_a_copy_or_a_write():
    """tcp_ring.BufferLayout aligns the summed gradients to 64 bytes so that
    tf.numpy_function adopts them instead of copying (a copy of every gradient per
    step, on the throughput benchmark's critical path). If TF starts copying again,
    training stays correct but slower: re-measure the throughput suite.

    --collective=shm returns views of the workers' shared result region, so it
    also relies on TF never writing into memory it adopted: no op may reuse
    ("forward") such an input buffer for its output, since the other workers
    are still reading it (TF forwards only buffers it owns). If this part fails,
    shm_ring must copy its results out again."""
    import numpy as np
    import tensorflow as tf
    from tfdist.parallel.tcp_ring import BufferLayout

    layout = BufferLayout([(1000,), (3,)])
    buffer = layout.empty()
    buffer[:] = 1.0

    def summed():
        return tf.numpy_function(lambda: layout.unpack(buffer), [], [tf.float32] * 2,
                                 stateful=True)

    @tf.function
    def last_uses():   # Mul and Relu are the outputs' only consumers: TF would forward
        adopted, small = summed()   # a buffer it owned into their results
        return adopted * 3.0, tf.nn.relu(small)

    scaled, _ = last_uses()
    assert float(scaled[0]) == 3.0 and np.all(buffer == 1.0)   # nothing written into it
    adopted, _ = tf.function(summed)()
    buffer[:] = 7.0   # visible through a tensor only if TF did not copy it
    assert adopted.numpy()[0] == 7.0




def test_checkpoint_saver_retraces_for_several_tasks():
    """tfdist.parallel.pipeline.checkpoint.HostCopy: a save of variables in several tasks traces a
    new tf.function each time, and traced graphs are never freed (tensorflow#124972). When the
    saver stops retracing, the pipeline across workers could save its stages directly."""
    from tensorflow.python.checkpoint import functional_saver
    source = inspect.getsource(functional_saver.MultiDeviceSaver.save)
    assert "self._num_unique_tasks > 1" in source
    assert "def tf_function_save()" in source


# What a fresh process reports: which of these Keras left imported (a module LazyLoader has
# not run yet is an instance of a ModuleType subclass of its own), then whether the deferred
# modules still work once used.
_KERAS_EXTRAS_PROBE = """
import sys, types
import tfdist, tensorflow as tf, keras
watched = ("sklearn", "matplotlib.pyplot")
print("IMPORTED", *[m for m in watched if type(sys.modules.get(m)) is types.ModuleType])
from keras.wrappers import SKLearnRegressor
assert tf.keras.wrappers.SKLearnRegressor is SKLearnRegressor
assert callable(keras.visualization.plot_image_gallery)
assert callable(tf.keras.visualization.draw_bounding_boxes)
print("USED", *[m for m in watched if type(sys.modules.get(m)) is types.ModuleType])
from sklearn.base import BaseEstimator
assert issubclass(keras.wrappers.SKLearnClassifier, BaseEstimator)
"""


def _keras_extras(eager: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TFDIST_EAGER_KERAS_IMPORTS"}
    env.update(PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2")
    if eager:
        env["TFDIST_EAGER_KERAS_IMPORTS"] = "1"
    result = subprocess.run([sys.executable, "-c", _KERAS_EXTRAS_PROBE], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = dict(line.split(" ", 1) if " " in line else (line, "")
                 for line in result.stdout.splitlines())
    return {key: set(lines[key].split()) for key in ("IMPORTED", "USED")}


def test_keras_still_imports_sklearn_and_pyplot_eagerly():
    """tfdist.lazy_keras (no upstream issue): Keras imports scikit-learn and matplotlib.pyplot
    at `import keras`. If the eager run stops importing them, Keras fixed it: delete
    lazy_keras. If the deferred run imports them, the deferral stopped working."""
    both = {"sklearn", "matplotlib.pyplot"}
    assert _keras_extras(eager=True)["IMPORTED"] == both
    deferred = _keras_extras(eager=False)
    assert deferred["IMPORTED"] == set(), deferred
    assert deferred["USED"] == both, deferred    # loaded on first use, and they work


def _rss_kb() -> int:
    with open("/proc/self/status") as f:
        return int(f.read().split("VmRSS:")[1].split()[0])


def _growth_kb(convert, calls: int = 20000) -> float:
    for i in range(200):   # warm-up: first calls allocate for good
        convert(i)
    before = _rss_kb()
    for i in range(200, 200 + calls):
        convert(i)
    return _rss_kb() - before


def test_tf_still_keeps_every_distinct_python_scalar_it_converts():
    """tfdist.train.loop.write_scalars hands numpy scalars to TensorFlow because the eager
    tensor of every distinct Python int and float is cached for good (tensorflow#68196;
    0.77 KB a value measured). When the Python case stops growing, the workaround can go.
    20,000 values: the cache grows about 15 MB, numpy scalars well under 3 MB."""
    # In a fresh process: in the suite's, memory earlier tests freed is reused first, and
    # the cache's growth showed as 7.8 MB of RSS (CI, 2026-12-07) instead of about 15.
    code = ("import numpy as np, tensorflow as tf, test_upstream_canaries as t\n"
            "print(t._growth_kb(lambda i: tf.constant(i * 0.001 + 0.5)),"
            " t._growth_kb(lambda i: tf.constant(np.float32(i * 0.001 + 0.25))))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, cwd=os.path.dirname(os.path.abspath(__file__)),
                          env=dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2"))
    assert done.returncode == 0, done.stderr[-3000:]
    python_scalars, numpy_scalars = map(float, done.stdout.split())
    assert python_scalars > 8000 and numpy_scalars < 3000, (python_scalars, numpy_scalars)


def test_tensorboard_scalars_do_not_grow_the_process(tmp_path):
    """The loop's summaries at 20,000 distinct steps and values (as --log_every writes
    them): no growth past the noise. Through Python scalars this grew about 30 MB
    (a step and a value per call, the test above)."""
    import tensorflow as tf
    from tfdist.train.loop import write_scalars
    writer = tf.summary.create_file_writer(str(tmp_path))
    assert _growth_kb(lambda i: write_scalars(writer, i, {"loss": 1.0 / (i + 1)})) < 3000


def test_keras_private_batch_norm_api():
    """tfdist.train.batch_stats replaces BatchNormalization._moments(inputs, mask) on
    the user's layers with the global batch's moments, reading _reduction_axes, and walks
    sub-layers with Layer._flatten_layers (keras_fixes.all_layers; keras-team/keras#4398
    closed without a public recursive listing)."""
    import keras
    from keras.src.layers.normalization import batch_normalization as bn
    assert list(inspect.signature(bn.BatchNormalization._moments).parameters) == [
        "self", "inputs", "mask"]
    assert "self._moments(" in inspect.getsource(bn.BatchNormalization.call)
    layer = keras.layers.BatchNormalization()
    layer.build((None, 3, 4))
    assert layer._reduction_axes == [0, 1]
    assert list(inspect.signature(keras.layers.Layer._flatten_layers).parameters) == [
        "self", "include_self", "recursive"]


def test_keras_synchronized_batch_norm_still_uses_the_cancelling_variance():
    """Why tfdist does not use Keras' synchronized=True (tfdist/train/batch_stats.py):
    E[x^2] - E[x]^2 loses digits where one device's tf.nn.moments does not. If Keras
    moves to the two-pass form, batch_stats could call it instead."""
    from keras.src.backend.tensorflow import nn as keras_tf_nn
    source = inspect.getsource(keras_tf_nn._compute_moments_sync)
    assert "y_squared_mean - tf.square(mean)" in source


def _startup_stderr(code: str, **env) -> str:
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                          text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=REPO, **env))
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stderr


def test_tensorflow_still_logs_its_startup_before_absl_is_initialised():
    """tfdist.quiet (tensorflow/tensorflow#100442): `import tensorflow` and its first device
    query print absl lines that TF_CPP_MIN_LOG_LEVEL=2 does not hide, on a machine without
    a GPU the cuInit E line among them. When TensorFlow stops printing them, tfdist.quiet can
    go; when it prints new ones, add them to quiet.NOISE (the assertion names them)."""
    from tfdist import quiet
    loud = _startup_stderr("import tensorflow as tf; tf.config.list_physical_devices()",
                           TF_CPP_MIN_LOG_LEVEL="2")
    lines = loud.splitlines()
    assert any("absl::InitializeLog" in line for line in lines), loud[-2000:]
    assert [line for line in lines if not quiet.NOISE.match(line)] == [], loud[-2000:]


def test_tf_coordination_key_value_store_calls_keep_their_signatures():
    """tfdist.parallel.dtensor.leader_leaves_last (no public API for the store)."""
    from tensorflow.python.eager import context
    assert list(inspect.signature(context.Context.set_config_key_value).parameters) == \
        ["self", "key", "value"]
    assert list(inspect.signature(context.Context.get_config_key_value).parameters) == \
        ["self", "key", "timeout_in_ms"]
    assert list(inspect.signature(context.Context.delete_config_key_value).parameters) == \
        ["self", "key"]
