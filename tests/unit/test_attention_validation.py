"""Attention plugins refuse, at deployment validation, models whose attention they cannot
serve (sliding window, MLA, encoder attention, ALiBi, soft-capping, sinks), head sizes and
bad parameters, each with the reason; before any engine starts."""
from __future__ import annotations

import json

import pytest

from vllm_graft.hooks import DeploymentError, validate
from vllm_graft.hooks.deployment import model_features
from vllm_graft.hooks.registry import Capabilities

BASE = {"architectures": ["LlamaForCausalLM"], "hidden_size": 256, "num_attention_heads": 4,
        "torch_dtype": "float16"}


def model(tmp_path, name, **extra):
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**BASE, **extra}))
    return str(folder)


@pytest.mark.parametrize("plugin", ["hydragen", "squeezed", "noop"])
@pytest.mark.parametrize("extra,words", [
    ({"sliding_window": 4096}, ["sliding-window attention", "sliding_window=4096"]),
    ({"layer_types": ["full_attention", "sliding_attention"]}, ["sliding-window", "layer_types"]),
    ({"kv_lora_rank": 512, "architectures": ["DeepseekV2ForCausalLM"]}, ["(MLA)", "kv_lora_rank=512"]),
    ({"is_encoder_decoder": True}, ["encoder", "is_encoder_decoder"]),
    ({"model_type": "bert"}, ["encoder", "model_type=bert"]),
    ({"attn_logit_softcapping": 50.0}, ["soft-capping"]),
])
def test_unsupported_model_attention_is_refused(registry, cpu_env, tmp_path, plugin, extra, words):
    data = {"model": model(tmp_path, "m", **extra), "attention": {"plugin": plugin}}
    with pytest.raises(DeploymentError) as e:
        validate(data, registry, cpu_env)
    text = str(e.value)
    assert "attention.plugin" in text and f"attention plugin {plugin!r} does not support" in text
    assert all(w in text for w in words), text


def test_supported_models_pass(registry, cpu_env, tmp_path):
    # Qwen2-style: a sliding_window value that is switched off
    m = model(tmp_path, "qwen", sliding_window=4096, use_sliding_window=False)
    for plugin in ("hydragen", "squeezed"):
        plan = validate({"model": m, "attention": {"plugin": plugin}}, registry, cpu_env)
        assert plan.enabled[0].name == plugin and plan.model.features == ()


def test_head_size_and_parameters_are_refused(registry, cpu_env, tmp_path):
    m = model(tmp_path, "odd", hidden_size=4 * 72)  # head size 72
    with pytest.raises(DeploymentError, match="does not support head size 72"):
        validate({"model": m, "attention": {"plugin": "hydragen"}}, registry, cpu_env)
    good = model(tmp_path, "good")
    with pytest.raises(DeploymentError) as e:
        validate({"model": good, "attention": {"plugin": "squeezed", "params": {"budget": 2, "chunk": 24}}},
                 registry, cpu_env)
    assert "attention.params.budget" in str(e.value) and "attention.params.chunk" in str(e.value)
    with pytest.raises(DeploymentError, match="min_group"):
        validate({"model": good, "attention": {"plugin": "hydragen", "params": {"min_group": 1}}},
                 registry, cpu_env)


def test_features_are_read_from_text_config_and_names_are_checked():
    assert model_features({"text_config": {"sliding_window": 512}})[0][0] == "sliding_window"
    assert model_features({"model_type": "gpt_oss"}) == (("attention_sinks", "model_type=gpt_oss"),)
    assert model_features(BASE) == ()
    with pytest.raises(ValueError, match="unknown model feature"):
        Capabilities(lossless=True, unsupported_features=("window",))
