"""learner.share_prompts: a group's prompt trained once, its responses attending to that copy.
The layout is checked by hand; logprobs, loss and updated weights must equal the plain rows'."""

import copy

import pytest
import torch

from megatron_rl.config.schema import RootConfig
from megatron_rl.learner.batch import build_shared_micro_batches
from megatron_rl.learner.learner import Learner
from megatron_rl.types import Trajectory

from batches import advantaged

VOCAB = 24


def _traj(uid, prompt, response, index=0):
    n = len(response)
    return Trajectory(uid, index, prompt, response, [-2.0] * n, [0] * n, "stop")


def test_shared_layout_by_hand():
    trajs = [_traj("a", [1, 2, 3], [4, 5]), _traj("b", [7, 8], [9, 10, 11]), _traj("a", [1, 2, 3], [6], 1)]
    (mb,) = build_shared_micro_batches(trajs, 1000, pad_id=0)
    shared = mb.shared
    # One row per prompt, shorter rows first (b: 2 + 3 tokens, a: 3 + 2 + 1); the batch's own
    # rows (the per-token fields) follow the same order.
    assert mb.rows == [1, 0, 2]
    assert shared.tokens.tolist() == [[7, 8, 9, 10, 11, 0], [1, 2, 3, 4, 5, 6]]
    # Each response continues at the end of its own prompt.
    assert shared.positions.tolist() == [[0, 1, 2, 3, 4, 0], [0, 1, 2, 3, 4, 3]]
    # The samples' own rows: the last prompt token, then the response.
    assert mb.tokens.tolist() == [[8, 9, 10, 11], [3, 4, 5, 0], [3, 6, 0, 0]]
    assert mb.labels[:, :3].tolist() == [[9, 10, 11], [4, 5, 0], [6, 0, 0]]
    # They read the logits of the prompt's last slot, then of their own: b/0 row 0's slots 1 | 2 3 4,
    # a/0 row 1's 8 | 9 10, a/1 8 | 11 (not a/0's). Places past a sample read slot 0 (masked).
    assert shared.logit_index.tolist() == [[1, 2, 3, 4], [8, 9, 10, 0], [8, 11, 0, 0]]
    layout = shared.layout
    segments = [(q[v].tolist(), k.tolist()) for q, v, k in zip(layout.q_index, layout.q_valid, layout.k_index)]
    pad = layout.slots  # 12: the zero slot
    assert segments == [
        ([0, 1], [0, 1, pad, pad, pad]),    # prompt b: causal among itself
        ([2, 3, 4], [0, 1, 2, 3, 4]),       # b/0: prompt b, then its own tokens
        ([6, 7, 8], [6, 7, 8, pad, pad]),   # prompt a
        ([9, 10], [6, 7, 8, 9, 10]),        # a/0
        ([11], [6, 7, 8, 11, pad]),         # a/1: prompt a, then slot 11 (not a/0's 9, 10)
    ]
    allowed = layout.allowed[:, 0]
    assert allowed[4, 0].tolist() == [True, True, True, True, False]  # a/1 sees prompt a and itself
    assert allowed[3, 1].tolist() == [True, True, True, True, True]   # a/0's second token: all five
    assert allowed[3, 0].tolist() == [True, True, True, True, False]  # ... its first: not the second
    assert allowed[2, 2].tolist() == [True, True, True, False, False]
    assert allowed[0, 2].tolist() == [True, False, False, False, False]  # padding query: one real key


def _groups():
    """Groups of 1-4 samples, prompts of 2-6 tokens, responses of 1-9 tokens, mixed advantages."""
    gen = torch.Generator().manual_seed(3)
    trajs, advantages = [], []
    for g, (prompt_len, size) in enumerate([(2, 4), (5, 3), (3, 1), (6, 4), (4, 2)]):
        prompt = torch.randint(1, VOCAB, (prompt_len,), generator=gen).tolist()
        for i in range(size):
            n = int(torch.randint(1, 10, (1,), generator=gen))
            response = torch.randint(1, VOCAB, (n,), generator=gen).tolist()
            trajs.append(_traj(f"p{g}", prompt, response, i))
            advantages.append(float((i + g) % 3 - 1))
    return advantaged(trajs, advantages)


def _cfg(share: bool, budget: int) -> RootConfig:
    cfg = RootConfig()
    cfg.model.num_attention_heads = 4
    cfg.model.num_query_groups = 2  # grouped-query attention through the segment kernel
    cfg.learner.share_prompts = share
    cfg.learner.micro_batch_tokens = budget
    cfg.algo.entropy_coef = 0.01
    cfg.algo.policy_loss = "decoupled"
    return cfg


cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="the learner refuses shared prompts on a GPU")


@cpu_only
@pytest.mark.parametrize("budget", [4096, 40])  # one micro-batch; several
def test_shared_prompts_train_exactly_as_separate_rows(megatron_world, budget):
    trajs = _groups()
    shared_mbs = build_shared_micro_batches(trajs, budget)
    assert (len(shared_mbs) == 1) == (budget > 1000)
    assert sorted(i for mb in shared_mbs for i in mb.rows) == list(range(len(trajs)))
    results = []
    for share in (False, True):
        torch.manual_seed(0)
        learner = Learner(_cfg(share, budget), VOCAB)
        logprobs = learner.compute_logprobs(trajs, 0.9)
        metrics = learner.train_step(copy.deepcopy(trajs), 0.9, lr=1e-3)
        weights = [p.detach().clone() for p in learner.model.parameters()]
        results.append((logprobs, metrics, weights))
    (lp_a, m_a, w_a), (lp_b, m_b, w_b) = results
    assert [len(x) for x in lp_a] == [len(t.response_ids) for t in trajs] == [len(x) for x in lp_b]
    assert max(abs(x - y) for ra, rb in zip(lp_a, lp_b) for x, y in zip(ra, rb)) <= 2e-6
    for key in ("train/loss", "train/entropy", "train/grad_norm"):
        assert abs(m_a[key] - m_b[key]) <= 1e-5 * max(1.0, abs(m_a[key])), key
    assert max((a - b).abs().max().item() for a, b in zip(w_a, w_b)) <= 1e-5


def test_share_prompts_refuses_what_it_cannot_lay_out(megatron_world, monkeypatch):
    from megatron_rl.checks import WORLD, load_config
    from megatron_rl.config import ConfigError

    # A pipeline runs in the torchrun world only: checked for that placement.
    with pytest.raises(ConfigError, match=r"learner.share_prompts=true is not supported with learner.pp > 1"):
        load_config("tiny_cpu", ["learner.share_prompts=true", "learner.pp=2"], placement=WORLD)
    with pytest.raises(ConfigError, match=r"multi-head latent attention"):
        load_config("tiny_cpu", ["learner.share_prompts=true", "model.family=deepseek_v3", "model.kv_lora_rank=16",
                                 "model.num_experts=4"])
    # A GPU learner: SDPA has no flash kernel for the segment mask there (measured 2-3x slower).
    import megatron_rl.learner.learner as learner_module

    monkeypatch.setattr(learner_module, "model_device", lambda: torch.device("cuda"))
    with pytest.raises(ConfigError, match="for CPU learners for now"):
        Learner(_cfg(True, 4096), VOCAB)


@cpu_only
def test_critic_values_with_shared_prompts_equal_separate_rows(megatron_world):
    from megatron_rl.learner.critic import Critic

    trajs = _groups()
    values = []
    for share in (False, True):
        torch.manual_seed(0)
        cfg = _cfg(share, 4096)
        cfg.algo.name = "gae"
        critic = Critic(cfg, VOCAB, 0, Learner(cfg, VOCAB).module)
        with torch.no_grad():  # off the zero-initialised value head, the same way for both
            gen = torch.Generator().manual_seed(1)
            for p in critic.module.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=gen).to(p.device))
        values.append(critic.compute_values(trajs))
    assert [len(v) for v in values[1]] == [len(t.response_ids) for t in trajs]
    assert max(abs(x) for v in values[0] for x in v) > 0.01  # values that can differ
    assert max(abs(x - y) for ra, rb in zip(*values) for x, y in zip(ra, rb)) <= 2e-6


def test_take_rows_backward_repeats_bit_for_bit_on_two_threads():
    """A group's prompt keys and last-prompt-token logits are read by every response, so their
    gradients add repeated rows. take_rows must give advanced indexing's values and add those
    rows in one order every time: with `t[index]` two runs of one seed at 2 threads drifted
    ~1e-8 apart per step (and this test saw different gradients within 30 tries)."""
    from megatron_rl.models.shared_prefix import take_rows

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        source = torch.randn(16 * 130, 4, 16, generator=torch.Generator().manual_seed(0))
        index = torch.randint(0, 16 * 130, (300, 70), generator=torch.Generator().manual_seed(1))
        upstream = torch.randn(300, 70, 4, 16, generator=torch.Generator().manual_seed(2))
        assert torch.equal(take_rows(source, index), source[index])
        grads = []
        for _ in range(30):
            x = source.clone().requires_grad_(True)
            take_rows(x, index).backward(upstream)
            grads.append(x.grad)
        assert all(torch.equal(grads[0], g) for g in grads[1:])
    finally:
        torch.set_num_threads(threads)
