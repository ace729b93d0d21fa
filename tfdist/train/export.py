"""A trained model out of any mode: a plain Keras copy on one device, saved or exported.

Whatever the mode did to the user's model (mirrored variables, DTensor shards,
pipeline stages on their own devices), `model.get_weights()` gives the full
weights in single-device order. A clone built outside every strategy scope
takes them, with the model's compile settings, so `model.save` writes the
standard .keras file that `keras.saving.load_model` reads on one device, and
`model.export` a SavedModel that `tf.saved_model.load` serves.
"""

import logging

import keras

log = logging.getLogger("tfdist")


def plain_copy(model) -> keras.Model:
    """The model with the trained weights in ordinary variables (called outside a
    strategy scope, as tfdist's save and export are, they live on the default device)."""
    weights = model.get_weights()   # under multi-client DTensor a gather every client joins
    copy = keras.models.clone_model(model)
    if not copy.built:
        copy.build_from_config(model.get_build_config())
    copy.set_weights(weights)
    _compile_like(copy, model)
    return copy


def _compile_like(copy, model) -> None:
    """The loss, metrics and optimizer settings go into the .keras file when Keras can
    serialise them; a custom function it cannot is left out, with a note."""
    if not getattr(model, "compiled", False):
        return
    try:
        copy.compile_from_config(model.get_compile_config())
    except Exception as error:   # an unregistered custom loss or metric
        log.info("saving %s without its compile settings (%s: %s); load it with "
                 "keras.saving.load_model(..., compile=False) and compile again",
                 model.name, type(error).__name__, error)


def save(model, filepath: str, is_chief: bool = True) -> None:
    copy = plain_copy(model)
    if is_chief:
        copy.save(filepath)


def export(model, dirpath: str, is_chief: bool = True) -> None:
    copy = plain_copy(model)
    if is_chief:
        copy.export(dirpath, verbose=False)
