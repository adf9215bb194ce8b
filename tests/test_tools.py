"""Tools under tools/."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

TOOLS = Path(__file__).resolve().parents[1] / "tools"


def test_plot_timeline_draws_every_span(tmp_path):
    spans = [{"name": "generate", "start": 0.0, "end": 1.0}, {"name": "train", "start": 0.5, "end": 2.0},
             {"name": "sync", "start": 2.0, "end": 2.1}, {"name": "generate", "start": 1.0, "end": 3.0}]
    (tmp_path / "timeline.jsonl").write_text("\n".join(json.dumps(s) for s in spans))
    result = subprocess.run([sys.executable, str(TOOLS / "plot_timeline.py"), str(tmp_path)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    svg = (tmp_path / "timeline.svg").read_text()
    assert svg.startswith("<svg") and svg.count("<rect") == 4
    assert ">generate<" in svg and ">train<" in svg and ">sync<" in svg


def test_plot_metrics_draws_a_real_run_into_the_file_named(tmp_path, monkeypatch):
    """A 3-step tiny_cpu run: the PNG is written where -o says, the reward panel's line is
    metrics.jsonl's reward/mean (smooth 1: the values themselves), and a run still being written
    (a torn last line) draws too."""
    from PIL import Image

    from megatron_rl.checks import load_config
    from megatron_rl.build import build_trainer

    sys.path.insert(0, str(TOOLS))
    import plot_metrics

    run_dir = tmp_path / "run"
    build_trainer(load_config("tiny_cpu", ["trainer.total_steps=3", f"trainer.run_dir={run_dir}", "trainer.progress=false",
                                     "algo.group_size=2", "algo.groups_per_batch=2", "learner.mini_batches=1",
                                     "trainer.save_final_checkpoint=false"])).run()
    with (run_dir / "metrics.jsonl").open("a") as fh:
        fh.write('{"step": 4, "reward/me')  # a run killed mid-line
    out = tmp_path / "plots" / "run.png"
    assert plot_metrics.main([str(run_dir), "-o", str(out)]) == 0
    with Image.open(out) as image:
        assert image.format == "PNG" and image.size == (1536, 864)
    rewards = [json.loads(line)["reward/mean"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()[:3]]
    fig = plot_metrics.figure([run_dir], smooth=1)
    titles = [ax.get_title() for ax in fig.axes]
    assert titles == ["reward", "response length", "staleness", "throughput"]
    (line,) = fig.axes[0].get_lines()
    assert list(line.get_xdata()) == [1, 2, 3] and list(line.get_ydata()) == rewards
    assert [ln.get_label() for ln in fig.axes[3].get_lines()] == ["generated", "trained"]
    # What cannot be drawn: one line naming it.
    assert plot_metrics.main([str(tmp_path / "nope"), "-o", str(out)]) == 2
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    with pytest.raises(plot_metrics.PlotError, match=r"matplotlib is not installed: pip install 'megatron_rl\[plot\]'"):
        plot_metrics.plot([run_dir], out)


def test_async_vs_sync_bench_prints_its_table():
    """The benchmark runs end to end (a few steps of a small recipe, the pair twice) and prints a
    row per run, the median speed-up with each pair's, and the overlap ceiling."""
    root = TOOLS.parent
    out = subprocess.run(
        [sys.executable, str(TOOLS / "bench/async_vs_sync.py"), "--recipe", "tiny_cpu", "--steps", "3",
         "--eta", "1", "--repeats", "2", "algo.groups_per_batch=2", "algo.group_size=4", "learner.mini_batches=1"],
        capture_output=True, text=True, timeout=600, cwd=root)
    assert out.returncode == 0, out.stderr[-2000:]
    table = [line.split() for line in out.stdout.splitlines() if line.split()[:1] in (["0"], ["1"])]
    assert [row[0] for row in table] == ["0", "1", "0", "1"]
    assert all(len(row) == 13 and float(row[-2]) >= 0 and row[-1] == "0" for row in table)  # held s, stale drops
    assert "speed-up" in out.stdout and "(runs: " in out.stdout and "overlap ceiling" in out.stdout
    assert "speed-up at equal reward" in out.stdout


