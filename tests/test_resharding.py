"""Resharding on gloo ranks: a Megatron checkpoint converted from HF (written at TP=PP=EP=1) loads
at TP=2, PP=2 and EP=2 with the same logits as transformers; saved again at that layout, it loads
back at TP=PP=EP=1 with the same logits and bitwise the same tensors."""

import pytest
import torch

from hf_helpers import hf_logits, save_random_hf_model
from rank_harness import run_ranks

pytest.importorskip("transformers")
TOKENS = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(7))


def _sharded_logits(src: str, out, tp: int, pp: int, ep: int, tokens: torch.Tensor) -> torch.Tensor:
    """On each rank: build the model at (tp, pp, ep), load ``src`` (Megatron or HF), run the forward
    (the pipeline by hand: stage 0's hidden states sent to stage 1), save at this layout to ``out``
    unless None; return the full logits (gathered over TP) from the last stage, None elsewhere."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    from megatron_rl.models.causal_attention import causal_mask
    from megatron_rl.learner.parallel import init_model_parallel
    from megatron_rl.models.convert import load_pretrained, pretrained_model_config, write_model_config
    from megatron_rl.models.gpt import build_gpt_model

    init_model_parallel(tp, pp, ep, seed=123)
    cfg, vocab = pretrained_model_config(src, "fp32")
    first = parallel_state.is_pipeline_first_stage()
    last = parallel_state.is_pipeline_last_stage()
    model = build_gpt_model(cfg, vocab, tp=tp, pp=pp, ep=ep, pre_process=first, post_process=last).eval()
    load_pretrained(model, cfg, src)
    b, s = tokens.shape
    positions = torch.arange(s).unsqueeze(0).expand(b, s)
    with torch.no_grad():
        if not first:
            hidden = torch.empty(s, b, cfg.hidden_size)
            dist.recv(hidden, src=parallel_state.get_pipeline_model_parallel_prev_rank())
            model.set_input_tensor(hidden)
        output = model(tokens, positions, causal_mask(s, tokens.device))
        if not last:
            dist.send(output.contiguous(), dst=parallel_state.get_pipeline_model_parallel_next_rank())
    # dist_checkpointing's writer starts a multiprocessing Manager; the harness's ranks are daemon
    # processes, which Python forbids to have children. A rank here is a full worker (as under
    # torchrun), and the Manager exits with it.
    import multiprocessing

    if out is not None:
        multiprocessing.current_process()._config["daemon"] = False
        dist_checkpointing.save({"model": model.sharded_state_dict()}, out)
        if dist.get_rank() == 0:
            write_model_config(out, cfg, vocab)
        dist.barrier()
    return gather_from_tensor_model_parallel_region(output) if last else None


def _single_rank(path):
    from megatron_rl.models.convert import load_pretrained, pretrained_model_config
    from megatron_rl.models.gpt import build_gpt_model

    cfg, vocab = pretrained_model_config(path, "fp32")
    model = build_gpt_model(cfg, vocab).eval()
    load_pretrained(model, cfg, path)
    return model


@pytest.mark.parametrize("family,tp,pp,ep", [("qwen3", 2, 1, 1), ("llama", 1, 2, 1), ("qwen3_moe", 1, 1, 2),
                                             ("deepseek_v3", 2, 1, 1), ("deepseek_v3", 1, 1, 2)],
                         ids=["tp2", "pp2", "ep2", "tp2-deepseek", "ep2-deepseek"])
def test_reshard_and_back_keeps_logits(megatron_world, tmp_path, family, tp, pp, ep):
    from megatron_rl.learner.learner import forward_logits
    from megatron_rl.models.convert import hf_to_megatron_checkpoint
    from megatron_rl.models.hf_checkpoint import full_state

    hf_model = save_random_hf_model(family, tmp_path / "hf")
    reference = hf_logits(hf_model, TOKENS)
    hf_to_megatron_checkpoint(tmp_path / "hf", tmp_path / "one", layout=(tp, pp, ep))

    world = tp * pp * ep
    (tmp_path / "sharded").mkdir()
    results = run_ranks(_sharded_logits, world, args=(str(tmp_path / "one"), str(tmp_path / "sharded"), tp, pp, ep,
                                                      TOKENS), timeout_s=240)
    outputs = [r for r in results if r is not None]
    assert len(outputs) == (world if pp == 1 else 1)
    for logits in outputs:  # every TP / EP rank computes the whole batch's logits
        assert (logits - reference).abs().max().item() <= 1e-4

    # Back to one rank from the checkpoint written at the sharded layout.
    original, back = _single_rank(tmp_path / "one"), _single_rank(tmp_path / "sharded")
    with torch.no_grad():
        assert (forward_logits(back, TOKENS) - reference).abs().max().item() <= 1e-4
    want = full_state(original)
    got = full_state(back)
    assert sorted(want) == sorted(got)
    assert all(torch.equal(got[k], want[k]) for k in want if not k.endswith("_extra_state"))


@pytest.mark.parametrize("family,tp,pp,ep", [("qwen2", 1, 2, 1), ("qwen2_moe", 2, 1, 1), ("mixtral", 1, 1, 2),
                                             ("deepseek_v3", 2, 1, 1)],
                         ids=["pp2-tied", "tp2-moe-shared", "ep2", "tp2-deepseek"])
def test_hf_loads_directly_at_a_sharded_layout(tmp_path, family, tp, pp, ep):
    """model.path=<HF dir> on a multi-rank learner: each rank slices its part straight from the HF
    files (tied output layer on the last stage, expert TP, experts by global index)."""
    hf_model = save_random_hf_model(family, tmp_path / "hf")
    reference = hf_logits(hf_model, TOKENS)
    results = run_ranks(_sharded_logits, tp * pp * ep, args=(str(tmp_path / "hf"), None, tp, pp, ep, TOKENS),
                        timeout_s=240)
    outputs = [r for r in results if r is not None]
    assert outputs
    for logits in outputs:
        assert (logits - reference).abs().max().item() <= 1e-4


@pytest.mark.parametrize("family,layout", [("qwen3_moe", ("--ep", "2")), ("deepseek_v3", ("--pp", "2"))],
                         ids=["ep2", "pp2-deepseek"])
def test_cli_converts_under_torchrun_one_shard_per_rank(megatron_world, tmp_path, family, layout):
    """``torchrun --nproc-per-node 2 convert_checkpoint.py hf-to-megatron ... --ep 2``: each rank
    fills its own shard from the HF files; the checkpoint loads on one rank with transformers'
    logits and exports back bitwise."""
    import subprocess
    import sys
    from pathlib import Path

    from safetensors.torch import load_file

    from megatron_rl.learner.learner import forward_logits
    from megatron_rl.models.hf_checkpoint import full_state, hf_tensors

    hf_model = save_random_hf_model(family, tmp_path / "hf")
    tool = Path(__file__).resolve().parents[1] / "tools" / "convert_checkpoint.py"
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(tool), "hf-to-megatron", str(tmp_path / "hf"), str(tmp_path / "mcore"), *layout,
                           "--no-progress"], capture_output=True, text=True, timeout=300,
                          env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-4000:]
    model = _single_rank(tmp_path / "mcore")
    with torch.no_grad():
        assert (forward_logits(model, TOKENS) - hf_logits(hf_model, TOKENS)).abs().max().item() <= 1e-4
    from megatron_rl.models.convert import pretrained_model_config

    cfg, _ = pretrained_model_config(tmp_path / "mcore", "fp32")
    original = load_file(str(tmp_path / "hf" / "model.safetensors"))
    back = dict(hf_tensors(full_state(model).items(), cfg))
    assert sorted(back) == sorted(original)
    assert all(torch.equal(back[k], original[k]) for k in original)
