"""dfloat11 without vLLM: Huffman codes, the exact round trip on random and real weights,
fused shards, corruption detection, and the compressed size of the bundled model."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from vllm_graft.hooks import StoredTensor, get_registry
from vllm_graft.plugins.quant.dfloat11 import DFloat11Params
from vllm_graft.plugins.quant.dfloat11.reference import (
    DFloat11,
    canonical_codes,
    code_lengths,
    decode,
    encode,
)

from .builds import require_built

MODEL = Path(__file__).resolve().parents[2] / "models" / "graft-tiny-llama"


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


def plugin(**kw) -> DFloat11:
    return DFloat11(DFloat11Params(**kw))


def roundtrip(m: DFloat11, shards: list[torch.Tensor]) -> torch.Tensor:
    """Encode each shard, verify it, load them as one fused layer and decode."""
    stored = [m.quantize(s) for s in shards]
    for s in stored:
        m.verify(s)
    tensors = m.load({k: [s[k] for s in stored] for k in stored[0]}, [s.shape[0] for s in shards])
    return m.weight(tensors)


@pytest.mark.parametrize("max_len", [8, 12, 16])
def test_code_lengths_are_a_prefix_code_within_the_limit(max_len):
    rng = np.random.default_rng(0)
    counts = np.zeros(256, dtype=np.int64)
    counts[100:140] = (rng.pareto(0.7, 40) * 10).astype(np.int64) + 1  # very skewed
    lengths = code_lengths(counts, max_len)
    present = lengths > 0
    assert (present == (counts > 0)).all()
    assert lengths.max() <= max_len
    assert sum(2.0 ** -int(l) for l in lengths[present]) <= 1.0  # Kraft: decodable
    codes = canonical_codes(lengths)
    words = {format(int(codes[s]), f"0{int(lengths[s])}b") for s in np.flatnonzero(present)}
    assert not any(a != b and b.startswith(a) for a in words for b in words)  # prefix-free


def test_single_symbol_and_empty():
    assert code_lengths(np.bincount([7] * 5, minlength=256), 12)[7] == 1
    w = torch.full((3, 5), 0.25, dtype=torch.bfloat16)
    assert same_bits(decode(encode(w)), w)


@pytest.mark.parametrize("shape,scale", [((64, 96), 0.02), ((17, 33), 1.0), ((5, 300), 1e-6)])
def test_roundtrip_random_weights_is_exact(shape, scale):
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(shape, generator=g) * scale).to(torch.bfloat16)
    assert same_bits(decode(encode(w, chunk=32)), w)


def test_roundtrip_every_bf16_bit_pattern():
    """All 65536 bf16 values (zeros, subnormals, inf, NaNs), so every exponent occurs."""
    w = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).reshape(256, 256)
    got = roundtrip(plugin(max_code_len=12), [w])
    assert same_bits(got, w)
    print("every bf16 bit pattern: exact")


def test_roundtrip_real_weights_fused_shards_and_size():
    from safetensors.torch import load_file

    sd = {k: v.to(torch.bfloat16) for k, v in load_file(str(MODEL / "model.safetensors")).items()}
    m = plugin()
    pre = "model.layers.1."
    q, k, v = (sd[f"{pre}self_attn.{p}_proj.weight"] for p in "qkv")
    assert same_bits(roundtrip(m, [q, k, v]), torch.cat([q, k, v]))
    gate, up = sd[f"{pre}mlp.gate_proj.weight"], sd[f"{pre}mlp.up_proj.weight"]
    assert same_bits(roundtrip(m, [gate, up]), torch.cat([gate, up]))
    assert same_bits(roundtrip(m, [sd["lm_head.weight"]]), sd["lm_head.weight"])
    stored = bf16 = 0
    for name, w in sd.items():
        if w.dim() != 2:
            continue
        t = m.quantize(w)
        stored += sum(x.numel() * x.element_size() for x in t.values())
        bf16 += w.numel() * 2
    ratio = stored / bf16
    print(f"dfloat11 on the bundled model's 2-D weights: {ratio:.4f} of bf16")
    assert ratio <= 0.72


def test_apply_and_embed_equal_the_bf16_weight():
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(48, 40, generator=g) * 0.05).to(torch.bfloat16)
    m = plugin(chunk=16)
    t = m.load({k: [v] for k, v in m.quantize(w).items()}, [48])
    x = torch.randn(3, 40, generator=g).to(torch.bfloat16)
    assert torch.equal(m.apply(t, x, None), torch.nn.functional.linear(x, w))
    ids = torch.tensor([0, 47, 3])
    assert torch.equal(m.embed(t, ids), w[ids])


def test_verify_names_the_corrupt_tensor():
    w = (torch.randn(32, 64) * 0.05).to(torch.bfloat16)
    m = plugin(chunk=16)
    good = m.quantize(w)
    m.verify(good)
    bad = dict(good, exponents=good["exponents"].clone())
    bad["exponents"][5] ^= 0x40
    with pytest.raises(ValueError, match="^exponents/.*CRC-32"):
        m.verify(bad)
    with pytest.raises(ValueError, match="^exponents: .* bytes"):
        m.verify(dict(good, exponents=good["exponents"][:-4]))
    with pytest.raises(ValueError, match="^chunk_offsets:"):
        m.verify(dict(good, chunk_offsets=good["chunk_offsets"][1:]))
    with pytest.raises(ValueError, match="^code_lengths:"):
        m.verify(dict(good, code_lengths=good["code_lengths"][:10]))
    with pytest.raises(ValueError, match="^header:.*chunk"):
        plugin(chunk=32).verify(good)


def test_stored_tensors_and_registration():
    m = plugin()
    specs = m.stored_tensors(10, 20)
    assert specs["sign_mantissa"] == StoredTensor((10, 20), "uint8")
    assert all(s.ragged and s.shape == (-1,) for k, s in specs.items() if k != "sign_mantissa")
    got = m.quantize(torch.zeros(10, 20, dtype=torch.bfloat16))
    assert set(got) == set(specs)
    assert all(str(got[k].dtype) == "torch." + s.dtype for k, s in specs.items())
    reg = get_registry().get("quant", "dfloat11").registration
    assert reg.capabilities.lossless and reg.capabilities.dtypes == ("bfloat16",)
    with pytest.raises(Exception, match="chunk"):
        DFloat11Params(chunk=3)
    with pytest.raises(TypeError, match="bfloat16"):
        m.quantize(torch.zeros(2, 2))


# ------------------------------------------------------------ the C++ CPU decoder (cpu.py)
def _cpp_available() -> bool:
    from vllm_graft.plugins.quant.dfloat11 import cpu

    require_built(cpu.decoder(), "the decoder")
    return True


@pytest.mark.parametrize("chunk", [16, 64, 128, 1000])
@pytest.mark.parametrize("rows", [[48], [37, 5, 90], [1, 1, 64]])
def test_cpp_decoder_equals_the_torch_decoder(chunk, rows):
    """Both CPU decoders on the same loaded layer (fused shards of uneven sizes, chunks that
    do not divide them): the same bf16 bits, and those of the original weight."""
    _cpp_available()
    g = torch.Generator().manual_seed(chunk + len(rows))
    shards = [(torch.randn(r, 70, generator=g) * 0.03).to(torch.bfloat16) for r in rows]
    cpp, ref = plugin(chunk=chunk), plugin(chunk=chunk, cpu_decoder="torch")
    stored = [cpp.quantize(s) for s in shards]
    tensors = cpp.load({k: [s[k] for s in stored] for k in stored[0]}, rows)
    a, b = cpp.weight(tensors), ref.weight(tensors)
    assert same_bits(a, b) and same_bits(a, torch.cat(shards))


def test_cpp_decoder_every_bit_pattern_and_real_weights():
    _cpp_available()
    w = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).reshape(256, 256)
    for max_len in (12, 16):
        assert same_bits(roundtrip(plugin(max_code_len=max_len), [w]), w)
    from safetensors.torch import load_file

    sd = load_file(str(MODEL / "model.safetensors"))
    q, k, v = (sd[f"model.layers.0.self_attn.{p}_proj.weight"].to(torch.bfloat16) for p in "qkv")
    assert same_bits(roundtrip(plugin(), [q, k, v]), torch.cat([q, k, v]))


def test_cpp_decoder_that_cannot_build_says_so_once_and_decodes_with_torch(monkeypatch, caplog):
    from vllm_graft.plugins.quant.dfloat11 import cpu

    monkeypatch.setattr(cpu, "decoder", lambda: (None, "RuntimeError: no compiler (test)"))
    from vllm_graft.plugins.quant import _shared

    monkeypatch.setattr(_shared, "_said", set())
    w = (torch.randn(20, 30) * 0.1).to(torch.bfloat16)
    m = plugin(chunk=16)
    t = m.load({k: [v] for k, v in m.quantize(w).items()}, [20])
    with caplog.at_level("WARNING", logger="vllm_graft"):
        assert same_bits(m.weight(t), w)
        assert same_bits(m.weight(t), w)
    said = [r.getMessage() for r in caplog.records if "C++ CPU decoder" in r.getMessage()]
    assert len(said) == 1 and "no compiler (test)" in said[0] and "cpu_decoder: torch" in said[0]


def test_cpu_decoder_is_not_a_checkpoint_parameter():
    assert "cpu_decoder" not in plugin(cpu_decoder="torch").checkpoint_params()
    assert plugin().checkpoint_params()["chunk"] == 128
    with pytest.raises(Exception, match="cpu_decoder"):
        DFloat11Params(cpu_decoder="asm")


def test_apply_decodes_into_a_reused_buffer_and_weight_into_a_fresh_one():
    """apply() decodes into one buffer per weight shape (fresh memory's page faults cost as much
    as the decode); weight() returns a tensor of its own, which a later decode leaves alone."""
    _cpp_available()
    g = torch.Generator().manual_seed(5)
    w1, w2 = ((torch.randn(24, 40, generator=g) * 0.05).to(torch.bfloat16) for _ in range(2))
    m = plugin(chunk=16)
    t1, t2 = (m.load({k: [v] for k, v in m.quantize(w).items()}, [24]) for w in (w1, w2))
    kept = m.weight(t1)
    a = m.weight(t1, reuse=True)
    b = m.weight(t2, reuse=True)
    assert a.data_ptr() == b.data_ptr() and same_bits(b, w2)  # one buffer, overwritten
    assert same_bits(kept, w1) and kept.data_ptr() != a.data_ptr()
    x = torch.randn(3, 40, generator=g).to(torch.bfloat16)
    assert torch.equal(m.apply(t1, x, None), torch.nn.functional.linear(x, w1))
