"""The kvcompress adapter's vLLM half: :data:`ADAPTER` activates a deployment's kvcompress
plugins in this process (the KV-cache spec and manager of :mod:`.vllm_spec`, the backend's
seams, the patches of the metadata, the prefix-cache salt and the scores channel) and
undoes them. The mechanism is documented in the package doc (:mod:`..kvcompress`).

This module imports vLLM only when a deployment activates it, so the adapter registry can
load it in a process that never starts an engine (the bench's parent, for instance).
"""

from __future__ import annotations

import inspect
import logging
from typing import TYPE_CHECKING, Any

from ....hooks import AttentionLayer, Kind, KVCacheFormat
from .. import Adapter, attention_backend_overrides
from . import state as _state
from .channel import (
    after_schedule_wrapper,
    execute_model_wrapper,
    sample_tokens_wrapper,
    update_from_output_wrapper,
)
from .keep import KeepAll
from .merge import MergingAttention, MergingScores
from .plan import KVCompressError, RowBuffers, compaction_index
from .rows import build_attention_metadata_wrapper, host_seq_lens, step_rows
from .salt import composition_salt, request_init_wrapper
from .scores import _Scores, _ScoringAttention
from .shared_attention import layouts_read
from .state import OWNER, Active, KVCompressState
from ... import targets
from ...patches import PATCHES

if TYPE_CHECKING:  # for the doctor's attribute rows: what the rewriter reads of vLLM's metadata
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner  # the CPU engine's runner subclasses it
    from vllm.v1.attention.backend import CommonAttentionMetadata

log = logging.getLogger("vllm_graft")


# ------------------------------------------------------------------------------ patches


def _tensor_parallel_sum(mass: Any) -> Any:
    """The step's attention mass summed over the tensor-parallel ranks (each holds some KV
    heads; the block table, and so what is freed, is shared): every rank then drops the same
    blocks, those one rank with all heads would drop. One rank: the mass as is."""
    from vllm.distributed.communication_op import tensor_model_parallel_all_reduce
    from vllm.distributed.parallel_state import get_tensor_model_parallel_world_size

    if get_tensor_model_parallel_world_size() == 1:
        return mass
    return tensor_model_parallel_all_reduce(mass.contiguous())


def _tensor_parallel_heads(mass: Any, total_heads: int | None) -> tuple[Any, int]:
    """A per-head compressor's step mass ``[rows, H_kv here, width]`` -> every KV head's
    ``[rows, H_kv, width]`` (gathered from the ranks, in rank order: rank r holds heads
    ``r * H_kv here`` on) and this rank's first head, so that every rank decides on all heads
    and masks its own. Where vLLM replicates a KV head over ranks (more ranks than KV heads),
    its ranks' shares (each from its own query heads) are summed. One rank: ``(mass, 0)``."""
    from vllm.distributed.communication_op import tensor_model_parallel_all_gather
    from vllm.distributed.parallel_state import (
        get_tensor_model_parallel_rank,
        get_tensor_model_parallel_world_size,
    )

    tp = get_tensor_model_parallel_world_size()
    if tp == 1:
        return mass, 0
    every = tensor_model_parallel_all_gather(mass.contiguous(), dim=1)
    rank = get_tensor_model_parallel_rank()
    if total_heads is not None and every.shape[1] > total_heads:
        every = every.reshape(every.shape[0], total_heads, -1, every.shape[2]).sum(2)
        return every, rank * total_heads // tp
    return every, rank * mass.shape[1]


def install_patch(salt: bool = False) -> None:
    """Wrap ``GPUModelRunner._build_attention_metadata`` and, for a lossy compressor,
    ``Request.__init__`` (the prefix-cache salt) (idempotent; why: :mod:`...targets`)."""
    if salt:
        PATCHES.apply(targets.KV_REQUEST_INIT, request_init_wrapper)
    PATCHES.apply(targets.KV_BUILD_METADATA, build_attention_metadata_wrapper)


def install_frees_channel() -> None:
    """The two patches that carry a rule-based compressor's frees to the worker (idempotent)."""
    PATCHES.apply(targets.KV_AFTER_SCHEDULE, after_schedule_wrapper)
    PATCHES.apply(targets.KV_EXECUTE_MODEL, execute_model_wrapper)


def install_scores_channel() -> None:
    """The three patches of the scores channel (idempotent)."""
    PATCHES.apply(targets.KV_EXECUTE_MODEL, execute_model_wrapper)
    PATCHES.apply(targets.KV_SAMPLE_TOKENS, sample_tokens_wrapper)
    PATCHES.apply(targets.KV_UPDATE_FROM_OUTPUT, update_from_output_wrapper)


