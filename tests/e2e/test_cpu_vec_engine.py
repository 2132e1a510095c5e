"""SnapKV in vLLM's CPU engine with the cache in vLLM's own layout (``cpu_vec``): the steps that
observe nothing (its decodes) run vLLM's C++ kernel, those whose observed window is a small part of
the step vLLM's kernel plus the window's mass alone, the others the compressor's attention; against the same scenario with the layout check made to fail (the blocked cache, the
compressor's attention on every step, as before the seam): the same greedy tokens, log-probs to
float rounding, the same blocks dropped and freed, the same blocks held.

Tree verification (lookahead's trees) likewise: steps without trees on vLLM's kernel, tree steps with
other rows on vLLM's kernel with the tree rows overwritten by their masked pass; plain vLLM's greedy
tokens and the blocked path's verify logits."""

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


# ------------------------------------------------------------------------ tree verification
#: lookahead's trees (<= 16 nodes), as in tests/e2e/test_spec_proposers.py
TREE = {"speculative": {"plugin": "lookahead", "params": {"tree": True, "num_speculative_tokens": 16}}}
TREE_TOKENS = 32


def _tree_run(monkeypatch, checked: bool | None):
    """Greedy tokens, the verify steps' logits and the proposer's events; ``checked`` None: plain
    vLLM (no deployment)."""
    from vllm_graft.hooks import Kind
    from vllm_graft.integration.adapters import backend
    from vllm_graft.integration import bridge
    from vllm_graft.integration.adapters.speculative import tree as T

    from .test_adapters_speculative_quant import PROMPTS, _events, _greedy, _tokens, engine

    backend.stock_layout_checked.cache_clear()
    if checked is False:  # no ISA accepted: the blocked write, every layer in PyTorch (before the seam)
        monkeypatch.setattr(backend, "CPU_VEC_ISAS", ())
    logits: list = []
    verify = T.TreeVerifier.verify

    def recording(self, runner, lg, md, output):
        if self.step and lg is not None and md is not None:
            logits.append(lg.detach().float().clone())
        return verify(self, runner, lg, md, output)

    monkeypatch.setattr(T.TreeVerifier, "verify", recording)
    bridge.deactivate()  # a fresh proposer (the same deployment would keep its warm n-gram pool)
    try:
        with engine(TREE if checked is not None else None) as llm:
            # each request alone (batch 1: its tree steps have no other rows), then all at once
            tokens = [t for p in PROMPTS for t in _tokens(llm.generate([p], _greedy(TREE_TOKENS), use_tqdm=False))]
            tokens += _tokens(llm.generate(PROMPTS, _greedy(TREE_TOKENS), use_tqdm=False))
        events = _events(Kind.SPECULATIVE, "lookahead")
    finally:
        monkeypatch.undo()
        backend.stock_layout_checked.cache_clear()
    return tokens, logits, events


def test_trees_on_vllms_kernel_give_plain_tokens_and_the_blocked_paths_logits(monkeypatch):
    """Tree verification with the cache in ``cpu_vec`` (issue 37): the steps without trees run
    vLLM's C++ kernel whole (``stock_layers``), the tree steps vLLM's kernel then the tree rows'
    masked pass (``stock_layers_with_tree``), a step of trees alone the passes only (``forward``),
    never the PyTorch attention of every row; the same
    greedy tokens as plain vLLM, and the same verify logits (to float rounding) as with the blocked
    cache, where every layer runs in PyTorch (``forward``)."""
    import torch
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from vllm_graft.integration.adapters import backend

    if _get_attn_isa(torch.float32, 128, 64, "auto") not in backend.CPU_VEC_ISAS:  # the tiny llama's
        pytest.skip("this machine's CPU attention ISA keeps another layout: the backend falls back")
    plain, _, _ = _tree_run(monkeypatch, None)
    new, logits_new, ev_new = _tree_run(monkeypatch, True)
    old, logits_old, ev_old = _tree_run(monkeypatch, False)
    print(f"\ncpu_vec: {ev_new}\nblocked: {ev_old}")
    assert new == plain and old == plain
    assert ev_new.get("tree_verify", 0) > 0 and ev_new.get("tree_accepted", 0) > 0
    assert ev_new.get("stock_layers", 0) > 0 and ev_new.get("stock_layers_with_tree", 0) > 0
    # the steps of trees alone (the request alone) run the passes only: the method's forward
    assert 0 < ev_new.get("forward", 0) < ev_new["stock_layers"] + ev_new["stock_layers_with_tree"]
    assert "stock_layers" not in ev_old and "stock_layers_with_tree" not in ev_old
    assert ev_old["forward"] == ev_new["stock_layers"] + ev_new["stock_layers_with_tree"] + ev_new.get("forward", 0)
    for k in ("tree_verify", "tree_accepted", "plan"):
        assert ev_new.get(k) == ev_old.get(k), k
    assert len(logits_new) == len(logits_old) > 0  # the verify steps with trees, in order
    assert [a.shape for a in logits_new] == [b.shape for b in logits_old]
    err = max((a - b).abs().max().item() for a, b in zip(logits_new, logits_old))
    print(f"verify logits, cpu_vec vs blocked: max |diff| {err:.2e} over {len(logits_new)} steps")
    assert err < 1e-3, err
