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


def test_block_size_and_head_map_are_checked_at_validation(registry, cpu_env, tmp_path):
    """squeezed's chunk must divide the KV block size (engine.block_size, else vLLM's CPU
    default 128) and its head map must fit the model: refused before any engine starts."""
    m = model(tmp_path, "m", num_hidden_layers=2, num_key_value_heads=2)
    sq = {"plugin": "squeezed", "params": {"chunk": 64}}
    validate({"model": m, "attention": sq}, registry, cpu_env)  # 64 divides the default 128
    with pytest.raises(DeploymentError) as e:
        validate({"model": m, "engine": {"block_size": 32}, "attention": sq}, registry, cpu_env)
    text = str(e.value)
    assert "attention.params" in text and "chunk 64 does not divide the KV block size 32" in text
    assert "set params.chunk to 32" in text, text
    with pytest.raises(DeploymentError, match="chunk 256 does not divide the KV block size 128"):
        validate({"model": m, "attention": {"plugin": "squeezed", "params": {"chunk": 256}}}, registry, cpu_env)

    heads = tmp_path / "heads.json"
    heads.write_text(json.dumps({"format": "vllm-graft-razor-head-map/1",
                                 "retrieval": [[True, False, False], [False, False, True]]}))
    with_map = {"plugin": "squeezed", "params": {"mode": "streaming-heads", "head_map": str(heads)}}
    with pytest.raises(DeploymentError) as e:
        validate({"model": m, "attention": with_map}, registry, cpu_env)
    assert "has 2 layers of 3 KV heads, but model" in str(e.value) and "2 layers of 2" in str(e.value)
    assert "vllm-graft calibrate razor --model" in str(e.value)
    heads.write_text(json.dumps({"format": "vllm-graft-razor-head-map/1",
                                 "retrieval": [[True, False], [False, True]]}))
    plan = validate({"model": m, "attention": with_map}, registry, cpu_env)
    assert plan.model.num_layers == 2 and plan.model.num_kv_heads == 2


def test_kv4_layout_is_checked_at_validation(registry, cpu_env, tmp_path):
    m = model(tmp_path, "h32", hidden_size=4 * 32, num_hidden_layers=2)  # head size 32
    kv4 = {"kvcompress": {"plugin": "kv4"}}
    with pytest.raises(DeploymentError) as e:  # 2 x 32 = 64 is not a multiple of the default 128
        validate({"model": m, **kv4}, registry, cpu_env)
    assert "kvcompress.params" in str(e.value) and "block size 128 does not divide 2 x head size (64)" in str(e.value)
    validate({"model": m, "engine": {"block_size": 32}, **kv4}, registry, cpu_env)
    # platform unknown and no block size: the check waits for start-up
    from vllm_graft.hooks import Environment

    validate({"model": m, **kv4}, registry, Environment(platform=None))


@pytest.mark.parametrize("scored", ["h2o", "snapkv"])
def test_a_scored_compressor_with_an_attention_plugin_is_refused_at_validation(registry, cpu_env, tmp_path, scored):
    data = {"model": model(tmp_path, "m"), "attention": {"plugin": "hydragen"}, "kvcompress": {"plugin": scored}}
    with pytest.raises(DeploymentError, match=f"kvcompress plugin {scored!r} cannot be combined with attention"):
        validate(data, registry, cpu_env)


def test_a_snapkv_window_that_does_not_fit_its_budget_is_refused_at_validation(registry, cpu_env, tmp_path):
    """SnapKV always keeps its observation window's blocks: with the sink they must fit in
    budget_blocks, or requests would hold more than the budget."""
    m = model(tmp_path, "m")
    snap = {"plugin": "snapkv", "params": {"budget_blocks": 8, "window_tokens": 512}}
    with pytest.raises(DeploymentError) as e:  # blocks of 32: 512 tokens span up to 17 blocks
        validate({"model": m, "engine": {"block_size": 32}, "kvcompress": snap}, registry, cpu_env)
    text = str(e.value)
    assert "kvcompress.params" in text and "window_tokens 512 spans up to 17 KV blocks of 32 tokens" in text
    assert "set window_tokens to at most 192 or budget_blocks to at least 18" in text, text
    # the fix it names passes; so does the window with the CPU's default blocks of 128 (5 blocks)
    validate({"model": m, "engine": {"block_size": 32},
              "kvcompress": {"plugin": "snapkv", "params": {"budget_blocks": 8, "window_tokens": 192}}},
             registry, cpu_env)
    validate({"model": m, "kvcompress": snap}, registry, cpu_env)
    # a one-token window lies in one block: it fits beside the sink in a budget of 2; two tokens
    # may straddle two, and then the advice is the one-token window
    validate({"model": m, "kvcompress": {"plugin": "snapkv", "params": {"budget_blocks": 2, "window_tokens": 1}}},
             registry, cpu_env)
    with pytest.raises(DeploymentError, match="set window_tokens to at most 1 or budget_blocks to at least 3"):
        validate({"model": m, "kvcompress": {"plugin": "snapkv", "params": {"budget_blocks": 2, "window_tokens": 2}}},
                 registry, cpu_env)


def test_a_snapkv_window_the_check_accepts_never_makes_the_planner_exceed_its_budget():
    """The check's block count is the planner's: over a grid of geometries, every accepted
    window keeps at most budget_blocks prompt blocks, and every refused one can exceed it."""
    from itertools import product
    from types import SimpleNamespace

    from vllm_graft.hooks import BlockView
    from vllm_graft.plugins.kvcompress.snapkv import SnapKVParams
    from vllm_graft.plugins.kvcompress.snapkv.reference import SnapKV

    for B, budget, sink in product((16, 32), range(2, 6), (0, 1)):
        for window in range(1, 3 * B + 2):
            p = SnapKVParams(budget_blocks=budget, sink_blocks=sink, window_tokens=window)
            ok = not p.check_deployment(SimpleNamespace(block_size=B, platform="cpu"))
            worst = 0
            for prompt in range(window + 9 * B, window + 10 * B):  # every alignment
                nb = -(-prompt // B)
                kept = SnapKV(p).keep(BlockView(prompt, B, prompt, tuple(float(i % 5) for i in range(nb))))
                worst = max(worst, len([b for b in kept if b * B < prompt]))
            assert (worst <= budget) == ok, (B, budget, sink, window, worst)
