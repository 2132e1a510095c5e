"""vllm-graft on CUDA rides vLLM's own backends (no GPU here; ``current_platform`` is patched to
look like CUDA where the route asks): FLASH_ATTN, TRITON_ATTN and FLASHINFER are overridden by
path with subclasses of vLLM's classes, ``build`` runs the KV-compression rewriters before the
stock build, ``forward`` hands the layer to vLLM's kernel unless a method changes the math, a
plugin that cannot read the packed layout is refused, and each deployment gets the CUDA-graph
mode vLLM's own resolution gives for the graph support the graft builders declare.

vLLM's FlashInfer module imports the ``flashinfer`` package, which this machine lacks: its
override is checked by path and by the ImportError vLLM's selector counts as "unavailable"."""
from __future__ import annotations

import importlib
import logging
import math
from types import SimpleNamespace

import pytest
import torch
from vllm_graft.integration.plan import plan_for

pytest.importorskip("vllm")


class _Platform:
    """The installed platform, except that it says it is ``kind``."""

    def __init__(self, kind: str, real):
        self.kind, self.real, self.device_name = kind, real, kind

    def is_cpu(self):
        return self.kind == "cpu"

    def is_cuda(self):
        return self.kind == "cuda"

    def __getattr__(self, name):
        return getattr(self.real, name)


def _platform(kind: str):
    platforms = importlib.import_module("vllm.platforms")
    real = platforms.current_platform
    return _Platform(kind, real.real if isinstance(real, _Platform) else real)


@pytest.fixture
def cuda(monkeypatch):
    _mods()  # vLLM's modules read the real platform at import: import them first
    importlib.import_module("vllm.v1.attention.backends.flex_attention")
    # and those the bridge's activation imports, which would otherwise bind the fake platform
    # for the rest of the session (the sampler then asks for FlashInfer)
    importlib.import_module("vllm.v1.sample.ops.topk_topp_sampler")
    backend = importlib.import_module("vllm_graft.integration.adapters.backend")
    platforms = importlib.import_module("vllm.platforms")
    monkeypatch.setattr(platforms, "current_platform", _platform("cuda"))
    monkeypatch.delenv(backend.BACKEND_ENV, raising=False)
    assert not backend.SEAMS.owners, "another test left the seams installed"
    yield backend
    for owner in list(backend.SEAMS.owners):
        backend.uninstall(owner)


def _mods():
    from vllm.v1.attention.backends import flash_attn, triton_attn
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from vllm_graft.integration.adapters import cuda_backends, custom_backend

    return AttentionBackendEnum, flash_attn, triton_attn, cuda_backends, custom_backend


# ------------------------------------------------------------------ registration
def test_install_overrides_the_three_cuda_backends_by_path(cuda, monkeypatch):
    enum, fa, ta, cb, custom = _mods()
    from vllm.v1.attention import selector

    cleared = []
    monkeypatch.setattr(selector._cached_get_attn_backend, "cache_clear",
                        lambda: cleared.append(1), raising=False)
    stock_fa, stock_ta = enum.FLASH_ATTN.get_path(), enum.TRITON_ATTN.get_path()
    cuda.install("test")
    assert cleared, "the selector cache must be cleared after registering"
    assert enum.FLASH_ATTN.get_path() == cuda.CUDA_PATHS["FLASH_ATTN"]
    assert enum.TRITON_ATTN.get_path() == cuda.CUDA_PATHS["TRITON_ATTN"]
    assert enum.FLASHINFER.get_path() == cuda.CUDA_PATHS["FLASHINFER"]
    for member, stock in ((enum.FLASH_ATTN, fa.FlashAttentionBackend),
                          (enum.TRITON_ATTN, ta.TritonAttentionBackend)):
        cls = member.get_class()
        assert issubclass(cls, stock) and cls is not stock
        assert cls.get_name() == member.name  # vLLM's name checks see the stock name
        assert issubclass(cls.get_builder_cls(), stock.get_builder_cls())
        assert issubclass(cls.get_impl_cls(), stock.get_impl_cls())
        assert issubclass(cls.get_builder_cls(), cb.GraftBuilderMixin)
        assert issubclass(cls.get_impl_cls(), cb.GraftImplMixin)
    # CUSTOM is the generic fallback; other members are guarded
    assert enum.CUSTOM.get_class() is custom.GraftAttentionBackend
    assert enum.FLEX_ATTENTION.get_path() == cb.guard_path("FLEX_ATTENTION")
    cuda.uninstall("test")
    assert enum.FLASH_ATTN.get_path() == stock_fa and enum.TRITON_ATTN.get_path() == stock_ta
    assert not enum.FLASH_ATTN.is_overridden() and not enum.FLEX_ATTENTION.is_overridden()


