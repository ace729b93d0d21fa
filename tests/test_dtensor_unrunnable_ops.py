"""An op DTensor cannot lay out (TF 2.21: "'tf.ReverseV2' op does not implement layout
propagation", from keras-io's Bidirectional LSTM; TensorListFromTensor from a recurrent
layer's loop) is refused at the first step, before anything ran, in one paragraph naming
the op and what uses it, instead of DTensor's MLIR error text. Found by the conformance
corpus (benchmarks/results/conformance.md)."""

import numpy as np
import pytest

from tfdist.errors import UsageError

pytestmark = pytest.mark.dtensor


def test_a_bidirectional_lstm_is_refused_naming_the_op_and_the_model_is_unchanged():
    import keras
    import tfdist
    strategy = tfdist.Strategy("dtensor", simulate_devices=4, mesh="batch=4")
    with strategy.scope():
        inputs = keras.Input((8,), dtype="int32")
        hidden = keras.layers.Embedding(32, 8)(inputs)
        hidden = keras.layers.Bidirectional(keras.layers.LSTM(8))(hidden)
        model = keras.Model(inputs, keras.layers.Dense(2)(hidden), name="bilstm")
        model.compile(optimizer="adam",
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x = np.random.default_rng(0).integers(0, 32, (64, 8)).astype("int32")
    y = np.zeros(64, "int32")
    before = [w.copy() for w in model.get_weights()]
    try:
        with pytest.raises(UsageError) as caught:
            strategy.fit(model, x, y, batch_size=16, epochs=1, verbose=0)
        with pytest.raises(UsageError, match="no layout propagation for the op"):
            strategy.evaluate(model, x, y, batch_size=16, verbose=0)
        with pytest.raises(UsageError, match="no layout propagation for the op"):
            strategy.predict(model, x[:16], batch_size=16, verbose=0)
    finally:
        strategy.close()
    message = str(caught.value)
    assert "cannot run model 'bilstm'" in message and "no layout propagation for the op" in message
    assert "Bidirectional" in message or "recurrent layer" in message, message
    assert "mirrored" in message and "MLIR" not in message and "\n" not in message, message
    assert all(np.array_equal(a, b) for a, b in zip(before, model.get_weights()))
