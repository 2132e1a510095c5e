"""A fake ``flashinfer`` for the unit and fake-device tests. This module sets no environment
(the fake-device suite imports it and must leave ``TRITON_INTERPRET`` alone on a real GPU, where
``tests/unit/test_flashinfer.py``'s own setting would have the kernel tests interpret half of
Triton: ``Cannot call @triton.jit'd outside of the scope of a kernel``)."""
from __future__ import annotations

import sys
import types

import torch

from vllm_graft.plugins import _flashinfer


class FakeFlashInfer:
    """``flashinfer`` with ``cascade.merge_state`` and ``top_k`` written from their documented
    behaviour at 0.7.2.post1 (flashinfer/cascade.py:42-95 and cascade.cuh:58-72: base-2 lse,
    fp16/bf16 v, float32 s, contiguous; flashinfer/topk.py:876-945), recording each call."""

    def __init__(self):
        self.calls = []
        self.module = types.ModuleType("flashinfer")
        self.cascade = types.ModuleType("flashinfer.cascade")
        self.cascade.merge_state = self.merge_state
        self.module.cascade = self.cascade
        self.module.merge_state = self.merge_state
        self.module.top_k = self.top_k

    def install(self, monkeypatch):
        monkeypatch.setitem(sys.modules, "flashinfer", self.module)
        monkeypatch.setitem(sys.modules, "flashinfer.cascade", self.cascade)
        monkeypatch.setattr(_flashinfer, "unavailable", lambda t: None)
        return self

    def merge_state(self, v_a, s_a, v_b, s_b):
        self.calls.append(("merge_state", v_a.dtype, s_a.dtype, tuple(v_a.shape), tuple(s_a.shape)))
        for t in (v_a, s_a, v_b, s_b):
            assert t.is_contiguous()
        assert v_a.dtype in (torch.float16, torch.bfloat16) and v_b.dtype == v_a.dtype
        assert s_a.dtype == s_b.dtype == torch.float32
        assert v_a.dim() == 3 and s_a.shape == v_a.shape[:2] and v_b.shape == v_a.shape
        m = torch.maximum(s_a, s_b)
        wa, wb = torch.exp2(s_a - m), torch.exp2(s_b - m)
        v = (v_a.float() * wa[..., None] + v_b.float() * wb[..., None]) / (wa + wb)[..., None]
        return v.to(v_a.dtype), m + torch.log2(wa + wb)

    def top_k(self, input, k, sorted=False, deterministic=False, tie_break=0, dsa_graph_safe=False):
        self.calls.append(("top_k", k, sorted, deterministic, tie_break))
        assert input.dim() == 2 and input.dtype in (torch.float32, torch.float16, torch.bfloat16)
        # the k largest, ties at the boundary to the smaller id (tie_break=1); unsorted output
        order = torch.argsort(-input.float(), dim=1, stable=True)[:, :k]
        if tie_break != 1:
            order = order.flip(1)
        shuffle = torch.randperm(k, generator=torch.Generator().manual_seed(1))
        idx = order[:, shuffle]
        return input.gather(1, idx), idx.to(torch.int64)
