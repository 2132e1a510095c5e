"""kv4 (the 4-bit KV storage format) without vLLM: the page layout and its byte count, the
quantise/pack and unpack/dequantise round trip with its error bounds, the reference
attention, composition in a deployment (one plugin per role), the prefix-cache salt."""
import pytest
import torch

from vllm_graft.hooks import DeploymentError, validate
from vllm_graft.plugins.kvcompress.kv4 import KV4Params
from vllm_graft.plugins.kvcompress.kv4.reference import (
    KV4, bytes_per_token, dequantize_block_rows, dequantize_values, pack4, paged_attention_kv4,
    quantize_values, unpack4, unsupported, write)


def test_pack_layout_low_nibble_is_the_even_channel():
    codes = torch.tensor([[1, 2, 3, 4, 15, 0]], dtype=torch.uint8)
    packed = pack4(codes)
    assert packed.tolist() == [[0x21, 0x43, 0x0F]]
    assert torch.equal(unpack4(packed), codes)
    every = torch.randint(0, 16, (5, 3, 64), dtype=torch.uint8)
    assert torch.equal(unpack4(pack4(every)), every)


@pytest.mark.parametrize("D, B, G, expected", [(64, 32, 32, 80), (64, 16, 32, 88), (128, 32, 32, 160),
                                               (128, 16, 64, 168), (64, 128, 64, 70)])
def test_bytes_per_token_and_the_saving_versus_fp16(D, B, G, expected):
    # codes D/2 + D/2, value params 4 bytes per group, key params 4*D bytes per block over B rows
    assert bytes_per_token(D, B, G) == expected
    fp16 = 2 * D * 2
    print(f"kv4 D={D} B={B} G={G}: {expected} bytes/token/head vs fp16 {fp16} ({fp16 / expected:.2f}x), "
          f"fp32 {2 * fp16} ({2 * fp16 / expected:.2f}x)")
    assert fp16 / expected > 2.8


def test_unsupported_shapes_are_named():
    assert unsupported(64, 32, 32) is None
    assert "does not divide head size 96" in unsupported(96, 32, 64)
    assert "block size 256 does not divide 2 x head size (128)" in unsupported(64, 256, 32)
    assert "odd" in unsupported(63, 16, 1)


def test_values_round_trip_within_half_a_step_per_group():
    torch.manual_seed(0)
    v = torch.randn(40, 2, 64) * 3
    codes, params = quantize_values(v, 32)
    assert codes.shape == (40, 2, 32) and params.shape == (40, 2, 8) and codes.dtype == torch.uint8
    back = dequantize_values(codes, params, 32)
    g = v.view(40, 2, 2, 32)
    step = ((g.amax(-1) - g.amin(-1)) / 15)[..., None].expand_as(g).reshape(40, 2, 64)
    err = (back - v).abs()
    print(f"values: max err / step {(err / step).max():.3f}, max abs err {err.max():.4f}")
    assert (err <= step * 0.5 + 2e-3 * v.abs() + 1e-3).all()


def _cache(D=64, B=32, G=32, H=2, blocks=4):
    return torch.zeros(blocks, H, B, bytes_per_token(D, B, G), dtype=torch.uint8)


def test_keys_of_a_whole_block_are_quantised_per_channel_within_half_a_step():
    torch.manual_seed(1)
    D, B, G, H = 64, 32, 32, 2
    k = torch.randn(B, H, D)
    k[:, :, 5] *= 20  # an outlier channel: per-channel scales keep it from hurting the others
    v = torch.randn(B, H, D)
    cache = _cache(D, B, G, H)
    write(k, v, cache, torch.arange(B) + 2 * B, G)  # block 2, whole
    assert cache[[0, 1, 3]].eq(0).all()  # nothing else touched
    kb, vb = dequantize_block_rows(cache[2], D, B, G)  # [H, B, D]
    step = (k.amax(0) - k.amin(0)) / 15  # [H, D]
    err = (kb.permute(1, 0, 2) - k).abs()
    print(f"keys (one write): max err / step {(err / step).max():.3f}")
    assert (err <= step * 0.5 + 1e-3 * k.abs() + 1e-4).all()
    # the outlier channel does not widen the others' steps (per-token groups would)
    assert step[:, 4].max() < step[:, 5].min() / 5


def test_keys_written_one_token_at_a_time_stay_close():
    """Decode: the block's range widens as tokens arrive, re-encoding its earlier keys; the
    error grows beyond half a step (measured here), but stays bounded."""
    torch.manual_seed(2)
    D, B, G, H = 64, 32, 32, 2
    k, v = torch.randn(B, H, D), torch.randn(B, H, D)
    once, steps = _cache(D, B, G, H), _cache(D, B, G, H)
    write(k, v, once, torch.arange(B) + B, G)
    for t in range(B):
        write(k[t:t + 1], v[t:t + 1], steps, torch.tensor([B + t]), G)
    step = (k.amax(0) - k.amin(0)) / 15
    e_once = (dequantize_block_rows(once[1], D, B, G)[0].permute(1, 0, 2) - k).abs() / step
    e_steps = (dequantize_block_rows(steps[1], D, B, G)[0].permute(1, 0, 2) - k).abs() / step
    print(f"keys in steps of one token: max err {e_steps.max():.2f} steps (mean {e_steps.mean():.3f}); "
          f"whole block: max {e_once.max():.2f} (mean {e_once.mean():.3f})")
    assert e_steps.max() < 2.5 and e_steps.mean() < 0.4
    # values are per token: the same either way
    assert torch.equal(once[1, :, :, 32:72], steps[1, :, :, 32:72])  # value codes and params


