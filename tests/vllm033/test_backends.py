"""vllm-graft's FLASH_ATTN, TRITON_ATTN and FLASHINFER subclasses inside vLLM 0.33's own classes
(see conftest.py): built through 0.33's ``Attention`` layer and selector, their builders' real
``__init__`` and ``build()``, and the mixin's ``forward`` and ``do_kv_cache_update`` on a decode
batch, a batch of prefill chunks and a mixed one, with the routes each plugin kind takes there:
nothing to change (vLLM's kernel), an attention method computing the layer, and the KV-compression
rewriter ahead of the stock ``build()``."""
from __future__ import annotations

import math
import os
import types

import pytest
import torch

from . import stubs

HERE = os.path.dirname(os.path.abspath(__file__))
PREFIX = "model.layers.0.self_attn.attn"
H, HK, D, BS, NB = 4, 2, 64, 16, 24
DTYPE = torch.float16
BACKENDS = ["FLASH_ATTN", "TRITON_ATTN", "FLASHINFER"]
BATCHES = {  # (tokens computed before the step, query tokens) per request
    "decode": ([4, 17, 40], [1, 1, 1]),
    "prefill": ([0, 16], [9, 13]),
    "mixed": ([30, 0, 5], [1, 7, 1]),
}


def test_this_is_vllm_033_from_the_wheel():
    import vllm
    from vllm.platforms import current_platform

    assert vllm.__version__ == "0.33.0"
    assert vllm.__file__.startswith(os.environ["GRAFT_VLLM033_ROOT"])
    assert current_platform.is_cuda() and current_platform.get_device_capability() == (9, 0)


@pytest.fixture(scope="module")
def vllm_config():
    from vllm.config import CacheConfig, ModelConfig, VllmConfig

    model = os.path.join(HERE, "..", "..", "models", "graft-tiny-llama")
    config = VllmConfig(model_config=ModelConfig(model=model, dtype="float16"), cache_config=CacheConfig(block_size=BS))
    # what 0.33's engine core resolves (resolve_kv_cache_layout, utils.py:293-340) with no
    # preference given: LBNHC (NHD) first (utils.py:229-236); the cache views below are NHD
    config.cache_config.kv_cache_layout = "LBNHC"
    return config


@pytest.fixture
def fd():
    from vllm_graft.kit.fakedevice import FakeDevice

    return FakeDevice(inputs_from=[HERE])


@pytest.fixture
def seams():
    from vllm_graft.integration.adapters import backend

    assert not backend.SEAMS.owners
    yield backend
    for owner in list(backend.SEAMS.owners):
        backend.uninstall(owner)
    backend.uninstall("test")


def _graft_backend(name: str) -> type:
    from vllm_graft.integration.adapters import cuda_backends

    if name == "FLASHINFER":
        from vllm_graft.integration.adapters import cuda_flashinfer

        return cuda_flashinfer.GraftFlashInferBackend
    return {"FLASH_ATTN": cuda_backends.GraftFlashAttentionBackend, "TRITON_ATTN": cuda_backends.GraftTritonAttentionBackend}[name]


def _layer(vllm_config, backend: type | None = None):
    """0.33's own ``Attention`` layer (it builds the impl through its real ``__init__``), made
    under the model's default dtype as vLLM's model loader makes it."""
    from vllm.model_executor.layers.attention.attention import Attention
    from vllm.utils.torch_utils import set_default_torch_dtype

    vllm_config.compilation_config.static_forward_context.clear()
    with set_default_torch_dtype(DTYPE):
        return Attention(H, D, D**-0.5, HK, cache_config=vllm_config.cache_config, prefix=PREFIX, attn_backend=backend)


def _builder(vllm_config, backend: type, spec=None):
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    spec = spec or FullAttentionSpec(block_size=BS, num_kv_heads=HK, head_size=D, dtype=DTYPE)
    return backend.get_builder_cls()(spec, [PREFIX], vllm_config, torch.device("cuda", 0))


