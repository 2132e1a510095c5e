"""The fake-device suite (see vllm_graft.kit.fakedevice): the adapters' vLLM-free halves with
their inputs on a (fake) CUDA device. With GRAFT_REAL_DEVICE=cuda (the GPU check command)
the same tests run with real CUDA tensors instead."""
from __future__ import annotations

import os

if not os.environ.get("GRAFT_REAL_DEVICE"):
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import pytest
import torch

from vllm_graft.kit.fakedevice import FakeDevice, device_under_test


class RealDevice:
    """The FakeDevice interface on a real device: put() moves tensors there; no marking, no
    sync counting (the test then checks it runs and matches the host)."""

    real = True

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.syncs: list = []

    def put(self, *tensors):
        out = tuple(t.to(self.device) for t in tensors)
        return out[0] if len(out) == 1 else out

    def region(self, name):
        import contextlib

        return contextlib.nullcontext()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.fixture
def device():
    """A FakeDevice (entered by the test: ``with device: ...``), or a RealDevice on a GPU run."""
    real = device_under_test()
    return RealDevice(real) if real is not None else FakeDevice()