def test_padding_slots_are_ignored_and_a_partly_written_block_keeps_its_tokens():
    torch.manual_seed(3)
    D, B, G, H = 64, 16, 32, 2
    cache = _cache(D, B, G, H)
    k, v = torch.randn(6, H, D), torch.randn(6, H, D)
    write(k, v, cache, torch.tensor([16, 17, 18, -1, -1, -1]), G)
    write(k[3:5], v[3:5], cache, torch.tensor([19, 20]), G)
    kb, vb = dequantize_block_rows(cache[1], D, B, G)
    got = kb.permute(1, 0, 2)[:5]
    want = torch.cat([k[:3], k[3:5]])
    assert (got - want).abs().max() < 0.5
    assert cache[0].eq(0).all() and cache[2:].eq(0).all()


def test_reference_attention_is_close_to_full_precision_attention():
    torch.manual_seed(4)
    D, B, G, H, Hkv = 64, 16, 32, 4, 2
    L = 40
    cache = _cache(D, B, G, Hkv, blocks=6)
    k, v = torch.randn(L, Hkv, D), torch.randn(L, Hkv, D)
    table = torch.tensor([[4, 1, 3, 0]], dtype=torch.int32)
    slots = table[0, torch.arange(L) // B].long() * B + torch.arange(L) % B
    write(k, v, cache, slots, G)
    from vllm_graft.hooks import AttentionLayer, PagedBatch

    q = torch.randn(3, H, D)
    batch = PagedBatch(torch.tensor([0, 3], dtype=torch.int32), torch.tensor([L], dtype=torch.int32), table)
    layer = AttentionLayer(H, Hkv, D, D ** -0.5, B)
    out, mass = paged_attention_kv4(q, cache, batch, layer, G, observe=torch.ones(3, dtype=torch.bool))
    kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    s = torch.einsum("qhd,khd->hqk", q, kk) * D ** -0.5
    s = s.masked_fill(torch.arange(L)[None, None] > torch.arange(L - 3, L)[None, :, None], float("-inf"))
    exact = torch.einsum("hqk,khd->qhd", s.softmax(-1), vv)
    err = (out - exact).abs().max().item()
    print(f"kv4 attention vs full precision: max err {err:.4f} (|out| max {exact.abs().max():.3f})")
    assert err < 0.15
    assert mass.shape == (1, 4) and abs(mass.sum().item() - 3 * H) < 1e-4  # one per query and head
    assert mass[0, 3] == 0 and mass[0, 2] > 0  # L = 40: three blocks of 16


def test_plugin_builds_and_describes():
    impl = KV4(KV4Params())
    assert impl.bytes_per_token(64, 32) == 80
    assert not hasattr(impl, "keep")  # a storage format evicts nothing: it is not a KVCompressor
    assert impl.describe() == {"kernel": "reference", "value_group_size": 32}


# ----------------------------------------------------------------- deployments (no vLLM)
def test_kv4_composes_with_one_eviction_compressor(registry, cpu_env):
    plan = validate({"engine": {"dtype": "float32"},
                     "kvcompress": [{"plugin": "streaming", "params": {"budget_blocks": 8}}, {"plugin": "kv4"}]},
                    registry, cpu_env)
    assert [e.name for e in plan.by_kind("kvcompress")] == ["streaming", "kv4"]
    assert [e.path for e in plan.by_kind("kvcompress")] == ["kvcompress[0]", "kvcompress[1]"]
    alone = validate({"kvcompress": {"plugin": "kv4", "params": {"value_group_size": 64}}}, registry, cpu_env)
    assert alone.deployment.to_json() == '{"kvcompress":{"plugin":"kv4","params":{"value_group_size":64}}}'
    for other in ("noop", "h2o", "snapkv"):
        validate({"kvcompress": [{"plugin": "kv4"}, {"plugin": other}]}, registry, cpu_env)


@pytest.mark.parametrize("items, expected", [
    ([{"plugin": "streaming"}, {"plugin": "h2o"}],
     "kvcompress: only one kvcompress plugin can be enabled at a time for each role: 'streaming' (at "
     "kvcompress[0]) and 'h2o' (at kvcompress[1]) both choose which KV blocks stay"),
    ([{"plugin": "kv4"}, {"plugin": "kv4", "params": {"value_group_size": 64}}],
     "kvcompress[1].plugin: plugin enabled twice"),
])
def test_two_plugins_of_one_role_are_refused(registry, cpu_env, items, expected):
    with pytest.raises(DeploymentError) as e:
        validate({"kvcompress": items}, registry, cpu_env)
    print(e.value)
    assert expected in str(e.value)


def test_two_storage_formats_are_refused(registry, cpu_env):
    from vllm_graft.hooks import Capabilities, Registration
    from vllm_graft.hooks.registry import Source

    registry.add(Registration(name="kv2", kind="kvcompress", summary="2-bit", paper="-",
                              impl="vllm_graft.plugins.kvcompress.kv4.reference:KV4",
                              params=KV4Params, capabilities=Capabilities(lossless=False, role="storage")),
                 Source("test", "0", "test"))
    with pytest.raises(DeploymentError) as e:
        validate({"kvcompress": [{"plugin": "kv4"}, {"plugin": "kv2"}, {"plugin": "streaming"}]}, registry, cpu_env)
    assert "'kv4' (at kvcompress[0]) and 'kv2' (at kvcompress[1]) both set how KV is stored" in str(e.value)
    assert "a kvcompress list may combine one plugin per role (eviction, storage)" in str(e.value)


def test_kv4_bad_input_gets_clear_errors(registry, cpu_env, tmp_path):
    import json

    with pytest.raises(DeploymentError) as e:
        validate({"kvcompress": {"plugin": "kv4", "params": {"value_group_size": 48}}}, registry, cpu_env)
    assert "kvcompress.params.value_group_size" in str(e.value)
    odd = tmp_path / "odd"
    odd.mkdir()
    (odd / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "head_dim": 80,
                                                 "torch_dtype": "float16"}))
    with pytest.raises(DeploymentError) as e:
        validate({"model": str(odd), "kvcompress": {"plugin": "kv4"}}, registry, cpu_env)
    assert "kvcompress plugin 'kv4' does not support head size 80" in str(e.value)
    window = tmp_path / "window"
    window.mkdir()
    (window / "config.json").write_text(json.dumps({"architectures": ["MistralForCausalLM"], "head_dim": 64,
                                                    "sliding_window": 4096, "torch_dtype": "float16"}))
    with pytest.raises(DeploymentError) as e:
        validate({"model": str(window), "kvcompress": [{"plugin": "streaming"}, {"plugin": "kv4"}]},
                 registry, cpu_env)
    assert "kv4' does not support sliding-window attention" in str(e.value)


