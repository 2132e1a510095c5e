"""benchmarks/gpu/run.py stays runnable: its --smoke mode (CPU, TRITON_INTERPRET=1, tiny
shapes) builds every case, and every kernel matches its reference there; a case that raises is
its own row; the copy that measures the peak bandwidth runs. No timing is checked."""
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
    assert len(rows) == 11 and all("| yes (" in r for r in rows), rows
    assert "not timed" in out.read_text()
    # every plugin that has a Triton kernel has a row
    # (a shared package of a kind, e.g. speculative/_tree, by its name; kvcompress/_shared is h2o/snapkv's);
    # a kind's helper module (plugins/attention/_kernel.py: vllm_graft.plugins.<kind>._kernel) holds jit
    # helpers only, each called by a plugin's kernel, so it is timed through that kernel's row
    jit = jit_functions()
    modules = {k.split(":")[0] for k in jit}
    helpers = {k for k in jit if len(k.split(":")[0].split(".")) == 4}
    called = set().union(*(calls for k, calls in jit.items() if k not in helpers))
    assert helpers <= called, helpers - called
    plugins = {m.split(".")[3].lstrip("_") for m in modules if len(m.split(".")) > 4} - {"shared"}
    text = out.read_text().replace("-", "_")
    assert all(p in text for p in plugins), plugins


def test_update_benchmarks_replaces_only_the_marked_section(tmp_path):
    run = _module()
    path = tmp_path / "B.md"
    path.write_text(f"# B\nbefore\n{run.MARK_START}\nold\n{run.MARK_END}\nafter\n")
    run.update_benchmarks("| new |\n", path)
    assert path.read_text() == f"# B\nbefore\n{run.MARK_START}\n| new |\n{run.MARK_END}\nafter\n"


def test_a_case_that_raises_is_a_row_and_the_others_still_run(monkeypatch):
    import torch

    run = _module()

    def boom():
        raise RuntimeError("no kernel image | for this device")

    same = run.Case("fine", "s", "fp32", lambda: torch.ones(3), lambda: torch.ones(3), 12, 0.0)
    broken = run.Case("broken", "s", "fp32", lambda: torch.ones(3), boom, 12, 0.0)
    monkeypatch.setattr(run, "cases", lambda smoke, device: [broken, same])
    text, rows = run.run(smoke=True, peak=None)
    assert [r["ok"] for r in rows] == [False, True]
    assert "| broken | s | fp32 | ERROR: RuntimeError: no kernel image / for this device |" in text
    assert "| fine | s | fp32 | yes (0.0e+00) |" in text
    assert "Peak bandwidth: not measured (smoke; a 64 MiB host copy moved" in text


def test_copy_bandwidth_counts_bytes_read_and_written(monkeypatch):
    run = _module()
    clock = iter([0.0, 0.5, 1.0, 1.25])  # two timed copies: 0.5 s and 0.25 s
    monkeypatch.setattr(run.time, "perf_counter", lambda: next(clock))
    # 8 MiB read + 8 MiB written in the fastest copy (0.25 s)
    assert run.copy_bandwidth("cpu", 8 << 20, repeats=2) == 2 * (8 << 20) / 0.25 / 1e9
