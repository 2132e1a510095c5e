"""Every Triton kernel under plugins/ compiles for CUDA sm_90 (CI) and sm_80 (``make test-aot``:
``GRAFT_AOT_ARCHS=80,90``), here, without a GPU.

The specialisations compiled are the ones the plugins' own launchers produce in their kernel
tests (captured under ``TRITON_INTERPRET=1``, see ``tests/kernels/aot.py``), plus a bfloat16
twin of every float16 launch for kernels whose plugin runs bfloat16 models (the kernel tests
run fp32 and fp16 only: the interpreter computes in numpy, which has no bfloat16). Launches
that differ only in integer constexprs (tile sizes) are compiled once per kernel, dtype and
flag combination. Compilation goes to a cubin through Triton's NVIDIA backend and its bundled
``ptxas``; a failure names the kernel, the specialisation and the compiler's error.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.kernels.aot import ENV, jit_functions

ROOT = Path(__file__).resolve().parents[2]
#: the architectures compiled for: Hopper in CI (the GPU users run), Ampere too with ``make test-aot``
ARCHS = tuple(int(a) for a in os.environ.get("GRAFT_AOT_ARCHS", "90").split(","))
#: The test files whose launches are captured: every plugin kernel's exactness tests.
KERNEL_TESTS = (
    "tests/unit/test_hydragen_kernel.py", "tests/unit/test_moe_dynamic_topk_kernel.py",
    "tests/unit/test_quant_dfloat11_kernel.py", "tests/unit/test_quant_squeezellm_kernel.py",
    "tests/unit/test_spec_recycling_kernel.py", "tests/unit/test_squeezed.py",
    "tests/unit/test_quant_w4a8.py", "tests/unit/test_kv4.py",
    "tests/kernels/test_h2o_kernel.py", "tests/kernels/test_kv4_kernel.py",
    "tests/kernels/test_tree_attention_kernel.py",
)


def _nvidia_backend() -> bool:
    try:
        from triton.backends import backends
    except ImportError:
        return False
    return "nvidia" in backends


pytestmark = pytest.mark.skipif(not _nvidia_backend(), reason="this Triton has no NVIDIA backend")


def _bf16_plugins() -> set[str]:
    """Plugin packages (``vllm_graft.plugins.<kind>.<name>``) that run bfloat16 models; a kind's
    shared packages (``_shared``, ``_tree``...) count if any plugin of the kind does."""
    from vllm_graft.hooks import get_registry

    from .aot import PLUGINS

    out = set()
    for e in get_registry().entries():
        if "bfloat16" in e.registration.capabilities.dtypes:
            out.add(e.registration.package)
            kind = e.registration.package.rsplit(".", 1)[0]
            if kind.startswith("vllm_graft.plugins."):  # built in (not a third-party package)
                out |= {f"{kind}.{p.name}" for p in (PLUGINS / kind.rsplit(".", 1)[1]).iterdir()
                        if p.is_dir() and p.name.startswith("_") and not p.name.startswith("__")}
    return out


def _specs(captured: list[dict]) -> list[dict]:
    bf16 = _bf16_plugins()
    out, seen = [], set()
    for spec in captured:
        variants = [spec]
        if "*fp16" in spec["signature"].values() and spec["kernel"].rsplit(".", 1)[0] in bf16:
            twin = json.loads(json.dumps(spec))
            twin["signature"] = {k: "*bf16" if v == "*fp16" else v for k, v in spec["signature"].items()}
            twin["twin"] = "bf16 twin of an fp16 launch"
            variants.append(twin)
        for s in variants:
            key = (s["kernel"], tuple(sorted(s["signature"].items())), tuple(sorted(s["options"].items())),
                   tuple(sorted((k, v) for k, v in s["constexprs"].items() if not isinstance(v, int)
                                or isinstance(v, bool))))
            if key not in seen:
                seen.add(key)
                out.append(s)
    return out


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> list[dict]:
    tmp = tmp_path_factory.mktemp("aot")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    capture = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.kernels.aot",
         *KERNEL_TESTS], cwd=ROOT, env={**env, ENV: str(tmp / "captured.json")},
        capture_output=True, text=True, timeout=1200)
    assert capture.returncode == 0, f"kernel tests failed while capturing:\n{capture.stdout[-3000:]}"
    specs = _specs(json.loads((tmp / "captured.json").read_text()))
    (tmp / "specs.json").write_text(json.dumps(specs))
    run = subprocess.run(
        [sys.executable, "-m", "tests.kernels.aot", str(tmp / "specs.json"), str(tmp / "out.json"),
         *map(str, ARCHS)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads((tmp / "out.json").read_text())


def _describe(spec: dict) -> str:
    types = sorted({v for v in spec["signature"].values() if v.startswith("*")})
    flags = {k: v for k, v in spec["constexprs"].items() if not isinstance(v, int) or isinstance(v, bool)}
    return f"{spec['kernel']} {types} {flags}"


@pytest.mark.parametrize("arch", ARCHS, ids=lambda a: f"sm_{a}")
def test_every_captured_kernel_compiles(compiled, arch):
    failures = [f"{_describe(s)}: {s['results'][str(arch)]}" for s in compiled
                if s["results"][str(arch)] != "ok"]
    assert not failures, f"{len(failures)} kernel specialisation(s) fail to compile for sm_{arch}:\n" + \
        "\n".join(failures)


def test_every_jit_function_under_plugins_was_compiled(compiled):
    """A kernel without a launch in its tests (or a helper no compiled kernel calls) fails here,
    named."""
    functions = jit_functions()
    launched = {s["kernel"] for s in compiled}
    reached = set(launched)
    for k in launched:
        reached |= functions[k]
    missing = sorted(set(functions) - reached)
    assert not missing, f"@triton.jit functions never compiled (add a launch to a kernel test): {missing}"
    assert len(functions) >= 15


def test_bfloat16_is_compiled_where_a_plugin_runs_bfloat16(compiled):
    bf16 = {s["kernel"] for s in compiled if "*bf16" in s["signature"].values()}
    fp16 = {s["kernel"] for s in compiled if "*fp16" in s["signature"].values()}
    assert "vllm_graft.plugins.attention.hydragen.kernel:_prefix_kernel" in bf16
    assert "vllm_graft.plugins.kvcompress.kv4.kernel:_kv4_attention_kernel" in bf16
    assert not any(k.startswith(("vllm_graft.plugins.quant.w4a8", "vllm_graft.plugins.quant.squeezellm"))
                   for k in bf16)  # those plugins refuse bfloat16 models
    assert fp16 - bf16 <= {k for k in fp16 if ".quant." in k}


def test_a_kernel_that_does_not_compile_is_reported_with_the_error(compiled, tmp_path):
    # the first captured dynamic top-k launch, with a float where the kernel indexes by an int
    spec = next(s for s in compiled if s["kernel"].endswith(":_dynamic_topk_kernel"))
    bad = {**spec, "signature": {**spec["signature"], "stride_t": "fp32"}}
    bad.pop("results")
    (tmp_path / "bad.json").write_text(json.dumps([bad]))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    subprocess.run([sys.executable, "-m", "tests.kernels.aot", str(tmp_path / "bad.json"),
                    str(tmp_path / "out.json"), "90"], cwd=ROOT, env=env, check=True, timeout=600)
    result = json.loads((tmp_path / "out.json").read_text())[0]["results"]["90"]
    assert result != "ok" and "Error" in result