def test_flashinfer_override_module_is_guarded_by_the_flashinfer_import(cuda):
    enum = _mods()[0]
    cuda.install("test")
    path = enum.FLASHINFER.get_path()
    assert path == "vllm_graft.integration.adapters.cuda_flashinfer.GraftFlashInferBackend"
    try:
        import flashinfer  # noqa: F401
    except ImportError:
        # vLLM's selector catches ImportError and counts the backend unavailable
        # (0.33 platforms/cuda.py:398-409): the same as without the override
        with pytest.raises(ImportError, match="flashinfer"):
            enum.FLASHINFER.get_class()
    else:
        from vllm.v1.attention.backends.flashinfer import FlashInferBackend

        cls = enum.FLASHINFER.get_class()
        assert issubclass(cls, FlashInferBackend) and cls.get_name() == "FLASHINFER"


def test_a_guarded_backend_is_invalid_only_while_the_seams_are_needed(cuda):
    enum, _, _, cb, _ = _mods()
    cuda.install("test")
    guard = enum.FLEX_ATTENTION.get_class()
    from vllm.v1.attention.backends.flex_attention import FlexAttentionBackend

    assert issubclass(guard, FlexAttentionBackend) and guard.get_name() == "FLEX_ATTENTION"
    kwargs = dict(head_size=64, dtype=torch.float16, kv_cache_dtype="auto", block_size=16,
                  use_mla=False, has_sink=False, use_sparse=False, use_mm_prefix=False,
                  use_per_head_quant_scales=False, device_capability=None, attn_type="decoder")
    cuda.SEAMS.rewriters.append(lambda builder, cm: cm)  # a KV compressor is active
    try:
        reasons = guard.validate_configuration(**kwargs)
    finally:
        cuda.SEAMS.rewriters.clear()
    assert len(reasons) == 1 and "FLEX_ATTENTION does not carry" in reasons[0]
    assert "attention_backend=CUSTOM" in reasons[0] and "FLASH_ATTN" in reasons[0]
    # nothing needs the seams (e.g. attention noop on the host kernel): the stock verdict
    assert all("vllm-graft" not in r for r in guard.validate_configuration(**kwargs))


def test_engine_overrides_leave_vllm_to_choose_and_fall_back_to_custom(caplog):
    from vllm_graft.launch import engine as launch
    from vllm_graft.integration.adapters import adapter_for

    model = str(launch.models_dir() / "graft-tiny-llama")
    for engine, expected in (({}, {}), ({"attention_backend": "TRITON_ATTN"}, {}),
                             ({"attention_backend": "FLEX_ATTENTION"}, {"attention_backend": "CUSTOM"})):
        plan = plan_for({"model": model, "platform": "cuda", "engine": engine,
                         "kvcompress": {"plugin": "streaming"}})
        got = adapter_for("kvcompress").engine_overrides(plan.enabled, plan)
        got.pop("async_scheduling", None)
        assert got == expected, engine
    assert "FLEX_ATTENTION has no vllm-graft seams" in caplog.text and "slower" in caplog.text
    plan = plan_for({"model": model, "platform": "cuda", "attention": {"plugin": "hydragen"}})
    assert adapter_for("attention").engine_overrides(plan.enabled, plan) == {}


# ------------------------------------------------------------------ builder
class _Cm(SimpleNamespace):
    pass


