"""Every shipped attention method and scored KV compressor reads the paged cache in the layout
it is handed (``layer.kv_layout``): its reference path gives the same output (and mass) for the
same tokens in a blocked cache, a packed NHD-ordered view and a packed HND cache
(kit/conformance/exercises/attention.py's cases), lossy plugins included, in every CPU path and
mode that reads the cache; and each claims both layouts in ``kv_layouts``. The Triton kernels'
layout tests are in tests/kernels/test_layouts.py."""
from __future__ import annotations

import pytest
import torch

from vllm_graft.hooks import AttentionMethod, Kind, KVCacheFormat, get_registry
from vllm_graft.kit.conformance.exercises.attention import ATTENTION_SHAPES, attention_case
from vllm_graft.kit.conformance.exercises.kvcompress import _head_mask, _observed

CACHES = ("blocked", "packed-NHD", "packed-HND")


def shipped(kind: Kind):
    return [e for e in get_registry().entries(kind) if e.source.package == "vllm-graft"]


def readers():
    """(spec, entry, params): each shipped attention method and scored compressor, with the
    parameter sets whose paths read the cache differently."""
    variants = {
        "squeezed": [{}, {"cpu_path": "per-sequence"}, {"mode": "recycled", "refresh": 4},
                     {"mode": "window"}, {"prefill": "sparse", "budget": 0.5}],
    }
    out = []
    for e in shipped(Kind.ATTENTION):
        for p in variants.get(e.name, [{}]):
            out.append(pytest.param(e, p, id=f"attention:{e.name}{p or ''}"))
    for e in shipped(Kind.KVCOMPRESS):
        cls = e.registration.load()
        if getattr(cls, "needs_scores", False) and not issubclass(cls, KVCacheFormat):
            out.append(pytest.param(e, {}, id=f"kvcompress:{e.name}"))
    return out


def _build(entry, params):
    return entry.registration.load()(entry.registration.params(**params))


def _run(impl, shape, cache, seed):
    q, kv, batch, layer = attention_case(shape, "float32", seed=seed, cache=cache)
    if isinstance(impl, AttentionMethod):
        return [impl.forward(q, kv, batch, layer, impl.plan(batch))]
    observe = _observed(q.shape[0])
    if getattr(impl, "per_head", False):
        return list(impl.attend(q, kv, batch, layer, observe,
                                head_mask=_head_mask(batch, layer.num_kv_heads, layer.block_size, seed + 1)))
    return list(impl.attend(q, kv, batch, layer, observe))


def test_every_shipped_reader_is_found():
    names = {p.id.split("{")[0] for p in readers()}
    assert {"attention:hydragen", "attention:squeezed", "attention:noop", "kvcompress:h2o",
            "kvcompress:snapkv", "kvcompress:adakv"} <= names


@pytest.mark.parametrize("entry, params", readers())
def test_same_output_in_every_layout(entry, params):
    assert set(_build(entry, params).kv_layouts) == {"blocked", "packed"}, \
        f"{entry.name} should claim both layouts (its reads go through layer.kv_layout.split)"
    for j, shape in enumerate(ATTENTION_SHAPES[:2]):
        want = None
        for cache in CACHES:
            got = _run(_build(entry, params), shape, cache, seed=300 + j)  # fresh state per cache
            if want is None:
                want = got
                continue
            for a, b in zip(got, want):
                err = (a.float() - b.float()).abs().max().item()
                assert err <= 1e-5, f"{entry.name} {params} {shape} {cache}: {err:.2e} off the blocked cache"


def test_kv4_claims_any_physical_order():
    """kv4 keeps its own byte page (no K|V split): it claims both layouts because it indexes the
    ``[N, H_kv, B, C]`` view (tests/kernels/test_layouts.py checks an NHD-ordered page)."""
    entry = get_registry().get(Kind.KVCOMPRESS, "kv4")
    assert set(entry.registration.load().kv_layouts) == {"blocked", "packed"}
