"""benchmarks/gpu/run.py stays runnable: its --smoke mode (CPU, TRITON_INTERPRET=1, tiny
shapes) builds every case, and every kernel matches its reference there. No timing is checked."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu" / "run.py"


def _module():
    spec = importlib.util.spec_from_file_location("gpu_run", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_smoke_mode_checks_every_plugin_kernel(tmp_path):
    from tests.kernels.aot import jit_functions

    out = tmp_path / "gpu.md"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--out", str(out)], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [line for line in out.read_text().splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert len(rows) == 10 and all("| yes (" in r for r in rows), rows
    assert "not timed" in out.read_text()
    # every plugin that has a Triton kernel has a row
    # (a shared package of a kind, e.g. speculative/_tree, by its name; kvcompress/_shared is h2o/snapkv's)
    plugins = {k.split(".")[3].lstrip("_") for k in jit_functions()} - {"shared"}
    text = out.read_text().replace("-", "_")
    assert all(p in text for p in plugins), plugins


def test_update_benchmarks_replaces_only_the_marked_section(tmp_path):
    run = _module()
    path = tmp_path / "B.md"
    path.write_text(f"# B\nbefore\n{run.MARK_START}\nold\n{run.MARK_END}\nafter\n")
    run.update_benchmarks("| new |\n", path)
    assert path.read_text() == f"# B\nbefore\n{run.MARK_START}\n| new |\n{run.MARK_END}\nafter\n"
