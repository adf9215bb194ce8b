"""The learner's Triton logprob/entropy kernels (learner/logprob_kernels.py).

On a CPU: the tensor-parallel combination of per-slice statistics (``shift_to``) equals the
whole row's, against float64. The kernels themselves run through Triton's interpreter where
triton is installed (tests/triton_interpreter.py: the vLLM test phase's venv), compared with the
compiled chunk functions they replace and, through the autograd function, with float64
log-softmax and its gradient; and compiled on a GPU (skipped without CUDA: CI has no GPU).
"""

import pytest
import torch
from triton_interpreter import run_interpreted

from megatron_rl.learner import logprob_kernels as lk
from megatron_rl.learner import logprobs as lp
from megatron_rl.models.decode_attention import triton_available


def _statistics(logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    """[4, N] statistics of logits [N, V] in their own dtype, each row shifted by its own max;
    targets outside [0, V) give a target logit of 0."""
    x = logits / temperature
    m = x.max(dim=-1).values
    shifted = x - m[:, None]
    in_range = (targets >= 0) & (targets < logits.shape[1])
    target = x.gather(1, torch.where(in_range, targets, 0)[:, None])[:, 0]
    return torch.stack((m, shifted.exp().sum(-1), (shifted.exp() * shifted).sum(-1),
                        torch.where(in_range, target, torch.zeros_like(target))))


def test_slices_shifted_to_the_group_max_add_up_to_the_whole_row():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=gen, dtype=torch.float64) * 4
    logits[2, 30:] += 20  # one row whose max lies in the second slice only
    targets = torch.tensor([0, 49, 31, 24, 25, 7])
    whole = _statistics(logits, targets, 0.7)
    slices = [_statistics(logits[:, :25], targets, 0.7), _statistics(logits[:, 25:], targets - 25, 0.7)]
    group_max = torch.maximum(slices[0][0], slices[1][0])
    shifted = [lk.shift_to(s, group_max) for s in slices]
    combined = torch.cat((group_max.unsqueeze(0), shifted[0][1:] + shifted[1][1:]))
    torch.testing.assert_close(combined, whole, atol=1e-12, rtol=1e-12)
    log_norm, logprobs, entropy = lk.reduce_statistics(combined)
    reference = torch.log_softmax(logits / 0.7, dim=-1)
    torch.testing.assert_close(logprobs, reference.gather(1, targets[:, None])[:, 0], atol=1e-12, rtol=0)
    torch.testing.assert_close(entropy, -(reference.exp() * reference).sum(-1), atol=1e-12, rtol=0)
    torch.testing.assert_close(log_norm, torch.logsumexp(logits / 0.7, dim=-1), atol=1e-12, rtol=0)


# The kernels through the interpreter (its numpy has no bfloat16: fp32 and fp16): widths that are
# not a multiple of the block, a row whose max comes late, targets outside this rank's slice,
# temperature ≠ 1; then the autograd function against float64 log-softmax and its gradient.
_INTERPRETED_CASES = r"""
import torch
from megatron_rl.learner import logprob_kernels as lk, logprobs as lp
from test_logprob_kernels import _statistics

lk.FORWARD_BLOCK = lk.BACKWARD_BLOCK = 64
gen = torch.Generator().manual_seed(1)
for n, width, dtype, temperature in [(5, 200, torch.float32, 1.0), (3, 64, torch.float16, 0.6),
                                     (4, 130, torch.float32, 1.3)]:
    logits = (torch.randn(n, width, generator=gen) * 3).to(dtype)
    logits[0, -1] = 30  # the max in the row's last (partial) block
    targets = torch.randint(0, width, (n,), generator=gen)
    targets[1] = width + 5  # another rank's token
    in_range = targets < width
    local = torch.where(in_range, targets, torch.zeros_like(targets))
    stats = lk.row_statistics(logits, local, in_range, temperature)
    tol = 1e-5 if dtype == torch.float32 else 1e-3
    assert torch.allclose(stats, _statistics(logits.float(), targets, temperature), atol=tol, rtol=tol), (n, width)
    log_norm, _, entropy = lk.reduce_statistics(stats)
    g_lp, g_h = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    grad = lk.logits_gradient(logits, local, in_range, log_norm, entropy, g_lp, g_h, temperature)
    expected = lp.backward_chunk(logits, local, in_range, log_norm, entropy, g_lp, g_h, temperature)
    assert grad.dtype == logits.dtype and torch.allclose(grad.float(), expected.float(), atol=tol, rtol=tol)

logits = torch.randn(2, 3, 90, generator=gen, dtype=torch.float64) * 2
targets = torch.randint(0, 90, (2, 3), generator=gen)
weights = torch.randn(2, 3, 2, generator=gen, dtype=torch.float64)
def loss_of(logprobs, entropy):
    return (weights[..., 0] * logprobs + weights[..., 1] * entropy).sum()
x = logits.float().requires_grad_()
logprobs, entropy = lp.token_logprobs_and_entropy(x, targets, temperature=0.8)
loss_of(logprobs, entropy).backward()
ref = logits.clone().requires_grad_()
log_p = torch.log_softmax(ref / 0.8, dim=-1)
ref_lp, ref_h = log_p.gather(-1, targets[..., None])[..., 0], -(log_p.exp() * log_p).sum(-1)
loss_of(ref_lp, ref_h).backward()
assert (logprobs.double() - ref_lp).abs().max() < 1e-5 and (entropy.double() - ref_h).abs().max() < 1e-5
assert (x.grad.double() - ref.grad).abs().max() < 1e-5
print("logprob kernels ok")
"""


def test_kernels_through_the_interpreter():
    run_interpreted(_INTERPRETED_CASES, "logprob kernels ok")


@pytest.mark.skipif(not triton_available(), reason="needs a GPU with triton")
def test_compiled_kernels_equal_the_chunk_functions_on_a_gpu():
    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(300, 151936, generator=gen, device="cuda").bfloat16() * 3
    targets = torch.randint(0, 151936, (300,), generator=gen, device="cuda")
    x = logits.clone().requires_grad_()
    logprobs, entropy = lp.token_logprobs_and_entropy(x, targets)
    (logprobs.sum() + 0.3 * entropy.sum()).backward()
    ref = logits.float().double().requires_grad_()
    log_p = torch.log_softmax(ref, dim=-1)
    ref_lp, ref_h = log_p.gather(-1, targets[:, None])[:, 0], -(log_p.exp() * log_p).sum(-1)
    (ref_lp.sum() + 0.3 * ref_h.sum()).backward()
    assert (logprobs.double() - ref_lp).abs().max() < 1e-4 and (entropy.double() - ref_h).abs().max() < 1e-4
    # The gradient is written in bf16: within one bf16 rounding step (2^-8 relative) of float64.
    assert ((x.grad.double() - ref.grad).abs() <= 2 ** -8 * ref.grad.abs() + 1e-7).all()
