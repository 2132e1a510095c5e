"""KV-compression adapter: the enabled :class:`~vllm_graft.hooks.KVCompressor` decides, every
step, which KV blocks of each request stay; the others are freed (scheduler) and left out of
attention (worker).

vLLM route
----------
Scheduler half. :class:`GraftKVCompressSpec`, a ``FullAttentionSpec`` subclass, is registered
with vLLM's KV-cache spec registry (``v1/kv_cache_spec_registry.py:
KVCacheSpecRegistry.register``, grouped with full attention) together with its manager
:class:`GraftKVCompressManager`, a subclass of ``v1/core/single_type_kv_cache_manager.py:
FullAttentionManager``. The shared CPU_ATTN backend's ``customize_spec`` (:mod:`.backend`)
turns each plain full-attention layer's spec into it (the spec carries the plugin's name:
vLLM builds specs where no vLLM config is current). The scheduler calls
``remove_skipped_blocks(request_id, processed_computed_tokens, num_prompt_tokens)`` once per
scheduling of a request (``v1/core/kv_cache_manager.py: KVCacheManager.allocate_slots``,
before it allocates the step's new blocks). The manager then builds a
:class:`~vllm_graft.hooks.BlockView` (``num_tokens`` = the computed tokens; ``pinned`` = held
blocks with ``ref_cnt > 1``, i.e. shared with other requests through the prefix cache), calls
``keep``, checks the answer (:func:`~vllm_graft.hooks.contracts.check_keep`, plus "a freed
block is never kept again") and frees the blocks not kept and not freed yet with the
manager's ``_remove_blocks_in_range``: they become ``null_block`` in the request's table and
return to the block pool (the way R-SWA frees its gap). ``get_num_skipped_tokens`` stays 0.

Worker half. The worker's block table is append-only: it keeps the stale ids of freed
blocks, which the pool hands to other requests, and vLLM's CPU kernel would read them. A
metadata *rewriter* (``backend.SEAMS.rewriters``, run by the backend's builder before the
stock ``CPUAttentionMetadataBuilder.build``) drops, in each row of the batch, the logical
blocks that ``keep`` drops and lowers the row's ``seq_len`` by ``block_size`` per dropped
block (they are full blocks: the last block is always kept). The worker has no scores and
does not hear from the scheduler, so it calls the same ``keep`` with the same view
(``num_tokens`` = ``seq_len - query_len``, the row's prompt length, ``pinned`` empty,
``scores`` None): compressors must be deterministic in those (see
:class:`~vllm_graft.hooks.KVCompressor`); one with ``needs_scores`` decides in the worker
instead (see "The scores channel"). Keys are cached after RoPE, so the kept keys keep their positions; the step's
queries are the last ``query_len`` positions of the shortened row, so causality among them
is unchanged. A row whose compressor drops nothing is left as it is (the noop path costs one
``keep`` call per row and no tensor work).

(That is the path of deterministic compressors such as ``streaming``; scored ones are below.)
The scheduler frees what ``keep`` dropped at ``processed_computed_tokens``; the worker drops
what ``keep`` drops at the step's computed length, which is never smaller. As dropped blocks
stay dropped, the worker reads a subset of the blocks the scheduler still holds: never a
freed one. (Pinned blocks the worker drops stay held until no longer shared.)

Prefix-cache salt
-----------------
KV computed while a lossy compressor evicts is not the plain KV of the same tokens, yet the
prefix cache finds blocks by a hash of their tokens (and the request's ``cache_salt``, an
extra key of the first block, which the hash chain carries to every later block). With a
lossy compressor (``capabilities.lossless`` False) the adapter wraps ``v1/request.py:
Request.__init__`` (a patch, owner ``adapters.kvcompress``) so that every request's
``cache_salt`` becomes ``vllm-graft/kvcompress/<name>/<parameters as JSON>`` (followed by
``|<the user's salt>`` if one was given): a compressed request's blocks are served only to
requests of the same compressor and budget, never to plain vLLM through a shared or
offloaded cache, nor across budgets. Within one compressor and budget, a block may still
have been computed under a slightly different eviction history (another prefill chunking):
the approximation is the compressor's own.

The scores channel (``needs_scores`` compressors: ``h2o``, ``snapkv``)
------------------------------------------------------------------------
Where the processes are. vLLM's default engine (``VLLM_ENABLE_V1_MULTIPROCESSING=1``) runs
the scheduler in the engine-core process; on CPU the platform turns the uni-process executor
into the multiprocess one (``platforms/cpu.py``: OMP needs it), so even a single CPU worker
runs in a process of its own. Attention scores exist only in the worker; blocks are freed
only by the scheduler. The channel is the object that already travels from the worker to the
scheduler every step, ``ModelRunnerOutput`` (pickled by the executor's message queue).

Worker. While a scored compressor is active, the backend's attention seam
(``backend.SEAMS.method``) is a scoring attention that runs the compressor's ``attend``
(its reference, or its Triton decode kernel) and adds the mass it reports, per block-table
column, into the step's plan (summed over heads, layers and the queries the compressor's
``score_positions`` selects). After the forward pass (wrappers of ``GPUModelRunner.
execute_model`` and ``sample_tokens``) each row's mass is folded into its request's
per-logical-block scores, ``keep`` is asked with ``num_tokens`` = all computed tokens and the
scores (``-inf`` for blocks dropped before), and the newly dropped blocks are (1) recorded in
the worker, whose rewriter leaves them out of attention from the next step on, and (2) put on
the step's ``ModelRunnerOutput`` as ``graft_kv_drops`` ``{request id: [logical blocks]}``.
Finished, preempted and resumed requests (from the ``SchedulerOutput`` given to
``execute_model``) are forgotten, so a request computed again starts with full attention.

Scheduler. A wrapper of ``Scheduler.update_from_output`` (run before the next
``schedule()``: CPU scheduling is synchronous) records the reported drops per request; the
manager's ``remove_skipped_blocks`` frees them with ``_remove_blocks_in_range``, except
blocks still shared through the prefix cache (``ref_cnt > 1``), which wait until they are
not; ``free()`` (finish, abort, preemption) forgets the request. Safety: the scheduler frees
only what the worker already stopped reading, so a freed block that the pool hands to
another request is never read by the request that gave it up. Cost: a decision frees its
blocks one step later than a deterministic compressor's. The same path runs in-process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), where the output object is passed as is. Each
process can append its channel events to a file named by ``VLLM_GRAFT_KVCOMPRESS_TRACE``
(tests use it to see the worker decide and the scheduler free in different processes).

Granularity. vLLM frees KV per block and per KV-cache group, so a block's score aggregates
its tokens, all heads and all layers: H2O and SnapKV here choose blocks for all layers at
once, not per layer or per head as in the papers. A scored compressor brings its own
attention, so it cannot be combined with an attention plugin (refused at validation: its
registration declares ``incompatible_with: attention:*``; activation checks again).

Storage formats (``KVCacheFormat``, e.g. ``kv4``) and composition
-----------------------------------------------------------------
A deployment's ``kvcompress:`` may list one plugin per role (``KindSpec.roles`` in ``hooks.kinds``):
an eviction compressor and a storage format. The format evicts nothing; alone, it is also the
"compressor" whose ``keep`` (every block) the manager asks. ``customize_spec`` gives the spec
``dtype=uint8`` and ``state_content_bytes`` = the format's bytes per token and KV head, so
vLLM's page size, and the number of blocks in the KV memory, are the format's (the spec
records ``compressor`` = "evictor+format" and ``kv_format``). The backend's impl calls the
format's ``write`` in ``do_kv_cache_update`` and its attention in ``forward`` on ``uint8``
caches (``backend.SEAMS.kv_format``); with a scored evictor the scoring attention asks the
format for the attention and the mass. The prefix-cache salt joins every lossy plugin's salt
(:func:`composition_salt`).

The metadata patch
------------------
``CommonAttentionMetadata`` has per-row sequence and query lengths but not which request a
row is, nor its prompt length. Row ``i`` is ``runner.input_batch.req_ids[i]`` (the runner
builds the metadata from its input batch in row order: ``GPUModelRunner.
_build_attention_metadata``, inherited by ``CPUModelRunner``). The adapter wraps that method
(through :data:`~..patches.PATCHES`, owner ``adapters.kvcompress``) to note the runner and
the step's ``num_scheduled_tokens`` while the builders run; the rewriter reads each row's
request id and prompt length from ``input_batch`` and checks that the row's query length is
the number of tokens the scheduler gave that request. Dummy/profiling builds (no scheduler
output) are left unchanged.

Events (``RUNTIME.count``): ``steps`` (``keep`` calls in the scheduler), ``blocks_freed``
(blocks returned to the pool), ``worker_steps`` (``keep`` calls in the worker) and
``blocks_skipped`` (row blocks left out of a step's attention, summed over rows and steps).

This module imports vLLM only when a deployment activates it: the pure logic (what to free,
how to rewrite a row) is unit-tested without vLLM, and the two vLLM classes are built on
first use (module ``__getattr__``, so they unpickle by name in any process).
"""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

