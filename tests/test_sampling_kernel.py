"""The fused sampling kernels (rollout/sampling_kernel.py): exact draws from softmax(logits / T) and
the logprob of each drawn token, in one read of the logits and a walk of one chunk.

CI has no GPU: the kernel's own code runs through Triton's interpreter where triton is installed
(the vLLM test phase), and compiled on a GPU. The same checks run both ways (``CHECKS``).
"""

from __future__ import annotations

import pytest

from megatron_rl.models.decode_attention import triton_available
from triton_interpreter import run_interpreted

CHECKS = r'''
import math
import torch
from megatron_rl.rollout import sampling, sampling_kernel


def seed(value):
    return torch.tensor([value], dtype=torch.int64, device=DEVICE)


def check_logprobs(dtype):
    # 3 rows over 5,000 entries in chunks of 4,096: a full chunk and a ragged one.
    torch.manual_seed(0)
    logits = (3 * torch.randn(3, 5000)).to(dtype).to(DEVICE)
    tokens, logprobs = sampling_kernel.sample(logits, 0.7, seed(11), chunk=4096, block=256)
    assert tokens.dtype == torch.int64 and logprobs.dtype == torch.float32
    assert bool(((tokens >= 0) & (tokens < 5000)).all()), tokens
    reference = torch.log_softmax(logits.double() / 0.7, dim=-1).gather(-1, tokens[:, None]).squeeze(-1)
    gap = (logprobs.double() - reference).abs().max().item()
    assert gap < 1e-5, (dtype, gap)


def check_distribution():
    # ROWS rows of the same 7 logits, in chunks of 2 entries walked a lane at a time (so each row's
    # draw spans four programs, the pick among them and a walk): the counts of the drawn ids
    # against softmax(x / T) by a chi-square test (6 degrees of freedom; 22.46 is its 0.1 % tail).
    # A kernel that drops the temperature (expected chi-square ~120 at 400 rows), walks the wrong
    # chunk, picks an entry one off or reuses one row's uniform for all rows fails it.
    rows, temperature = ROWS, 3.0
    row = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, 1.5, -0.5])
    logits = row.repeat(rows, 1).to(DEVICE)
    tokens, _ = sampling_kernel.sample(logits, temperature, seed(2024), chunk=2, block=1)
    counts = torch.bincount(tokens.cpu(), minlength=7).double()
    expected = rows * torch.softmax(row.double() / temperature, dim=0)
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 22.46, (chi2, counts.tolist(), expected.tolist())
    # The same seed draws the same tokens, whatever the chunk and the lanes; another seed others.
    again, _ = sampling_kernel.sample(logits[:50], temperature, seed(2024), chunk=8, block=4)
    assert torch.equal(again, tokens[:50])
    other, _ = sampling_kernel.sample(logits[:50], temperature, seed(2025), chunk=2, block=1)
    assert not torch.equal(other, tokens[:50])


def check_masked_entries():
    # -inf entries are never drawn, also when the whole first chunk is -inf.
    logits = torch.full((2, 5000), float("-inf"))
    logits[0, 4500], logits[0, 4700] = 1.0, 2.0
    logits[1, 10], logits[1, 4999] = 0.0, 0.0
    logits = logits.to(DEVICE)
    for value in range(8):
        tokens, logprobs = sampling_kernel.sample(logits, 1.0, seed(value), chunk=4096, block=512)
        assert int(tokens[0]) in (4500, 4700) and int(tokens[1]) in (10, 4999), tokens
        reference = torch.log_softmax(logits.double(), dim=-1).gather(-1, tokens[:, None]).squeeze(-1)
        assert (logprobs.double() - reference).abs().max().item() < 1e-6


def check_sample_tokens():
    # The engine's entry point takes the kernel for plain sampling, seeded from its generator:
    # the same generator state draws the same tokens.
    assert sampling_kernel.available(torch.zeros(2, 3, device=DEVICE))
    logits = torch.randn(3, 300, device=DEVICE)
    first = torch.Generator(device=DEVICE).manual_seed(7)
    second = torch.Generator(device=DEVICE).manual_seed(7)
    a, lp = sampling.sample_tokens(logits, 0.9, generator=first)
    b, _ = sampling.sample_tokens(logits, 0.9, generator=second)
    assert torch.equal(a, b)
    reference = torch.log_softmax(logits.double() / 0.9, dim=-1).gather(-1, a[:, None]).squeeze(-1)
    assert (lp.double() - reference).abs().max().item() < 1e-5


def check_self_check():
    # The once-per-device check passes, and catches a kernel whose logprobs are off; sampling then
    # keeps the torch path.
    assert sampling_kernel.agrees_with_torch(torch.device(DEVICE))
    launch = sampling_kernel.sample
    sampling_kernel.sample = lambda *a, **k: (lambda t, lp: (t, lp + 1e-3))(*launch(*a, **k))
    sampling_kernel.agrees_with_torch.cache_clear()
    try:
        assert not sampling_kernel.agrees_with_torch(torch.device(DEVICE))
        assert not sampling_kernel.available(torch.zeros(2, 3, device=DEVICE))
    finally:
        sampling_kernel.sample = launch
        sampling_kernel.agrees_with_torch.cache_clear()


check_self_check()
check_logprobs(torch.float32)
check_logprobs(torch.bfloat16)
check_distribution()
check_masked_entries()
check_sample_tokens()
print("sampling kernel checks passed")
'''


def test_sampling_kernel_through_the_interpreter():
    # Each program costs tens of ms interpreted: 400 rows for the distribution, 20,000 compiled.
    run_interpreted("DEVICE, ROWS = 'cpu', 400\n" + CHECKS, "sampling kernel checks passed")


@pytest.mark.skipif(not triton_available(), reason="needs a GPU and triton")
def test_sampling_kernel_compiled_on_a_gpu():
    namespace = {"DEVICE": "cuda", "ROWS": 20000}
    exec(compile(CHECKS.replace('print("sampling kernel checks passed")', ""), "checks", "exec"), namespace)
