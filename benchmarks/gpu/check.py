"""One GPU check: ``benchmarks/gpu/check.sh OUT`` (or ``make gpu-check OUT=...``).

For the day a GPU machine is lent (torch + Triton + CUDA, no vLLM, no network), from the
repository root, inside a time budget (420 s by default, ``GPU_CHECK_BUDGET``):

1. environment: Python, torch (and its CUDA), Triton, the device;
2. dependencies: what ``hooks/`` and ``plugins/`` import and the machine lacks (pydantic and its
   helpers, pluggy, PyYAML, packaging; pytest for the tests) is installed from the wheels in
   ``benchmarks/gpu/wheels`` (``make gpu-wheels`` fetches them) into a scratch folder put on
   ``PYTHONPATH``; ``vllm_graft`` is imported from the checkout through a folder of links
   (with the entry points of pyproject.toml) unless it is installed;
3. tests: ``pytest tests/kernels`` (and ``tests/fakedevice`` where it exists) with
   ``GRAFT_REAL_DEVICE=cuda``: the kernels compiled and run on the GPU, the fake-device suite on
   real CUDA tensors; stopped (SIGINT, so pytest still reports) at its share of the budget;
4. FlashInfer: Hydragen's merge by ``flashinfer.cascade.merge_state`` against the Triton merge
   kernel, both checked against the reference and timed (``benchmarks/gpu/flashinfer_merge.py``;
   "skipped" with the reason where FlashInfer cannot run, e.g. not installed at vLLM's pin). The
   packed-layout kernels (``tests/kernels/test_layouts.py``) and tree attention against its dense
   oracle (``tests/kernels/test_tree_attention_kernel.py``) run in stage 3;
5. kernel benchmark: ``benchmarks/gpu/run.py`` (peak bandwidth measured on the device).

Every stage is a row of the markdown report written to OUT (rewritten after each stage, so a
run cut short still leaves one); a stage that fails says so there and the next still runs.
The exit status is 0 only if every stage passed.

``--smoke`` is the CPU rehearsal CI runs (tests/unit/test_gpu_check.py): Triton interpreted,
two of the kernel test files on the host, ``flashinfer_merge.py --smoke``, ``run.py --smoke``; the
wheels only if something is
missing. ``GPU_CHECK_TESTS`` (paths and pytest options, space separated) replaces the tests run.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WHEELS = ROOT / "benchmarks" / "gpu" / "wheels"
#: import name -> the distributions to install (from WHEELS, no index) when it is missing.
NEEDS = {
    "pydantic": ["pydantic", "pydantic-core", "annotated-types", "typing-inspection", "typing-extensions"],
    "pluggy": ["pluggy"],
    "yaml": ["PyYAML"],
    "packaging": ["packaging"],
    "pytest": ["pytest", "iniconfig", "pygments"],
}
#: Imported by the plugins but not carried as wheels (large, binary, in every torch image).
EXPECTED = ("torch", "triton", "numpy")
PACKAGE_FOLDERS = ("hooks", "plugins", "integration", "launch", "kit", "tools", "models", "deployments")
KERNEL_TESTS = ["tests/kernels", "--ignore=tests/kernels/test_triton_aot.py",
                "--ignore=tests/kernels/test_gpu_bench_smoke.py"]  # both CPU-only checks
#: --smoke's share: enough to show the stage works (make test runs them all on the host anyway).
SMOKE_TESTS = ["tests/kernels/test_h2o_kernel.py", "tests/kernels/test_perhead_kernel.py"]


class Report:
    def __init__(self, out: Path, smoke: bool) -> None:
        self.out, self.smoke = out, smoke
        self.rows: list[tuple[str, str, float, str]] = []
        self.sections: list[tuple[str, str]] = []
        self.device = "?"

    def add(self, stage: str, result: str, seconds: float, detail: str) -> None:
        self.rows.append((stage, result, seconds, detail))
        print(f"[gpu-check] {stage}: {result} ({seconds:.0f} s) {detail}", flush=True)
        self.write()

    def section(self, title: str, body: str) -> None:
        self.sections.append((title, body))
        self.write()

    @property
    def ok(self) -> bool:
        return all(r[1] in ("ok", "skipped") for r in self.rows)

    def text(self) -> str:
        mode = " --smoke` (CPU rehearsal: nothing here is a GPU figure)" if self.smoke else "`"
        lines = [f"# GPU check: {self.device}", "",
                 f"`bash benchmarks/gpu/check.sh{mode}, {time.strftime('%Y-%m-%d %H:%M')}.", "",
                 "| stage | result | seconds | detail |", "|---|---|---|---|"]
        for stage, result, seconds, detail in self.rows:
            lines.append(f"| {stage} | {result} | {seconds:.0f} | {detail.replace('|', '/')} |")
        for title, body in self.sections:
            lines += ["", f"## {title}", "", body.rstrip()]
        return "\n".join(lines) + "\n"

    def write(self) -> None:
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.out.write_text(self.text())


def run_stage(cmd: list[str], env: dict, budget: float, log: Path) -> tuple[int | None, float]:
    """Run ``cmd`` from the repository root, its output streamed to ours and to ``log``; at
    ``budget`` seconds SIGINT (pytest then still writes its report), 15 s later SIGKILL.
    Returns (exit status, or None if it was stopped; seconds)."""
    t0 = time.monotonic()
    with log.open("w") as sink:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, errors="replace", start_new_session=True)

        def pump() -> None:
            for line in proc.stdout:
                sys.stdout.write(line)
                sink.write(line)
            sys.stdout.flush()

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        stopped = False
        try:
            proc.wait(timeout=max(budget, 1))
        except subprocess.TimeoutExpired:
            stopped = True
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        reader.join(timeout=10)
    return (None if stopped else proc.returncode), time.monotonic() - t0


def tail(log: Path, n: int = 25) -> str:
    lines = log.read_text(errors="replace").splitlines()[-n:] if log.exists() else []
    return "```\n" + "\n".join(lines) + "\n```"


def probe(python: str, env: dict, code: str) -> tuple[bool, str]:
    done = subprocess.run([python, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    return done.returncode == 0, (done.stdout if done.returncode == 0 else done.stderr).strip()


# ------------------------------------------------------------------------------ stages
ENV_PROBE = """
import json, platform
info = {"python": platform.python_version()}
try:
    import torch
    info["torch"] = torch.__version__
    info["cuda"] = torch.version.cuda
    info["cuda_available"] = torch.cuda.is_available()
    if info["cuda_available"]:
        p = torch.cuda.get_device_properties(0)
        info["device"] = f"{p.name} ({p.multi_processor_count} SMs, {p.total_memory / 2 ** 30:.0f} GiB)"