from vllm_graft.hooks import BlockView, Kind, KVCacheFormat, KVCompressor
from vllm_graft.integration.adapters.kvcompress.keep import KeepAll, KeepError, check_keep, dropped_blocks

from vllm_graft.integration.patches import PATCHES
from vllm_graft.integration.adapters import Adapter, attention_backend_overrides

if TYPE_CHECKING:
    import torch

OWNER = "adapters.kvcompress"
VERSIONS = ">=0.32,<0.34"


class KVCompressError(RuntimeError):
    """The adapter cannot run the plugin (state, or vLLM's batch not as expected)."""


# ------------------------------------------------------------------- pure logic (no vLLM)
def blocks_to_free(
    compressor: KVCompressor,
    plugin: str,
    *,
    num_tokens: int,
    block_size: int,
    num_prompt_tokens: int,
    held: Sequence[tuple[bool, int]],
) -> list[int] | None:
    """The scheduler's decision for one request: the logical blocks to free now.

    ``held[i]`` is ``(is_null, ref_cnt)`` of the request's block i (null: freed earlier).
    Returns None, without calling the plugin, when the request does not yet hold a block
    for every computed token (a prefix-cache hit is added after this call; the next step
    decides). Raises :class:`KeepError` if the answer breaks a rule, including keeping a
    block that an earlier step freed.
    """
    view = BlockView(num_tokens=num_tokens, block_size=block_size, num_prompt_tokens=num_prompt_tokens)
    n = view.num_blocks
    if n == 0 or len(held) < n:
        return None
    pinned = frozenset(i for i in range(n) if not held[i][0] and held[i][1] > 1)
    view = BlockView(num_tokens=num_tokens, block_size=block_size,
                     num_prompt_tokens=num_prompt_tokens, pinned=pinned)
    kept = check_keep(view, compressor.keep(view), plugin)
    back = [i for i in kept if held[i][0]]
    if back:
        raise KeepError(
            f"kvcompress plugin {plugin!r}: keep() returned {kept} for {num_tokens} tokens, but "
            f"block(s) {back} were dropped at an earlier step and their KV is gone; a dropped "
            "block must stay dropped")
    return [i for i in dropped_blocks(view, kept) if not held[i][0]]


