"""SnapKV in vLLM's CPU engine with the cache in vLLM's own layout (``cpu_vec``): the steps that
observe nothing (its decodes) run vLLM's C++ kernel, those whose observed window is a small part of
the step vLLM's kernel plus the window's mass alone, the others the compressor's attention; against the same scenario with the layout check made to fail (the blocked cache, the
compressor's attention on every step, as before the seam): the same greedy tokens, log-probs to
float rounding, the same blocks dropped and freed, the same blocks held."""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import pytest  # noqa: E402

from . import kvcompress_scenario as scenario  # noqa: E402

pytestmark = pytest.mark.e2e

#: prompts of 2-3 blocks of 32 tokens: a budget of 2 drops a block of the longer ones
SNAPKV = {"plugin": "snapkv", "params": {"budget_blocks": 2, "sink_blocks": 0, "window_tokens": 16}}


def _run(monkeypatch, checked: bool):
    from vllm_graft.integration.adapters import backend
    from vllm_graft.integration.runtime import RUNTIME

    backend.stock_layout_checked.cache_clear()
    if not checked:  # no ISA accepted: the blocked write and the compressor's attention throughout
        monkeypatch.setattr(backend, "CPU_VEC_ISAS", ())
    RUNTIME.events.clear()
    try:
        r = scenario.run(SNAPKV)
    finally:
        monkeypatch.undo()
        backend.stock_layout_checked.cache_clear()
    r["events"] = {k.split(":", 1)[1]: n for k, n in r["events"].items() if k.startswith("snapkv:")}
    return r


def test_snapkv_plain_steps_run_vllms_kernel_with_the_same_tokens_and_frees(monkeypatch):
    import torch
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from vllm_graft.integration.adapters import backend

    if _get_attn_isa(torch.float32, scenario.BLOCK, 64, "auto") not in backend.CPU_VEC_ISAS:  # the tiny llama's
        pytest.skip("this machine's CPU attention ISA keeps another layout: the backend falls back")
    new = _run(monkeypatch, checked=True)
    old = _run(monkeypatch, checked=False)
    ev_new, ev_old = new["events"], old["events"]
    print(f"\ncpu_vec: {ev_new}\nblocked: {ev_old}")
    # the seam ran: most layer calls went to vLLM's kernel, the observing ones to the compressor
    assert ev_new.get("stock_layers", 0) > 0 and ev_new.get("forward", 0) > 0
    assert ev_new["stock_layers"] > ev_new["forward"]
    # ... and the observing steps whose window is a small part of the step: vLLM's kernel for the
    # output, the compressor's attention for the window's mass alone (mass_only)
    assert ev_new.get("stock_layers_with_mass", 0) > 0
    assert "stock_layers" not in ev_old and "stock_layers_with_mass" not in ev_old
    assert ev_old["forward"] == ev_new["forward"] + ev_new["stock_layers"] + ev_new["stock_layers_with_mass"]
    # the same decisions and the same frees
    for k in ("blocks_freed", "blocks_skipped", "steps", "worker_steps", "plan"):
        assert ev_new.get(k) == ev_old.get(k), k
    assert ev_new["blocks_freed"] > 0
    for k in ("max_held", "preemptions", "leaked", "cached", "aborted"):
        assert new[k] == old[k], k
    # the same greedy tokens; the log-probs differ by the two kernels' float rounding only
    assert new["tokens"] == old["tokens"]
    err = max(abs(a - b) for r in new["logprobs"] for a, b in zip(new["logprobs"][r], old["logprobs"][r]))
    assert err < 1e-4, err
