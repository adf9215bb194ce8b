"""Full training-state save/resume (Megatron dist_checkpointing); HF import/export later."""

from .save import latest_checkpoint, load_checkpoint, save_checkpoint

__all__ = ["latest_checkpoint", "load_checkpoint", "save_checkpoint"]
