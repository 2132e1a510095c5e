"""The kit's ``device`` check: the kind's exercise on a fake CUDA device (see
:mod:`vllm_graft.kit.fakedevice`).

Every tensor the exercise builds (what vLLM would hand the plugin: query, KV cache, block
tables, weights, router logits, the target's logits) is marked as on the device; the plugin's
reference path then runs as it would on CUDA. The check fails on the first op that mixes a
device tensor with a host tensor the plugin made (it would raise on CUDA), and reports the
host syncs (``.item()``, ``.tolist()``, ``bool(t)``, ``.cpu()``, ``nonzero``...) per call of
each hot method: a sync per layer is correct on CUDA but stalls the GPU stream, and breaks
a CUDA-graph capture.

:func:`host_syncs` is the same run returning the numbers (``vllm-graft plugins --json
--host-syncs`` prints them for every plugin).
"""

from __future__ import annotations

import os
from typing import Any

from ...hooks import KERNEL_FIELD, Kind
from .base import Target, build, exercise_dtypes
from .exercises import EXERCISES

#: The methods each kind's adapter calls per step or per layer (the ones whose syncs matter),
#: and how often vLLM calls them.
HOT: dict[Kind, dict[str, str]] = {
    Kind.ATTENTION: {"plan": "step", "forward": "layer"},
    Kind.KVCOMPRESS: {"keep": "step", "keep_heads": "step", "attend": "layer", "write": "layer", "forward": "layer"},
    Kind.SPECULATIVE: {
        "begin_step": "step",
        "propose": "step",
        "propose_tree": "step",
        "accepted": "step",
        "observe_topk": "step",
    },
    Kind.QUANT: {"apply": "layer", "embed": "layer"},
    Kind.MOE: {"route": "layer", "adjust_logits": "layer", "observe": "layer"},
}

#: The exercises' folder: the tensors made there stand for what vLLM hands the plugin.
HARNESS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "exercises")


def run_on_fake_device(t: Target) -> tuple[Any, list[str]]:
    """The kind's exercise (reference path, the first dtype the plugin declares) under a
    :class:`~vllm_graft.kit.fakedevice.FakeDevice`; returns it and the methods watched.
    Raises :class:`~vllm_graft.kit.fakedevice.DeviceMixError` on a mixed-device op."""
    from ..fakedevice import FakeDevice

    changes = {KERNEL_FIELD: "reference"} if KERNEL_FIELD in t.entry.registration.params.model_fields else {}
    impl = build(t, **changes)
    fd = FakeDevice(inputs_from=[HARNESS])
    watched = fd.wrap(impl, HOT[t.kind])
    with fd:
        EXERCISES[t.kind](t, impl, exercise_dtypes(t)[0], False)
    return fd, watched


def host_syncs(t: Target) -> dict[str, Any]:
    """``{method: {"per": "step"|"layer", "calls", "syncs", "per_call", "where"}}`` for each hot
    method the exercise called."""
    fd, _ = run_on_fake_device(t)
    report = fd.report()
    return {m: {"per": HOT[t.kind][m], **report[m]} for m in HOT[t.kind] if m in report}


def check_device(t: Target) -> str:
    from ..fakedevice import DeviceMixError

    try:
        fd, watched = run_on_fake_device(t)
    except DeviceMixError as e:
        raise t.fail(f"on a CUDA device its reference path would fail: {e}") from None
    report = fd.report()
    parts = []
    for m in watched:
        r = report.get(m)
        if r is None:
            continue
        parts.append(
            f"{m} ({HOT[t.kind][m]}): {r['per_call']:g} sync(s)/call over {r['calls']} call(s)"
            + (f" [{'; '.join(r['where'][:3])}]" if r["where"] else "")
        )
    return "no mixed-device op on a fake CUDA device; host syncs: " + ("; ".join(parts) or "none watched")


__all__ = ["HOT", "check_device", "host_syncs", "run_on_fake_device"]
