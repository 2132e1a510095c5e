"""The one GPU check (benchmarks/gpu/check.sh) stays runnable without a GPU: its --smoke mode
(Triton interpreted, the kernel tests on the host, run.py --smoke) writes a report with a row
per stage, all passing; without CUDA the real mode reports each failing stage and still runs the
next; a stage past its budget is stopped; the checkout imports as ``vllm_graft`` (with its entry
points) through the folder of links the check builds where the package is not installed."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu" / "check.sh"
STAGES = ("environment", "dependencies", "package", "tests", "flashinfer merge", "kernel benchmark", "total")


def _module():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu" / "check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _rows(text: str) -> dict[str, list[str]]:
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in text.splitlines()
            if line.startswith("| ") and not line.startswith(("| stage |", "| kernel |"))]
    return {r[0]: r[1:] for r in rows if r[0] in STAGES}


def _check(tmp_path, *args, **env):
    out = tmp_path / "gpu.md"
    done = subprocess.run(["bash", str(SCRIPT), *args, str(out)], cwd=tmp_path, capture_output=True, text=True,
                          env={**os.environ, "PYTHON": sys.executable, **env}, timeout=300)
    return done, out.read_text()


def test_smoke_writes_a_passing_row_per_stage(tmp_path):
    done, text = _check(tmp_path, "--smoke")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = _rows(text)
    assert list(rows) == list(STAGES), text
    assert all(r[0] == "ok" for s, r in rows.items() if s != "flashinfer merge"), text
    assert rows["flashinfer merge"][:1] == ["skipped"] and rows["flashinfer merge"][2] == (
        "Triton merge matches the reference; FlashInfer: skipped: the tensors are on cpu; FlashInfer runs on CUDA only. "
        "Device: host (Triton interpreted)."), text
    assert " 0 failed, 0 errors" in rows["tests"][2] and "tests/kernels/test_h2o_kernel.py" in rows["tests"][2]
    assert rows["kernel benchmark"][2].startswith("11 kernels, 11 match their reference")
    assert "## Kernel timings (benchmarks/gpu/run.py)" in text and "CPU rehearsal" in text


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch")
def test_without_cuda_every_stage_still_runs_and_reports(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here")
    done, text = _check(tmp_path, GPU_CHECK_TESTS="tests/kernels/test_kv4_kernel.py")
    assert done.returncode == 1
    rows = _rows(text)
    assert list(rows) == list(STAGES), text
    assert rows["environment"][0] == "FAILED" and "torch sees no CUDA device" in rows["environment"][2]
    assert rows["tests"][0] == "FAILED" and "GRAFT_REAL_DEVICE=cuda" in rows["tests"][2]
    assert rows["kernel benchmark"][0] == "FAILED" and "no CUDA device" in text
    assert rows["flashinfer merge"][0] == "FAILED"
    assert rows["total"][0] == "FAILED" and "## Test failures" in text


def test_a_stage_past_its_budget_is_stopped(tmp_path):
    check = _module()
    rc, seconds = check.run_stage([sys.executable, "-c", "import time; print('started', flush=True); "
                                   "time.sleep(60)"], dict(os.environ), 1, tmp_path / "log")
    assert rc is None and seconds < 30
    assert "started" in (tmp_path / "log").read_text()


def test_the_checkout_imports_through_the_links_with_its_entry_points(tmp_path):
    check = _module()
    assert check.make_shim(tmp_path).endswith("entry points")
    # -S: no site-packages, so an installed vllm_graft cannot answer instead of the links
    probe = ("import importlib.util, importlib.metadata as md; "
             "print(importlib.util.find_spec('vllm_graft.plugins').origin); "
             "print(sorted(e.name for e in md.entry_points(group='vllm_graft')))")
    done = subprocess.run([sys.executable, "-S", "-c", probe], env={**os.environ, "PYTHONPATH": str(tmp_path)},
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    origin, names = done.stdout.splitlines()
    assert Path(origin).resolve() == ROOT / "plugins" / "__init__.py"
    assert "'h2o-kvcompress'" in names and "'dfloat11'" in names


def test_collecting_the_gpu_tests_leaves_triton_compiled(tmp_path):
    """On the GPU the check's test stage collects tests/kernels and tests/fakedevice with
    GRAFT_REAL_DEVICE=cuda; nothing collected may set TRITON_INTERPRET, or kernels imported after
    it are interpreted while helpers imported before are not (the first H100 run, 2026-11-27:
    25 kernel tests failed with "Cannot call @triton.jit'd outside of the scope of a kernel",
    because a fake-device module imported tests/unit/test_flashinfer.py; 3 more, test_squeezed,
    from tests/unit/test_squeezed.py, imported inside the test)."""
    check = _module()
    # and nothing they import while running: every tests.unit module a collected file names
    (tmp_path / "probe.py").write_text(
        "import importlib, os, re\n"
        "def pytest_collection_finish(session):\n"
        "    for path in sorted({str(item.path) for item in session.items}):\n"
        "        for name in re.findall(r'from (?:tests|\\.\\.)\\.?(unit\\.\\w+) import', open(path).read()):\n"
        "            importlib.import_module('tests.' + name)\n"
        "    print('TRITON_INTERPRET=' + repr(os.environ.get('TRITON_INTERPRET')))\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(GRAFT_REAL_DEVICE="cuda", PYTHONPATH=f"{tmp_path}{os.pathsep}{env.get('PYTHONPATH', '')}")
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "probe", "-p", "no:cacheprovider",
                           "--collect-only", "-q", *check.KERNEL_TESTS, "tests/fakedevice"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert "TRITON_INTERPRET=" in done.stdout, done.stdout[-2000:] + done.stderr[-2000:]
    assert "TRITON_INTERPRET=None" in done.stdout, done.stdout[-2000:]