def test_time_to_reward_by_hand():
    """The benchmark's equal-reward clock: seconds of steps until the mean of 20 consecutive
    rewards first reaches the target (rows 0..19 average 0.1, rows 1..20 average 0.15)."""
    sys.path.insert(0, str(TOOLS / "bench"))
    try:
        from async_vs_sync import time_to_reward
    finally:
        sys.path.pop(0)
    rows = [{"reward/mean": 0.1, "time/step_s": 0.5} for _ in range(20)]
    rows += [{"reward/mean": 1.1, "time/step_s": 2.0}, {"reward/mean": 5.0, "time/step_s": 1.0}]
    assert time_to_reward(rows, 0.1) == 10.0       # the first 20 steps: 20 × 0.5 s
    assert time_to_reward(rows, 0.15) == 12.0      # one step more
    assert time_to_reward(rows, 0.16) == 13.0      # rows 2..21
    assert time_to_reward(rows, 1.0) == float("inf")
    assert time_to_reward(rows[:3], 0.1) == 1.5    # a run shorter than the window: all of it


def test_placement_bench_runs_the_colocated_layout_on_a_cpu(tmp_path):
    """tools/bench/placement_gpu.py end to end where no GPU exists: the colocated row only (the
    disaggregated one needs a second GPU); its table has steps/hour and the final reward."""
    root = TOOLS.parent
    out = subprocess.run(
        [sys.executable, str(TOOLS / "bench/placement_gpu.py"), "--recipe", "tiny_cpu", "--steps", "3", "--eta", "1",
         "--skip", "1", "--placements", "colocated", "algo.groups_per_batch=2", "algo.group_size=4",
         "learner.mini_batches=1"],
        capture_output=True, text=True, timeout=600, cwd=root)
    assert out.returncode == 0, out.stderr[-2000:]
    row = next(line.split() for line in out.stdout.splitlines() if line.split()[:1] == ["colocated"])
    assert float(row[2]) > 0 and float(row[3]) > 0  # s/step, steps/hour
    assert "rollout.separate_process=true rollout.device=auto" in out.stdout


def test_engine_decode_bench_prints_both_attentions():
    out = subprocess.run([sys.executable, str(TOOLS / "bench/engine_decode.py"), "--rows", "4", "--windows", "8,16"],
                         capture_output=True, text=True, timeout=300, cwd=TOOLS.parent)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [line.split() for line in out.stdout.splitlines() if line.split()[:1] in (["8"], ["16"])]
    assert len(rows) == 2 and all(row[-1].endswith("x") and float(row[1]) > 0 and float(row[2]) > 0 for row in rows)


def test_engine_gpu_bench_runs_on_a_cpu():
    """The engine bench's CPU dry run at tiny_cpu's shape: the engine builds from the recipe's
    own options, generates with each sampler and attention slicing asked for, times two batches
    each (the median in the table), profiles (no kernels to list on a CPU) and the host's time,
    and the run's time split, the table rows and the logprob gap print."""
    out = subprocess.run([sys.executable, str(TOOLS / "bench/engine_gpu.py"), "--recipe", "tiny_cpu", "--batches", "4",
                          "--prompt-len", "8", "--new-tokens", "12", "--skip-hf", "--vocab", "64",
                          "--sampler", "fused,torch", "--profile", "--host-profile",
                          "--decode-attention", "triton,triton:4", "--repeats", "2"],
                         capture_output=True, text=True, timeout=300, cwd=TOOLS.parent)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "decode step at 4 rows by kind of kernel:" in out.stdout, out.stdout
    rows = [line.split() for line in out.stdout.splitlines() if line.split()[:3] == ["4", "8", "12"]]
    assert {row[3] for row in rows} == {"on/triton", "on/triton/torch", "on/triton:4", "on/triton:4/torch"}, out.stdout
    assert all(float(row[4]) > 0 for row in rows), out.stdout
    assert "outside model calls" in out.stdout, out.stdout
    assert out.stdout.count("host: batch profiled") == 4 and "_record" in out.stdout, out.stdout
    assert out.stdout.count("measured batch 2 of 2:") == 4 and "garbage collections by generation: 0:" in out.stdout
    assert out.stdout.count("measured batches: median") == 4, out.stdout
    assert "roofline 'measured' at an H200's measured peaks (803 TFLOP/s, 4.3 TB/s), not this CPU's" in out.stdout
    assert "logprob gap" in out.stdout and "max 0.000" in out.stdout, out.stdout


