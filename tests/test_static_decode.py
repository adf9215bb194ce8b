"""The engine's static-shape decode step (what a CUDA graph replays on a GPU) samples what the
eager step samples, and the fused prefill attention computes what the engine's matmul path does.

CI has no GPU: the static step runs here without capture (same shapes, same device-held slot,
same masked width and row buckets); capture itself is the only part left to the GPU benchmark.
"""

import functools

import numpy as np
import pytest
import torch

from megatron_rl.types import SamplingParams

from hf_helpers import FAMILY_CONFIGS, hf_config


# DeepSeek-V3's test shape has a query latent (q_lora_rank); this variant projects the query in one
# matmul (q_lora_rank=None, as DeepSeek-V2-Lite does).
VARIANTS = {"deepseek_v3_no_q_lora": ("deepseek_v3", dict(q_lora_rank=None))}


def _model(family: str):
    from megatron_rl.models.families import get_family
    from megatron_rl.models.gpt import build_gpt_model
    from megatron_rl.models.hf_config import model_config_from_hf

    family, overrides = VARIANTS.get(family, (family, {}))
    hf = {**hf_config(family, **overrides).to_dict(), "architectures": [get_family(family).architecture]}
    cfg, vocab = model_config_from_hf(hf)
    model = build_gpt_model(cfg, vocab, kv_attention=True).eval()
    with torch.no_grad():  # random, not Megatron's near-zero init, so every weight matters
        gen = torch.Generator().manual_seed(1)
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2 + (1.0 if p.ndim == 1 else 0.0))
    return model


def _script(model, static: bool):
    """Prefill rows of different lengths, decode across attention-width buckets, admit newcomers
    while a finished row is compacted away, decode until the window slides (multi-latent
    attention's window never slides: its widths keep growing)."""
    from megatron_rl.models.gpt import model_device
    from megatron_rl.rollout.embedded.generator import KVCachedGenerator

    gen = KVCachedGenerator(model, max_batch_size=12, max_seq_len=64, device=model_device(), seed=5,
                            static_decode=static)
    assert (gen._static is not None) == static
    params = SamplingParams(max_new_tokens=60)
    out = [gen.prefill([[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11, 12]], params)]
    out += [gen.decode(params) for _ in range(12)]
    out.append(gen.admit([0, 2], [[13, 14, 15, 16], [17, 18], [19, 20, 21]], params))
    out += [gen.decode(params) for _ in range(14)]
    out.append(gen.admit([], [[22, 23, 24, 25, 26]], params))  # one row left: the window slides
    out += [gen.decode(params) for _ in range(24)]
    assert gen.slides >= 1 or model.config.multi_latent_attention
    tokens = [t for step, _ in out for t in step]
    return tokens, torch.tensor([lp for _, step in out for lp in step]), _routing(out)


def _routing(out):
    """Every call's routing, row by row (None for a dense model)."""
    if out[0].routing is None:
        assert all(step.routing is None for step in out)
        return None
    return [row for step in out for row in step.routing]


