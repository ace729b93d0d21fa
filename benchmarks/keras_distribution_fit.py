"""Step time of ModelParallel through keras.distribution (Keras' own model.fit, routed
by tfdist.keras_distribution) against tfdist's own dtensor path (tfdist.Strategy.fit)
on the same mesh (batch=2,model=2 over 4 simulated CPUs), model and layout map: a
keras-hub GemmaCausalLM (2 layers, hidden 64, 4 heads, vocabulary 512, sequences of
32, random weights) sharded by GemmaBackbone.get_layout_map; Adam, global batch 16.
The contenders alternate trial by trial in one process; medians and their ratio.

    python -m benchmarks --suite=keras_distribution
"""

import json
import os
import statistics
import subprocess
import sys

VOCABULARY, SEQUENCE, BATCH = 512, 32, 16


def compare(steps: int = 40, trials: int = 3):
    """Runs the contenders in a fresh process (it needs its own 4 simulated CPUs)."""
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.keras_distribution_fit", str(steps),
         str(trials)], env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", KERAS_BACKEND="tensorflow"),
        capture_output=True, text=True, timeout=3600, check=True)
    rates = json.loads(result.stdout.strip().splitlines()[-1])
    medians = {name: statistics.median(values) for name, values in rates.items()}
    return [{"contender": name, "examples_per_sec_median": round(medians[name], 1),
             "trials": " ".join(f"{r:.1f}" for r in rates[name]),
             "ratio_to_tfdist_dtensor": round(medians[name] / medians["tfdist dtensor"], 3)}
            for name in rates]


def _data(steps):
    import numpy as np
    tokens = np.random.default_rng(0).integers(0, VOCABULARY, size=(steps * BATCH, SEQUENCE + 1))
    tokens = tokens.astype("int32")
    x = {"token_ids": tokens[:, :-1], "padding_mask": np.ones_like(tokens[:, :-1])}
    return x, tokens[:, 1:]


def _model():
    import keras
    import keras_hub
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.GemmaBackbone(
        vocabulary_size=VOCABULARY, num_layers=2, num_query_heads=4, num_key_value_heads=4,
        hidden_dim=64, intermediate_dim=128, head_dim=16, dropout=0, dtype="float32")
    model = keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=None)
    model.compile(optimizer=keras.optimizers.Adam(1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def main(steps: str, trials: str) -> None:
    from tfdist import keras_distribution
    keras_distribution.enable(simulate_devices=4)
    import keras
    import keras_hub
    import tensorflow as tf
    import tfdist
    x, y = _data(int(steps))
    mesh = keras.distribution.DeviceMesh((2, 2), ["batch", "model"])
    layout_map = keras_hub.models.GemmaBackbone.get_layout_map(mesh)

    def via_keras_distribution():
        distribution = keras.distribution.ModelParallel(layout_map=layout_map,
                                                        batch_dim_name="batch")
        keras.distribution.set_distribution(distribution)
        try:
            _model().fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
        finally:
            keras.distribution.set_distribution(None)
        return keras_distribution.strategy_for(distribution).last_result.examples_per_sec

    def via_tfdist():
        strategy = tfdist.Strategy("dtensor", simulate_devices=4, mesh="batch=2,model=2",
                                   layout=layout_map)
        # keras-hub's fit turns the arrays into a batched Dataset; tfdist gets the same
        strategy.fit(_model(), tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH),
                     verbose=0)
        return strategy.last_result.examples_per_sec

    rates = {"keras.distribution ModelParallel": [], "tfdist dtensor": []}
    for _ in range(int(trials)):
        rates["keras.distribution ModelParallel"].append(via_keras_distribution())
        rates["tfdist dtensor"].append(via_tfdist())
    print(json.dumps(rates))


if __name__ == "__main__":
    main(*sys.argv[1:])