def blocks_to_skip(
    compressor: KVCompressor,
    plugin: str,
    *,
    num_tokens: int,
    block_size: int,
    num_prompt_tokens: int,
) -> list[int]:
    """The worker's decision for one batch row: the logical blocks its attention leaves out
    (``num_tokens`` = tokens computed before this step). Raises :class:`KeepError`."""
    if num_tokens <= 0:
        return []
    view = BlockView(num_tokens=num_tokens, block_size=block_size, num_prompt_tokens=num_prompt_tokens)
    return dropped_blocks(view, check_keep(view, compressor.keep(view), plugin))


def runs(indices: Sequence[int]) -> list[tuple[int, int]]:
    """Ascending ``indices`` as half-open ranges of consecutive values: [1,2,5] -> [(1,3),(5,6)]."""
    out: list[tuple[int, int]] = []
    for i in indices:
        if out and out[-1][1] == i:
            out[-1] = (out[-1][0], i + 1)
        else:
            out.append((i, i + 1))
    return out


def compact_rows(
    block_table: "torch.Tensor",
    seq_lens: "torch.Tensor",
    skips: Sequence[Sequence[int]],
    block_size: int,
) -> tuple["torch.Tensor", "torch.Tensor"]:
    """New ``(block_table, seq_lens)`` where row i lacks the logical blocks ``skips[i]``
    (ascending, all full blocks before the row's last one): the remaining block ids move
    left in order, the freed columns at the end become 0 (vLLM's null block, never read as
    they lie past the new length), and ``seq_lens[i]`` drops by ``block_size`` per block.
    Rows past ``len(skips)`` are unchanged; the inputs are not modified."""
    import torch

    table = block_table.clone()
    lens = seq_lens.clone()
    width = table.shape[1]
    for i, skip in enumerate(skips):
        if not skip:
            continue
        if skip[-1] >= width:
            raise KVCompressError(f"row {i}: block {skip[-1]} is past the table's {width} columns")
        keep = torch.ones(width, dtype=torch.bool, device=table.device)
        keep[list(skip)] = False
        row = block_table[i][keep]
        table[i, :row.numel()] = row
        table[i, row.numel():] = 0
        lens[i] -= block_size * len(skip)
    return table, lens


# --------------------------------------------------------------------- process state
@dataclass
class _Active:
    compressor: KVCompressor
    name: str
    count: Callable[[str, int], None]
    salt: str | None = None  # prefix-cache salt of this compressor and budget (None: lossless)
    scored: "_Scores | None" = None  # worker-side state of a needs_scores compressor
    needs_scores: bool = False
    to_free: dict = None  # scheduler side: request id -> logical blocks the worker dropped
    kv_format: KVCacheFormat | None = None  # the storage format (e.g. kv4), if one is enabled
    format_name: str = ""

    def __post_init__(self):
        if self.to_free is None:
            self.to_free = {}

    @property
    def spec_name(self) -> str:
        """What the KV-cache spec records: the compressor, then the storage format."""
        if self.kv_format is None or self.format_name == self.name:
            return self.name
        return f"{self.name}+{self.format_name}"


def cache_salt(name: str, params: Any) -> str:
    """The prefix-cache salt of a lossy compressor with its parameters: KV computed while
    blocks were evicted differs from plain KV of the same tokens, so its block hashes must
    never match a plain request's (nor those of another compressor or budget)."""
    dumped = params.model_dump_json() if hasattr(params, "model_dump_json") else repr(params)
    return f"vllm-graft/kvcompress/{name}/{dumped}"


def composition_salt(plugins: Sequence[tuple[str, Any, bool]]) -> str | None:
    """The prefix-cache salt of a deployment's kvcompress plugins ``(name, params, lossless)``
    (an eviction compressor and/or a storage format): the lossy ones' salts joined with
    ``+``, so kv4 KV never matches plain KV, nor streaming-only KV, nor kv4 at other
    parameters; None when every plugin is lossless."""
    lossy = [cache_salt(name, params) for name, params, lossless in plugins if not lossless]
    return "+".join(lossy) if lossy else None


def salted(user_salt: str | None, salt: str | None) -> str | None:
    """A request's ``cache_salt`` with the compressor's salt in front (the user's salt, if
    any, stays part of it, so requests salted differently still never share)."""
    if salt is None:
        return user_salt
    return salt if not user_salt else f"{salt}|{user_salt}"


_active: _Active | None = None


def _current(spec_compressor: str) -> _Active:
    if _active is None:
        raise KVCompressError(
            f"a vllm-graft KV-compression cache (plugin {spec_compressor!r}) is in use in process "
            f"{os.getpid()}, but no deployment with a kvcompress plugin is active there (was "
            "another engine with a different deployment started in this process?)")
    if spec_compressor and spec_compressor != _active.spec_name:
        raise KVCompressError(
            f"this engine's KV cache was built for kvcompress plugin {spec_compressor!r}, but "
            f"{_active.spec_name!r} is active in this process")
    return _active