@pytest.mark.parametrize("fused", [False, True], ids=["matmul", "fused"])
@pytest.mark.parametrize("family", sorted(FAMILY_CONFIGS) + sorted(VARIANTS))
def test_static_decode_step_samples_what_the_eager_step_samples(megatron_world, monkeypatch, family, fused):
    """Widths of 8 slots: the script crosses several width buckets, runs 1..5 live rows in buckets
    of 8 (dead rows compute beside them), and slides the window (the width shrinks again).
    Mixtures of experts run theirs too (routing, sort by expert and combine on the device; the
    routing each step records is the eager step's), and multi-latent attention (DeepSeek-V3, with
    and without a query latent; YaRN RoPE and mscale) its own (models/mla.py). ``fused``: as on a
    GPU, attention through torch's fused kernels and, for GQA, the static step's rotation and cache
    store as one call (models/rope_store.py, its torch reference here)."""
    from megatron_rl.models import kv_attention
    from megatron_rl.models.kv_attention import CachedKVAttention, EngineSelfAttention
    from megatron_rl.rollout.embedded import decode_graphs

    monkeypatch.setattr(decode_graphs, "WIDTH_STEP", 8)
    monkeypatch.setattr(CachedKVAttention, "fused_on_cpu", fused)
    monkeypatch.setattr(EngineSelfAttention, "rope_store_on_cpu", fused)
    stores = []
    reference = kv_attention.rope_store_reference
    # Each call's query layout: [rows, groups, heads per group, dim] as the fused projection holds it
    # (no reshape copy), unless the attention normalises its query (Qwen3) and so reshapes it first.
    monkeypatch.setattr(kv_attention, "rope_store_reference", lambda *a: stores.append(a[0].dim()) or reference(*a))
    model = _model(family)
    assert decode_graphs.static_decode_supported(model)
    mla = model.config.multi_latent_attention
    tokens, logprobs, routing = _script(model, static=False)
    assert not stores  # the eager step rotates and stores as before
    static_tokens, static_logprobs, static_routing = _script(model, static=True)
    assert bool(stores) == (fused and not mla), len(stores)
    if stores:
        normed = not kv_attention._identity(model.decoder.layers[0].self_attention.q_layernorm)
        assert set(stores) == ({3} if normed else {4}), (family, set(stores))
    assert static_tokens == tokens
    assert (routing is None) == (not model.config.num_moe_experts)
    if routing is not None:
        assert len(static_routing) == len(routing)
        assert all(np.array_equal(a, b) for a, b in zip(static_routing, routing))
    gap = (static_logprobs - logprobs).abs().max().item()
    print(f"{family}: {len(tokens)} tokens, static vs eager decode: max logprob gap {gap:.2e}")
    assert gap <= 1e-5, gap


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_the_fused_window_rotation_samples_what_the_unfused_path_samples(megatron_world, monkeypatch, family):
    """Prefills (padded rows), admissions (rows after the kept ones, slots after the offset) and
    eager decode steps through the window's fused rotation and cache store (models/rope_store.py,
    its torch reference here) sample what megatron-core's rotation and the cache's own writes
    sample. Qwen2 hands it the query as the fused projection's view; Qwen3 (query norm) as
    megatron-core's [sq, b, heads, dim]."""
    from megatron_rl.models import kv_attention
    from megatron_rl.models.kv_attention import EngineSelfAttention

    model = _model(family)
    tokens, logprobs, _ = _script(model, static=False)
    monkeypatch.setattr(EngineSelfAttention, "rope_store_on_cpu", True)
    windows = []
    reference = kv_attention.rope_store_window_reference
    monkeypatch.setattr(kv_attention, "rope_store_window_reference",
                        lambda *a: windows.append((a[0].dim(), a[7], a[8])) or reference(*a))
    fused_tokens, fused_logprobs, _ = _script(model, static=False)
    layers = model.config.num_layers
    assert {dim for dim, _, _ in windows} == ({4} if family == "qwen3" else {5})
    # Every layer of the prefill, the two admissions (one at rows 2.. after slot 15) and the 50 decode steps.
    assert len(windows) == layers * (3 + 50) and {(first, start) for _, first, start in windows} >= {(0, 0), (2, 15)}
    assert fused_tokens == tokens
    gap = (fused_logprobs - logprobs).abs().max().item()
    assert gap <= 1e-5, gap


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_the_lm_head_writes_the_static_steps_logits_in_place(megatron_world, family):
    """The static step's logits come from the LM head's matmul written into the decoder's one
    buffer (models/logits_target.py: no copy of [rows, V] per step), tied (qwen2's test shape) or
    untied (llama's) head alike, and only there: a forward with autograd computes its own."""
    from megatron_rl.models.gpt import model_device
    from megatron_rl.rollout.embedded.generator import KVCachedGenerator

    model = _model(family)
    gen = KVCachedGenerator(model, max_batch_size=4, max_seq_len=32, device=model_device(), seed=0,
                            static_decode=True)
    params = SamplingParams(max_new_tokens=8)
    gen.prefill([[1, 2, 3], [4, 5]], params)
    target = gen._static._head
    assert target is not None and target.writes == 0
    for step in range(3):
        gen.decode(params)
        # The first step makes the buffer (its logits copied in), every later one writes into it.
        assert target.writes == step
    assert target.buffer is None
    hidden = torch.randn(1, 2, model.config.hidden_size, device=model_device())
    with target.writing_to(gen._static.logits), torch.enable_grad():
        logits, _ = model.output_layer(hidden, weight=model.shared_embedding_or_output_weight())
    assert target.writes == 2 and logits.data_ptr() != gen._static.logits.data_ptr() and logits.requires_grad


def test_buckets():
    from megatron_rl.rollout.embedded.decode_graphs import WIDTH_STEP, row_bucket, width_bucket

    assert [row_bucket(n, 256) for n in (1, 8, 9, 64, 65, 200, 256)] == [8, 8, 16, 64, 128, 256, 256]
    assert row_bucket(100, 96) == 96
    assert width_bucket(1, 4096) == WIDTH_STEP and width_bucket(WIDTH_STEP + 1, 4096) == 2 * WIDTH_STEP
    assert width_bucket(4000, 3000) == 3000