except Exception as e:
    info["torch_error"] = f"{type(e).__name__}: {e}"
try:
    import triton
    info["triton"] = triton.__version__
except Exception as e:
    info["triton_error"] = f"{type(e).__name__}: {e}"
print(json.dumps(info))
"""


def environment(report: Report, python: str, env: dict) -> dict:
    t0 = time.monotonic()
    ok, out = probe(python, env, ENV_PROBE)
    info = json.loads(out.splitlines()[-1]) if ok else {}
    if not ok:
        report.add("environment", "FAILED", time.monotonic() - t0, f"{python} did not start: {out[-300:]}")
        return info
    report.device = info.get("device") or ("CPU" if report.smoke else "no CUDA device")
    detail = (f"{report.device}; Python {info['python']}; torch {info.get('torch', '(missing)')}"
              f"{' (CUDA ' + str(info['cuda']) + ')' if info.get('cuda') else ''}; "
              f"Triton {info.get('triton', '(missing)')}")
    problems = [info[k] for k in ("torch_error", "triton_error") if k in info]
    if not report.smoke and not info.get("cuda_available"):
        problems.append("torch sees no CUDA device")
    report.add("environment", "FAILED" if problems else "ok", time.monotonic() - t0,
               detail + ("; " + "; ".join(problems) if problems else ""))
    return info


def missing_modules(python: str, env: dict, names) -> list[str]:
    code = ("import importlib.util, json; print(json.dumps([n for n in %r "
            "if importlib.util.find_spec(n) is None]))" % (list(names),))
    ok, out = probe(python, env, code)
    return json.loads(out.splitlines()[-1]) if ok else list(names)


def dependencies(report: Report, python: str, env: dict, site: Path, py_version: str) -> None:
    t0 = time.monotonic()
    missing = missing_modules(python, env, NEEDS)
    notes = []
    if not missing:
        result, detail = "ok", "nothing missing (" + ", ".join(NEEDS) + ")"
    elif not any(WHEELS.glob("*.whl")):
        result = "FAILED"
        detail = (f"missing {', '.join(missing)} and no wheels in benchmarks/gpu/wheels "
                  "(`make gpu-wheels` here, then carry that folder); continuing with what is installed")
    else:  # one pip call per module: a missing binary wheel does not hold back the others
        for module in missing:
            done = subprocess.run([python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                                   "--disable-pip-version-check", "--find-links", str(WHEELS), "--target",
                                   str(site), *NEEDS[module]], cwd=ROOT, env=env, capture_output=True, text=True,
                                  timeout=300)
            if done.returncode:
                notes.append(f"{module}: " + done.stderr.strip()[-600:])
        still = missing_modules(python, env, missing)
        got = [m for m in missing if m not in still]
        if not still:
            result, detail = "ok", f"installed from benchmarks/gpu/wheels: {', '.join(got)}"
        else:
            result = "FAILED"
            detail = ((f"installed {', '.join(got)}; " if got else "")
                      + f"could not install {', '.join(still)} from benchmarks/gpu/wheels for Python {py_version} "
                      f"(pydantic-core and PyYAML are binary: `make gpu-wheels GPU_PY={py_version}` fetches "
                      "wheels for it); continuing with what is installed")
    absent = missing_modules(python, env, EXPECTED)
    if absent:
        result = "FAILED"
        detail += f"; also missing {', '.join(absent)} (not carried: expected on a torch machine)"
    report.add("dependencies", result, time.monotonic() - t0, detail)
    if notes:
        report.section("pip's errors", "```\n" + "\n".join(notes) + "\n```")


def make_shim(site: Path) -> str:
    """``vllm_graft.<folder>`` importable from this checkout without installing it: links in
    ``site/vllm_graft`` to the top-level folders (pyproject's package-dir) and a dist-info with
    pyproject's entry points (the built-in plugins register through them)."""
    pkg = site / "vllm_graft"
    pkg.mkdir(parents=True, exist_ok=True)
    for name in PACKAGE_FOLDERS:
        if not (pkg / name).exists():
            (pkg / name).symlink_to(ROOT / name, target_is_directory=True)
    info = site / "vllm_graft-0.1.0.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm-graft\nVersion: 0.1.0\n")
    try:
        import tomllib
    except ImportError:  # Python 3.10: the plugins still import, the registry finds none
        return "no entry points (Python < 3.11 has no tomllib)"
    groups = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"].get("entry-points", {})
    (info / "entry_points.txt").write_text("".join(
        f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items()) + "\n" for group, eps in groups.items()))
    return f"{sum(len(e) for e in groups.values())} entry points"


