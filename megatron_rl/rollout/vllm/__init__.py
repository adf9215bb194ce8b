"""The vLLM rollout engine. ``adapter.py`` is the only module that imports vllm; importing this
package does not (``vllm_import_error()`` says whether vLLM can be used here)."""

from .adapter import vllm_import_error
from .engine import VLLMEngine

__all__ = ["VLLMEngine", "vllm_import_error"]