@pytest.mark.parametrize("bench", ["sampling_gpu.py", "swiglu_matmul_gpu.py"])
def test_gpu_only_benches_say_they_need_a_gpu(bench):
    """These benches import their sibling benches and the modules they time, and on a machine
    without a GPU stop with one line saying so."""
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the bench runs instead of stopping")
    out = subprocess.run([sys.executable, str(TOOLS / "bench" / bench), "--rows", "4"],
                         capture_output=True, text=True, timeout=300, cwd=TOOLS.parent)
    assert out.returncode == 1 and out.stderr.strip() == f"{bench} needs a GPU", out.stderr[-2000:]


@pytest.mark.parametrize("compare", ["attention", "packing"])
def test_learner_step_bench_prints_both_ways(compare):
    out = subprocess.run([sys.executable, str(TOOLS / "bench/learner_step.py"), "--compare", compare, "--recipe",
                          "tiny_cpu", "--digits", "6", "--threads", "1", "--steps", "2", "--repeats", "1",
                          "algo.groups_per_batch=2", "learner.mini_batches=1", "algo.group_size=4"],
                         capture_output=True, text=True, timeout=300, cwd=TOOLS.parent)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [line.split() for line in out.stdout.splitlines() if line.split()[:1] == ["6"]]
    assert len(rows) == 1 and rows[0][-1].endswith("x") and float(rows[0][3]) > 0 and float(rows[0][4]) > 0, out.stdout

def test_learner_gpu_bench_flop_formula_by_hand():
    """tools/bench/learner_gpu.py's TFLOP/s: Qwen2-1.5B's matmul weights are its 1.54B parameters
    (tied embeddings: the LM head counted once, the lookup is no matmul)."""
    sys.path.insert(0, str(TOOLS / "bench"))
    from learner_gpu import matmul_params, step_flops

    from megatron_rl.checks import load_config

    m = load_config("gsm8k_qwen2_gpu", ["trainer.progress=false"]).model
    per_layer = 1536 * (1536 + 2 * 128 * 2) + 1536 * 1536 + 3 * 1536 * 8960
    assert matmul_params(m, 151936) == 28 * per_layer + 151936 * 1536 == 1_543_569_408
    # 8 rows of 2048: 6 N T plus causal attention, 6 L d s^2 per row.
    assert step_flops(m, 151936, 8, 2048) == 6 * 1_543_569_408 * 8 * 2048 + 6 * 28 * 1536 * 8 * 2048 ** 2


def test_decode_gemm_bench_covers_the_step_matmuls():
    """tools/bench/decode_gemm_gpu.py's matmuls at Qwen2-1.5B's shape are the step's matmul
    weights: every layer's four and the LM head once, as model_size counts them (the down
    projection counted once: as ``fc2+act``, the plain ``fc2`` row shown but not summed)."""
    sys.path.insert(0, str(TOOLS / "bench"))
    from decode_gemm_gpu import bound_us, shapes
    from model_size import matmul_params

    from megatron_rl.checks import load_config

    m = load_config("gsm8k_qwen2_gpu", ["trainer.progress=false"]).model
    table = shapes(m.hidden_size, m.num_attention_heads, m.num_query_groups, m.hidden_size // m.num_attention_heads,
                   m.ffn_hidden_size, 151936, m.num_layers)
    weights = sum(out * inp * calls for _, out, inp, _, calls in table)
    assert weights == matmul_params(m, 151936)
    assert [name for name, *_, calls in table if calls == 0] == ["fc2"]
    # 256 rows of the output projection: compute-bound (1.21 GFLOP at 803 TFLOP/s = 1.50 us).
    assert abs(bound_us(256, 1536, 1536, 803, 4.3) - 2 * 256 * 1536 ** 2 / 803e6) < 1e-9


