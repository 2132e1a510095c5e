"""Worker: which request each batch row is (see "The metadata patch" in the package doc),
vLLM-free. The wrapper of ``GPUModelRunner._build_attention_metadata`` notes the runner and
the step's scheduled tokens in :data:`step_rows` while the builders run; :class:`_StepRows`
maps each row to its request and computes the blocks the row leaves out of attention."""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any, Callable

from .plan import KVCompressError, blocks_to_skip
from .state import VERSIONS, Active
from ...runtime import RUNTIME
from ...targets import KV_BUILD_METADATA

log = logging.getLogger("vllm_graft")

if TYPE_CHECKING:  # for the doctor's attribute rows (never imported at run time: this module is vLLM-free)
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner  # the CPU engine's runner subclasses it
    from vllm.v1.attention.backend import CommonAttentionMetadata


class _StepRows:
    """The rows of the batch whose attention metadata is being built (see the patch)."""

    def __init__(self, runner: GPUModelRunner, num_scheduled_tokens: dict[str, int]) -> None:
        self.runner = runner
        self.num_scheduled_tokens = num_scheduled_tokens
        self._skips: dict[int, list[list[int]]] = {}  # by block size
        # scored mode: per row (request id, computed before the step, query length, prompt
        # length, logical blocks left out)
        self.rows: list[tuple[str, int, int, int, list[int]]] = []
        #: the batch's query_start_loc as host ints (vLLM's ``query_start_loc_cpu``, every row of
        #: the metadata, padded ones too): the scored plan reads it instead of the device copy
        self.query_start_loc: list[int] = []

    def skips(self, cm: CommonAttentionMetadata, block_size: int, state: Active) -> list[list[int]]:
        if block_size not in self._skips:
            self._skips[block_size] = self._compute(cm, block_size, state)
        return self._skips[block_size]

    def _compute(self, cm: CommonAttentionMetadata, block_size: int, state: Active) -> list[list[int]]:
        self.block_size = block_size
        batch = self.runner.input_batch
        n = min(int(cm.num_reqs), batch.num_reqs)
        self.query_start_loc = cm.query_start_loc_cpu[: int(cm.num_reqs) + 1].tolist()
        qsl = self.query_start_loc[: n + 1]
        seq_lens = host_seq_lens(cm)[:n].tolist()
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
                    "input_batch.req_ids (vLLM changed how it builds attention metadata)"
                )
            computed = seq_lens[i] - q
            if state.scored is not None:
                skip = state.scored.skip(req_id, computed, block_size)
                self.rows.append((req_id, computed, q, int(prompt_lens[i]), skip))
            else:
                skip = blocks_to_skip(
                    state.compressor,
                    state.name,
                    num_tokens=computed,
                    block_size=block_size,
                    num_prompt_tokens=int(prompt_lens[i]),
                    request_id=req_id,
                )
                freed = state.worker_freed.get(req_id)
                if freed and freed.get(block_size):
                    skip = follow_frees(state, req_id, computed, freed[block_size], skip)
            if computed > 0 and state.scored is None:
                calls += 1
            skipped += len(skip)
            out.append(skip)
        if calls:
            state.count("worker_steps", calls)
        if skipped:
            state.count("blocks_skipped", skipped)
        return out


def follow_frees(state: Active, req_id: str, computed: int, freed: set[int], skip: list[int]) -> list[int]:
    """The blocks the row leaves out: the worker's own answer (``skip``) and every block the
    scheduler freed for the request (``freed``), so that attention never reads a block the pool
    may have handed to another request, whatever ``keep`` answered the worker.

    ``keep`` must be a function of its view (the contract); one that is not answered the two
    calls differently, and the worker read freed blocks (issue 64; before that, the frees check
    stopped the engine). The scheduler's frees win; the disagreement is counted
    (``keep_disagreed``) and said once, naming the plugin, the request and the blocks."""
    read = freed.difference(skip)
    if not read:
        return skip
    state.count("keep_disagreed", 1)
    if RUNTIME.once(("keep disagreed", state.name)):
        log.warning(
            "vllm-graft: kvcompress plugin %r: keep() answered the scheduler and the worker differently for "
            "request %r at %d computed tokens: the scheduler freed block(s) %s, which the worker's answer "
            "keeps. The worker leaves them out (the scheduler's frees win), so no freed block is read; "
            "but keep() must be a function of its view only (num_tokens, block_size, num_prompt_tokens, "
            "request_id; pinned is the scheduler's) and a dropped block must stay dropped: fix the "
            "plugin (counted as keep_disagreed; said once)",
            state.name,
            req_id,
            computed,
            sorted(read),
        )
    return sorted(read.union(skip))


def host_seq_lens(cm: CommonAttentionMetadata) -> Any:
    """The rows' lengths on the host, without reading the device: vLLM's
    ``seq_lens_cpu_upper_bound`` (num_computed + num_scheduled per row, exact unless async
    speculative decoding, which the adapter turns off with async scheduling), else ``seq_lens``
    when it is a host tensor."""
    upper = getattr(cm, "seq_lens_cpu_upper_bound", None)
    if upper is not None:
        return upper
    if cm.seq_lens.device.type == "cpu":
        return cm.seq_lens
    raise KVCompressError(
        "vllm-graft kvcompress: the attention metadata has no seq_lens_cpu_upper_bound and its "
        "seq_lens are on the device; the rewriter would have to read them back every step. This "
        f"vLLM builds attention metadata differently from the one the adapter was written for ({VERSIONS})"
    )


#: ``step_rows.step``: the :class:`_StepRows` of the metadata build under way in this thread;
#: ``step_rows.inside``: True while the patched ``_build_attention_metadata`` runs (dummy
#: batches included).
step_rows = threading.local()


#: Parameters of ``GPUModelRunner._build_attention_metadata`` the wrapper reads.
_WRAPPED_PARAMS = KV_BUILD_METADATA.params


def build_attention_metadata_wrapper(original: Callable) -> Callable:
    """The patch of ``GPUModelRunner._build_attention_metadata``: sets :data:`step_rows`
    while the builders run (dummy / profiling builds are left alone)."""
    import inspect

    signature = inspect.signature(original)
    missing = [p for p in _WRAPPED_PARAMS if p not in signature.parameters]
    if missing:
        raise KVCompressError(
            f"vllm-graft kvcompress: GPUModelRunner._build_attention_metadata has no parameter(s) "
            f"{missing}; this vLLM builds attention metadata differently from the one the "
            f"adapter was written for ({VERSIONS})"
        )

    def _build_attention_metadata(self, *args, **kwargs):
        bound = signature.bind_partial(self, *args, **kwargs).arguments
        scheduled = bound.get("num_scheduled_tokens")
        previous = getattr(step_rows, "step", None), getattr(step_rows, "inside", False)
        step_rows.inside = True  # the rewriter's proof that this patch runs (see rewrite)
        if scheduled is not None and not bound.get("for_cudagraph_capture"):
            step_rows.step = _StepRows(self, scheduled)  # else a dummy / profiling batch
        try:
            return original(self, *args, **kwargs)
        finally:
            step_rows.step, step_rows.inside = previous

    _build_attention_metadata.__wrapped__ = original  # type: ignore[attr-defined]
    return _build_attention_metadata