def package(report: Report, python: str, env: dict, site: Path) -> None:
    t0 = time.monotonic()
    if probe(python, env, "import vllm_graft.hooks")[0]:
        report.add("package", "ok", time.monotonic() - t0, "vllm_graft is installed")
        return
    note = make_shim(site)
    ok, out = probe(python, env, "import vllm_graft.hooks, vllm_graft.plugins")
    report.add("package", "ok" if ok else "FAILED", time.monotonic() - t0,
               f"vllm_graft imported from the checkout (links in {site}, {note})"
               + ("" if ok else f": {out.splitlines()[-1] if out else 'import failed'}"))


def junit_counts(path: Path) -> tuple[dict, list[str], list[str]]:
    """Counts, one line per failing test, and the traceback tails of the first three (a one-line
    message alone did not say where the first GPU run's failures came from)."""
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    failed, traces = [], []
    root = ET.parse(path).getroot()
    for suite in root.iter("testsuite"):
        for k in counts:
            counts[k] += int(suite.get(k, 0))
    for case in root.iter("testcase"):
        for bad in list(case.findall("failure")) + list(case.findall("error")):
            msg = (bad.get("message") or "").strip().splitlines()
            failed.append(f"- `{case.get('classname')}::{case.get('name')}`: {msg[0][:200] if msg else bad.tag}")
            if len(traces) < 3:
                lines = (bad.text or "").rstrip().splitlines()[-25:]
                traces.append(f"`{case.get('classname')}::{case.get('name')}`:\n\n```\n" + "\n".join(lines) + "\n```")
    return counts, failed, traces