# ---------------------------------------------------------------- worker: row -> request
class _StepRows:
    """The rows of the batch whose attention metadata is being built (see the patch)."""

    def __init__(self, runner: Any, num_scheduled_tokens: dict[str, int]) -> None:
        self.runner = runner
        self.num_scheduled_tokens = num_scheduled_tokens
        self._skips: dict[int, list[list[int]]] = {}  # by block size
        # scored mode: per row (request id, computed before the step, query length, prompt
        # length, logical blocks left out)
        self.rows: list[tuple[str, int, int, int, list[int]]] = []

    def skips(self, cm: Any, block_size: int, state: _Active) -> list[list[int]]:
        if block_size not in self._skips:
            self._skips[block_size] = self._compute(cm, block_size, state)
        return self._skips[block_size]

    def _compute(self, cm: Any, block_size: int, state: _Active) -> list[list[int]]:
        self.block_size = block_size
        batch = self.runner.input_batch
        n = min(int(cm.num_reqs), batch.num_reqs)
        qsl = cm.query_start_loc_cpu[: n + 1].tolist()
        seq_lens = cm.seq_lens[:n].tolist()
        prompt_lens = batch.num_prompt_tokens[:n].tolist()
        req_ids = batch.req_ids[:n]
        out: list[list[int]] = []
        calls = skipped = 0
        for i in range(n):
            q = qsl[i + 1] - qsl[i]
            if q <= 0:
                out.append([])
                self.rows.append(("", 0, 0, 0, []))
                continue
            req_id = req_ids[i]
            scheduled = self.num_scheduled_tokens.get(req_id)
            if scheduled != q:
                raise KVCompressError(
                    f"vllm-graft kvcompress: batch row {i} has {q} query tokens but the scheduler "
                    f"gave its request {req_id!r} {scheduled}; the rows no longer follow "
                    "input_batch.req_ids (vLLM changed how it builds attention metadata)")
            computed = seq_lens[i] - q
            if state.scored is not None:
                skip = state.scored.skip(req_id, computed, block_size)
                self.rows.append((req_id, computed, q, int(prompt_lens[i]), skip))
            else:
                skip = blocks_to_skip(state.compressor, state.name, num_tokens=computed,
                                      block_size=block_size, num_prompt_tokens=int(prompt_lens[i]))
            if computed > 0 and state.scored is None:
                calls += 1
            skipped += len(skip)
            out.append(skip)
        if calls:
            state.count("worker_steps", calls)
        if skipped:
            state.count("blocks_skipped", skipped)
        return out


_rows = threading.local()


#: Parameters of ``GPUModelRunner._build_attention_metadata`` the wrapper reads.
_WRAPPED_PARAMS = ("num_scheduled_tokens", "for_cudagraph_capture")


def _build_attention_metadata_wrapper(original: Callable) -> Callable:
    import inspect

    signature = inspect.signature(original)
    missing = [p for p in _WRAPPED_PARAMS if p not in signature.parameters]
    if missing:
        raise KVCompressError(
            f"vllm-graft kvcompress: GPUModelRunner._build_attention_metadata has no parameter(s) "
            f"{missing}; this vLLM builds attention metadata differently from the one the "
            f"adapter was written for ({VERSIONS})")

    def _build_attention_metadata(self, *args, **kwargs):
        bound = signature.bind_partial(self, *args, **kwargs).arguments
        scheduled = bound.get("num_scheduled_tokens")
        if scheduled is None or bound.get("for_cudagraph_capture"):
            return original(self, *args, **kwargs)  # dummy / profiling batch: no requests
        previous = getattr(_rows, "step", None)
        _rows.step = _StepRows(self, scheduled)
        try:
            return original(self, *args, **kwargs)
        finally:
            _rows.step = previous

    _build_attention_metadata.__wrapped__ = original  # type: ignore[attr-defined]
    return _build_attention_metadata


def _request_init_wrapper(original: Callable) -> Callable:
    import inspect

    signature = inspect.signature(original)
    if "cache_salt" not in signature.parameters:
        raise KVCompressError(
            "vllm-graft kvcompress: vllm.v1.request.Request takes no 'cache_salt'; this vLLM "
            f"hashes prefix-cache blocks differently from the one the adapter was written for ({VERSIONS})")

    def __init__(self, *args, **kwargs):
        state = _active
        if state is not None and state.salt is not None:
            bound = signature.bind(self, *args, **kwargs)
            bound.arguments["cache_salt"] = salted(bound.arguments.get("cache_salt"), state.salt)
            return original(*bound.args, **bound.kwargs)
        return original(self, *args, **kwargs)

    __init__.__wrapped__ = original  # type: ignore[attr-defined]
    return __init__


