"""Every shipped attention method and scored KV compressor reads the paged cache in the layout
it is handed (``layer.kv_layout``): its reference path gives the same output (and mass) for the
same tokens in a blocked cache, a packed NHD-ordered view and a packed HND cache
(kit/conformance/exercises/attention.py's cases), lossy plugins included, in every CPU path and
mode that reads the cache; and each claims both layouts in ``kv_layouts`` (a compressor that
leaves its attention to the worker's shared one, its layouts, which include ``cpu_vec``: that
cache is checked too where claimed). The Triton kernels'
layout tests are in tests/kernels/test_layouts.py."""
from __future__ import annotations

import pytest

import dataclasses

from vllm_graft.hooks import AttentionMethod, Kind, KVCacheFormat, get_registry
from vllm_graft.integration.adapters.kvcompress.shared_attention import attend_with_mass, layouts_read
from vllm_graft.kit.conformance.exercises.attention import relaid_cache
from vllm_graft.kit.conformance.exercises.kvcompress import _head_mask, _observed

from .paged_cases import paged

CACHES = ("blocked", "packed-NHD", "packed-HND")
#: (tokens in the cache, new tokens) per sequence: long decodes (sparse methods choose among
#: their chunks), a chunked prefill, a prefill; and two sequences sharing prefix blocks (hydragen)
SEQS = [(200, 1), (37, 1), (19, 3), (130, 1), (24, 24)]
SHAPES = [(4, 2, 64, 16), (4, 4, 32, 32)]


def case(shape, seed):
    h, hkv, d, bs = shape
    q, kv, batch, layer = paged(SEQS, h, hkv, d, bs, seed=seed, index=0)
    batch.block_table[3, :2] = batch.block_table[0, :2]  # sequences 0 and 3 share their first two blocks
    return q, kv, batch, layer


def shipped(kind: Kind):
    return [e for e in get_registry().entries(kind) if e.source.package == "vllm-graft"]


def readers():
    """(spec, entry, params): each shipped attention method and scored compressor, with the
    parameter sets whose paths read the cache differently."""
    variants = {
        "squeezed": [{"sink_tokens": 16, "recent_tokens": 16, **p} for p in (
            {}, {"cpu_path": "per-sequence"}, {"mode": "recycled", "refresh": 4}, {"mode": "window"},
            {"prefill": "sparse"})],
        "hydragen": [{"min_blocks": 1}],
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
    q, kv, batch, layer = case(shape, seed)
    layout, kv = relaid_cache(kv, cache)
    layer = dataclasses.replace(layer, kv_layout=layout)
    if isinstance(impl, AttentionMethod):
        return [impl.forward(q, kv, batch, layer, impl.plan(batch))]
    observe = _observed(q.shape[0])
    if getattr(impl, "per_head", False):
        mask = _head_mask(batch, layer.num_kv_heads, layer.block_size, seed + 1)
        mask[:, :, 0] = True  # every query sees a key
        return list(attend_with_mass(impl, q, kv, batch, layer, observe, head_mask=mask))
    return list(attend_with_mass(impl, q, kv, batch, layer, observe))  # what the worker runs


def test_every_shipped_reader_is_found():
    names = {p.id.split("{")[0] for p in readers()}
    assert {"attention:hydragen", "attention:squeezed", "attention:noop", "kvcompress:h2o",
            "kvcompress:snapkv", "kvcompress:adakv"} <= names


@pytest.mark.parametrize("entry, params", readers())
def test_same_output_in_every_layout(entry, params):
    impl = _build(entry, params)
    claimed = layouts_read(impl) if not isinstance(impl, AttentionMethod) else impl.kv_layouts
    assert {"blocked", "packed"} <= set(claimed) <= {"blocked", "packed", "cpu_vec"}, \
        f"{entry.name} should claim both layouts (its reads go through layer.kv_layout.split)"
    # cpu_vec (vLLM's CPU cache, keys transposed: tests/unit/test_cpu_vec_layout.py) where claimed
    caches = CACHES + (("cpu_vec",) if "cpu_vec" in claimed else ())
    for j, shape in enumerate(SHAPES):
        want = None
        for cache in caches:
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
