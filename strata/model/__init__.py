"""The network and checkpoint loading (knows nothing of slots or requests)."""

from strata.model.config import CheckpointError, ModelArgs, load_model_args
from strata.model.loader import LoadedModel, load_checkpoint, save_checkpoint
from strata.model.qwen3_next import Qwen3Next
from strata.model.state import DecodeState

__all__ = ["CheckpointError", "ModelArgs", "load_model_args", "LoadedModel", "load_checkpoint",
           "save_checkpoint", "Qwen3Next", "DecodeState"]