def test_engine_gpu_bench_roofline_by_hand():
    """tools/bench/engine_gpu.py's roofline at Qwen2-1.5B's shape, batch 256, 512 + 256 tokens:
    prefill matmuls and attention, then per step the matmuls (compute-bound at 256 rows) and the
    cached keys and values (28 KiB per token) read once."""
    sys.path.insert(0, str(TOOLS / "bench"))
    from engine_gpu import roofline_seconds

    from megatron_rl.checks import load_config

    m = load_config("gsm8k_qwen2_gpu", ["trainer.progress=false"]).model
    layers, weights = 1_543_569_408 - 151936 * 1536, 1_543_569_408
    prefill = (2 * layers * 512 + 2 * 28 * 1536 * 512 ** 2) * 256 / 989e12
    step = 2 * weights * 256 / 989e12  # > weights * 2 / 4.8e12: compute-bound
    kv = 256 * 28 * 2 * 2 * 128 * 2 * sum(512 + t for t in range(256)) / 4.8e12
    assert roofline_seconds(m, 151936, 256, 512, 256) == pytest.approx(prefill + 256 * step + kv, rel=1e-12)
    assert 0.80 < prefill + 256 * step + kv < 0.82  # ~81k tokens/s
    # One row: the step is bound by reading the weights, not by their arithmetic.
    one = roofline_seconds(m, 151936, 1, 512, 256)
    assert one > 256 * weights * 2 / 4.8e12


def test_learner_gpu_bench_active_flops_for_the_moe_recipe():
    """For MoE the bench counts active FLOPs: per layer attention (18.9 M), router (2048 x 128)
    and 8 of the 128 experts' three 2048 x 768 matmuls, plus the 151,936 x 2048 LM head: 0.54 B
    of the 3.11 B matmul weights of gsm8k_qwen3_moe_gpu (Qwen3-30B-A3B's layer shape, 4 layers)."""
    sys.path.insert(0, str(TOOLS / "bench"))
    from learner_gpu import step_flops
    from model_size import active_matmul_params, matmul_params

    from megatron_rl.checks import load_config

    m = load_config("gsm8k_qwen3_moe_gpu", ["trainer.progress=false"]).model
    attention, router, expert, head = 2048 * (4096 + 2 * 512) + 4096 * 2048, 2048 * 128, 3 * 2048 * 768, 151936 * 2048
    assert attention == 18_874_368
    assert active_matmul_params(m, 151936) == 4 * (attention + router + 8 * expert) + head == 538_705_920
    assert matmul_params(m, 151936) == 4 * (attention + router + 128 * expert) + head
    assert 3.10e9 < matmul_params(m, 151936) + head < 3.12e9  # with the (untied) embedding: 3.11 B parameters
    assert step_flops(m, 151936, 8, 2048) == 6 * 538_705_920 * 8 * 2048 + 6 * 4 * 32 * 128 * 8 * 2048 ** 2
    full = load_config("gsm8k_qwen3_moe_gpu", ["trainer.progress=false", "model.num_layers=48"]).model
    assert 30.4e9 < matmul_params(full, 151936) + head < 30.6e9  # Qwen3-30B-A3B: 30.5 B


def test_learner_gpu_bench_lora_flops_for_the_14b_recipe():
    """Under LoRA the frozen base costs its forward and input gradients, 4 · N · T, and the adapters
    all three products, 6 · N_lora · T: gsm8k_qwen3_14b_lora_gpu (Qwen3-14B's shape, 14.77 B
    parameters at its 151,936 vocabulary) trains rank-32 adapters on the four projections, 108.8 M."""
    sys.path.insert(0, str(TOOLS / "bench"))
    from learner_gpu import step_flops
    from model_size import lora_params, matmul_params

    from megatron_rl.checks import load_config

    cfg = load_config("gsm8k_qwen3_14b_lora_gpu", ["trainer.progress=false"])
    m, lora = cfg.model, cfg.lora
    # (in + out) of linear_qkv (q 5120 + k, v 1024 each), linear_proj, linear_fc1 (gate + up), linear_fc2
    per_layer = 32 * ((5120 + 7168) + (5120 + 5120) + (5120 + 2 * 17408) + (17408 + 5120))
    assert lora_params(m, lora.rank, lora.targets) == 40 * per_layer == 108_789_760
    head = 151936 * 5120
    n = 40 * (5120 * (5120 + 2 * 1024) + 5120 * 5120 + 3 * 5120 * 17408) + head
    assert matmul_params(m, 151936) == n
    assert 14.76e9 < n + head < 14.78e9  # with the untied embedding: Qwen3-14B's 14.77 B
    tokens, attention = 8 * 2048, 6 * 40 * 5120 * 8 * 2048 ** 2
    assert step_flops(m, 151936, 8, 2048, lora) == 4 * n * tokens + 6 * 108_789_760 * tokens + attention
    assert step_flops(m, 151936, 8, 2048) == 6 * n * tokens + attention  # full fine-tuning's count


