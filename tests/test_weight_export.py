"""The one export of a learner's weights (``weights/export.py``): full tensors under Hugging Face
names, the same whatever the learner's layout. At TP = PP = 1 it is what the learner's state dict
maps to, name by name; at TP = 2 and PP = 2 every rank gets exactly those tensors (TP shards
gathered, pipeline stages exchanged as tensors over the pipeline group)."""

import pytest
import torch

from parallel_cases import VOCAB, export_case, tiny_cfg
from rank_harness import run_ranks


@pytest.fixture(scope="module")
def reference(megatron_world):
    """A TP = PP = 1 learner moved off Megatron's init, its Megatron state and its export."""
    from megatron_rl.learner.learner import Learner

    learner = Learner(tiny_cfg(), VOCAB)
    with torch.no_grad():  # no layout hides behind symmetric weights
        gen = torch.Generator().manual_seed(7)
        for p in learner.module.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=gen).to(p.device))
    full = {k: v.detach().cpu().clone() for k, v in learner.module.state_dict().items() if isinstance(v, torch.Tensor)}
    return learner, full, {k: v.detach().cpu().clone() for k, v in learner.export_hf_weights()}


def test_one_process_export_is_the_state_dict_under_hf_names(reference):
    """What the learner's own export used to be at TP = PP = 1: each state-dict tensor mapped to
    its HF names, nothing more, nothing less."""
    from megatron_rl.models.hf_names import megatron_to_hf

    learner, _, exported = reference
    expected = {}
    for name, tensor in learner.module.state_dict().items():
        if isinstance(tensor, torch.Tensor) and not name.endswith("_extra_state"):
            expected.update((k, v.detach().cpu()) for k, v in megatron_to_hf(name, tensor, learner.cfg.model))
    assert sorted(exported) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(exported[name], tensor), name


@pytest.mark.parametrize("tp, pp", [(2, 2)], ids=["tp2xpp2"])
def test_sharded_export_gives_every_rank_the_one_process_tensors(reference, tp, pp):
    _, full, exported = reference
    out = run_ranks(export_case, tp * pp, args=(tiny_cfg(tp, pp), full), timeout_s=180)
    for rank, got in enumerate(out):
        assert sorted(got) == sorted(exported), rank
        for name, tensor in exported.items():
            assert torch.equal(got[name], tensor), (rank, name)
