"""The scores channel (see "The scores channel" in the package doc), vLLM-free: the wrappers
that carry a scored compressor's decisions from the worker to the scheduler on the step's
``ModelRunnerOutput`` (``graft_kv_drops``, ``{request id: [logical blocks]}``), installed by
the adapter's ``install_scores_channel``, and the per-process event trace."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Callable

from . import state as _state
from ...runtime import RUNTIME

if TYPE_CHECKING:  # for the doctor's attribute rows: what is read of vLLM's scheduler output
    from vllm.v1.core.sched.output import SchedulerOutput


#: Environment variable naming a file to which each process appends one JSON line per
#: scores-channel event (``{"pid", "event", "n"}``): the proof, in tests, that the worker
#: decides and the scheduler frees, in their own processes. Unset: nothing is written.
ENV_TRACE = "VLLM_GRAFT_KVCOMPRESS_TRACE"


def trace(event: str, n: int, **detail: Any) -> None:
    """Append a scores-channel event (and its ``detail``, e.g. which blocks) to the
    :data:`ENV_TRACE` file, if one is named."""
    path = os.environ.get(ENV_TRACE)
    if path:
        import json

        with open(path, "a") as f:
            f.write(json.dumps({"pid": os.getpid(), "event": event, "n": n, **detail}) + "\n")


def _attach_drops(out: Any) -> Any:
    """Worker: finalize the step and put the dropped blocks on the ModelRunnerOutput.

    The adapter turns vLLM's async scheduling off (``engine_overrides``), so ``out`` is a plain
    ``ModelRunnerOutput``. Should an async output come anyway (``AsyncGPUModelRunnerOutput``,
    vLLM 0.33 CUDA: no ``req_ids``, the step's output kept as ``_model_runner_output`` and
    returned by ``get_output()``), the drops go on that inner output, which reaches the
    scheduler, and a warning says the blocks are freed a step late."""
    state = _state.get_active()
    if state is None or state.scored is None or out is None:
        return out
    inner = getattr(out, "_model_runner_output", None)
    if not hasattr(out, "req_ids") and inner is None:
        return out
    drops = state.scored.finalize()
    if not drops:
        return out
    import copy

    if inner is not None and not hasattr(out, "req_ids"):
        if RUNTIME.once("kvcompress async output"):
            import logging

            logging.getLogger("vllm_graft").warning(
                "vllm-graft kvcompress: vLLM runs with async scheduling although the deployment turned "
                "it off; dropped KV blocks are reported on the wrapped output and freed a step late"
            )
        out._model_runner_output = copy.copy(inner)
        out._model_runner_output.graft_kv_drops = drops
        return out
    out = copy.copy(out)  # never mark a shared (e.g. empty) output object
    out.graft_kv_drops = drops
    return out


def _gone(scheduler_output: SchedulerOutput) -> set[str]:
    """The requests whose blocks are all gone at this step: finished, preempted, resumed (a
    resumed request is computed again from its first block)."""
    out: set[str] = set()
    for ids in (
        scheduler_output.finished_req_ids,
        getattr(scheduler_output, "preempted_req_ids", None),
        getattr(getattr(scheduler_output, "scheduled_cached_reqs", None), "resumed_req_ids", None),
    ):
        out.update(ids or ())
    return out


#: The SchedulerOutput attribute carrying the blocks a rule-based compressor's scheduler freed
#: in that step: ``{request id: {block size: [logical blocks]}}``.
FREED_ATTR = "graft_kv_freed"


def after_schedule_wrapper(original: Callable) -> Callable:
    """Scheduler, ``Scheduler._update_after_schedule`` (the end of ``schedule()``): put the
    blocks this step's ``remove_skipped_blocks`` calls freed on the SchedulerOutput
    (:data:`FREED_ATTR`), except those of requests preempted in the same step (all their blocks
    went back), for the worker's check."""

    def _update_after_schedule(self, scheduler_output, *args, **kwargs):
        state = _state.get_active()
        if state is not None and state.freed_now:
            preempted = getattr(scheduler_output, "preempted_req_ids", None) or ()
            freed = {r: b for r, b in state.freed_now.items() if r not in preempted}
            state.freed_now = {}
            if freed:
                setattr(scheduler_output, FREED_ATTR, freed)
        return original(self, scheduler_output, *args, **kwargs)

    _update_after_schedule.__wrapped__ = original  # type: ignore[attr-defined]
    return _update_after_schedule


def note_freed(state: Any, scheduler_output: SchedulerOutput) -> None:
    """Worker: forget the requests whose blocks are gone, then add the blocks the scheduler
    freed this step (:data:`FREED_ATTR`) to ``state.worker_freed``."""
    table = state.worker_freed
    for req_id in _gone(scheduler_output) if table else ():
        table.pop(req_id, None)
    for req_id, by_size in (getattr(scheduler_output, FREED_ATTR, None) or {}).items():
        mine = table.setdefault(req_id, {})
        for block_size, blocks in by_size.items():
            mine.setdefault(block_size, set()).update(blocks)


def execute_model_wrapper(original: Callable) -> Callable:
    """Worker, ``GPUModelRunner.execute_model``: forget finished, preempted and resumed
    requests; note the blocks the scheduler freed (rule-based compressors) or attach the
    step's drops (scored ones)."""

    def execute_model(self, scheduler_output, *args, **kwargs):
        state = _state.get_active()
        if state is not None and state.scored is not None:
            state.scored.forget(_gone(scheduler_output))
        elif state is not None:
            note_freed(state, scheduler_output)
        return _attach_drops(original(self, scheduler_output, *args, **kwargs))

    execute_model.__wrapped__ = original  # type: ignore[attr-defined]
    return execute_model


def sample_tokens_wrapper(original: Callable) -> Callable:
    """Worker, ``GPUModelRunner.sample_tokens``: attach the step's drops."""

    def sample_tokens(self, *args, **kwargs):
        return _attach_drops(original(self, *args, **kwargs))

    sample_tokens.__wrapped__ = original  # type: ignore[attr-defined]
    return sample_tokens


def update_from_output_wrapper(original: Callable) -> Callable:
    """Scheduler, ``Scheduler.update_from_output``: record the reported drops per request
    (``state.get_active().to_free``); the KV manager frees them."""

    def update_from_output(self, scheduler_output, model_runner_output, *args, **kwargs):
        drops = getattr(model_runner_output, "graft_kv_drops", None)
        state = _state.get_active()
        if drops and state is not None:
            for req_id, blocks in drops.items():
                if req_id in self.requests:
                    state.to_free.setdefault(req_id, set()).update(blocks)
        return original(self, scheduler_output, model_runner_output, *args, **kwargs)

    update_from_output.__wrapped__ = original  # type: ignore[attr-defined]
    return update_from_output