def _built_family_model(family: str):
    """(ModelConfig, vocabulary, a built Megatron model) of tests/hf_helpers.py's small config of ``family``;
    tools/bench on the path for model_size."""
    sys.path.insert(0, str(TOOLS / "bench"))
    sys.path.insert(0, str(TOOLS.parent / "tests"))
    from hf_helpers import hf_config

    from megatron_rl.models.families import get_family
    from megatron_rl.models.gpt import build_gpt_model
    from megatron_rl.models.hf_config import model_config_from_hf

    hf = hf_config(family).to_dict()
    hf["architectures"] = [get_family(family).architecture]
    m, vocab = model_config_from_hf(hf)
    return m, vocab, build_gpt_model(m, vocab)


@pytest.mark.parametrize("family,targets", [("qwen3", ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]),
                                            ("qwen2_moe", ["linear_qkv", "linear_proj"]),
                                            ("deepseek_v3", ["linear_proj", "linear_fc1"])])
def test_bench_lora_params_count_the_adapters_of_the_built_model(megatron_world, family, targets):
    """tools/bench/model_size.py's adapter count against models/lora.py's adapters on a built model:
    fused q/k/v and gate/up, grouped-query and latent attention, MoE layers without MLP adapters
    (deepseek_v3's first layer is dense: its linear_fc1 gets one)."""
    from megatron_rl.models.lora import add_lora

    m, _, model = _built_family_model(family)
    from model_size import lora_params
    add_lora(model, 4, 8.0, 0.0, targets)
    assert lora_params(m, 4, targets) == sum(p.numel() for p in model.parameters() if p.requires_grad) > 0


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v3", "qwen2"])
def test_bench_matmul_params_count_every_matmul_weight_of_the_built_model(megatron_world, family):
    """tools/bench/model_size.py's counts against a built Megatron model of each family (dense
    layers, shared experts and their gate, multi-head latent attention included): every 2-D
    weight but the embedding lookup."""
    m, vocab, model = _built_family_model(family)
    from model_size import matmul_params
    weights = sum(p.numel() for name, p in model.named_parameters()
                  if p.dim() == 2 and name != "embedding.word_embeddings.weight")
    if m.tie_word_embeddings:
        weights += vocab * m.hidden_size  # the LM head multiplies by the embedding
    assert matmul_params(m, vocab) == weights


def test_learner_gpu_bench_kernels_busy_counts_overlaps_once():
    sys.path.insert(0, str(TOOLS / "bench"))
    from learner_gpu import union_length

    assert union_length([(5, 6), (0, 2), (1, 3), (5.5, 5.7), (3, 4)]) == 5.0
    assert union_length([]) == 0.0


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v3"])
def test_engine_gpu_bench_splits_fused_experts_as_checkpoints_store_them(tmp_path, family):
    """transformers keeps a layer's experts fused in memory; the engine bench pushes them under the
    per-expert names (and Mixtral's router name) of the checkpoint transformers itself writes."""
    sys.path.insert(0, str(TOOLS / "bench"))
    sys.path.insert(0, str(TOOLS.parent / "tests"))
    from engine_gpu import per_expert_hf_tensors
    from hf_helpers import save_random_hf_model
    from safetensors.torch import load_file

    from megatron_rl.models.hf_config import model_config_from_hf, read_hf_config

    model = save_random_hf_model(family, tmp_path)
    on_disk = {}
    for shard in tmp_path.glob("*.safetensors"):
        on_disk.update(load_file(shard))
    m, _ = model_config_from_hf(read_hf_config(tmp_path))
    split = dict(per_expert_hf_tensors(model.state_dict().items(), m))
    assert any(".experts.0." in name for name in split)
    assert sorted(split) == sorted(on_disk)
    assert all(torch.equal(split[name], on_disk[name]) for name in on_disk)


