"""xquant (XQuant's GQA variant: the quantised latent of the layer input, K and V
rematerialised): its bit packing, its RoPE against vLLM's own, the latent algebra, the page
write and read, attention against attention over the true K/V, the bases file and its errors,
and the positions the engine's format seam hands a write that asks for them."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from vllm_graft.hooks import AttentionLayer, DeploymentError, PagedBatch, validate
from vllm_graft.plugins.kvcompress._shared.quant import dequantize_groups, pack_bits, quantize_groups, unpack_bits
from vllm_graft.plugins.kvcompress.xquant import XQuantParams
from vllm_graft.plugins.kvcompress.xquant import bases as xb
from vllm_graft.plugins.kvcompress.xquant import reference as xr
from vllm_graft.plugins.kvcompress.xquant.layout import bytes_per_token, unsupported

TINY = Path(__file__).resolve().parents[2] / "models" / "graft-tiny-llama"


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_codes_pack_eight_over_bits_to_a_byte_and_unpack(bits):
    g = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 1 << bits, (3, 5, 64), generator=g, dtype=torch.uint8)
    packed = pack_bits(codes, bits)
    assert packed.shape == (3, 5, 64 * bits // 8) and packed.dtype == torch.uint8
    assert torch.equal(unpack_bits(packed, bits), codes)
    if bits == 4:  # kv4's layout: channel 2j in the low nibble, 2j+1 in the high one
        assert int(packed[0, 0, 0]) == int(codes[0, 0, 0]) | int(codes[0, 0, 1]) << 4


@pytest.mark.parametrize("bits,tol", [(2, 0.5), (4, 0.1), (8, 0.006)])
def test_group_quantisation_error_is_within_half_a_step(bits, tol):
    x = torch.randn(16, 3, 64, generator=torch.Generator().manual_seed(0))
    codes, params = quantize_groups(x, 32, bits)
    assert params.shape == (16, 3, 4 * 64 // 32)
    y = dequantize_groups(codes, params, 32, bits)
    g = x.reshape(16, 3, 2, 32)
    step = (g.amax(-1) - g.amin(-1)) / ((1 << bits) - 1)
    err = (y - x).abs().reshape(16, 3, 2, 32).amax(-1)
    assert bool((err <= step * 0.5 + 2e-3 * step + 1e-3).all())
    assert float((y - x).abs().mean()) < tol


def test_bytes_per_token_and_shapes_it_cannot_hold():
    assert bytes_per_token(64, 4, 32) == 32 + 32 + 8 + 8 + 4 == 84
    assert bytes_per_token(64, 2, 64) == 16 + 16 + 4 + 4 + 4 == 44
    assert bytes_per_token(128, 8, 128) == 128 + 128 + 4 + 4 + 4
    assert "group_size 32 does not divide head size 80" in unsupported(80, 4, 32)
    assert unsupported(64, 4, 32) is None


def test_rope_is_vllms_neox_rope_and_its_inverse_undoes_it():
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    theta, D = 100000.0, 64
    with set_current_vllm_config(VllmConfig()):
        rot = get_rope(D, 4096, is_neox_style=True, rope_parameters={"rope_type": "default", "rope_theta": theta},
                       dtype=torch.float32)
    g = torch.Generator().manual_seed(1)
    k = torch.randn(40, 3, D, generator=g)
    pos = torch.randint(0, 4000, (40,), generator=g)
    q = torch.zeros(40, 3 * D)
    _, want = rot.forward_native(pos, q, k.reshape(40, 3 * D).clone())
    got = xr.rope(k, pos, theta)
    assert torch.allclose(got, want.reshape(40, 3, D), atol=1e-5)
    assert torch.allclose(xr.rope(got, pos, theta, inverse=True), k, atol=1e-5)


def _basis(hidden=96, Hkv=2, D=16, seed=0, bias=True):
    """A random layer's projections, their bases and a few layer inputs X."""
    g = torch.Generator().manual_seed(seed)
    n = Hkv * D
    w = {p: torch.randn(n, hidden, generator=g, dtype=torch.float64) / math.sqrt(hidden) for p in "kv"}
    b = {p: (torch.randn(n, generator=g, dtype=torch.float64) if bias else torch.zeros(n, dtype=torch.float64))
         for p in "kv"}
    t = {}
    for p in "kv":
        u, s, _ = torch.linalg.svd(w[p], full_matrices=False)
        t[f"{p}_u"], t[f"{p}_s"], t[f"{p}_bias"] = u.float(), s.float(), b[p].float()
    x = torch.randn(20, hidden, generator=g, dtype=torch.float64)
    return xr.Basis(t, 10000.0), w, b, x


def test_the_latent_is_the_layer_input_projected_on_the_right_singular_vectors():
    basis, w, b, x = _basis()
    k = (x @ w["k"].T + b["k"]).float().reshape(20, 2, 16)
    lat = basis.latent(k, "k")
    _, _, vh = torch.linalg.svd(w["k"], full_matrices=False)
    u = torch.linalg.svd(w["k"], full_matrices=False)[0]
    # the latent is X Vh^T, up to each singular vector's sign (fixed by U: the same decomposition)
    assert torch.allclose(lat.reshape(20, 32).double(), x @ vh.T, atol=1e-4)
    assert torch.allclose(basis.rematerialise(lat, "k"), k, atol=1e-4)
    assert u.shape == (32, 32)