def install_patch(salt: bool = False) -> None:
    """Wrap ``GPUModelRunner._build_attention_metadata`` and, for a lossy compressor,
    ``Request.__init__`` (the prefix-cache salt) (idempotent)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if salt:
        from vllm.v1.request import Request

        PATCHES.ensure(
            OWNER, Request, "__init__", _request_init_wrapper, wrap=True,
            reason="KV computed while a lossy compressor evicts blocks is not the plain KV of its "
                   "tokens; the prefix cache hashes blocks by tokens (and cache_salt), so every "
                   "request's cache_salt gets the compressor's name and parameters in front: "
                   "blocks are shared only between requests of the same compressor and budget",
            versions=VERSIONS)

    PATCHES.ensure(
        OWNER, GPUModelRunner, "_build_attention_metadata", _build_attention_metadata_wrapper,
        wrap=True,
        reason="the attention-metadata builder sees batch rows but not their requests; KV "
               "compression needs each row's request (input_batch.req_ids) and prompt length "
               "to drop the blocks the scheduler freed",
        versions=VERSIONS)


def rewrite(builder: Any, cm: Any) -> Any:
    """The backend's metadata rewriter: drop skipped blocks from each row (see module doc)."""
    classes = _vllm_classes()
    spec = getattr(builder, "kv_cache_spec", None)
    if not isinstance(spec, classes["GraftKVCompressSpec"]):
        return cm
    if getattr(builder, "is_cross_attention", False) or getattr(builder, "is_encoder_only_attention", False):
        return cm
    step = getattr(_rows, "step", None)
    if step is None:
        return cm
    block_size = spec.block_size
    if getattr(builder, "block_size", block_size) != block_size:
        raise NotImplementedError(
            f"vllm-graft kvcompress: kernel blocks ({builder.block_size}) smaller than KV-cache "
            f"blocks ({block_size}) are not supported")
    skips = step.skips(cm, block_size, _current(spec.compressor))
    if not any(skips):
        return cm
    table, seq_lens = compact_rows(cm.block_table_tensor, cm.seq_lens, skips, block_size)
    changes: dict[str, Any] = {"block_table_tensor": table, "seq_lens": seq_lens,
                               "max_seq_len": int(seq_lens.max()) if seq_lens.numel() else 0,
                               "_num_computed_tokens_cache": None}
    if getattr(cm, "seq_lens_cpu_upper_bound", None) is not None:
        changes["seq_lens_cpu_upper_bound"] = seq_lens.cpu()
    return cm.replace(**changes)


# --------------------------------------------------------- scored compressors (worker)
NEG_INF = float("-inf")

#: Environment variable naming a file to which each process appends one JSON line per
#: scores-channel event (``{"pid", "event", "n"}``): the proof, in tests, that the worker
#: decides and the scheduler frees, in their own processes. Unset: nothing is written.
ENV_TRACE = "VLLM_GRAFT_KVCOMPRESS_TRACE"


def _trace(event: str, n: int) -> None:
    path = os.environ.get(ENV_TRACE)
    if path:
        import json

        with open(path, "a") as f:
            f.write(json.dumps({"pid": os.getpid(), "event": event, "n": n}) + "\n")


@dataclass
class _ReqScores:
    scores: list[float]
    dropped: set[int]


@dataclass
class _StepPlan:
    """One step's rows as the scoring attention sees them (built in the metadata builder)."""

    rows: list[tuple[str, int, int, int, list[int]]]  # (req id, computed, q, prompt, skipped)
    cols: list[list[int]]  # per row: the logical block of each block-table column after compaction
    observe: "torch.Tensor"  # [T] bool: queries whose attention counts towards the scores
    mass: "torch.Tensor"  # [rows, width] float32, summed over layers
    block_size: int