def _cm(seq_lens, q_lens):
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    n = len(seq_lens)
    return _Cm(num_reqs=n, num_actual_tokens=int(qsl[-1]), query_start_loc=qsl, max_query_len=max(q_lens),
               seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
               block_table_tensor=torch.arange(n * 4, dtype=torch.int32).view(n, 4), causal=True)


@pytest.mark.parametrize("which", ["flash", "triton"])
def test_build_runs_the_rewriters_then_the_stock_build(cuda, monkeypatch, which):
    _, fa, ta, cb, _ = _mods()
    graft, stock = ((cb.GraftFlashAttentionMetadataBuilder, fa.FlashAttentionMetadataBuilder)
                    if which == "flash" else
                    (cb.GraftTritonAttentionMetadataBuilder, ta.TritonAttentionMetadataBuilder))
    seen = []

    def fake_build(self, common_prefix_len, common_attn_metadata, fast_build=False):
        seen.append(("stock", common_attn_metadata))
        return SimpleNamespace()

    monkeypatch.setattr(stock, "build", fake_build)  # the real one needs CUDA kernels/buffers
    builder = object.__new__(graft)
    original = _cm([5, 9], [1, 1])
    rewritten = _cm([1, 9], [1, 1])

    def rewrite(b, cm):
        assert b is builder and cm is original
        seen.append(("rewrite", cm))
        return rewritten

    cuda.install("test")
    cuda.SEAMS.rewriters.append(rewrite)
    md = builder.build(0, original)
    assert [s[0] for s in seen] == ["rewrite", "stock"] and seen[1][1] is rewritten
    assert not hasattr(md, "graft_batch")  # a compressor alone changes no math: vLLM's kernel
    assert builder.supports_update_block_table is False  # would bypass build()'s rewriters

    plans = []
    cuda.SEAMS.method = SimpleNamespace(plan=lambda batch: plans.append(batch) or "P")
    cuda.SEAMS.method_name = "m"
    md = builder.build(0, original)
    assert md.graft_plan == "P" and md.graft_batch is plans[0] and md.graft_num_tokens == 2
    assert torch.equal(md.graft_batch.seq_lens, rewritten.seq_lens)  # the rewritten metadata
    cuda.SEAMS.host_kernel = True  # plain attention: vLLM's kernel, no plan
    md = builder.build(0, original)
    assert not hasattr(md, "graft_batch") and len(plans) == 1


def test_update_block_table_keeps_the_stock_value_when_build_has_no_work(cuda):
    _, _, _, cb, _ = _mods()
    cuda.install("test")
    assert object.__new__(cb.GraftFlashAttentionMetadataBuilder).supports_update_block_table is True
    assert object.__new__(cb.GraftTritonAttentionMetadataBuilder).supports_update_block_table is False


# ------------------------------------------------------------------ impl
def _impl(cls, heads=4, kv_heads=2, d=8):
    impl = object.__new__(cls)
    impl.num_heads, impl.num_kv_heads, impl.head_size, impl.scale = heads, kv_heads, d, d ** -0.5
    impl.sliding_window, impl.alibi_slopes, impl.sinks = (-1, -1), None, None
    impl.logits_soft_cap, impl.kv_cache_dtype = 0, "auto"  # no attn_type: 0.33's FlashInferImpl sets none
    return impl


def _packed_cache(num_blocks, kv_heads, block, d, dtype=torch.float32):
    """vLLM's CUDA cache view ``[N, H, B, 2D]`` with the default NHD physical order
    (``[N, B, H, 2D]`` in memory; 0.33 kv_cache_interface.py:360-377, utils.py:229-236)."""
    return torch.zeros(num_blocks, block, kv_heads, 2 * d, dtype=dtype).transpose(1, 2)