def _paged(T_per_seq=(37, 20), B=16, Hkv=2, D=16, seed=3):
    """Two sequences' true post-RoPE K, V and their slots in a paged cache."""
    g = torch.Generator().manual_seed(seed)
    keys, vals, slots, table, pos = [], [], [], [], []
    nxt = 1
    for L in T_per_seq:
        nb = -(-L // B)
        blocks = list(range(nxt, nxt + nb))
        nxt += nb
        table.append(blocks)
        for t in range(L):
            slots.append(blocks[t // B] * B + t % B)
            pos.append(t)
        keys.append(torch.randn(L, Hkv, D, generator=g))
        vals.append(torch.randn(L, Hkv, D, generator=g))
    width = max(len(r) for r in table)
    bt = torch.tensor([r + [0] * (width - len(r)) for r in table], dtype=torch.int32)
    return torch.cat(keys), torch.cat(vals), torch.tensor(slots), bt, torch.tensor(pos), nxt


@pytest.mark.parametrize("with_basis", [False, True])
def test_the_write_stores_rows_at_their_slots_and_reads_back_the_kv(with_basis):
    basis = _basis()[0] if with_basis else None
    k, v, slots, bt, pos, nblocks = _paged()
    if basis is not None:
        k = xr.rope(k, pos, basis.theta)  # vLLM hands the cache post-RoPE keys
    cache = torch.zeros(nblocks, 2, 16, bytes_per_token(16, 8, 16), dtype=torch.uint8)
    padded = torch.cat([slots, torch.tensor([-1, -1])])
    kp, vp, pp = (torch.cat([t, t[:2]]) for t in (k, v, pos))
    xr.write(kp, vp, cache, padded, pp, 8, 16, basis)
    dk, dv = xr.decode_block_rows(cache, 16, 8, 16, basis)  # [N, H, B, D]
    blocks, offs = slots // 16, slots % 16
    got_k, got_v = dk[blocks, :, offs], dv[blocks, :, offs]
    assert torch.allclose(got_k, k, atol=0.06) and torch.allclose(got_v, v, atol=0.06)
    stored = cache[blocks, 0, offs, -4:].contiguous().view(torch.int32).flatten()
    assert torch.equal(stored, pos.to(torch.int32))
    assert int(cache[0].sum()) == 0  # block 0 is nobody's: padding wrote nothing


def test_a_basis_without_positions_is_refused_with_the_fix():
    basis = _basis()[0]
    k, v, slots, _, _, nblocks = _paged()
    cache = torch.zeros(nblocks, 2, 16, bytes_per_token(16, 4, 16), dtype=torch.uint8)
    with pytest.raises(ValueError, match="needs each written token's position.*bases: identity"):
        xr.write(k, v, cache, slots, None, 4, 16, basis)
    with pytest.raises(ValueError, match="cache rows of 7 bytes, expected"):
        xr.write(k, v, torch.zeros(nblocks, 2, 16, 7, dtype=torch.uint8), slots, None, 4, 16, None)


@pytest.mark.parametrize("bits,tol", [(8, 0.02), (4, 0.25)])
def test_attention_over_the_page_is_close_to_attention_over_the_true_kv(bits, tol):
    from vllm_graft.plugins.attention._shared import paged_attention

    basis = _basis()[0]
    k, v, slots, bt, pos, nblocks = _paged()
    k = xr.rope(k, pos, basis.theta)
    fmt = xr.XQuant(XQuantParams(bases="identity", bits=bits, group_size=16))
    fmt.basis = lambda *a: basis  # the file's basis, without a file
    cache = torch.zeros(nblocks, 2, 16, fmt.bytes_per_token(16, 16), dtype=torch.uint8)
    fmt.write(k, v, cache, slots, positions=pos)
    layer = AttentionLayer(num_heads=4, num_kv_heads=2, head_size=16, scale=0.25, block_size=16, index=0)
    dense = torch.zeros(nblocks, 2, 16, 32)  # the true K/V in the blocked layout
    dk, dv = layer.kv_layout.split(dense)
    dk[slots // 16, :, slots % 16] = k
    dv[slots // 16, :, slots % 16] = v
    batch = PagedBatch(torch.tensor([0, 5, 6], dtype=torch.int32), torch.tensor([37, 20], dtype=torch.int32), bt)
    q = torch.randn(6, 4, 16, generator=torch.Generator().manual_seed(9))
    out, mass = fmt.forward(q, cache, batch, layer)
    want = paged_attention(q, dense, batch, layer)
    assert mass is None and out.shape == want.shape
    assert float((out - want).abs().max()) < tol
    observe = torch.tensor([False, False, False, False, True, True])
    out2, mass2 = fmt.forward(q, cache, batch, layer, observe)
    assert torch.allclose(out2, out, atol=1e-5) and mass2.shape == (2, bt.shape[1])


def test_bases_of_the_tiny_model_round_trip_and_their_header_reads_without_torch(tmp_path):
    t, meta = xb.compute(TINY)
    cfg = json.loads((TINY / "config.json").read_text())
    n = cfg["num_key_value_heads"] * cfg["head_dim"]
    assert t["k_u"].shape == (cfg["num_hidden_layers"], n, n) and t["v_s"].shape == (cfg["num_hidden_layers"], n)
    assert bool((t["k_s"][:, :-1] >= t["k_s"][:, 1:]).all())  # singular values, descending
    out = tmp_path / "b.safetensors"
    xb.save(out, t, meta)
    head = xb.read_header(out)
    assert head["format"] == xb.FORMAT and head["rope_theta"] == "10000.0" and head["num_layers"] == "4"
    loaded, _ = xb.load(out)
    assert torch.equal(loaded["k_u"], t["k_u"])
    assert xb.mismatch(head, str(out), num_layers=4, num_kv_heads=2, head_size=64) is None
    assert "this model has num layers 30" in xb.mismatch(head, str(out), num_layers=30)


def test_missing_foreign_or_unsupported_inputs_get_clear_errors(tmp_path):
    with pytest.raises(xb.BasesError, match="does not exist; write it with `vllm-graft calibrate xquant"):
        xb.read_header(tmp_path / "none.safetensors")
    (tmp_path / "junk").write_bytes(b"\x01" * 32)
    with pytest.raises(xb.BasesError, match="is not a safetensors file"):
        xb.read_header(tmp_path / "junk")
    base = {"architectures": ["LlamaForCausalLM"], "rope_theta": 10000.0}
    assert xb.rope_of(base, "m") == 10000.0
    with pytest.raises(xb.BasesError, match="RoPE scaling 'llama3'.*use kv4"):
        xb.rope_of({**base, "rope_scaling": {"rope_type": "llama3"}}, "m")
    with pytest.raises(xb.BasesError, match="is a GPT2LMHeadModel"):
        xb.rope_of({"architectures": ["GPT2LMHeadModel"]}, "m")
    with pytest.raises(ValueError, match="does not exist; write it with"):
        XQuantParams(bases=str(tmp_path / "none.safetensors"))


def test_the_format_seam_hands_positions_from_the_forward_in_flight(monkeypatch):
    from types import SimpleNamespace

    import vllm.forward_context as fc

    from vllm_graft.integration.adapters.kvcompress import engine

    seen = {}

    class Fmt(xr.XQuant):
        def write(self, key, value, kv_cache, slot_mapping, layer=None, positions=None):
            seen["positions"] = positions

    counted = SimpleNamespace(count=lambda *a: None)
    seam = engine._FormatSeam(Fmt(XQuantParams(bases="identity")), "xquant", counted)
    assert seam.takes_positions and seam.takes_layer
    seam.write(None, None, None, torch.zeros(3))
    assert seen["positions"] is None  # outside a forward: none, and the format says what it needs
    # a step of two sequences: 3 new tokens of a 10-token one (a chunk), 1 of a 5-token one, 1 padding
    meta = SimpleNamespace(query_start_loc=torch.tensor([0, 3, 4], dtype=torch.int32),
                           seq_lens=torch.tensor([10, 5], dtype=torch.int32))
    monkeypatch.setattr(fc, "is_forward_context_available", lambda: True)
    monkeypatch.setattr(fc, "get_forward_context", lambda: SimpleNamespace(attn_metadata={"layers.0": meta}))
    seam.write(None, None, None, torch.zeros(5))
    assert seen["positions"][:4].tolist() == [7, 8, 9, 4]


def test_deployment_validation_checks_the_bases_against_the_model(registry, cpu_env, tmp_path):
    good = tmp_path / "tiny.safetensors"
    xb.save(good, *xb.compute(TINY))
    kv = {"plugin": "xquant", "params": {"bases": str(good)}}
    assert validate({"model": str(TINY), "kvcompress": kv}, registry, cpu_env).model is not None
    t, meta = xb.compute(TINY)
    bad = tmp_path / "other.safetensors"
    xb.save(bad, t, {**meta, "num_layers": "30", "model": "smollm2-135m"})
    with pytest.raises(DeploymentError) as e:
        validate({"model": str(TINY), "kvcompress": {"plugin": "xquant", "params": {"bases": str(bad)}}},
                 registry, cpu_env)
    assert "made for smollm2-135m" in str(e.value) and "num layers 4" in str(e.value)
    plan = validate({"kvcompress": [{"plugin": "streaming"}, {"plugin": "xquant", "params": {"bases": "identity"}}]},
                    registry, cpu_env)
    assert [x.name for x in plan.enabled] == ["streaming", "xquant"]
    with pytest.raises(DeploymentError, match="both set how KV is stored"):
        validate({"kvcompress": [{"plugin": "kv4"}, {"plugin": "xquant", "params": {"bases": "identity"}}]},
                 registry, cpu_env)