def tests(report: Report, python: str, env: dict, work: Path, budget: float) -> None:
    paths = os.environ.get("GPU_CHECK_TESTS", "").split() or (SMOKE_TESTS if report.smoke else (
        KERNEL_TESTS + (["tests/fakedevice"] if (ROOT / "tests" / "fakedevice").is_dir() else [])))
    xml, log = work / "tests.xml", work / "tests.log"
    env = dict(env)
    if report.smoke:
        env.pop("GRAFT_REAL_DEVICE", None)
        env["TRITON_INTERPRET"] = "1"
    else:
        env["GRAFT_REAL_DEVICE"] = "cuda"
        env.pop("TRITON_INTERPRET", None)
    cmd = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE", f"--junitxml={xml}", *paths]
    rc, seconds = run_stage(cmd, env, budget, log)
    where = " ".join(p for p in paths if not p.startswith("-"))
    device = "host, Triton interpreted" if report.smoke else "GRAFT_REAL_DEVICE=cuda"
    if not xml.exists():
        report.add("tests", "FAILED", seconds, f"{where} ({device}): pytest wrote no report (exit {rc})")
        report.section("tests: the end of pytest's output", tail(log))
        return
    counts, failed, traces = junit_counts(xml)
    bad = counts["failures"] + counts["errors"]
    passed = counts["tests"] - bad - counts["skipped"]
    result = "TIMEOUT" if rc is None else ("ok" if rc == 0 and not bad else "FAILED")
    detail = (f"{passed} passed, {counts['failures']} failed, {counts['errors']} errors, "
              f"{counts['skipped']} skipped: {where} ({device})")
    if rc is None:
        detail += f"; stopped at its {budget:.0f} s budget"
    report.add("tests", result, seconds, detail)
    if failed:
        report.section("Test failures", "\n".join(failed[:40]) + (f"\n- ... {len(failed) - 40} more" if len(failed) > 40 else ""))
        report.section("The first failures' tracebacks (last 25 lines each)", "\n\n".join(traces))
    elif result != "ok":
        report.section("tests: the end of pytest's output", tail(log))


def run_report_script(report: Report, python: str, env: dict, work: Path, budget: float, script: str,
                      name: str) -> tuple[int | None, float, str, Path]:
    """``benchmarks/gpu/SCRIPT --out WORK/NAME.md`` (``--smoke`` on a smoke run) on the real device
    (no ``GRAFT_REAL_DEVICE``: it is the tests' switch), within ``budget``: ``(exit code or None
    on timeout, seconds, the Markdown it wrote or "", its log WORK/NAME.log)``."""
    out, log = work / f"{name}.md", work / f"{name}.log"
    cmd = [python, f"benchmarks/gpu/{script}", "--out", str(out)] + (["--smoke"] if report.smoke else [])
    env = dict(env)
    env.pop("GRAFT_REAL_DEVICE", None)
    rc, seconds = run_stage(cmd, env, budget, log)
    return rc, seconds, out.read_text() if out.exists() else "", log