def test_engine_gpu_bench_moe_decode_bound_by_hand():
    """The whole Qwen3-30B-A3B at batch 256 (512 + 256 tokens): 256 rows choosing 8 of 128 experts
    touch all of them, so a decode step reads every expert (48 × 128 × 3 × 2048 × 768 bf16 values),
    the rest of the weights and the KV cache (96 KiB per token) at 4.3 TB/s; one row reads 8
    experts per layer."""
    sys.path.insert(0, str(TOOLS / "bench"))
    from engine_gpu import moe_decode_bound

    from megatron_rl.checks import load_config

    m = load_config("gsm8k_qwen3_moe_gpu", ["trainer.progress=false", "model.num_layers=48"]).model
    bound = moe_decode_bound(m, 151936, 256, 512, 256)
    experts = 48 * 128 * 3 * 2048 * 768 * 2
    other = (48 * (18_874_368 + 2048 * 128) + 151936 * 2048) * 2
    kv = 256 * 48 * 2 * 4 * 128 * 2 * (512 + 255 / 2)
    assert bound.experts_per_layer == pytest.approx(128.0)
    assert bound.expert_bytes == pytest.approx(experts) and bound.other_bytes == pytest.approx(other)
    assert bound.kv_bytes == pytest.approx(kv)
    assert bound.seconds == pytest.approx((experts + other + kv) / 4.3e12)  # ~17.8 ms
    one = moe_decode_bound(m, 151936, 1, 512, 256)
    assert one.experts_per_layer == pytest.approx(8.0)


def test_engine_gpu_bench_sorts_kernels_by_kind():
    """The profile's table by kind of kernel, from kernel names as an H200 profile gives them."""
    sys.path.insert(0, str(TOOLS / "bench"))
    from engine_gpu import kernel_kind, kinds_table

    kinds = {
        "attention_split_kernel": "attention",
        "attention_combine_kernel": "attention",
        "sample_chunk_kernel": "sampling",
        "sample_pick_kernel": "sampling",
        "rms_norm_kernel": "norm",
        "rope_store_kernel": "rotation+store",
        "void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::BFloat16, float, true>": "norm",
        "nvjet_tst_128x64_64x8_2x1_v_bz_TNT": "matmul",
        "void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16>": "matmul",
        "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>>": "residual add",
        "void at::native::vectorized_elementwise_kernel<4, at::native::silu_kernel(at::TensorIteratorBase&)>": "activation",
        "void at::native::elementwise_kernel<128, 4, at::native::direct_copy_kernel_cuda>": "copy",
        "Memcpy DtoH (Device -> Pinned)": "copy",
        "void at::native::vectorized_elementwise_kernel<4, at::native::MulFunctor<float>>": "other",
    }
    assert {name: kernel_kind(name) for name in kinds} == kinds
    # Two steps: 2 matmuls of 10 us and 4 norms of 2.5 us each per step.
    lines = kinds_table([("nvjet_a", 30.0, 2), ("nvjet_b", 10.0, 2), ("rms_norm_kernel", 20.0, 8)], steps=2)
    assert lines[1].split() == ["matmul", "0.020", "2", "10.00", "66.7%"]
    assert lines[2].split() == ["norm", "0.010", "4", "2.50", "33.3%"]


def test_engine_gpu_bench_sets_the_decode_attention_launch():
    """``--decode-attention triton:BLOCKxWARPSxSTAGES[xPROGRAMS]`` sets decode_attention's launch
    constants, ``triton:N`` only its target programs, and plain ``triton`` the module's own again."""
    sys.path.insert(0, str(TOOLS / "bench"))
    from engine_gpu import DEFAULT_ATTENTION_LAUNCH, use_decode_attention

    from megatron_rl.models import decode_attention as da
    from megatron_rl.models.kv_attention import CachedKVAttention

    def launch():
        return da.BLOCK_SLOTS, da.SPLIT_WARPS, da.SPLIT_STAGES, da.TARGET_PROGRAMS

    kernel = CachedKVAttention.decode_kernel
    try:
        use_decode_attention("triton:32x8x3x256")
        assert launch() == (32, 8, 3, 256)
        use_decode_attention("triton:32x8")
        assert launch() == (32, 8, *DEFAULT_ATTENTION_LAUNCH[2:])
        use_decode_attention("triton:128")
        assert launch() == (*DEFAULT_ATTENTION_LAUNCH[:3], 128)
    finally:
        use_decode_attention("triton")
        CachedKVAttention.decode_kernel = kernel
    assert launch() == DEFAULT_ATTENTION_LAUNCH
