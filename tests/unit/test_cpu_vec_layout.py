"""The ``cpu_vec`` KV-cache layout (``hooks.CPU_VEC``): vLLM's CPU kernels' own cache for the
``vec``/``vec16`` ISAs, read by the graft's PyTorch attention so that a scored compressor's plain
steps run vLLM's C++ kernel over the same cache (integration/adapters/backend.py).

* vLLM's own write (``ops.cpu_attn_reshape_and_cache``) reads back exactly through
  ``CPU_VEC.split`` for each ISA the backend accepts, and ``CPU_VEC.write`` writes the same bytes;
  the ISA this machine selects is one of them; another ISA (``amx``) is refused, in the log;
* the readers on this route give the same output, mass and block scores in ``cpu_vec`` as in
  ``blocked`` (the shared attention's reference; the cache scorers' ``block_scores``), and the
  claims (``layouts_read``) say who reads it (not the Triton kernel: it needs a unit stride);
* the backend's choice of layout, its write, and the ``plain`` seam (vLLM's kernel on a step
  that scores nothing, the compressor's attention on one that observes).

The engine-level checks (same tokens, same blocks freed) are in tests/e2e/test_kvcompress_engine.py
and tests/e2e/test_cpu_vec_engine.py."""

from __future__ import annotations

import dataclasses
import logging
from types import SimpleNamespace

import pytest
import torch

from vllm_graft.hooks import BLOCKED, CPU_VEC, KV_LAYOUTS, Kind, KVCacheFormat, get_registry

ops = pytest.importorskip("vllm._custom_ops")