#: The builder attribute holding its :class:`~.plan.RowBuffers` (one per builder: vLLM gives
#: each micro-batch a builder of its own).
_BUFFERS = "_graft_kv_rows"
#: The builder attribute caching the KV-cache block size its compressor decides in.
_BLOCK_SIZE = "_graft_kv_block_size"


def _row_buffers(builder: Any, cm: CommonAttentionMetadata) -> RowBuffers:
    """The builder's persistent block table and seq_lens, made at its first build with
    ``max_num_seqs`` rows and the width of the table vLLM hands it."""
    table = cm.block_table_tensor
    buf = getattr(builder, _BUFFERS, None)
    if buf is not None and buf.fits(table):
        return buf
    sched = getattr(getattr(builder, "vllm_config", None), "scheduler_config", None)
    max_rows = getattr(sched, "max_num_seqs", None)
    if buf is not None:
        if max_rows is not None:
            raise KVCompressError(
                f"vllm-graft kvcompress: the block table handed to the attention metadata builder "
                f"changed from {tuple(buf.table.shape)} {buf.table.dtype} on {buf.table.device} to "
                f"{tuple(table.shape)} {table.dtype} on {table.device}; the rewriter's persistent "
                "buffers (which CUDA graphs captured) cannot follow. This vLLM builds metadata "
                "differently from the one the adapter was written for."
            )
        log.warning(
            "vllm-graft kvcompress: block table %s no longer fits the rewriter's buffers %s "
            "(builder without a vllm_config); new buffers, at new addresses",
            tuple(table.shape),
            tuple(buf.table.shape),
        )
    buf = RowBuffers(max(table.shape[0], max_rows or 0), table, cm.seq_lens)
    setattr(builder, _BUFFERS, buf)
    return buf


def _manager_block_size(runner: GPUModelRunner, spec: Any) -> int:
    """The KV-cache (manager) block size of the builder's layers. vLLM gives a builder the
    spec with the kernel block size when it splits each KV-cache block into kernel blocks
    (v1/worker/utils.py ``AttentionGroup.create_metadata_builders``); the compressor decides
    in the manager's blocks. Found as the KV-cache group whose spec, at the kernel block size,
    is the builder's."""
    from dataclasses import replace

    from .vllm_spec import GraftKVCompressSpec

    sizes = set()
    for group in getattr(getattr(runner, "kv_cache_config", None), "kv_cache_groups", None) or ():
        s = group.kv_cache_spec
        per_layer = getattr(s, "kv_cache_specs", None)  # UniformTypeKVCacheSpecs
        for x in per_layer.values() if isinstance(per_layer, dict) else (s,):
            if (
                isinstance(x, GraftKVCompressSpec)
                and x.block_size % spec.block_size == 0
                and replace(x, block_size=spec.block_size) == spec  # type: ignore[call-arg]  # vLLM's field
            ):
                sizes.add(x.block_size)
    if len(sizes) > 1:
        raise NotImplementedError(
            f"vllm-graft kvcompress: KV-cache groups of block sizes {sorted(sizes)} share the "
            f"attention kernel's block size {spec.block_size}; the rewriter cannot tell which "
            "one a builder serves. Give the model one KV-cache block size (--block-size)."
        )
    return sizes.pop() if sizes else spec.block_size