class Step:
    """One step's tensors as vLLM 0.33's V1 runner hands them to ``build()`` and to the layer:
    the device ones marked on the fake device, the host copies (``*_cpu``) not."""

    def __init__(self, computed: list[int], queries: list[int], seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.computed, self.queries = computed, queries
        self.seq = [c + q for c, q in zip(computed, queries)]
        qsl = [0]
        for q in queries:
            qsl.append(qsl[-1] + q)
        self.qsl, self.n = qsl, qsl[-1]
        width = -(-max(self.seq) // BS) + 1
        ids = torch.randperm(NB - 1, generator=g)[: len(self.seq) * width] + 1  # block 0 is NULL
        self.table = ids.view(len(self.seq), width).to(torch.int32)
        # the cache: 0.33's per-layer view [blocks, KV heads, block, K|V] over NHD memory
        self.cache = torch.zeros(NB, BS, HK, 2 * D, dtype=DTYPE).transpose(1, 2)
        self.keys = [torch.randn(s, HK, D, generator=g).to(DTYPE) for s in self.seq]
        self.values = [torch.randn(s, HK, D, generator=g).to(DTYPE) for s in self.seq]
        for i, s in enumerate(self.seq):
            for p in range(s):
                blk, off = int(self.table[i, p // BS]), p % BS
                self.cache[blk, :, off, :D] = self.keys[i][p]
                self.cache[blk, :, off, D:] = self.values[i][p]
        self.slots = torch.tensor(
            [int(self.table[i, p // BS]) * BS + p % BS for i, (c, s) in enumerate(zip(computed, self.seq)) for p in range(c, s)],
            dtype=torch.int64,
        )
        self.query = torch.randn(self.n, H * D, generator=g).to(DTYPE)
        # made here, outside the fake device (a factory call of the harness inside it is a device tensor)
        self.qsl_cpu = torch.tensor(qsl, dtype=torch.int32)
        self.seq_cpu = torch.tensor(self.seq, dtype=torch.int32)

    def metadata(self, fd):
        from vllm.v1.attention.backend import CommonAttentionMetadata

        qsl, seq = self.qsl_cpu.clone(), self.seq_cpu.clone()  # host copies stay host tensors
        dev = fd.put(qsl.clone(), seq.clone(), self.table.clone(), self.slots.clone())
        return CommonAttentionMetadata(
            query_start_loc=dev[0], query_start_loc_cpu=qsl, seq_lens=dev[1], seq_lens_cpu_upper_bound=seq,
            num_reqs=len(self.seq), num_actual_tokens=self.n, max_query_len=max(self.queries),
            max_seq_len=max(self.seq), block_table_tensor=dev[2], slot_mapping=dev[3],
        )

    def dense(self, masks: dict | None = None) -> torch.Tensor:
        """Causal attention over every key, in float32 (a row given in ``masks`` attends under
        that ``[queries, keys]`` mask instead): what the layer's output must be."""
        outs = []
        q = self.query.float().view(self.n, H, D)
        for i, (s, qn) in enumerate(zip(self.seq, self.queries)):
            k = self.keys[i].float().repeat_interleave(H // HK, 1).transpose(0, 1)
            v = self.values[i].float().repeat_interleave(H // HK, 1).transpose(0, 1)
            qq = q[self.qsl[i] : self.qsl[i + 1]].transpose(0, 1)
            mask = torch.arange(s)[None, :] <= torch.arange(s - qn, s)[:, None]
            mask = (masks or {}).get(i, mask)
            att = (qq @ k.transpose(1, 2) * D**-0.5).masked_fill(~mask, -math.inf).softmax(-1)
            outs.append((att @ v).transpose(0, 1))
        return torch.cat(outs).reshape(self.n, H * D)


@pytest.fixture
def kernels(monkeypatch):
    """The backends' kernels as recorders bound against the real signatures; returns the calls."""
    from vllm.v1.attention.backends import flash_attn, flashinfer, triton_attn

    calls: list = []
    stubs.stub(monkeypatch, flash_attn, "flash_attn_varlen_func", calls, stubs.fill_out)
    stubs.stub(monkeypatch, flash_attn, "get_scheduler_metadata", calls,
               lambda a: torch.zeros(a["batch_size"] + 1, dtype=torch.int32, device=a["cache_seqlens"].device))
    stubs.stub(monkeypatch, flash_attn, "reshape_and_cache_flash", calls)
    stubs.stub(monkeypatch, triton_attn, "unified_attention", calls, stubs.fill_out)
    stubs.stub(monkeypatch, triton_attn, "triton_reshape_and_cache_flash", calls)
    monkeypatch.setattr(flashinfer, "_copy_page_indices_kernel", stubs.CopyPageIndices(calls))
    from vllm import _custom_ops

    # FlashInfer's write calls the compiled op directly (flashinfer.py:2847): the same op and
    # arguments as vLLM's Python wrapper of it (_custom_ops.reshape_and_cache_flash)
    monkeypatch.setattr(torch.ops._C_cache_ops, "reshape_and_cache_flash",
                        stubs.Recorder("_C_cache_ops.reshape_and_cache_flash", _custom_ops.reshape_and_cache_flash, calls),
                        raising=False)
    for name in ("BatchDecodeWithPagedKVCacheWrapper", "BatchPrefillWithPagedKVCacheWrapper"):
        monkeypatch.setattr(flashinfer, name, stubs.recorded_class(getattr(flashinfer, name), calls))
    return calls


# ------------------------------------------------------------------ construction and selection
@pytest.mark.parametrize("name", BACKENDS)
def test_impl_and_builder_run_vllm_033s_own_init(vllm_config, fd, name):
    from vllm.config import set_current_vllm_config

    from vllm_graft.integration.adapters.cuda_backends import GraftBuilderMixin, GraftImplMixin

    backend = _graft_backend(name)
    with set_current_vllm_config(vllm_config), fd:
        layer = _layer(vllm_config, backend)
        builder = _builder(vllm_config, backend)
    assert isinstance(layer.impl, GraftImplMixin) and isinstance(builder, GraftBuilderMixin)
    assert layer.impl.graft_attn_type == "decoder" and layer.attn_backend.get_name() == name
    if name == "FLASHINFER":  # why the mixin keeps its own: 0.33's FlashInferImpl stores none
        assert not hasattr(layer.impl, "attn_type")


@pytest.mark.parametrize("asked", [None, *BACKENDS, "FLEX_ATTENTION"])
def test_vllm_033s_selector_picks_the_graft_subclasses(vllm_config, fd, seams, asked, monkeypatch):
    """With the seams needed (here a KV rewriter), 0.33's CUDA selector (platforms/cuda.py:420-518)
    validates our overrides and picks them as it would the stock classes: FLASH_ATTN first on
    Hopper when nothing is asked; a named member that carries no seams is refused with the fix."""
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from vllm_graft.integration.adapters.cuda_backends import GraftImplMixin, guard_reason

    seams.install("test")
    seams.SEAMS.rewriters.append(lambda builder, cm: cm)
    monkeypatch.setattr(vllm_config.attention_config, "backend", AttentionBackendEnum[asked] if asked else None)
    with set_current_vllm_config(vllm_config), fd:
        if asked == "FLEX_ATTENTION":
            with pytest.raises(ValueError) as info:
                _layer(vllm_config)
            assert guard_reason("FLEX_ATTENTION") in str(info.value)
            return
        layer = _layer(vllm_config)
    assert layer.attn_backend.get_name() == (asked or "FLASH_ATTN")
    assert isinstance(layer.impl, GraftImplMixin)
    assert issubclass(layer.attn_backend, _graft_backend(asked or "FLASH_ATTN"))


# ------------------------------------------------------------------ build() and forward()
def _attention_method(seams):
    """An attention method that computes the layer itself (plain paged attention in PyTorch,
    the reference every attention plugin is held to), routed as the attention adapter routes one."""
    from vllm_graft.plugins.attention._shared import PagedAttention

    seams.install("test")
    seams.SEAMS.method, seams.SEAMS.method_name, seams.SEAMS.host_kernel = PagedAttention(None), "paged", False
    return seams.SEAMS.method


def _run(vllm_config, fd, name, step, forward=True):
    """Build the step's metadata with the graft builder and run the layer's write and forward,
    as 0.33's layer calls them (attention.py:545-575); returns (metadata, output or None)."""
    from vllm.config import set_current_vllm_config

    backend = _graft_backend(name)
    with set_current_vllm_config(vllm_config), fd:
        layer = _layer(vllm_config, backend)
        builder = _builder(vllm_config, backend)
        cm = step.metadata(fd)
        md = builder.build(0, cm)
        query, cache = fd.put(step.query.clone(), step.cache.clone())
        key = fd.put(torch.randn(step.n, HK * D).to(DTYPE))
        output = fd.put(torch.zeros(step.n, H * D, dtype=DTYPE))
        with fd.region("layer"):
            layer.impl.do_kv_cache_update(layer, key.view(-1, HK, D), key.view(-1, HK, D), cache, cm.slot_mapping)
            if not forward:
                return md, None
            out = layer.impl.forward(layer, query.view(-1, H, D), key.view(-1, HK, D), key.view(-1, HK, D),
                                     cache, md, output.view(-1, H, D))
        assert fd.is_marked(out)
    return md, out.detach().clone().view(step.n, H * D)


@pytest.mark.parametrize("batch", sorted(BATCHES))
@pytest.mark.parametrize("name", BACKENDS)
def test_stock_route_runs_vllm_033s_build_and_kernel(vllm_config, fd, kernels, seams, name, batch):
    """No plugin changes the math: the graft builder's ``build()`` is the stock one (no graft
    batch), the write and the forward reach 0.33's own kernel calls, with arguments their real
    signatures accept."""
    step = Step(*BATCHES[batch])
    # FlashInfer's stock forward reads the state its wrappers' plan() keeps inside FlashInfer
    # (and vLLM's own fast_plan_decode), which the recorders do not rebuild: it stops after the
    # write; build() ran 0.33's planning, with the recorded wrapper calls
    md, out = _run(vllm_config, fd, name, step, forward=name != "FLASHINFER")
    assert getattr(md, "graft_batch", None) is None
    called = {c[0] for c in kernels}
    if name == "FLASH_ATTN":
        assert {"reshape_and_cache_flash", "flash_attn_varlen_func"} <= called
    elif name == "TRITON_ATTN":
        assert {"triton_reshape_and_cache_flash", "unified_attention"} <= called
    else:
        assert "_C_cache_ops.reshape_and_cache_flash" in called and "_copy_page_indices_kernel" in called
        if batch != "decode":
            assert "BatchPrefillWithPagedKVCacheWrapper.plan" in called


@pytest.mark.parametrize("batch", sorted(BATCHES))
@pytest.mark.parametrize("name", BACKENDS)
def test_an_attention_method_computes_the_layer_inside_vllm_033s_backends(vllm_config, fd, kernels, seams, name, batch):
    """An attention plugin that is not plain attention: ``build()`` (0.33's, then the graft batch
    and the method's plan) and the mixin's ``forward`` give causal attention over the cache 0.33
    lays out, without calling vLLM's attention kernel and without a host sync in the layer."""
    method = _attention_method(seams)
    # the method's own syncs (the PyTorch reference's) are its own: the layer's are the seam's
    fd.wrap(method, ["forward", "plan"], prefix="method.")
    step = Step(*BATCHES[batch], seed=3)
    md, out = _run(vllm_config, fd, name, step, "method")
    assert md.graft_batch is not None and md.graft_num_tokens == step.n
    assert not {"flash_attn_varlen_func", "unified_attention"} & {c[0] for c in kernels}
    assert not [c for c in kernels if c[0].endswith(".run")]
    torch.testing.assert_close(out.float(), step.dense(), atol=2e-3, rtol=2e-3)
    assert fd.sync_counts().get("layer", 0) == 0, fd.report()


@pytest.mark.parametrize("name", BACKENDS)
def test_the_kv_rewriter_feeds_vllm_033s_build_and_kernel(vllm_config, fd, kernels, seams, name, monkeypatch):
    """A KV compressor's rewriter ahead of 0.33's ``build()``: the rows' dropped blocks leave the
    block table and the lengths, and 0.33's kernel call gets the compacted ones (the keep rule:
    the first block and the last two). FlashInfer's native paths plan from the host upper bound
    of the lengths (flashinfer.py:1669-1676), which the rewriter lowers too: its page list holds
    the kept pages only."""
    from vllm.config import set_current_vllm_config

    from vllm_graft.hooks import KVCompressor
    from vllm_graft.integration.adapters.kvcompress import state as kvstate
    from vllm_graft.integration.adapters.kvcompress.engine import rewrite
    from vllm_graft.integration.adapters.kvcompress.rows import _StepRows, step_rows
    from vllm_graft.integration.adapters.kvcompress.vllm_spec import GraftKVCompressSpec

    class SinkWindow(KVCompressor):
        def keep(self, view):
            n = view.num_blocks
            return sorted(set(range(min(1, n))) | set(range(max(0, n - 2), n)))

    seams.install("test")
    seams.SEAMS.rewriters.append(rewrite)
    previous = kvstate.get_active()
    kvstate.set_active(kvstate.Active(SinkWindow(None), "sw", lambda event, n=1: None))
    step = Step([5 * BS + 3, 2 * BS, 0], [1, 1, 9], seed=4)
    runner = types.SimpleNamespace(input_batch=types.SimpleNamespace(
        num_reqs=3, req_ids=["r0", "r1", "r2"], num_prompt_tokens=torch.tensor(step.seq).numpy()))
    spec = GraftKVCompressSpec(block_size=BS, num_kv_heads=HK, head_size=D, dtype=DTYPE, compressor="sw")
    backend = _graft_backend(name)
    step_rows.inside, step_rows.step = True, _StepRows(runner, {"r0": 1, "r1": 1, "r2": 9})
    try:
        with set_current_vllm_config(vllm_config), fd:
            layer = _layer(vllm_config, backend)
            builder = _builder(vllm_config, backend, spec)
            md = builder.build(0, step.metadata(fd))
            out = fd.put(torch.zeros(step.n, H, D, dtype=DTYPE))
            q, cache = fd.put(step.query.clone().view(-1, H, D), step.cache.clone())
            if name != "FLASHINFER":  # its stock forward: see test_stock_route_runs_...
                layer.impl.forward(layer, q, q[:, :HK], q[:, :HK], cache, md, out)
    finally:
        step_rows.inside, step_rows.step = False, None
        kvstate.set_active(previous)
    # row 0: 6 blocks (83 tokens + 1), keeps blocks 0, 4, 5: 3 blocks (48 tokens) dropped
    lens = [step.seq[0] - 3 * BS, step.seq[1], step.seq[2]]
    kept0 = [int(step.table[0, j]) for j in (0, 4, 5)]
    if name == "FLASHINFER":
        pages = [-(-n // BS) for n in lens]
        indptr = builder.paged_kv_indptr.cpu[:4].tolist()
        assert indptr == [0, pages[0], pages[0] + pages[1], sum(pages)]
        assert builder.paged_kv_indices[: pages[0]].cpu().tolist() == kept0
        last = builder.paged_kv_last_page_len.cpu[:3].tolist()
        assert last == [n % BS or BS for n in lens]
        return
    assert md.seq_lens.cpu().tolist()[:3] == lens
    assert md.block_table.cpu()[0, :3].tolist() == kept0
    kernel = next(a for n, a in kernels if n in ("flash_attn_varlen_func", "unified_attention"))
    assert kernel["seqused_k"] is md.seq_lens and kernel["block_table"] is md.block_table


@pytest.mark.parametrize("name", BACKENDS)
def test_a_scored_compressor_scores_then_hands_steps_to_vllm_033s_kernel(vllm_config, fd, kernels, seams, name):
    """SnapKV as its adapter wires it (a scoring attention method plus the rewriter): the prompt's
    step computes attention with mass inside 0.33's backend (equal to dense causal attention) and
    drops a block at its end; the next decode step, outside the observation window, leaves that
    block out of the table and runs 0.33's own kernel over the rest."""
    from vllm.config import set_current_vllm_config

    from vllm_graft.hooks import get_registry
    from vllm_graft.integration.adapters.kvcompress import state as kvstate
    from vllm_graft.integration.adapters.kvcompress.engine import rewrite
    from vllm_graft.integration.adapters.kvcompress.rows import _StepRows, step_rows
    from vllm_graft.integration.adapters.kvcompress.scores import _Scores, _ScoringAttention
    from vllm_graft.integration.adapters.kvcompress.vllm_spec import GraftKVCompressSpec

    reg = get_registry().get("kvcompress", "snapkv").registration
    compressor = reg.load()(reg.params(budget_blocks=2, sink_blocks=1, window_tokens=4))
    events: list = []
    count = lambda event, n=1: events.append((event, n))  # noqa: E731
    active = kvstate.Active(compressor, "snapkv", count, needs_scores=True)
    active.scored = _Scores(compressor, "snapkv", count)
    seams.install("test")
    seams.SEAMS.method, seams.SEAMS.method_name, seams.SEAMS.count = _ScoringAttention(active.scored), "snapkv", count
    seams.SEAMS.rewriters.append(rewrite)
    previous = kvstate.get_active()
    kvstate.set_active(active)
    spec = GraftKVCompressSpec(block_size=BS, num_kv_heads=HK, head_size=D, dtype=DTYPE, compressor="snapkv")
    backend = _graft_backend(name)
    prompt = 3 * BS + 8  # 4 blocks; the budget keeps 2
    prefill, decode = Step([0], [prompt], seed=5), Step([prompt], [1], seed=5)
    decode.table, decode.cache = prefill.table, prefill.cache  # the same request's blocks
    runner = types.SimpleNamespace(input_batch=types.SimpleNamespace(
        num_reqs=1, req_ids=["r0"], num_prompt_tokens=torch.tensor([prompt]).numpy()))
    outs, mds = [], []
    try:
        with set_current_vllm_config(vllm_config), fd:
            layer = _layer(vllm_config, backend)
            builder = _builder(vllm_config, backend, spec)
            for st in (prefill, decode):
                kernels.clear()
                step_rows.inside, step_rows.step = True, _StepRows(runner, {"r0": st.queries[0]})
                md = builder.build(0, st.metadata(fd))
                q, cache = fd.put(st.query.clone().view(-1, H, D), st.cache.clone())
                out = fd.put(torch.zeros(st.n, H, D, dtype=DTYPE))
                if st is prefill or name != "FLASHINFER":
                    with fd.region("layer"):
                        layer.impl.forward(layer, q, q[:, :HK], q[:, :HK], cache, md, out)
                drops = active.scored.finalize()
                outs.append((out.detach().clone().view(st.n, H * D), drops, [c[0] for c in kernels]))
                mds.append(md)
    finally:
        step_rows.inside, step_rows.step = False, None
        kvstate.set_active(previous)
    (p_out, p_drops, p_kernels), (_, d_drops, d_kernels) = outs
    torch.testing.assert_close(p_out.float(), prefill.dense(), atol=2e-3, rtol=2e-3)
    # the sink block and the window's block stay: blocks 1 and 2 go (2 x 16 of 56 tokens)
    assert p_drops == {"r0": [1, 2]}, p_drops
    assert not {"flash_attn_varlen_func", "unified_attention"} & set(p_kernels)
    assert not d_drops
    kept = [0, 3]  # 57 tokens after the decode step, 25 of them kept: two pages
    if name == "FLASHINFER":
        pages = builder.paged_kv_indptr.cpu[1]
        assert pages == len(kept)
        assert builder.paged_kv_indices[:pages].cpu().tolist() == [int(prefill.table[0, j]) for j in kept]
        return
    assert {"flash_attn_varlen_func", "unified_attention"} & set(d_kernels), d_kernels
    assert mds[1].seq_lens.cpu().tolist()[:1] == [prompt + 1 - 2 * BS]
    assert mds[1].block_table.cpu()[0, : len(kept)].tolist() == [int(prefill.table[0, j]) for j in kept]


@pytest.mark.parametrize("name", BACKENDS)
def test_a_storage_format_writes_and_attends_in_its_own_page_inside_vllm_033s_backends(
    vllm_config, fd, kernels, seams, name, monkeypatch
):
    """kv4 as its adapter wires it: the backend's ``customize_spec`` (0.33's, then ours) gives the
    format's uint8 page, 0.33's builder takes that spec, the layer's write goes to the format and
    its attention reads the page: the same output as kv4's own reference on the same page, and
    neither of vLLM's write or attention kernels is called. FLASHINFER's builder asserts that the
    spec's dtype is the model's (0.33 flashinfer.py:983): with a format it is invalid, so vLLM's
    selector passes it over (on Blackwell, where it comes first) and refuses it by name, with why."""
    from vllm.config import set_current_vllm_config
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from vllm_graft.hooks import PACKED, AttentionLayer, PagedBatch, get_registry
    from vllm_graft.integration.adapters.kvcompress import state as kvstate
    from vllm_graft.integration.adapters.kvcompress.engine import _FormatSeam
    from vllm_graft.integration.adapters.kvcompress.keep import KeepAll
    from vllm_graft.integration.adapters.kvcompress.vllm_spec import GraftKVCompressSpec

    reg = get_registry().get("kvcompress", "kv4").registration
    fmt = reg.load()(reg.params())
    runtime = types.SimpleNamespace(count=lambda *a: None)
    active = kvstate.Active(KeepAll(), "kv4", lambda *a: None, kv_format=fmt, format_name="kv4")
    previous = kvstate.get_active()
    kvstate.set_active(active)
    seams.install("test")
    seams.SEAMS.kv_format = _FormatSeam(fmt, "kv4", runtime)
    from vllm_graft.integration.adapters.kvcompress import vllm_spec

    seams.SEAMS.customize_spec = vllm_spec.customize_spec
    backend = _graft_backend(name)
    step = Step([0, 0], [9, 20], seed=6)
    if name == "FLASHINFER":
        try:
            _refused_on_flashinfer(vllm_config, fd, monkeypatch)
        finally:
            kvstate.set_active(previous)
        return
    try:
        spec = backend.customize_spec(FullAttentionSpec(block_size=BS, num_kv_heads=HK, head_size=D, dtype=DTYPE))
        assert isinstance(spec, GraftKVCompressSpec) and spec.dtype == torch.uint8
        page = torch.zeros(NB, BS, HK, fmt.bytes_per_token(D, BS), dtype=torch.uint8).transpose(1, 2)
        keys, values = torch.cat(step.keys), torch.cat(step.values)
        with set_current_vllm_config(vllm_config), fd:
            layer = _layer(vllm_config, backend)
            builder = _builder(vllm_config, backend, spec)
            cm = step.metadata(fd)
            md = builder.build(0, cm)
            dpage, q, k, v = fd.put(page.clone(), step.query.clone().view(-1, H, D), keys.clone(), values.clone())
            out = fd.put(torch.zeros(step.n, H, D, dtype=DTYPE))
            with fd.region("layer"):
                layer.impl.do_kv_cache_update(layer, k, v, dpage, cm.slot_mapping)
                layer.impl.forward(layer, q, k, v, dpage, md, out)
    finally:
        kvstate.set_active(previous)
    assert not {c[0] for c in kernels} & {"reshape_and_cache_flash", "triton_reshape_and_cache_flash",
                                          "_C_cache_ops.reshape_and_cache_flash", "flash_attn_varlen_func",
                                          "unified_attention"}
    # kv4's reference on the host, the same inputs: the page and the output
    want_page = page.clone()
    fmt.write(keys, values, want_page, step.slots)
    assert torch.equal(dpage.detach().clone(), want_page)
    batch = PagedBatch(query_start_loc=step.qsl_cpu, seq_lens=step.seq_cpu, block_table=step.table, max_query_len=20)
    spec_layer = AttentionLayer(num_heads=H, num_kv_heads=HK, head_size=D, scale=D**-0.5, block_size=BS, index=0,
                                kv_layout=PACKED)
    want, _ = fmt.forward(step.query.view(-1, H, D), want_page, batch, spec_layer)
    torch.testing.assert_close(out.detach().clone().float(), want.float(), atol=1e-3, rtol=1e-3)


def _refused_on_flashinfer(vllm_config, fd, monkeypatch):
    from vllm.config import set_current_vllm_config
    from vllm.platforms import current_platform
    from vllm.platforms.interface import DeviceCapability
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from vllm_graft.integration.adapters.cuda_flashinfer import FORMAT_REASON

    monkeypatch.setattr(type(current_platform), "get_device_capability", classmethod(lambda cls, device_id=0: DeviceCapability(10, 0)))
    with set_current_vllm_config(vllm_config), fd:
        layer = _layer(vllm_config)  # SM 10.0 puts FLASHINFER first (platforms/cuda.py:155-182)
        assert layer.attn_backend.get_name() == "FLASH_ATTN"
        monkeypatch.setattr(vllm_config.attention_config, "backend", AttentionBackendEnum.FLASHINFER)
        with pytest.raises(ValueError) as info:
            _layer(vllm_config)
    assert FORMAT_REASON in str(info.value)


PARENTS = [-1, -1, 0, 1, 1, 3]  # a draft tree of six nodes after its root


@pytest.mark.parametrize("name", BACKENDS)
def test_tree_verification_computes_its_rows_inside_vllm_033s_backends(vllm_config, fd, kernels, seams, name, monkeypatch):
    """Tree verification as the speculative adapter installs it (its attention method in the
    seam): 0.33's ``build()``, the method's plan, and a step of a decode row and a tree row (its
    root and six nodes, each seeing its context and its ancestors): dense attention under that
    mask, vLLM's attention kernel not called."""
    from vllm.config import set_current_vllm_config

    from tests.unit.test_spec_tree_engine import step_tree, verifier_with
    from vllm_graft.integration.adapters.speculative import tree as T

    step = Step([20, 30], [1, 1 + len(PARENTS)], seed=7)
    monkeypatch.setattr(T._state(), "tree_verifier", verifier_with({1: step_tree(PARENTS, start=1, context=30)}, others=True))
    T.install_attention("test")
    try:
        md, out = _run(vllm_config, fd, name, step)
    finally:
        T.uninstall_attention("test")
    assert md.graft_batch is not None and md.graft_plan is not None
    assert not {"flash_attn_varlen_func", "unified_attention"} & {c[0] for c in kernels}
    # row 1's pass: every row sees the 30 keys of its context, itself and its ancestors
    mask = torch.zeros(7, 37, dtype=torch.bool)
    mask[:, :30] = True
    parents = [-1, *(q + 1 for q in PARENTS)]
    for i in range(7):
        j = i
        while j >= 0:
            mask[i, 30 + j] = True
            j = parents[j]
    assert md.graft_plan.kernel is not None  # device tensors: the Triton tree kernel (interpreted here)
    assert (step.dense() - step.dense({1: mask})).abs().max() > 1e-2  # the tree mask is not causal
    torch.testing.assert_close(out.float(), step.dense({1: mask}), atol=2e-3, rtol=2e-3)
