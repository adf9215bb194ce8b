"""config.json -> ModelConfig for both spellings transformers has written (4.x: rope_theta and
rope_scaling at the top level; 5.x: rope_parameters), and one-line refusals naming the key."""

import pytest

from megatron_rl.models.hf_config import UnsupportedConfigError, hf_config_from_model, model_config_from_hf

# Shapes of a Llama-3.1-8B-like config as transformers 4 wrote it (written here by hand).
LLAMA31_V4 = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu", "hidden_size": 4096,
    "intermediate_size": 14336, "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "attention_bias": False,
    "mlp_bias": False, "tie_word_embeddings": False, "vocab_size": 128256, "torch_dtype": "bfloat16",
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
}


def test_transformers_4_spelling():
    cfg, vocab = model_config_from_hf(LLAMA31_V4)
    assert vocab == 128256
    assert (cfg.family, cfg.num_layers, cfg.hidden_size, cfg.num_query_groups, cfg.ffn_hidden_size) == \
        ("llama", 32, 4096, 8, 14336)
    assert cfg.rotary_base == 500000.0 and cfg.rope_scaling_factor == 8.0 and cfg.head_dim is None
    assert cfg.norm_epsilon == 1e-05


def test_qwen25_style_sliding_window_present_but_off():
    hf = {**LLAMA31_V4, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "rope_scaling": None,
          "use_sliding_window": False, "sliding_window": 131072, "max_window_layers": 28, "rope_theta": 1e6}
    hf.pop("attention_bias")
    cfg, _ = model_config_from_hf(hf)
    assert cfg.family == "qwen2" and cfg.rotary_base == 1e6 and cfg.rope_scaling_factor is None


def test_export_then_import_is_the_same_model():
    cfg, vocab = model_config_from_hf(LLAMA31_V4)
    assert model_config_from_hf(hf_config_from_model(cfg, vocab, LLAMA31_V4)) == (cfg, vocab)


def test_llama3_rope_with_any_original_context_and_factors_is_read_and_written_back():
    rope = {**LLAMA31_V4["rope_scaling"], "original_max_position_embeddings": 4096, "low_freq_factor": 2.0,
            "high_freq_factor": 8.0}
    cfg, vocab = model_config_from_hf({**LLAMA31_V4, "rope_scaling": rope})
    assert (cfg.rope_original_max_position_embeddings, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor) == (
        4096, 2.0, 8.0)
    back = hf_config_from_model(cfg, vocab)
    assert {k: back["rope_scaling"][k] for k in rope} == rope
    assert model_config_from_hf(back) == (cfg, vocab)


@pytest.mark.parametrize("change,fragment", [
    ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
    ({"mlp_bias": True}, "mlp_bias=True is not supported"),
    ({"attention_bias": True}, "attention_bias=True is not supported for LlamaForCausalLM"),
    ({"use_sliding_window": True}, "use_sliding_window=True is not supported"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_type='dynamic' is not supported"),
    ({"quantization_config": {"quant_method": "fp8"}}, "quant_method='fp8'"),
    ({"architectures": ["MambaForCausalLM"]}, "unsupported architecture 'MambaForCausalLM'"),
    ({"architectures": []}, "no 'architectures' entry"),
])
def test_refusals_name_the_key(change, fragment):
    with pytest.raises(UnsupportedConfigError) as info:
        model_config_from_hf({**LLAMA31_V4, **change})
    assert fragment in str(info.value) and "\n" not in str(info.value)