#: (ISA, head sizes) the backend accepts; vec16 is what vLLM picks for head sizes not a multiple of 32
ISA_CASES = [("vec", 32), ("vec", 64), ("vec", 128), ("vec16", 64), ("vec16", 80), ("vec16", 112)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _tokens(n_blocks, hkv, block, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    slots = torch.randperm(n_blocks * block, generator=g)
    slots[::7] = -1  # padding: not written
    key = torch.randn(slots.numel(), hkv, d, generator=g).to(dtype)
    value = torch.randn(slots.numel(), hkv, d, generator=g).to(dtype)
    return slots, key, value


def _vllm_write(kv, key, value, slots, isa):
    n, h, b, c = kv.shape
    key_cache, value_cache = kv.view(n, h, 2 * b, c // 2).chunk(2, dim=2)  # as vLLM's CPU backend
    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, isa)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block", [32, 128])
@pytest.mark.parametrize("isa, d", ISA_CASES)
def test_vllms_cpu_write_reads_back_through_cpu_vec(isa, d, block, dtype):
    n, hkv = 3, 2
    slots, key, value = _tokens(n, hkv, block, d, dtype)
    kv = torch.full((n, hkv, block, 2 * d), float("nan"), dtype=dtype)
    _vllm_write(kv, key, value, slots, isa)
    k, v = CPU_VEC.split(kv)
    assert k.shape == v.shape == (n, hkv, block, d)
    ok = slots >= 0
    blocks, offsets = slots[ok] // block, slots[ok] % block
    assert torch.equal(k[blocks, :, offsets], key[ok]) and torch.equal(v[blocks, :, offsets], value[ok])
    # the padding slots were not written (still NaN), and the keys are not where blocked reads them
    written = torch.zeros(n * block, dtype=torch.bool)
    written[slots[ok]] = True
    pad = (~written).nonzero().flatten()  # the slots that only padding pointed at
    assert pad.numel() > 0 and torch.isnan(k[pad // block, :, pad % block].float()).all()
    kb, _ = BLOCKED.split(kv)
    assert not torch.equal(kb[blocks, :, offsets], key[ok])
    # the layout's own write gives vLLM's bytes
    mine = torch.full_like(kv, float("nan"))
    CPU_VEC.write(key, value, mine, slots)
    assert torch.equal(mine.view(torch.uint8), kv.view(torch.uint8))


def test_the_isa_this_machine_selects_is_checked():
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from vllm_graft.integration.adapters import backend

    checked = []
    for dtype in DTYPES:
        for d in (64, 80, 128):
            isa = _get_attn_isa(dtype, 32, d, "auto")
            if isa not in backend.CPU_VEC_ISAS:
                pytest.skip(f"this machine's CPU attention ISA is {isa!r}: the backend falls back to blocked")
            assert backend.stock_layout_checked(isa, dtype, d, 32), (isa, dtype, d)
            checked.append(isa)
    assert "vec" in checked


def test_an_unverified_isa_is_refused_in_the_log(caplog):
    from vllm_graft.integration.adapters import backend

    backend.stock_layout_checked.cache_clear()
    with caplog.at_level(logging.INFO, logger="vllm_graft"):
        assert not backend.stock_layout_checked("amx", torch.bfloat16, 64, 32)
        assert backend.stock_layout_checked("vec", torch.float32, 64, 32)
    msgs = [r.getMessage() for r in caplog.records]
    assert any(
        "'amx'" in m and "blocked layout" in m and r.levelno == logging.WARNING for m, r in zip(msgs, caplog.records)
    ), msgs
    assert any("'vec'" in m and "checked" in m for m in msgs), msgs
    # an ISA named as accepted whose write does not read back would be refused too: amx's does not
    kv = torch.full((2, 2, 32, 128), float("nan"), dtype=torch.bfloat16)
    slots, key, value = _tokens(2, 2, 32, 64, torch.bfloat16)
    slots = slots.abs()
    try:
        _vllm_write(kv, key, value, slots, "amx")
    except RuntimeError as e:  # vLLM's amx write refuses to run on a CPU without AMX (e.g. AMD EPYC)
        if "Unsupported CPU attention configuration" not in str(e):
            raise
        pytest.skip(f"vLLM's amx cache write does not run on this CPU ({e}); the refusal above was checked")
    k, _ = CPU_VEC.split(kv)
    assert not torch.equal(k[slots // 32, :, slots % 32], key)


def test_the_layout_is_registered_and_split_refuses_unknown_names():
    assert KV_LAYOUTS["cpu_vec"] is CPU_VEC
    with pytest.raises(ValueError, match="cpu_vec"):
        dataclasses.replace(CPU_VEC, name="nope").split(torch.zeros(1, 1, 32, 8))


# ------------------------------------------------------------------------------- readers


def _case(shape, seed, dtype=torch.float32):
    from vllm_graft.kit.conformance.exercises.attention import attention_case

    return attention_case(shape, {torch.float32: "float32", torch.float16: "float16"}[dtype], seed)


def _shipped_scored():
    out = []
    for e in get_registry().entries(Kind.KVCOMPRESS):
        if e.source.package != "vllm-graft":
            continue
        cls = e.registration.load()
        if getattr(cls, "needs_scores", False) and not issubclass(cls, KVCacheFormat):
            out.append(pytest.param(e, id=e.name))
    return out


@pytest.mark.parametrize("entry", _shipped_scored())
def test_scored_readers_match_the_blocked_cache_in_cpu_vec(entry):
    """Every shipped scored compressor's attention with mass (and block scores, where it scores
    the cache) reads ``cpu_vec`` as it reads ``blocked``; the claim says whether the route hands
    it ``cpu_vec`` (the shared attention's reference does, the cache scorers' own claims decide)."""
    from vllm_graft.integration.adapters.kvcompress.shared_attention import (
        attend_with_mass,
        block_scores,
        layouts_read,
        scores_the_cache,
        uses_shared_attention,
    )
    from vllm_graft.kit.conformance.exercises.attention import relaid_cache
    from vllm_graft.kit.conformance.exercises.kvcompress import _head_mask, _observed

    impl = entry.registration.load()(entry.registration.params())
    for j, shape in enumerate([(4, 2, 64, 16), (4, 4, 32, 32)]):
        q, kv, batch, layer = _case(shape, seed=500 + j)
        observe = _observed(q.shape[0])
        mask = None
        if getattr(impl, "per_head", False) or getattr(impl, "per_layer", False):
            mask = _head_mask(batch, layer.num_kv_heads, layer.block_size, 9)
            mask[:, :, 0] = True
        layout, vec = relaid_cache(kv, "cpu_vec")
        assert layout is CPU_VEC and vec.stride() == kv.stride()
        vec_layer = dataclasses.replace(layer, kv_layout=CPU_VEC)
        fresh = lambda: entry.registration.load()(entry.registration.params())  # noqa: E731
        want = attend_with_mass(fresh(), q, kv, batch, layer, observe, head_mask=mask)
        got = attend_with_mass(fresh(), q, vec, batch, vec_layer, observe, head_mask=mask)
        for a, b in zip(got, want):
            assert (a.float() - b.float()).abs().max().item() <= 1e-5, entry.name
        if scores_the_cache(impl):
            s_want = block_scores(fresh(), kv, batch, layer, q, observe, want[1])
            s_got = block_scores(fresh(), vec, batch, vec_layer, q, observe, got[1])
            assert torch.allclose(s_got.float(), s_want.float(), atol=1e-5, rtol=1e-5), entry.name
    claimed = layouts_read(impl)
    assert "blocked" in claimed  # what the CPU route falls back to
    if scores_the_cache(impl):  # its own claim decides (today: blocked and packed)
        assert ("cpu_vec" in claimed) == ("cpu_vec" in impl.kv_layouts)
    elif uses_shared_attention(impl):  # the reference reads it
        assert "cpu_vec" in claimed


def test_the_triton_kernel_reads_cpu_vec_as_the_reference_does():
    """``kernel: triton`` (decode rows in the kernel, which takes the D stride of the views) gives
    the reference's output and mass on a cpu_vec cache; both claim it."""
    from vllm_graft.hooks import PagedBatch
    from vllm_graft.integration.adapters.kvcompress.shared_attention import attend_with_mass, layouts_read
    from vllm_graft.kit.conformance.exercises.attention import relaid_cache

    e = get_registry().get(Kind.KVCOMPRESS, "snapkv")
    ref = e.registration.load()(e.registration.params())
    tri = e.registration.load()(e.registration.params(kernel="triton"))
    assert "cpu_vec" in layouts_read(ref) and "cpu_vec" in layouts_read(tri)
    q, kv, batch, layer = _case((4, 2, 64, 16), seed=7)
    qsl = batch.query_start_loc
    decode = PagedBatch(  # every sequence's last query alone: decode rows, all in the kernel
        torch.arange(len(qsl), dtype=torch.int32), batch.seq_lens, batch.block_table, max_query_len=1
    )
    q = q[(qsl[1:] - 1).long()]
    _, vec = relaid_cache(kv, "cpu_vec")
    vec_layer = dataclasses.replace(layer, kv_layout=CPU_VEC)
    observe = torch.ones(q.shape[0], dtype=torch.bool)
    want = attend_with_mass(ref, q, kv, decode, layer, observe)
    got = attend_with_mass(tri, q, vec, decode, vec_layer, observe)
    for a, b in zip(got, want):
        assert (a.float() - b.float()).abs().max().item() <= 1e-4


# ------------------------------------------------------------------------------- backend


@pytest.fixture
def cpu_impl(monkeypatch):
    from vllm.v1.attention.backends import cpu_attn

    from vllm_graft.integration.adapters import backend

    impl = object.__new__(backend.GraftCPUAttentionImpl)
    impl.num_heads, impl.num_kv_heads, impl.head_size, impl.scale = 4, 2, 64, 64**-0.5
    impl.sliding_window, impl.alibi_slopes, impl.sinks, impl.logits_soft_cap = -1, None, None, 0
    impl.kv_cache_dtype, impl.is_fp8_kv_cache, impl.attn_type = "auto", False, "decoder"
    calls = []
    monkeypatch.setattr(
        cpu_attn.CPUAttentionBackendImpl, "forward", lambda self, *a, **k: calls.append("stock") or a[6]
    )
    saved = (backend.SEAMS.method, backend.SEAMS.method_name, backend.SEAMS.count, backend.SEAMS.host_kernel)
    yield impl, calls, backend
    backend.SEAMS.method, backend.SEAMS.method_name, backend.SEAMS.count, backend.SEAMS.host_kernel = saved


def _layer(isa="vec"):
    return SimpleNamespace(isa=isa, _k_scale_float=1.0, _v_scale_float=1.0, layer_name="model.layers.1.self_attn.attn")


@pytest.mark.parametrize(
    "isa, claims, want",
    [
        ("vec", ("blocked", "cpu_vec"), "cpu_vec"),
        ("vec", ("blocked", "packed"), "blocked"),  # the method does not read it
        ("amx", ("blocked", "cpu_vec"), "blocked"),  # not a checked ISA
        (None, ("blocked", "cpu_vec"), "blocked"),  # no ISA on the layer
    ],
)
def test_the_backend_writes_the_layout_it_hands_the_method(cpu_impl, isa, claims, want):
    impl, calls, backend = cpu_impl
    seen = []

    class Method:
        kv_layouts = claims

        def forward(self, query, kv_cache, batch, layer, plan=None):
            seen.append(layer.kv_layout)
            return torch.zeros_like(query)

    backend.SEAMS.method, backend.SEAMS.method_name, backend.SEAMS.host_kernel = Method(), "m", False
    backend.SEAMS.count = None
    n, hkv, block, d = 3, 2, 32, 64
    slots, key, value = _tokens(n, hkv, block, d, torch.float32)
    layer = _layer(isa)
    kv = torch.full((n, hkv, block, 2 * d), float("nan"))
    assert impl.graft_layout(layer, kv).name == want
    impl.do_kv_cache_update(layer, key, value, kv, slots)
    expect = torch.full_like(kv, float("nan"))
    KV_LAYOUTS[want].write(key, value, expect, slots)
    assert torch.equal(torch.nan_to_num(kv, 7.0), torch.nan_to_num(expect, 7.0))
    md = SimpleNamespace(graft_batch=SimpleNamespace(), graft_plan=None, num_actual_tokens=2)
    impl.forward(layer, torch.randn(2, 4, d), None, None, kv, md, torch.zeros(2, 4, d))
    assert [x.name for x in seen] == [want] and calls == []
    # a uint8 page (a storage format's) is never cpu_vec
    assert impl.graft_layout(layer, torch.zeros(2, 2, 32, 16, dtype=torch.uint8)) is BLOCKED


@pytest.mark.parametrize("isa", ["vec", "amx"])
@pytest.mark.parametrize("per_head", [False, True])
def test_a_scored_step_that_scores_nothing_runs_vllms_cpu_kernel(cpu_impl, monkeypatch, isa, per_head):
    """SnapKV's decode steps (no query observed) go to vLLM's C++ kernel where the cache is in
    its layout; a step that observes runs the compressor's attention; a per-head compressor, or
    an ISA whose layout is not checked (the cache is then blocked), never hands a step over."""
    from vllm_graft.integration.adapters.kvcompress.scores import _ScoringAttention, _StepPlan

    impl, calls, backend = cpu_impl
    e = get_registry().get(Kind.KVCOMPRESS, "snapkv")
    compressor = e.registration.load()(e.registration.params())
    if per_head:
        monkeypatch.setattr(compressor, "per_head", True, raising=False)
    scoring = _ScoringAttention(SimpleNamespace(compressor=compressor, name="snapkv"))
    assert "cpu_vec" in scoring.kv_layouts
    monkeypatch.setattr(
        scoring,
        "forward",
        lambda q, kv, b, layer, plan=None: calls.append(("attend", layer.kv_layout.name)) or torch.zeros_like(q),
    )
    counted = []
    backend.SEAMS.method, backend.SEAMS.method_name, backend.SEAMS.host_kernel = scoring, "snapkv", False
    backend.SEAMS.count = lambda event, k: counted.append(event)
    kv = torch.zeros(2, 2, 32, 128)
    query, output = torch.randn(3, 4, 64), torch.zeros(3, 4, 64)
    for observed in (False, True):
        plan = _StepPlan([], [], torch.zeros(3, dtype=torch.bool), None, 32, observed=observed)
        md = SimpleNamespace(graft_batch=SimpleNamespace(), num_actual_tokens=3, graft_plan=plan)
        impl.forward(_layer(isa), query, None, None, kv, md, output)
    layout = "cpu_vec" if isa == "vec" else "blocked"
    if per_head or isa != "vec":
        assert calls == [("attend", layout), ("attend", layout)] and "stock_layers" not in counted
    else:
        assert calls == ["stock", ("attend", "cpu_vec")] and counted.count("stock_layers") == 1


def test_a_layer_the_method_cannot_compute_is_refused_on_its_first_step_even_a_plain_one(cpu_impl):
    """The refusal (sliding window here) comes before a step is handed to vLLM's kernel: a model
    the method cannot serve fails on its first step, not on the first step the method computes."""
    impl, calls, backend = cpu_impl

    class Method:
        kv_layouts = ("blocked", "cpu_vec")

        def plain(self, plan):
            return True

    backend.SEAMS.method, backend.SEAMS.method_name, backend.SEAMS.host_kernel = Method(), "m", False
    backend.SEAMS.count = None
    kv = torch.zeros(2, 2, 32, 128)
    md = SimpleNamespace(graft_batch=SimpleNamespace(), graft_plan=None, num_actual_tokens=2)
    impl.sliding_window = 128
    with pytest.raises(NotImplementedError, match="'m': layers with sliding window"):
        impl.forward(_layer("vec"), torch.randn(2, 4, 64), None, None, kv, md, torch.zeros(2, 4, 64))
    assert calls == []
    impl.sliding_window = -1  # a supported layer: the plain step is vLLM's kernel's
    impl.forward(_layer("vec"), torch.randn(2, 4, 64), None, None, kv, md, torch.zeros(2, 4, 64))
    assert calls == ["stock"]


def test_the_layout_is_kept_per_method_and_cache_dtype(cpu_impl, monkeypatch):
    """graft_layout is asked twice per layer and step; it is kept, and asked anew for another
    method, another cache dtype, or while the layer has no ISA yet."""
    impl, _, backend = cpu_impl

    class Reads:
        kv_layouts = ("blocked", "cpu_vec")

    class Blocked:
        kv_layouts = ("blocked",)

    kv = torch.zeros(2, 2, 32, 128)
    backend.SEAMS.method = Reads()
    assert impl.graft_layout(_layer(None), kv) is BLOCKED  # no ISA yet: not kept
    assert impl.graft_layout(_layer("vec"), kv).name == "cpu_vec"
    checks = []  # kept: asked again with the same method and dtype, the ISA is not checked again
    monkeypatch.setattr(backend, "stock_layout_checked", lambda *a: checks.append(a) or False)
    assert impl.graft_layout(_layer("vec"), kv).name == "cpu_vec" and checks == []
    assert impl.graft_layout(_layer("vec"), kv.to(torch.uint8)) is BLOCKED
    backend.SEAMS.method = Blocked()
    assert impl.graft_layout(_layer("vec"), kv) is BLOCKED