def rewrite(builder: Any, cm: CommonAttentionMetadata) -> Any:
    """The backend's metadata rewriter: drop skipped blocks from each row (see "Worker half"
    in the package doc). On a device it always returns the builder's persistent block table
    and seq_lens (dummy, profiling and CUDA-graph capture builds and steps that drop nothing
    included: then with the runner's values), so a full CUDA graph replays with this step's
    rows; on the host (no graphs) a build that drops nothing returns ``cm`` itself. The
    runner's tensors are never written (the drafter gets the same ``cm``), and nothing is read
    back from the device: the drops and the lengths are known on the host."""
    from .vllm_spec import GraftKVCompressSpec

    spec = getattr(builder, "kv_cache_spec", None)
    if not isinstance(spec, GraftKVCompressSpec):
        return cm
    if getattr(builder, "is_cross_attention", False) or getattr(builder, "is_encoder_only_attention", False):
        return cm
    step = getattr(step_rows, "step", None)
    if step is None and not getattr(step_rows, "inside", False):
        # a builder called outside the patched V1 method: Model Runner V2 (integration/
        # runner.py should have prevented it) or a vLLM that builds metadata elsewhere
        raise KVCompressError(
            "vllm-graft kvcompress: attention metadata is being built outside "
            f"{targets.KV_BUILD_METADATA.where} (is this worker running vLLM's Model Runner "
            "V2?); the freed blocks cannot be dropped from the block table, so attention "
            "would read blocks that belong to other requests. Run with "
            f"VLLM_USE_V2_MODEL_RUNNER=0 in every vLLM process."
        )
    table = cm.block_table_tensor
    on_host = table.device.type == "cpu"
    if step is None:  # a dummy / profiling / CUDA-graph capture batch: nothing to drop
        if on_host:
            return cm
        table, seq_lens = _row_buffers(builder, cm).fill(table, cm.seq_lens)
        return cm.replace(block_table_tensor=table, seq_lens=seq_lens, _num_computed_tokens_cache=None)
    block_size = getattr(builder, _BLOCK_SIZE, None)
    if block_size is None:
        block_size = _manager_block_size(step.runner, spec)
        setattr(builder, _BLOCK_SIZE, block_size)
    skips = step.skips(cm, block_size, _state.current(spec.compressor))
    if on_host and not any(skips):
        return cm
    host_lens = host_seq_lens(cm)
    index = compaction_index(skips, host_lens.numpy(), block_size, table.shape[1], block_size // spec.block_size)
    table, seq_lens = _row_buffers(builder, cm).fill(cm.block_table_tensor, cm.seq_lens, index)
    changes: dict[str, Any] = {"block_table_tensor": table, "seq_lens": seq_lens, "_num_computed_tokens_cache": None}
    if index is not None:
        import torch

        # on the host by design: vLLM's seq_lens_cpu_upper_bound is a CPU tensor (FlashInfer's
        # plan reads it there), lowered from the host-known drops, never read back from the device
        upper = host_lens.clone()
        upper[torch.from_numpy(index[:, 0]).long()] -= torch.from_numpy(index[:, 1]).to(upper.dtype)
        if getattr(cm, "seq_lens_cpu_upper_bound", None) is not None:
            changes["seq_lens_cpu_upper_bound"] = upper
        if upper.numel():  # max_seq_len may stay an upper bound; this one is exact, from the host
            changes["max_seq_len"] = min(int(cm.max_seq_len), int(upper.max()))
    return cm.replace(**changes)


# ------------------------------------------------------------------------------ adapter

#: vLLM's engine argument: async scheduling (on by default on CUDA vLLM 0.33 when nothing
#: turns it off; off on the CPU engine).
ASYNC_SCHEDULING = "async_scheduling"
ASYNC_WHY = (
    "a KV compressor's drops travel from the worker to the scheduler on the step's "
    "ModelRunnerOutput and the scheduler frees those blocks in the same step; with async "
    "scheduling vLLM wraps that output (AsyncGPUModelRunnerOutput) and schedules the next step "
    "before it has read this one, so the blocks would be freed a step late or never and the "
    "scheduler's and the worker's views of each request's blocks could part (vLLM turns async "
    "scheduling off the same way for speculative methods it cannot run ahead)"
)


#: The forward context's attribute holding ``(n, positions)`` once :func:`step_positions` has
#: computed them: every layer's write of one forward asks for the same ones.
_POSITIONS = "_graft_step_positions"


def step_positions(n: int) -> Any:
    """Each of the step's first ``n`` tokens' position in its sequence (``[n]`` int64), from the
    attention metadata of the forward in flight (``query_start_loc``, ``seq_lens``: sequence i's
    tokens are its last ``q_i`` positions), computed once a forward; None outside a forward or
    where the metadata has neither. Device ops only (no host read)."""
    from vllm.forward_context import get_forward_context, is_forward_context_available

    if not is_forward_context_available():
        return None
    ctx = get_forward_context()
    cached = getattr(ctx, _POSITIONS, None)
    if cached is None or cached[0] != n:
        cached = (n, _positions(ctx.attn_metadata, n))
        setattr(ctx, _POSITIONS, cached)
    return cached[1]


def _positions(meta: Any, n: int) -> Any:
    import torch

    if isinstance(meta, dict):  # one per layer; every decoder layer's has the same sequences
        meta = next((m for m in meta.values() if hasattr(m, "seq_lens") and hasattr(m, "query_start_loc")), None)
    qsl, lens = getattr(meta, "query_start_loc", None), getattr(meta, "seq_lens", None)
    if qsl is None or lens is None:
        return None
    qsl = qsl.long()
    tok = torch.arange(n, device=qsl.device)
    seq = torch.searchsorted(qsl[1:], tok, right=True).clamp(max=lens.shape[0] - 1)  # padding: the last
    return lens.long()[seq] - (qsl[seq + 1] - tok)


class _FormatSeam:
    """What the backend calls for a storage format: its ``write`` (``do_kv_cache_update``)
    and its attention (``forward``), counted as the format's events."""

    def __init__(self, fmt: KVCacheFormat, name: str, runtime: Any) -> None:
        self.fmt, self.name, self.runtime = fmt, name, runtime
        # a format written before write() took the layer (KVCacheFormat.write) is called without it;
        # one whose write names positions gets each token's position (xquant re-applies RoPE)
        params = inspect.signature(fmt.write).parameters
        self.takes_layer, self.takes_positions = "layer" in params, "positions" in params

    def write(self, key, value, kv_cache, slot_mapping, layer: AttentionLayer | None = None) -> None:
        more = {"positions": step_positions(slot_mapping.shape[0])} if self.takes_positions else {}
        if self.takes_layer:
            self.fmt.write(key, value, kv_cache, slot_mapping, layer=layer, **more)
        else:
            self.fmt.write(key, value, kv_cache, slot_mapping, **more)
        self.runtime.count(Kind.KVCOMPRESS, self.name, "write", 1)

    def forward(self, query, kv_cache, batch, layer):
        out, _ = self.fmt.forward(query, kv_cache, batch, layer, None)
        self.runtime.count(Kind.KVCOMPRESS, self.name, "forward", 1)
        return out


class KVCompressAdapter(Adapter[KVCompressState]):
    kind = Kind.KVCOMPRESS
    owner = OWNER
    State = KVCompressState

    engine_why = {ASYNC_SCHEDULING: ASYNC_WHY}

    def engine_overrides(self, enabled, plan):
        return {**attention_backend_overrides(plan), ASYNC_SCHEDULING: False}

    def activate(self, enabled, plan, runtime):
        instances = [(e, runtime.instance(e)) for e in enabled]
        formats = [(e, i) for e, i in instances if isinstance(i, KVCacheFormat)]
        evictors = [(e, i) for e, i in instances if not isinstance(i, KVCacheFormat)]
        # validation has held the combination to one plugin per role and each class to its
        # shape (hooks.contracts.kvcompress.shape_problems: flags, methods, what they combine
        # with); here only the wiring. A format alone keeps every block.
        fmt_e, fmt = formats[0] if formats else (None, None)
        e, compressor = evictors[0] if evictors else (fmt_e, KeepAll())
        scored = bool(getattr(compressor, "needs_scores", False))
        merges = bool(getattr(compressor, "merges", False))
        from .. import backend  # imports vLLM

        if scored:  # its attend() reads the cache: in the layout of the route's backend
            backend.require_layout(e.name, layouts_read(compressor), plan, "kvcompress plugin")

        def count(event: str, n: int = 1, _name: str = e.name) -> None:
            runtime.count(Kind.KVCOMPRESS, _name, event, n)

        from . import vllm_spec  # imports vLLM

        vllm_spec.register_spec()
        backend.install(OWNER)
        try:
            salt = composition_salt(
                [(x.name, x.params, x.entry.registration.capabilities.lossless) for x, _ in instances]
            )
            install_patch(salt=salt is not None or merges)
            active = Active(compressor, e.name, count, salt=salt, needs_scores=scored, salt_per_request=merges)
            if merges:
                log.info(
                    "vllm-graft kvcompress %r merges evicted KV into kept blocks: its requests share no "
                    "prefix-cache blocks (each is salted on its own)",
                    e.name,
                )
            _state.set_active(active)
            runtime.track_state(f"kvcompress/{e.name}/adapter", active)  # read by `soak`
            if fmt is not None:
                active.kv_format, active.format_name = fmt, fmt_e.name
                backend.SEAMS.kv_format = _FormatSeam(fmt, fmt_e.name, runtime)
            if not scored and not isinstance(compressor, KeepAll):
                install_frees_channel()
            if scored:
                install_scores_channel()
                scores_cls, attention_cls = (
                    (MergingScores, MergingAttention) if merges else (_Scores, _ScoringAttention)
                )
                active.scored = scores_cls(
                    compressor, e.name, count, reduce=_tensor_parallel_sum, gather=_tensor_parallel_heads
                )
                if getattr(compressor, "scoring_pass", False):
                    from .scoring_forward import pass_block_scores

                    active.scored.passes = lambda runner, req_id, n, _c=compressor: pass_block_scores(
                        runner, _c, req_id, n
                    )
                backend.SEAMS.method = attention_cls(active.scored)
                backend.SEAMS.method_name = e.name
                backend.SEAMS.count = count
            backend.SEAMS.customize_spec = vllm_spec.customize_spec
            if rewrite not in backend.SEAMS.rewriters:
                backend.SEAMS.rewriters.append(rewrite)
        except BaseException:
            self.deactivate()
            raise

    def deactivate(self):
        import sys

        _state.set_active(None)
        backend = sys.modules.get("vllm_graft.integration.adapters.backend")
        if backend is None:  # activation failed before installing anything
            return
        from . import vllm_spec  # vLLM is loaded

        if backend.SEAMS.customize_spec is vllm_spec.customize_spec:
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
