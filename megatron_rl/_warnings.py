"""Warnings every start or resume would print that say nothing a user can act on, filtered here, in
one place, by their exact text (so a new warning of the same libraries still shows):

- megatron-core's "Transformer Engine and Apex are not installed" / "Apex is not installed": printed
  at import on every machine without those optional kernels; the trainer's fallbacks are chosen on
  purpose (docs/gpu.md) and the rest of megatron-core's warnings still show.
- torch's "we are deprecating ShardedTensor" and "`load_state_dict` is deprecated": raised inside
  megatron-core's dist_checkpointing at every resume; nothing in this project calls either API.

(megatron-core's "full scope is deprecated" is avoided at its source: models/gpt.py passes
``cuda_graph_scope=[]``.)"""

from __future__ import annotations

import warnings

KNOWN_NOISE = (
    (UserWarning, r"Transformer Engine and Apex are not installed\. Falling back to "),
    (UserWarning, r"Apex is not installed\. Falling back to Torch Norm"),
    (FutureWarning, r"Please use DTensor instead and we are deprecating ShardedTensor\."),
    (FutureWarning, r"`load_state_dict` is deprecated and will be removed in future versions\. Please use `load` instead\."),
)


def quiet_known_warnings() -> None:
    """Install the filters (idempotent: ``warnings.filterwarnings`` drops duplicates)."""
    for category, message in KNOWN_NOISE:
        warnings.filterwarnings("ignore", message=message, category=category)
