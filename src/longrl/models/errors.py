"""The error of a model that cannot be loaded (its own module: loading.py and from_checkpoint.py both raise it)."""


class ModelLoadError(RuntimeError):
    """The model or tokenizer could not be loaded; the message names the path or id."""