@pytest.mark.parametrize("which", ["flash", "triton"])
def test_forward_dispatch(cuda, monkeypatch, which):
    from vllm_graft.hooks import PACKED, PagedBatch
    from vllm_graft.plugins.attention._shared import PagedAttention

    _, fa, ta, cb, _ = _mods()
    graft, stock = ((cb.GraftFlashAttentionImpl, fa.FlashAttentionImpl) if which == "flash"
                    else (cb.GraftTritonAttentionImpl, ta.TritonAttentionImpl))
    calls = []
    monkeypatch.setattr(stock, "forward", lambda self, *a, **k: calls.append("forward") or a[6])
    monkeypatch.setattr(stock, "do_kv_cache_update", lambda self, *a, **k: calls.append("write"))
    impl = _impl(graft)
    h, hk, d, bs = 4, 2, 8, 4
    g = torch.Generator().manual_seed(0)
    seq_lens, q_lens = [6, 3], [2, 3]
    cache = _packed_cache(6, hk, bs, d)
    table = torch.tensor([[4, 1], [2, 5]], dtype=torch.int32)
    keys = [torch.randn(s, hk, d, generator=g) for s in seq_lens]
    vals = [torch.randn(s, hk, d, generator=g) for s in seq_lens]
    for i, s in enumerate(seq_lens):
        slots = torch.tensor([int(table[i, p // bs]) * bs + p % bs for p in range(s)])
        PACKED.write(keys[i], vals[i], cache, slots)
    n = sum(q_lens)
    query = torch.randn(n, h, d, generator=g)
    output = torch.zeros(n, h, d)
    batch = PagedBatch(query_start_loc=torch.tensor([0, 2, 5], dtype=torch.int32),
                       seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_table=table)
    md = SimpleNamespace(graft_batch=batch, graft_num_tokens=n, graft_plan=None)
    args = (None, query, None, None, cache, md, output)

    cuda.install("test")
    impl.forward(*args)  # nothing changes the math: vLLM's kernel
    impl.forward(None, query, None, None, cache, None, output)  # profiling run
    impl.do_kv_cache_update(None, None, None, cache, None)  # vLLM's packed write
    assert calls == ["forward", "forward", "write"]
    counted = []
    cuda.SEAMS.count = lambda event, k: counted.append(event)
    cuda.SEAMS.method, cuda.SEAMS.method_name, cuda.SEAMS.host_kernel = PagedAttention(None), "noop", True
    impl.forward(*args)
    assert calls[-1] == "forward" and counted == ["host"]
    cuda.SEAMS.host_kernel = False  # the method computes the layer, reading vLLM's packed cache
    impl.forward(*args)
    assert calls.count("forward") == 3 and counted[-1] == "forward"
    # against dense causal attention over the same keys/values (GQA: 2 query heads per KV head)
    start = 0
    for i, (s, q) in enumerate(zip(seq_lens, q_lens)):
        k = keys[i].repeat_interleave(h // hk, dim=1).transpose(0, 1)
        v = vals[i].repeat_interleave(h // hk, dim=1).transpose(0, 1)
        qq = query[start:start + q].transpose(0, 1)
        mask = torch.arange(s)[None, :] <= torch.arange(s - q, s)[:, None]
        att = (qq @ k.transpose(1, 2) * impl.scale).masked_fill(~mask, -math.inf).softmax(-1)
        torch.testing.assert_close(output[start:start + q], (att @ v).transpose(0, 1))
        start += q
    impl.graft_attn_type = "encoder_only"
    impl.forward(*args)
    assert calls.count("forward") == 4
    impl.graft_attn_type, impl.sliding_window = "decoder", (127, 0)
    with pytest.raises(NotImplementedError, match="sliding window"):
        impl.forward(*args)


def test_the_impl_mixin_reads_the_attention_type_from_its_own_init_arguments(cuda):
    """vLLM 0.33's ``FlashInferImpl`` takes ``attn_type`` in ``__init__``, checks it and never stores
    it (v1/attention/backends/flashinfer.py:2023-2058); the layer passes it positionally
    (layers/attention/attention.py:420-432). The mixin keeps its own copy, so a stock impl that sets
    no ``attn_type`` still routes (before the fix: AttributeError on every graft step)."""
    cb = _mods()[3]

    class StockLikeFlashInfer:  # the 0.33 signature; stores what FlashInferImpl stores
        def __init__(self, num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window,
                     kv_cache_dtype, logits_soft_cap=None, attn_type="decoder",
                     kv_sharing_target_layer_name=None, sinks=None):
            self.num_heads, self.head_size, self.scale, self.num_kv_heads = num_heads, head_size, scale, num_kv_heads
            self.sliding_window, self.alibi_slopes, self.sinks = (-1, -1), None, None
            self.kv_cache_dtype, self.logits_soft_cap = kv_cache_dtype, logits_soft_cap

        def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *rest):
            return "stock"

    class Graft(cb.GraftImplMixin, StockLikeFlashInfer):
        pass

    positional = Graft(4, 8, 0.35, 2, None, None, "auto", None, "decoder", None)
    assert not hasattr(positional, "attn_type") and positional.graft_attn_type == "decoder"
    assert Graft(4, 8, 0.35, 2, None, None, "auto").graft_attn_type == "decoder"  # its default
    assert Graft(4, 8, 0.35, 2, None, None, "auto", attn_type="encoder_only").graft_attn_type == "encoder_only"
    md = SimpleNamespace(graft_batch=object(), graft_num_tokens=1, graft_plan=None)
    cuda.install("test")
    # a graft batch with nothing that changes the math: the stock forward, no AttributeError
    assert positional.forward(None, torch.zeros(1, 32), None, None, torch.zeros(1), md, None) == "stock"


@pytest.mark.parametrize("per_head", [False, True])
def test_a_scored_step_that_scores_nothing_runs_vllms_kernel(cuda, monkeypatch, per_head):
    """SnapKV's decode steps (no query in the observation window) are plain attention over the
    kept blocks: vLLM's kernel computes them; a step that observes runs the compressor's attend;
    a per-head compressor masks blocks per head, so it never hands a step to the stock kernel."""
    from vllm_graft.integration.adapters.kvcompress.scores import _ScoringAttention, _StepPlan

    _, fa, _, cb, _ = _mods()
    calls = []
    monkeypatch.setattr(fa.FlashAttentionImpl, "forward", lambda self, *a, **k: calls.append("stock") or a[6])
    impl = _impl(cb.GraftFlashAttentionImpl)
    scoring = _ScoringAttention(SimpleNamespace(compressor=SimpleNamespace(per_head=per_head)))
    monkeypatch.setattr(scoring, "forward", lambda q, *a, **k: calls.append("attend") or torch.zeros_like(q))
    counted = []
    cuda.install("test")
    cuda.SEAMS.method, cuda.SEAMS.method_name = scoring, "scored"
    cuda.SEAMS.count = lambda event, k: counted.append(event)
    batch = SimpleNamespace()
    query, output = torch.randn(3, 4, 8), torch.zeros(3, 4, 8)
    for observed in (False, True):
        plan = _StepPlan([], [], torch.zeros(3, dtype=torch.bool), None, 4, observed=observed)
        md = SimpleNamespace(graft_batch=batch, graft_num_tokens=3, graft_plan=plan)
        impl.forward(None, query, None, None, torch.zeros(2, 2, 4, 16), md, output)
    assert calls == (["attend", "attend"] if per_head else ["stock", "attend"])
    assert counted.count("stock_layers") == (0 if per_head else 1)


def test_storage_format_writes_and_attends_in_its_page(cuda, monkeypatch):
    from vllm_graft.hooks import PagedBatch

    _, fa, _, cb, _ = _mods()
    calls = []
    monkeypatch.setattr(fa.FlashAttentionImpl, "forward", lambda self, *a, **k: calls.append("stock"))
    monkeypatch.setattr(fa.FlashAttentionImpl, "do_kv_cache_update", lambda self, *a: calls.append("stock-write"))
    fmt = SimpleNamespace(write=lambda *a: calls.append("fmt-write"),
                          forward=lambda q, kv, batch, layer: calls.append(("fmt", layer.kv_layout.name)) or torch.ones_like(q))
    impl = _impl(cb.GraftFlashAttentionImpl)
    cuda.install("test")
    cuda.SEAMS.kv_format = fmt
    page = torch.zeros(3, 2, 4, 16, dtype=torch.uint8)
    impl.do_kv_cache_update(None, None, None, page, None)
    q = torch.randn(2, 4, 8)
    out = torch.zeros(2, 4, 8)
    batch = PagedBatch(torch.tensor([0, 2], dtype=torch.int32), torch.tensor([2], dtype=torch.int32),
                       torch.zeros(1, 1, dtype=torch.int32))
    impl.forward(None, q, None, None, page, SimpleNamespace(graft_batch=batch, graft_num_tokens=2), out)
    assert calls == ["fmt-write", ("fmt", "packed")] and bool((out == 1).all())


# ------------------------------------------------------------------ layouts at activation
def test_a_blocked_only_plugin_is_refused_on_cuda_and_accepted_on_cpu(cuda, monkeypatch):
    from vllm_graft.integration.adapters.attention.engine import ADAPTER

    class Blocked:
        kv_layouts = ("blocked",)

        def __init__(self, host=False):
            self.host = host

        def uses_host_kernel(self):
            return self.host

    e = SimpleNamespace(name="blocked-only")
    plan = SimpleNamespace(deployment=SimpleNamespace(engine={}))
    runtime = SimpleNamespace(instance=lambda _: Blocked(), count=lambda *a: None)
    with pytest.raises(NotImplementedError, match=r"'blocked-only' reads the KV cache in layout\(s\) "
                                                  r"\['blocked'\].*'packed' layout"):
        ADAPTER.activate([e], plan, runtime)
    ADAPTER.deactivate()
    # plain attention on the host kernel never reads the cache: accepted, vLLM's kernel runs it
    ADAPTER.activate([e], plan, SimpleNamespace(instance=lambda _: Blocked(host=True), count=lambda *a: None))
    try:
        assert cuda.SEAMS.host_kernel is True
    finally:
        ADAPTER.deactivate()
    platforms = importlib.import_module("vllm.platforms")
    monkeypatch.setattr(platforms, "current_platform", _platform("cpu"))
    cuda.require_layout("blocked-only", ("blocked",))  # the CPU route's layout
    with pytest.raises(NotImplementedError, match="'blocked' layout"):
        cuda.require_layout("packed-only", ("packed",))


def test_a_scored_compressor_reading_only_blocked_is_refused_on_cuda(cuda):
    from vllm_graft.hooks import KVCompressor
    from vllm_graft.integration.adapters.kvcompress.engine import ADAPTER

    class BlockedScorer(KVCompressor):  # needs scores, its attend reads blocked memory only
        needs_scores = True

        def keep(self, view):
            return list(range(view.num_blocks))

        def attend(self, query, kv_cache, batch, layer, observe, head_mask=None):
            raise AssertionError("never called here")

    entry = SimpleNamespace(name="blocked-scorer", params={},
                            entry=SimpleNamespace(registration=SimpleNamespace(
                                capabilities=SimpleNamespace(lossless=False))))
    plan = SimpleNamespace(deployment=SimpleNamespace(engine={}))
    runtime = SimpleNamespace(instance=lambda _: BlockedScorer(None), count=lambda *a: None)
    try:
        with pytest.raises(NotImplementedError, match=r"kvcompress plugin 'blocked-scorer' reads "
                                                      r"the KV cache in layout\(s\) \['blocked'\]"):
            ADAPTER.activate([entry], plan, runtime)
    finally:
        ADAPTER.deactivate()
    assert not cuda.SEAMS.owners  # nothing left installed


# ------------------------------------------------------------------ CUDA graphs per deployment
def _resolved_mode(builders) -> str:
    """vLLM's own resolution (installed CompilationConfig.resolve_cudagraph_mode_and_sizes,
    the same code as 0.33 config/compilation.py:1376-1494) from the minimum support over the
    builders (0.33 gpu_model_runner.py:6770-6787), with 0.33's defaults: VLLM_COMPILE,
    FULL_AND_PIECEWISE (config/vllm.py:297-311), splitting ops set for V1."""
    from vllm.config import CompilationConfig
    from vllm.config.compilation import CompilationMode, CUDAGraphMode

    support = min((b.get_cudagraph_support(None, None) for b in builders), key=lambda s: s.value)
    config = CompilationConfig(mode=CompilationMode.VLLM_COMPILE,
                               cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE)
    config.set_splitting_ops_for_v1(all2all_backend="naive")
    return config.resolve_cudagraph_mode_and_sizes(support, "graft", use_v2_model_runner=True).name


@pytest.mark.parametrize("section, expected", [
    ({"kvcompress": {"plugin": "streaming"}}, "FULL_AND_PIECEWISE"),
    ({"attention": {"plugin": "noop"}}, "FULL_AND_PIECEWISE"),
    ({"kvcompress": {"plugin": "h2o"}}, "PIECEWISE"),
    ({"kvcompress": {"plugin": "snapkv"}}, "PIECEWISE"),
    ({"attention": {"plugin": "hydragen"}}, "PIECEWISE"),
    ({"kvcompress": {"plugin": "kv4"}}, "PIECEWISE"),
])
def test_cuda_graph_mode_per_deployment(cuda, section, expected):
    from vllm_graft.integration import bridge
    from vllm_graft.launch import engine as launch

    _, fa, ta, cb, _ = _mods()
    plan = plan_for({"model": str(launch.models_dir() / "graft-tiny-llama"),
                     "platform": "cuda", **section})
    bridge.activate(plan, source="test")
    try:
        builders = [cb.GraftFlashAttentionMetadataBuilder, cb.GraftTritonAttentionMetadataBuilder]
        assert _resolved_mode(builders) == expected
        if expected != "PIECEWISE":  # the stock support is kept, whatever it is
            assert [b.get_cudagraph_support(None, None) for b in builders] == [
                fa.FlashAttentionMetadataBuilder._cudagraph_support,
                ta.TritonAttentionMetadataBuilder._cudagraph_support]
    finally:
        bridge.deactivate()
    assert _resolved_mode([fa.FlashAttentionMetadataBuilder]) == "FULL_AND_PIECEWISE"  # plain vLLM


def test_plugins_left_on_their_reference_are_named_on_cuda(cuda, caplog, monkeypatch):
    from vllm_graft.integration import bridge
    from vllm_graft.launch import engine as launch

    def activate(kernel):
        caplog.clear()
        plan = plan_for({"model": str(launch.models_dir() / "graft-tiny-llama"),
                         "platform": "cuda",
                         "kvcompress": {"plugin": "h2o", "params": {"kernel": kernel}}})
        with caplog.at_level(logging.WARNING, logger="vllm_graft"):
            bridge.activate(plan, source="test")
        bridge.deactivate()
        return [r.getMessage() for r in caplog.records if "kernel: triton" in r.getMessage()]

    said = activate("reference")
    assert len(said) == 1 and "kvcompress:h2o" in said[0]
    assert activate("triton") == []
    platforms = importlib.import_module("vllm.platforms")
    monkeypatch.setattr(platforms, "current_platform", _platform("cpu"))
    assert activate("reference") == []  # the reference is the CPU path


def test_the_attention_adapter_hands_plugins_vllms_merge_kernel(cuda):
    """While an attention plugin is active, HOST_KERNELS holds vLLM's own merge_attn_states
    (hydragen merges with it on CUDA); deactivation takes it back."""
    from vllm.v1.attention.ops.merge_attn_states import merge_attn_states

    from vllm_graft.hooks.contracts.attention import HOST_KERNELS, host_kernel
    from vllm_graft.integration.adapters.attention.engine import ADAPTER

    class Packed:
        kv_layouts = ("packed",)

        def uses_host_kernel(self):
            return False

    plan = SimpleNamespace(deployment=SimpleNamespace(engine={}))
    runtime = SimpleNamespace(instance=lambda _: Packed(), count=lambda *a: None)
    assert host_kernel("merge_attn_states") is None
    ADAPTER.activate([SimpleNamespace(name="packed")], plan, runtime)
    try:
        assert host_kernel("merge_attn_states") is merge_attn_states
    finally:
        ADAPTER.deactivate()
    assert not HOST_KERNELS