def flashinfer_merge(report: Report, python: str, env: dict, work: Path, budget: float) -> None:
    """Hydragen's merge by FlashInfer's cascade.merge_state vs the Triton kernel (correctness and
    time; benchmarks/gpu/flashinfer_merge.py); "skipped" where FlashInfer cannot run."""
    rc, seconds, text, log = run_report_script(report, python, env, work, budget, "flashinfer_merge.py", "flashinfer")
    note = next((s for s in text.splitlines() if s.startswith("FlashInfer:")), "")
    if rc is None:
        result, detail = "TIMEOUT", f"stopped at its {budget:.0f} s budget"
    elif rc != 0 or not text:
        result, detail = "FAILED", "a merge missed the reference" if text else f"no table (exit {rc})"
    else:
        result = "ok" if note.startswith("FlashInfer: used") else "skipped"
        detail = "Triton merge matches the reference; " + (note or "FlashInfer: not reported")
    report.add("flashinfer merge", result, seconds, detail)
    if text:
        report.section("Hydragen merge: FlashInfer vs Triton (benchmarks/gpu/flashinfer_merge.py)", text)
    if result not in ("ok", "skipped"):
        report.section("flashinfer merge: the end of its output", tail(log))


def bench(report: Report, python: str, env: dict, work: Path, budget: float) -> None:
    rc, seconds, text, log = run_report_script(report, python, env, work, budget, "run.py", "bench")
    rows = [r for r in text.splitlines() if r.startswith("| ") and not r.startswith("| kernel |")]
    match = sum("| yes (" in r for r in rows)
    peak = next((s.split("Peak bandwidth:")[1].split(";")[0].split(")")[0].strip() + ")"
                 for s in text.splitlines() if "Peak bandwidth:" in s), "not reported")
    result = "TIMEOUT" if rc is None else ("ok" if rc == 0 and rows else "FAILED")
    detail = f"{len(rows)} kernels, {match} match their reference; peak bandwidth {peak}"
    if rc is None:
        detail += f"; stopped at its {budget:.0f} s budget"
    report.add("kernel benchmark", result, seconds, detail)
    if text:
        report.section("Kernel timings (benchmarks/gpu/run.py)", text)
    if result != "ok":
        report.section("kernel benchmark: the end of its output", tail(log))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", help="the markdown report to write")
    ap.add_argument("--smoke", action="store_true", help="CPU rehearsal: interpreted Triton, run.py --smoke")
    ap.add_argument("--python", default=sys.executable, help="the interpreter that has torch (default: this one)")
    args = ap.parse_args(argv)
    start = time.monotonic()
    budget = float(os.environ.get("GPU_CHECK_BUDGET", 420))  # + at most 15 s: a stopped stage's grace
    test_share = float(os.environ.get("GPU_CHECK_TEST_S", 200))
    out = Path(args.out).resolve()
    report = Report(out / "gpu-check.md" if out.is_dir() else out, args.smoke)  # e.g. the device tool's $OUT
    work = Path(tempfile.mkdtemp(prefix="graft-gpu-check-"))
    site = work / "site"
    site.mkdir()
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join([str(site)] + ([os.environ["PYTHONPATH"]]
                                                     if os.environ.get("PYTHONPATH") else []))}
    env.pop("TRITON_INTERPRET", None)
    if args.smoke:
        env["TRITON_INTERPRET"] = "1"
    try:
        info = environment(report, args.python, env)
        dependencies(report, args.python, env, site, info.get("python", "?")[:4].rstrip("."))
        package(report, args.python, env, site)
        left = budget - (time.monotonic() - start)
        tests(report, args.python, env, work, min(test_share, max(left - 150, 30)))  # 150 s kept below
        left = budget - (time.monotonic() - start)
        flashinfer_merge(report, args.python, env, work, min(60, max(left - 90, 30)))  # 90 s kept for run.py
        left = budget - (time.monotonic() - start)
        bench(report, args.python, env, work, max(left - 5, 30))
    finally:
        report.add("total", "ok" if report.ok else "FAILED", time.monotonic() - start,
                   f"budget {budget:.0f} s; report {report.out}")
        shutil.rmtree(work, ignore_errors=True)
    print(report.text())
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