def test_reachable_buckets_cover_every_step_and_stay_few():
    """Every (live rows, offset) a step can meet lands in a reachable bucket; past 16 widths they
    grow by an eighth, so a 2 x 16.9k-slot cache needs 33 widths (not 132), at most 1/8 + one
    WIDTH_STEP of masked slots more than a step needs."""
    from megatron_rl.rollout.embedded.decode_graphs import (WIDTH_STEP, reachable_buckets, row_bucket,
                                                            width_bucket, width_buckets)

    cache = 2 * (16384 + 512)
    widths = width_buckets(cache)
    assert len(widths) == 33 and widths[-1] == cache and widths[:16] == [WIDTH_STEP * k for k in range(1, 17)]
    assert all(b - a <= a // 8 + WIDTH_STEP for a, b in zip(widths, widths[1:]))
    reachable = set(reachable_buckets(256, cache))
    assert len(reachable) == 33 * 6
    for slots in (1, 255, 256, 257, 4096, 4097, 20000, cache):
        assert all((row_bucket(rows, 256), width_bucket(slots, cache)) in reachable for rows in (1, 9, 64, 114, 256))


def test_fused_attention_equals_the_matmul_path(megatron_world, monkeypatch):
    """The GPU's attention (torch's fused kernels; a prefill's queries also allowed their own
    slot) gives the real rows what the matmul path gives them: left-padded rows, GQA (qwen2: 4
    heads, 2 groups), prefill, admission and decode."""
    from megatron_rl.models.kv_attention import CachedKVAttention

    model = _model("qwen2")
    runs = []
    for fused in (False, True):
        monkeypatch.setattr(CachedKVAttention, "fused_on_cpu", fused)
        runs.append(_script(model, static=False)[:2] + _uniform_prefill(model))
    (tokens, logprobs, u_tokens, u_logprobs), (f_tokens, f_logprobs, fu_tokens, fu_logprobs) = runs
    assert f_tokens == tokens and fu_tokens == u_tokens
    gap = max((f_logprobs - logprobs).abs().max().item(), (fu_logprobs - u_logprobs).abs().max().item())
    print(f"fused vs matmul attention: max logprob gap {gap:.2e}")
    assert gap <= 1e-5, gap


def _uniform_prefill(model):
    """Prompts of one length: the prefill passes no mask (flash attention's causal path on a GPU)."""
    from megatron_rl.models.gpt import model_device
    from megatron_rl.rollout.embedded.generator import KVCachedGenerator

    gen = KVCachedGenerator(model, max_batch_size=4, max_seq_len=32, device=model_device(), seed=2)
    params = SamplingParams(max_new_tokens=10)
    out = [gen.prefill([[1, 2, 3, 4, 5], [6, 7, 8, 9, 10], [11, 12, 13, 14, 15]], params)]
    out += [gen.decode(params) for _ in range(8)]
    return [t for step, _ in out for t in step], torch.tensor([lp for _, step in out for lp in step])


def test_a_failed_graph_capture_falls_back_to_the_eager_step(megatron_world, monkeypatch, caplog):
    """Should capturing a bucket's step fail (an op that cannot be captured), the generator warns
    and decodes eagerly from then on: the same tokens as a generator that never had graphs."""
    from megatron_rl.rollout.embedded import decode_graphs

    model = _model("qwen2")
    tokens, logprobs, _ = _script(model, static=False)

    def failing_record(self, rows, width):
        self._forward(rows, width)  # the warm-up ran: the step's cache slot is written
        raise RuntimeError("operation not permitted when stream is capturing")

    init = decode_graphs.StaticDecoder.__init__

    def capturing_init(self, *args, **kwargs):  # a CPU cannot capture: pretend, up to _record
        init(self, *args, **kwargs)
        self.capture = True

    monkeypatch.setattr(decode_graphs.StaticDecoder, "__init__", capturing_init)
    monkeypatch.setattr(decode_graphs.StaticDecoder, "_record", failing_record)
    with caplog.at_level("WARNING"):
        fallback_tokens, fallback_logprobs, _ = _script(model, static=True)
    assert "decoding without CUDA graphs" in caplog.text
    assert fallback_tokens == tokens
    torch.testing.assert_close(fallback_logprobs, logprobs, atol=1e-5, rtol=0)


def test_engine_adds_a_bias_in_the_matmul_without_grad(megatron_world):
    """The engine's qwen2 query/key/value projection adds its bias in ``F.linear`` when no gradient
    is recorded (one kernel fewer on a GPU), and computes what megatron-core's function computes,
    which still runs with autograd on."""
    model = _model("qwen2")
    qkv = model.decoder.layers[0].self_attention.linear_qkv
    megatron_linear = qkv._forward_impl.args[0]
    calls = []
    qkv._forward_impl = functools.partial(qkv._forward_impl.func,
                                          lambda **kw: calls.append(1) or megatron_linear(**kw))
    x = torch.randn(3, 2, model.config.hidden_size)
    with torch.no_grad():
        fast, _ = qkv(x)
    assert not calls
    slow, _ = qkv(x)
    assert calls
    torch.testing.assert_close(fast, slow.detach(), atol=1e-6, rtol=1e-6)


class _HostSyncs(torch.overrides.TorchFunctionMode):
    """Records what, in a forward, would make a GPU wait for the host (and a CUDA graph fail or
    go stale): values read on the host, and ops whose output size depends on tensor values."""

    HOST_READS = {"item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__", "__index__"}

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        if name in self.HOST_READS or name in ("nonzero", "masked_select", "unique", "unique_consecutive"):
            self.seen.append(name)
        if name == "repeat_interleave" and kwargs.get("output_size") is None and isinstance(args[1] if len(args) > 1 else kwargs.get("repeats"), torch.Tensor):
            self.seen.append(name)
        if name == "__getitem__" and _has_bool_index(args[1]):
            self.seen.append("boolean index")
        return func(*args, **kwargs)


def _has_bool_index(index) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


@pytest.mark.parametrize("family", ["qwen2", "qwen2_moe", "qwen3_moe", "mixtral", "deepseek_v3",
                                    "deepseek_v3_no_q_lora"])
def test_the_static_step_never_waits_for_the_host(megatron_world, family):
    """The static decode step (what a CUDA graph captures) reads no value on the host and makes
    no tensor whose size depends on values: for mixtures of experts the routing, the sort by
    expert, the grouped matmuls and the combine stay on the device, routing recorded."""
    from megatron_rl.models.gpt import model_device
    from megatron_rl.rollout.embedded.generator import KVCachedGenerator

    model = _model(family)
    gen = KVCachedGenerator(model, max_batch_size=8, max_seq_len=32, device=model_device(), static_decode=True)
    assert gen._static is not None and gen.records_routing == bool(model.config.num_moe_experts)
    gen.prefill([[1, 2, 3], [4, 5, 6, 7, 8]], SamplingParams(max_new_tokens=8))
    syncs = _HostSyncs()
    with torch.no_grad(), syncs:
        logits, choices = gen._static.step(gen._last, gen.offset)
    assert logits.shape[0] == 2 and (choices is None) == (not model.config.num_moe_experts)
    assert not syncs.seen, syncs.seen
    # The detector sees what it looks for (megatron-core's SequentialMLP splits rows by counts
    # read on the host; a boolean index sizes its output by the values).
    with _HostSyncs() as check:
        x = torch.arange(4.0)
        x[x > 1], x.sum().item(), x.tolist()
    assert check.seen == ["boolean index", "item", "tolist"], check.seen


class _Calls(torch.overrides.TorchFunctionMode):
    """Counts calls of one torch function."""

    def __init__(self, name: str):
        super().__init__()
        self.name, self.count = name, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.count += getattr(func, "__name__", "") == self.name
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("family, halves_per_layer", [("qwen2", 2), ("mixtral", 1)])
def test_engine_adds_the_residual_in_the_matmul(megatron_world, monkeypatch, family, halves_per_layer):
    """The engine's attention output projection (and a dense MLP's down projection) adds the
    layer's residual in its matmul (models/residual_in_matmul.py): the same tokens and logprobs as
    a model whose layers add it on their own, through prefills, decodes, admissions and a sliding
    window; a mixture-of-experts layer folds its attention half only."""
    import megatron_rl.models.gpt as gpt
    from megatron_rl.models.residual_in_matmul import residual_in_matmul_without_grad

    folded = _model(family)
    monkeypatch.setattr(gpt, "residual_in_matmul_without_grad", lambda model: 0)
    plain = _model(family)
    layers = len(plain.decoder.layers)
    runs = {}
    for name, model in (("folded", folded), ("plain", plain)):
        with _Calls("addmm_") as calls:
            runs[name] = _script(model, static=False)
        runs[name] += (calls.count,)
    tokens, logprobs, _, addmms = runs["folded"]
    assert addmms > 0 and addmms % (halves_per_layer * layers) == 0 and runs["plain"][3] == 0
    assert tokens == runs["plain"][0]
    torch.testing.assert_close(logprobs, runs["plain"][1], atol=1e-5, rtol=0)
    # A norm then its projection: the residual goes into the matmul without autograd only (a
    # training forward is never changed).
    assert residual_in_matmul_without_grad(plain) == halves_per_layer * layers
    layer = plain.decoder.layers[0]
    projection = layer.self_attention.linear_proj
    hidden = torch.randn(3, 2, plain.config.hidden_size)
    attended = torch.randn(3, 2, projection.input_size)
    for grad, addmms in ((True, 0), (False, 1)):
        with torch.set_grad_enabled(grad), _Calls("addmm_") as calls:
            layer.input_layernorm(hidden)
            out, _ = projection(attended)
        assert calls.count == addmms, grad
        # Without autograd the sum is written over the residual (no new buffer, no copy into one).
        assert (out.data_ptr() == hidden.data_ptr()) == (not grad)
