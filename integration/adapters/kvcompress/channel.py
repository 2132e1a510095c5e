"""The scores channel (see "The scores channel" in the package doc), vLLM-free: the wrappers
that carry a scored compressor's decisions from the worker to the scheduler on the step's
``ModelRunnerOutput`` (``graft_kv_drops``, ``{request id: [logical blocks]}``), installed by
the adapter's ``install_scores_channel``, and the per-process event trace."""
from __future__ import annotations

import os
from typing import Any, Callable

from vllm_graft.integration.adapters.kvcompress import state as _state


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


_warned_async = False


def _attach_drops(out: Any) -> Any:
    """Worker: finalize the step and put the dropped blocks on the ModelRunnerOutput.

    The adapter turns vLLM's async scheduling off (``engine_overrides``), so ``out`` is a plain
    ``ModelRunnerOutput``. Should an async output come anyway (``AsyncGPUModelRunnerOutput``,
    vLLM 0.33 CUDA: no ``req_ids``, the step's output kept as ``_model_runner_output`` and
    returned by ``get_output()``), the drops go on that inner output, which reaches the
    scheduler, and a warning says the blocks are freed a step late."""
    global _warned_async
    state = _state.active
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
        if not _warned_async:
            _warned_async = True
            import logging

            logging.getLogger("vllm_graft").warning(
                "vllm-graft kvcompress: vLLM runs with async scheduling although the deployment turned "
                "it off; dropped KV blocks are reported on the wrapped output and freed a step late")
        out._model_runner_output = copy.copy(inner)
        out._model_runner_output.graft_kv_drops = drops
        return out
    out = copy.copy(out)  # never mark a shared (e.g. empty) output object
    out.graft_kv_drops = drops
    return out


def execute_model_wrapper(original: Callable) -> Callable:
    """Worker, ``GPUModelRunner.execute_model``: forget finished, preempted and resumed
    requests, then attach the step's drops."""
    def execute_model(self, scheduler_output, *args, **kwargs):
        state = _state.active
        if state is not None and state.scored is not None:
            sc = state.scored
            sc.forget(scheduler_output.finished_req_ids)
            sc.forget(getattr(scheduler_output, "preempted_req_ids", None))
            sc.forget(getattr(scheduler_output.scheduled_cached_reqs, "resumed_req_ids", None))
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
    (``state.active.to_free``); the KV manager frees them."""
    def update_from_output(self, scheduler_output, model_runner_output, *args, **kwargs):
        drops = getattr(model_runner_output, "graft_kv_drops", None)
        state = _state.active
        if drops and state is not None:
            for req_id, blocks in drops.items():
                if req_id in self.requests:
                    state.to_free.setdefault(req_id, set()).update(blocks)
        return original(self, scheduler_output, model_runner_output, *args, **kwargs)

    update_from_output.__wrapped__ = original  # type: ignore[attr-defined]
    return update_from_output