def test_the_salt_separates_kv4_from_plain_and_from_other_compositions():
    from vllm_graft.integration.adapters.kvcompress.salt import cache_salt, composition_salt

    p = KV4Params()
    kv4 = composition_salt([("kv4", p, False)])
    both = composition_salt([("streaming", {"b": 8}, False), ("kv4", p, False)])
    assert kv4 == cache_salt("kv4", p) and kv4.startswith("vllm-graft/kvcompress/kv4/")
    assert both == cache_salt("streaming", {"b": 8}) + "+" + kv4
    assert composition_salt([("noop", None, True)]) is None
    assert composition_salt([("noop", None, True), ("kv4", p, False)]) == kv4
    assert composition_salt([("kv4", KV4Params(value_group_size=64), False)]) != kv4


def test_kv4_with_an_attention_plugin_is_refused_at_validation(registry, cpu_env):
    with pytest.raises(DeploymentError) as e:
        validate({"attention": {"plugin": "noop"}, "kvcompress": {"plugin": "kv4"}}, registry, cpu_env)
    assert "kvcompress plugin 'kv4' cannot be combined with attention plugin 'noop'" in str(e.value)


def test_the_batched_decode_path_matches_the_per_sequence_path():
    """The CPU path batches decode rows; the scored path (with mass) goes sequence by
    sequence: same outputs, GQA, ragged lengths, a prefill row among decode rows."""
    from vllm_graft.hooks import AttentionLayer, PagedBatch

    torch.manual_seed(5)
    D, B, G, H, Hkv = 64, 16, 32, 8, 2
    lens, qs = [40, 1, 17, 33, 12], [1, 1, 5, 1, 12]
    cache = _cache(D, B, G, Hkv, blocks=20)
    table = torch.randperm(19)[:15].add(1).view(5, 3).to(torch.int32)
    for i, L in enumerate(lens):
        slots = table[i, torch.arange(L) // B].long() * B + torch.arange(L) % B
        write(torch.randn(L, Hkv, D), torch.randn(L, Hkv, D), cache, slots, G)
    qsl = torch.tensor([0] + list(torch.tensor(qs).cumsum(0)), dtype=torch.int32)
    q = torch.randn(int(qsl[-1]), H, D)
    batch = PagedBatch(qsl, torch.tensor(lens, dtype=torch.int32), table)
    layer = AttentionLayer(H, Hkv, D, D ** -0.5, B)
    fast, none = paged_attention_kv4(q, cache, batch, layer, G)
    slow, mass = paged_attention_kv4(q, cache, batch, layer, G, observe=torch.ones(q.shape[0], dtype=torch.bool))
    print(f"batched vs per-sequence: max|diff| {(fast - slow).abs().max():.2e}")
    assert none is None and torch.allclose(fast, slow, atol=1e-5)
