"""slim-llm (SliM-LLM salience-driven mixed precision): the exact average bit-width, the
salience ranking of the allocation, the per-group quantiser, the variable-width packing, the
reference compute path, the checks on a stored shard, the parameters, and a round trip through
`vllm-graft quantize` with activation calibration on the tiny model."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from pydantic import ValidationError

from vllm_graft.plugins.quant.slim_llm import SliMLLMParams
from vllm_graft.plugins.quant.slim_llm.reference import (
    SliMLLM,
    allocate,
    group_errors,
    group_lengths,
    group_salience,
    importance,
    pack_codes,
    quantize_groups,
    stored_bits_per_weight,
    unpack_codes,
)

MODEL = Path(__file__).resolve().parents[2] / "models" / "graft-tiny-llama"


def salient_layer(n_out, n_in, seed=0):
    """A weight and per-channel activation second moments with a few heavy input channels (as in
    a trained model), so that salience differs a lot between groups."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n_out, n_in, generator=g) * 0.05
    h = torch.rand(n_in, generator=g) + 0.1
    heavy = torch.randperm(n_in, generator=g)[: max(1, n_in // 200)]
    h[heavy] *= 400.0
    w[:, heavy[:1]] *= 6.0
    return w, h, heavy


def bits_of(t):
    return t["group_bits"].to(torch.int64)


@pytest.mark.parametrize("bits,group_size,n_in,raised", [
    (3, 128, 1024, None), (3, 32, 200, None), (2, 64, 704, 0.25), (4, 16, 688, 0.5), (3, 128, 576, 0.5),
])
def test_every_row_holds_exactly_the_average_bits(bits, group_size, n_in, raised):
    w, h, _ = salient_layer(48, n_in)
    m = SliMLLM(SliMLLMParams(bits=bits, group_size=group_size, raised_fraction=raised))
    t = m.quantize(w, sensitivity=h)
    gb = bits_of(t)
    lens = torch.tensor(group_lengths(n_in, group_size))
    assert torch.equal((gb * lens).sum(1), torch.full((48,), bits * n_in))
    assert torch.equal((gb == bits + 1).sum(1), (gb == bits - 1).sum(1))  # as many raised as lowered
    assert bool((gb == bits + 1).any())  # it mixed: the test is not about a uniform map
    if n_in % group_size:
        assert bool((gb[:, -1] == bits).all())  # the shorter last group stays at the average
    # stored bits per weight: codes exactly `bits`, plus step, zero and bit map per group
    stored = sum(v.numel() * v.element_size() for v in t.values()) * 8 / w.numel()
    G = len(lens)
    assert stored == stored_bits_per_weight(48, n_in, bits, group_size) == bits + 32 * G / n_in
    assert {k: (tuple(v.shape), str(v.dtype)[6:]) for k, v in t.items()} == \
        {k: (s.shape, s.dtype) for k, s in m.stored_tensors(48, n_in).items()}


def test_the_most_salient_groups_get_the_higher_widths():
    w, h, heavy = salient_layer(64, 1024, seed=1)
    t = SliMLLM(SliMLLMParams(bits=3, group_size=64)).quantize(w, sensitivity=h)
    gb = bits_of(t)
    S = group_salience(w, importance(w, h), 64)
    raised_rows = 0
    for r in range(64):
        hi, mid, lo = S[r][gb[r] == 4], S[r][gb[r] == 3], S[r][gb[r] == 2]
        rest = torch.cat([mid, lo])
        if hi.numel():
            raised_rows += 1
            assert hi.min() >= rest.max()
        if lo.numel():
            assert lo.max() <= torch.cat([hi, mid]).min()
    assert raised_rows > 32
    # the salience follows the activations: every row's most salient group holds a heavy channel
    heavy_groups = (heavy // 64).unique()
    assert bool(torch.isin(S.argmax(1), heavy_groups).all())
    # and where a row raises groups, its most salient one is among them
    top = S.argmax(1)
    rows = (gb == 4).any(1)
    assert bool((gb[rows, top[rows]] == 4).all())


def test_without_calibration_salience_is_the_weight_magnitude():
    w = torch.randn(8, 256) * 0.01
    w[:, 128:192] *= 20  # group 2 of 4 carries the magnitude
    t = SliMLLM(SliMLLMParams(bits=3, group_size=64)).quantize(w)
    assert bool((bits_of(t)[:, 2] == 4).all())
    assert SliMLLM(SliMLLMParams(calibration="none")).needs_calibration is False
    assert SliMLLM(SliMLLMParams()).calibration_statistic == "activations"


def test_per_group_error_decreases_with_the_groups_bits():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(32, 512, generator=g) * 0.05 + 0.01
    h = torch.ones_like(w)
    errs = []
    for b in range(1, 9):
        w_hat = quantize_groups(w, torch.full((32, 4), b), 128)[3]
        errs.append(group_errors(w, w_hat, h, 128))
    for lo, hi in zip(errs, errs[1:]):
        assert bool((hi < lo).all())
    # and inside one mixed allocation: the mean group error orders with the width
    t = SliMLLM(SliMLLMParams(bits=3, group_size=32, raised_fraction=0.25)).quantize(w)
    gb = bits_of(t)
    w_hat = quantize_groups(w, gb, 32)[3]
    rel = group_errors(w, w_hat, h, 32) / group_salience(w, h, 32)
    assert rel[gb == 2].mean() > rel[gb == 3].mean() > rel[gb == 4].mean()


def test_the_searched_count_is_never_worse_than_uniform_or_a_fixed_one():
    w, hvec, _ = salient_layer(40, 768, seed=3)
    h = importance(w, hvec)
    total = {}
    for name, frac, spread in (("searched", None, 1), ("uniform", None, 0), ("fixed", 0.5, 1)):
        t = SliMLLM(SliMLLMParams(bits=3, group_size=64, raised_fraction=frac, spread=spread)).quantize(w, hvec)
        per_row = group_errors(w, quantize_groups(w, bits_of(t), 64)[3], h, 64).sum(1)
        total[name] = per_row
    assert bool((total["searched"] <= total["uniform"] * (1 + 1e-6)).all())
    assert bool((total["searched"] <= total["fixed"] * (1 + 1e-6)).all())
    assert total["searched"].sum() < 0.95 * total["uniform"].sum()  # mixing pays on a salient layer


def test_allocate_with_no_room_to_mix_is_uniform():
    S = torch.rand(4, 1)
    assert torch.equal(allocate(S, {}, 1, 3, 1, None), torch.full((4, 1), 3))


@pytest.mark.parametrize("n_in,gs", [(200, 32), (1024, 128), (688, 128), (64, 8)])
def test_pack_and_unpack_are_inverse_for_any_balanced_map(n_in, gs):
    g = torch.Generator().manual_seed(n_in)
    out, G = 16, -(-n_in // gs)
    n_full = n_in // gs
    gb = torch.full((out, G), 3)
    for r in range(out):  # a random balanced map per row
        k = int(torch.randint(0, n_full // 2 + 1, (1,), generator=g))
        perm = torch.randperm(n_full, generator=g)
        gb[r, perm[:k]] = 4
        gb[r, perm[k:2 * k]] = 2
    cols = torch.arange(n_in) // gs
    q = (torch.rand(out, n_in, generator=g) * (1 << gb[:, cols]).float()).long()
    codes = pack_codes(q, gb.to(torch.uint8), 3, gs)
    assert codes.shape == (out, 3 * n_in // 8) and codes.dtype == torch.uint8
    assert torch.equal(unpack_codes(codes, gb.to(torch.uint8), 3, gs).long(), q)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_apply_is_dequantise_then_matmul(dtype):
    w, h, _ = salient_layer(96, 320, seed=4)
    w = w.to(dtype)
    m = SliMLLM(SliMLLMParams(bits=3, group_size=64))
    stored = m.quantize(w, sensitivity=h)
    # two shards (as vLLM fuses q/k/v), each a slice of the rows
    shards = {k: [v[:40], v[40:]] for k, v in stored.items()}
    for i in range(2):
        m.verify({n: s[i] for n, s in shards.items()})
    t = m.load(shards, [40, 56])
    w_hat = quantize_groups(w, bits_of(stored), 64)[3]  # what the quantiser decided, before packing
    assert torch.equal(m.dequantize(t), w_hat)
    x = torch.randn(7, 320).to(dtype)
    bias = torch.randn(96).to(dtype)
    y = m.apply(t, x, bias)
    assert y.dtype == dtype and y.shape == (7, 96)
    assert torch.equal(y, F.linear(x, w_hat.to(dtype)) + bias)
    rel = ((y.double() - (x.double() @ w.double().T + bias.double())).norm() /
           (x.double() @ w.double().T + bias.double()).norm()).item()
    assert rel < m.error_bound("structured")


def test_verify_names_the_corrupt_tensor():
    m = SliMLLM(SliMLLMParams(bits=3, group_size=32))
    t = m.quantize(salient_layer(8, 256)[0])
    m.verify(t)
    gb = t["group_bits"].clone()
    gb[0, 0] = 5
    with pytest.raises(ValueError, match=r"^group_bits: widths outside"):
        m.verify(dict(t, group_bits=gb))
    gb = t["group_bits"].clone()
    gb[0, :] = 3
    gb[0, 0] = 4  # one raised, none lowered: the row no longer averages 3
    with pytest.raises(ValueError, match=r"^group_bits: a row's widths do not average 3"):
        m.verify(dict(t, group_bits=gb))
    with pytest.raises(ValueError, match=r"^group_zero:"):
        m.verify(dict(t, group_zero=torch.full_like(t["group_zero"], 200)))
    step = t["group_step"].clone()
    step[1, 1] = float("inf")
    with pytest.raises(ValueError, match=r"^group_step:"):
        m.verify(dict(t, group_step=step))
    with pytest.raises(ValueError, match="in_features 100 is not a multiple of 8"):
        m.quantize(torch.randn(4, 100))
    with pytest.raises(ValueError, match="sensitivity has 3 channels"):
        m.quantize(torch.randn(4, 64), sensitivity=torch.ones(3))


@pytest.mark.parametrize("params,field", [
    ({"bits": 9}, "bits"), ({"bits": 1}, "bits"), ({"group_size": 100}, "group_size"),
    ({"group_size": 4}, "group_size"), ({"raised_fraction": 0.6}, "raised_fraction"),
    ({"calibration": "hessian"}, "calibration"), ({"calibration_tokens": 10}, "calibration_tokens"),
    ({"spread": 4}, "spread"), ({"colour": 1}, "colour"),
])
def test_bad_parameters_are_named(params, field):
    with pytest.raises(ValidationError, match=field):
        SliMLLMParams(**params)


def test_widths_outside_one_to_eight_are_refused_with_the_spread_that_fits():
    with pytest.raises(ValidationError, match=r"spread 2 with bits 2 gives widths 0\.\.4.*spread <= 1 for bits 2"):
        SliMLLMParams(bits=2, spread=2)
    with pytest.raises(ValidationError, match=r"spread 2 with bits 7 gives widths 5\.\.9"):
        SliMLLMParams(bits=7, spread=2)
    assert SliMLLMParams(bits=7, spread=1).bits == 7


def test_quantize_command_round_trip_with_activation_calibration(tmp_path):
    from safetensors.torch import load_file

    from vllm_graft.tools.quant.quantize import activation_moments, quantize_checkpoint

    params = {"bits": 3, "group_size": 64, "calibration_tokens": 256}
    out = tmp_path / "slim"
    report = quantize_checkpoint("slim-llm", str(MODEL), str(out), params, log=lambda *a: None)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "graft-slim-llm"
    m = SliMLLM(SliMLLMParams(**cfg["quantization_config"]["params"]))
    state = load_file(str(out / "model.safetensors"))
    src = load_file(str(MODEL / "model.safetensors"))
    targets = sorted(k for k in src if k.endswith("_proj.weight"))
    assert report["layers"] == len(targets) == 4 * 7
    moments = activation_moments(MODEL, targets, None, 256)
    n_bits = n_w = 0
    for name in targets:
        prefix = name[: -len(".weight")]
        stored = {k: state[f"{prefix}.{k}"] for k in m.stored_tensors(1, 8)}
        assert f"{prefix}.weight" not in state
        m.verify(stored)
        w = src[name].to(torch.float16)
        # what the checkpoint holds is what the plugin makes from the weight and its moments
        again = m.quantize(w, sensitivity=moments[name])
        assert all(torch.equal(stored[k], again[k]) for k in stored), name
        deq = m.dequantize(m.load({k: [v] for k, v in stored.items()}, [w.shape[0]]))
        assert ((deq - w.float()).norm() / w.float().norm()) < 0.3
        n_bits += sum(v.numel() * v.element_size() * 8 for v in stored.values())
        n_w += w.numel()
    assert report["bits_per_quantised_weight"] == round(n_bits / n_w, 3)
    assert 3.0 < report["bits_per_quantised_weight"] <= 3.0 + 32 / 64 + 0.05
    # calibration changed the allocation from the weights-only one in some layer
    plain = SliMLLM(SliMLLMParams(**{**params, "calibration": "none"}))
    assert any(not torch.equal(plain.quantize(src[n].to(torch.float16))["group_bits"],
                               state[n[: -len("weight")] + "group_bits"]) for n in targets)