class _Scores:
    """Worker-side state of a ``needs_scores`` compressor: per request, each logical block's
    accumulated score and the blocks dropped so far (see "The scores channel" above)."""

    def __init__(self, compressor: KVCompressor, name: str, count: Callable[[str, int], None]) -> None:
        self.compressor, self.name, self.count = compressor, name, count
        self.reqs: dict[str, _ReqScores] = {}
        self.pending: _StepPlan | None = None

    def forget(self, req_ids: Any) -> None:
        for r in req_ids or ():
            self.reqs.pop(r, None)

    def skip(self, req_id: str, computed: int, block_size: int) -> list[int]:
        st = self.reqs.get(req_id)
        if computed <= 0 and st is not None:  # computed from scratch again (e.g. preempted)
            self.reqs.pop(req_id)
            return []
        if st is None:
            return []
        return sorted(i for i in st.dropped if (i + 1) * block_size <= computed)

    def plan(self, batch: Any) -> _StepPlan | None:
        import torch

        step = getattr(_rows, "step", None)
        if step is None or not step.rows:
            self.pending = None
            return None
        qsl = batch.query_start_loc.tolist()
        T = qsl[len(step.rows)] if len(qsl) > len(step.rows) else qsl[-1]
        observe = torch.zeros(max(T, qsl[-1]), dtype=torch.bool)
        cols = []
        B = step.block_size
        for i, (req_id, computed, q, prompt, skip) in enumerate(step.rows):
            total = computed + q
            dropped = set(skip)
            cols.append([j for j in range(-(-total // B)) if j not in dropped])
            lo, hi = self.compressor.score_positions(prompt)
            a, b = max(lo, computed), min(hi, total)
            if a < b:
                observe[qsl[i] + a - computed: qsl[i] + b - computed] = True
        plan = _StepPlan(step.rows, cols, observe,
                         torch.zeros(len(step.rows), batch.block_table.shape[1], dtype=torch.float32), B)
        self.pending = plan
        return plan

    def finalize(self) -> dict[str, list[int]]:
        """After the step's forward: add its attention mass to the scores, ask ``keep`` and
        return the blocks newly dropped, per request."""
        plan, self.pending = self.pending, None
        if plan is None:
            return {}
        B = plan.block_size
        mass = plan.mass.tolist()
        drops: dict[str, list[int]] = {}
        for i, (req_id, computed, q, prompt, _) in enumerate(plan.rows):
            if q <= 0:
                continue
            st = self.reqs.setdefault(req_id, _ReqScores([], set()))
            total = computed + q
            nb = -(-total // B)
            st.scores.extend([0.0] * (nb - len(st.scores)))
            for j, logical in enumerate(plan.cols[i]):
                st.scores[logical] += mass[i][j]
            scores = tuple(NEG_INF if k in st.dropped else st.scores[k] for k in range(nb))
            view = BlockView(num_tokens=total, block_size=B, num_prompt_tokens=prompt, scores=scores)
            kept = check_keep(view, self.compressor.keep(view), self.name)
            back = sorted(st.dropped & set(kept))
            if back:
                raise KeepError(
                    f"kvcompress plugin {self.name!r}: keep() returned {kept} for {total} tokens, but "
                    f"block(s) {back} were dropped at an earlier step and their KV is gone; a dropped "
                    "block must stay dropped (dropped blocks have score -inf)")
            new = dropped_blocks(view, kept)
            new = [k for k in new if k not in st.dropped]
            if new:
                st.dropped.update(new)
                drops[req_id] = new
                _trace("worker_dropped", len(new))
        self.count("worker_steps", sum(1 for r in plan.rows if r[2] > 0))
        return drops


class _ScoringAttention:
    """What the backend's attention seam runs while a ``needs_scores`` compressor is active:
    the compressor's :meth:`~vllm_graft.hooks.KVCompressor.attend`, its mass added to the step."""

    def __init__(self, scores: _Scores) -> None:
        self.scores = scores

    def plan(self, batch: Any) -> Any:
        return self.scores.plan(batch)

    def forward(self, query, kv_cache, batch, layer, plan=None):
        import torch

        n = query.shape[0]
        observe = plan.observe[:n] if plan is not None else torch.zeros(n, dtype=torch.bool)
        if observe.numel() < n:
            observe = torch.cat([observe, torch.zeros(n - observe.numel(), dtype=torch.bool)])
        state = _active
        if state is not None and state.kv_format is not None and kv_cache.dtype == _uint8():
            # the cache is in the storage format: its attention reads it (and scores it)
            out, mass = state.kv_format.forward(query, kv_cache, batch, layer, observe)
        else:
            out, mass = self.scores.compressor.attend(query, kv_cache, batch, layer, observe)
        if plan is not None:
            rows, width = plan.mass.shape
            plan.mass += mass[:rows, :width].to(plan.mass.dtype)
        return out


def _uint8():
    import torch

    return torch.uint8


def _attach_drops(out: Any) -> Any:
    """Worker: finalize the step and put the dropped blocks on the ModelRunnerOutput."""
    state = _active
    if state is None or state.scored is None or out is None or not hasattr(out, "req_ids"):
        return out
    drops = state.scored.finalize()
    if drops:
        import copy

        out = copy.copy(out)  # never mark a shared (e.g. empty) output object
        out.graft_kv_drops = drops
    return out


def _execute_model_wrapper(original: Callable) -> Callable:
    def execute_model(self, scheduler_output, *args, **kwargs):
        state = _active
        if state is not None and state.scored is not None:
            sc = state.scored
            sc.forget(scheduler_output.finished_req_ids)
            sc.forget(getattr(scheduler_output, "preempted_req_ids", None))
            sc.forget(getattr(scheduler_output.scheduled_cached_reqs, "resumed_req_ids", None))
        return _attach_drops(original(self, scheduler_output, *args, **kwargs))

    execute_model.__wrapped__ = original  # type: ignore[attr-defined]
    return execute_model


def _sample_tokens_wrapper(original: Callable) -> Callable:
    def sample_tokens(self, *args, **kwargs):
        return _attach_drops(original(self, *args, **kwargs))

    sample_tokens.__wrapped__ = original  # type: ignore[attr-defined]
    return sample_tokens


def _update_from_output_wrapper(original: Callable) -> Callable:
    def update_from_output(self, scheduler_output, model_runner_output, *args, **kwargs):
        drops = getattr(model_runner_output, "graft_kv_drops", None)
        state = _active
        if drops and state is not None:
            for req_id, blocks in drops.items():
                if req_id in self.requests:
                    state.to_free.setdefault(req_id, set()).update(blocks)
        return original(self, scheduler_output, model_runner_output, *args, **kwargs)

    update_from_output.__wrapped__ = original  # type: ignore[attr-defined]
    return update_from_output


def install_scores_channel() -> None:
    """The three patches of the scores channel (idempotent)."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    why = ("a score-based compressor decides in the worker (which has the attention scores) "
           "and the scheduler frees; the decision rides on the ModelRunnerOutput the worker "
           "returns each step (pickled across processes in vLLM's multiprocess executor)")
    PATCHES.ensure(OWNER, GPUModelRunner, "execute_model", _execute_model_wrapper, wrap=True,
                   reason=why + " (worker: forget finished/preempted requests, attach drops)",
                   versions=VERSIONS)
    PATCHES.ensure(OWNER, GPUModelRunner, "sample_tokens", _sample_tokens_wrapper, wrap=True,
                   reason=why + " (worker: attach the step's drops)", versions=VERSIONS)
    PATCHES.ensure(OWNER, Scheduler, "update_from_output", _update_from_output_wrapper, wrap=True,
                   reason=why + " (scheduler: record the drops; the KV manager frees them)",
                   versions=VERSIONS)


# ------------------------------------------------------------- vLLM classes (built lazily)
_classes: dict[str, type] = {}
_CLASS_NAMES = ("GraftKVCompressSpec", "GraftKVCompressManager")


def _vllm_classes() -> dict[str, type]:
    if _classes:
        return _classes
    from dataclasses import replace

    from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    @dataclass(frozen=True, kw_only=True)
    class GraftKVCompressSpec(FullAttentionSpec):
        """Full attention whose blocks a vllm-graft KV compressor frees."""

        compressor: str = ""  # the plugin's name (no vLLM config is current where specs are built)
        kv_format: str = ""  # the storage format's name ("": dense K/V in the model's dtype)

        @classmethod
        def merge(cls, specs):
            names = {(s.compressor, s.kv_format) for s in specs}
            if len(names) != 1:
                raise ValueError(f"layers of one KV cache group name different compressors: {sorted(names)}")
            name, kv_format = names.pop()
            # FullAttentionSpec.merge builds cls(...) from its own fields only (dtype and
            # state_content_bytes, which carry a storage format's page size, included).
            return replace(super().merge(specs), compressor=name, kv_format=kv_format)

    class GraftKVCompressManager(FullAttentionManager):
        """Frees, each step, the blocks the compressor does not keep."""

        def remove_skipped_blocks(self, request_id, processed_computed_tokens, num_prompt_tokens=None):
            super().remove_skipped_blocks(request_id, processed_computed_tokens, num_prompt_tokens)
            blocks = self.req_to_blocks.get(request_id)
            if not blocks or processed_computed_tokens <= 0 or num_prompt_tokens is None:
                return
            state = _current(self.kv_cache_spec.compressor)
            if state.needs_scores:
                self._free_reported(request_id, blocks, state)
                return
            free = blocks_to_free(
                state.compressor, state.name, num_tokens=processed_computed_tokens,
                block_size=self.block_size, num_prompt_tokens=num_prompt_tokens,
                held=[(b.is_null, b.ref_cnt) for b in blocks])
            if free is None:
                return
            state.count("steps", 1)
            for start, end in reversed(runs(free)):
                self._remove_blocks_in_range(request_id, start, end)
            if free:
                state.count("blocks_freed", len(free))

        def _free_reported(self, request_id, blocks, state):
            """Scored compressors: free what the worker reported dropped, except blocks
            still shared through the prefix cache (freed once no longer shared)."""
            pending = state.to_free.get(request_id)
            if not pending:
                return
            free = sorted(i for i in pending if i < len(blocks) and not blocks[i].is_null
                          and blocks[i].ref_cnt <= 1)
            pending.difference_update(free)
            pending.difference_update([i for i in pending if i < len(blocks) and blocks[i].is_null])
            state.count("steps", 1)
            for start, end in reversed(runs(free)):
                self._remove_blocks_in_range(request_id, start, end)
            if free:
                state.count("blocks_freed", len(free))
                _trace("scheduler_freed", len(free))

        def free(self, request_id):
            if _active is not None:
                _active.to_free.pop(request_id, None)
            return super().free(request_id)

    for cls in (GraftKVCompressSpec, GraftKVCompressManager):
        cls.__module__ = __name__
        cls.__qualname__ = cls.__name__
    _classes.update(GraftKVCompressSpec=GraftKVCompressSpec, GraftKVCompressManager=GraftKVCompressManager)
    globals().update(_classes)
    return _classes


def __getattr__(name: str) -> Any:
    if name in _CLASS_NAMES:
        return _vllm_classes()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def customize_spec(spec: Any) -> Any:
    """The backend's ``customize_spec`` seam: plain full attention becomes compressible."""
    from dataclasses import fields

    from vllm.v1.kv_cache_interface import FullAttentionSpec

    cls = _vllm_classes()["GraftKVCompressSpec"]
    if type(spec) is not FullAttentionSpec or spec.sliding_window is not None \
            or spec.attention_chunk_size is not None or spec.non_causal:
        return spec  # other layer kinds are not compressed
    name = _active.spec_name if _active is not None else ""
    values = {f.name: getattr(spec, f.name) for f in fields(spec) if f.init}
    fmt = _active.kv_format if _active is not None else None
    if fmt is not None:
        import torch

        why = fmt.unsupported(spec.head_size, spec.block_size)
        if why is None and spec.head_size_v != spec.head_size:
            why = f"key and value head sizes differ ({spec.head_size} vs {spec.head_size_v})"
        if why is not None:
            raise KVCompressError(f"kvcompress storage format {_active.format_name!r} cannot store this "
                                  f"model's KV cache: {why}")
        # the format's page: uint8 rows of bytes_per_token per token and KV head; vLLM sizes
        # its pages, and so the number of blocks in the KV memory, from these two fields
        values.update(dtype=torch.uint8, state_content_bytes=fmt.bytes_per_token(spec.head_size, spec.block_size),
                      page_size_padded=None)
        return cls(**values, compressor=name, kv_format=_active.format_name)
    return cls(**values, compressor=name)


def register_spec() -> None:
    """Register the spec and its manager with vLLM (idempotent)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

    classes = _vllm_classes()
    # The built-in specs register only into an empty registry: fill it first.
    KVCacheSpecRegistry._ensure_registered()
    KVCacheSpecRegistry.register(classes["GraftKVCompressSpec"], classes["GraftKVCompressManager"],
                                 uniform_type_base_spec=FullAttentionSpec)


# ------------------------------------------------------------------------------ adapter
class _FormatSeam:
    """What the backend calls for a storage format: its ``write`` (``do_kv_cache_update``)
    and its attention (``forward``), counted as the format's events."""

    def __init__(self, fmt: KVCacheFormat, name: str, runtime: Any) -> None:
        self.fmt, self.name, self.runtime = fmt, name, runtime

    def write(self, key, value, kv_cache, slot_mapping) -> None:
        self.fmt.write(key, value, kv_cache, slot_mapping)
        self.runtime.count(Kind.KVCOMPRESS, self.name, "write", 1)

    def forward(self, query, kv_cache, batch, layer):
        out, _ = self.fmt.forward(query, kv_cache, batch, layer, None)
        self.runtime.count(Kind.KVCOMPRESS, self.name, "forward", 1)
        return out


class KVCompressAdapter(Adapter):
    kind = Kind.KVCOMPRESS
    owner = OWNER

    def engine_overrides(self, enabled, plan):
        return attention_backend_overrides(plan)

    def activate(self, enabled, plan, runtime):
        global _active
        # deployment validation allows one plugin per role: an eviction compressor and/or a
        # storage format (KVCacheFormat, e.g. kv4)
        instances = [(e, runtime.instance(e)) for e in enabled]
        formats = [(e, i) for e, i in instances if isinstance(i, KVCacheFormat)]
        evictors = [(e, i) for e, i in instances if not isinstance(i, KVCacheFormat)]
        if len(formats) > 1 or len(evictors) > 1:
            raise NotImplementedError(
                f"kvcompress: at most one eviction compressor and one storage format, got "
                f"{[e.name for e, _ in instances]}")
        fmt_e, fmt = formats[0] if formats else (None, None)
        # a format alone keeps every block
        e, compressor = evictors[0] if evictors else (fmt_e, KeepAll())
        scored = bool(getattr(compressor, "needs_scores", False))
        if scored and type(compressor).attend is KVCompressor.attend:
            raise NotImplementedError(
                f"kvcompress plugin {e.name!r} needs attention scores (needs_scores = True) but "
                "implements no attend(): the worker gets the scores from the compressor's own "
                "attention. Implement KVCompressor.attend (see vllm_graft.plugins.kvcompress.h2o), "
                "or set needs_scores = False.")
        from vllm_graft.integration.adapters import backend  # imports vLLM

        if scored and backend.SEAMS.method is not None and not isinstance(backend.SEAMS.method, _ScoringAttention):
            raise NotImplementedError(
                f"kvcompress plugin {e.name!r} needs attention scores, which it computes in its own "
                f"attention; it cannot be combined with the attention plugin {backend.SEAMS.method_name!r}. "
                "Leave one of them out of the deployment.")

        def count(event: str, n: int = 1, _name: str = e.name) -> None:
            runtime.count(Kind.KVCOMPRESS, _name, event, n)

        if fmt is not None and backend.SEAMS.method is not None \
                and not isinstance(backend.SEAMS.method, _ScoringAttention):
            raise NotImplementedError(
                f"kvcompress storage format {fmt_e.name!r} stores KV in its own layout, which the "
                f"attention plugin {backend.SEAMS.method_name!r} cannot read; leave one of them out "
                "of the deployment")

        register_spec()
        backend.install(OWNER)
        try:
            salt = composition_salt([(x.name, x.params, x.entry.registration.capabilities.lossless)
                                     for x, _ in instances])
            install_patch(salt=salt is not None)
            _active = _Active(compressor, e.name, count, salt=salt, needs_scores=scored)
            if fmt is not None:
                _active.kv_format, _active.format_name = fmt, fmt_e.name
                backend.SEAMS.kv_format = _FormatSeam(fmt, fmt_e.name, runtime)
            if scored:
                install_scores_channel()
                _active.scored = _Scores(compressor, e.name, count)
                backend.SEAMS.method = _ScoringAttention(_active.scored)
                backend.SEAMS.method_name = e.name
                backend.SEAMS.count = count
            backend.SEAMS.customize_spec = customize_spec
            if rewrite not in backend.SEAMS.rewriters:
                backend.SEAMS.rewriters.append(rewrite)
        except BaseException:
            self.deactivate()
            raise

    def deactivate(self):
        global _active
        import sys

        _active = None
        backend = sys.modules.get(f"{__package__}.backend")
        if backend is None:  # activation failed before installing anything
            return
        if backend.SEAMS.customize_spec is customize_spec:
            backend.SEAMS.customize_spec = None
        if isinstance(backend.SEAMS.kv_format, _FormatSeam):
            backend.SEAMS.kv_format = None
        if isinstance(backend.SEAMS.method, _ScoringAttention):
            backend.SEAMS.method, backend.SEAMS.method_name, backend.SEAMS.count = None, "", None
        while rewrite in backend.SEAMS.rewriters:
            backend.SEAMS.rewriters.remove(rewrite)
        backend.uninstall(OWNER)
        PATCHES.undo(OWNER)


ADAPTER = KVCompressAdapter()
