"""The KV method's errors that commands catch, apart from the modelling code (no torch): a
command's `except` names them before the models load."""


class ModelNotFoundError(RuntimeError):
    """A model that is neither packaged, nor a local folder, nor in the local Hugging Face cache."""
