"""GPT built from the layer: its config, the model, its own checkpoint files and the converters
from and to transformers' GPT-2 and nanoGPT. Imports run config <- checkpoint <- gpt <- convert.

convert.convert (the command line's conversion) is not re-exported: the name would hide the module
convert as an attribute of this package."""

from .checkpoint import CheckpointError
from .config import GPTConfig, load_config
from .convert import (
    config_from_huggingface,
    config_to_huggingface,
    from_huggingface,
    from_nanogpt,
    nanogpt_model_args,
    to_huggingface,
    to_huggingface_state_dict,
    to_nanogpt_state_dict,
)
from .gpt import GPT, TinyGPT

__all__ = ["GPT", "CheckpointError", "GPTConfig", "TinyGPT", "config_from_huggingface", "config_to_huggingface",
           "from_huggingface", "from_nanogpt", "load_config", "nanogpt_model_args", "to_huggingface",
           "to_huggingface_state_dict", "to_nanogpt_state_dict"]
