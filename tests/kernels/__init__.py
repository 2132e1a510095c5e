"""The kernel tests run on the host under Triton's interpreter (``TRITON_INTERPRET=1``), or,
with ``GRAFT_REAL_DEVICE=cuda`` (``benchmarks/gpu/check.sh`` on a GPU machine), compiled on
that device: each test module calls :func:`device` before it imports triton and builds the
tensors a kernel reads there."""
from __future__ import annotations

import os


def device() -> str:
    """``GRAFT_REAL_DEVICE`` (e.g. ``cuda``), else ``cpu``, where Triton is interpreted."""
    dev = os.environ.get("GRAFT_REAL_DEVICE") or "cpu"
    if dev == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
    return dev
