"""The error of a model directory the decoder cannot load or run, one type for both of its models (the generator,
decoder_service/model/, and the sentence encoder, decoder_service/encoder/), so neither imports the other for it."""


class ModelError(Exception):
    """A model directory the runtime cannot load or run (the message says what and where)."""
