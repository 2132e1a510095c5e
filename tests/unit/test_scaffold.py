"""`vllm-graft new-plugin`: the generated package registers, builds, and fails the
conformance kit with NotImplementedError until its reference is written; a plugin without a
kernel by default, ``--kernel`` adds one."""
import importlib
import sys

import pytest

from vllm_graft.hooks import CONTRACTS, KERNEL_FIELD, KINDS, KernelParams, Kind, Params, Registration
from vllm_graft.hooks.registry import Entry, Source
from vllm_graft.cli.main import main
from vllm_graft.kit.conformance import checks as c
from vllm_graft.kit.scaffold import TEMPLATES, _args


def _load(kind, out, package, monkeypatch):
    """The generated package imported from ``out``, its registration as the registry sees it."""
    _forget(package, monkeypatch)
    monkeypatch.syspath_prepend(str(out))
    module = importlib.import_module(package)
    got = []
    getattr(module, KINDS[kind].hook)(got.append)
    (reg,) = got
    reg = Registration(**{**reg.model_dump(), "params": reg.params, "kind": kind})
    return c.Target(Entry(reg, Source("graft-test", "0.1.0", reg.name)), {})


def _forget(package, monkeypatch):
    for name in [m for m in sys.modules if m == package or m.startswith(package + ".")]:
        del sys.modules[name]  # for good: the next test generates a package of the same name


@pytest.mark.parametrize("kind", list(Kind), ids=lambda k: k.value)
def test_generated_package_registers_and_builds(kind, tmp_path, monkeypatch, capsys):
    """By default: a plugin without a kernel (parameters from Params, no kernel.py)."""
    out = tmp_path / "pkg"
    assert main(["new-plugin", kind.value, f"my-{kind.value}", "--dir", str(out)]) == 0
    package = f"graft_my_{kind.value}"
    assert {p.name for p in out.iterdir()} == {"pyproject.toml", "README.md", package, "tests"}
    assert {p.name for p in (out / package).iterdir()} == {"__init__.py", "reference.py"}
    assert f'my-{kind.value} = "{package}"' in (out / "pyproject.toml").read_text()
    for path in out.rglob("*.py"):  # every annotation's name is imported: no __future__ needed
        assert "from __future__" not in path.read_text(), path
    target = _load(kind, out, package, monkeypatch)
    params = target.entry.registration.params
    assert issubclass(params, Params) and not issubclass(params, KernelParams)
    assert KERNEL_FIELD not in params.model_fields
    assert "builds" in c.check_registration(target)
    c.check_params_roundtrip(target)
    c.check_params_reject(target)
    impl = c.build(target)
    assert isinstance(impl, CONTRACTS[kind])
    with pytest.raises(NotImplementedError, match="write the reference"):
        c.check_contract(target)
    with pytest.raises(c.Skipped, match="no 'kernel' parameter"):
        c.check_parity(target)
    _forget(package, monkeypatch)


@pytest.mark.parametrize("kind", list(Kind), ids=lambda k: k.value)
def test_kernel_option_adds_kernel_params_and_a_kernel_module(kind, tmp_path, monkeypatch, capsys):
    out = tmp_path / "pkg"
    assert main(["new-plugin", kind.value, f"my-{kind.value}", "--kernel", "--dir", str(out)]) == 0
    package = f"graft_my_{kind.value}"
    assert {p.name for p in (out / package).iterdir()} == {"__init__.py", "reference.py", "kernel.py"}
    for path in out.rglob("*.py"):
        assert "from __future__" not in path.read_text(), path
    target = _load(kind, out, package, monkeypatch)
    assert issubclass(target.entry.registration.params, KernelParams)
    with pytest.raises(NotImplementedError, match="write the reference"):
        c.check_contract(target)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(NotImplementedError, match="write the"):  # the reference first, then the kernel
        c.check_parity(target)
    kernel = importlib.import_module(f"{package}.kernel")
    sig = TEMPLATES[kind]["methods"][0][0]
    stub = getattr(kernel, sig.split("(")[0])
    with pytest.raises(NotImplementedError, match="write the Triton kernel"):
        stub(None, *[None] * len(_args(sig)))
    _forget(package, monkeypatch)


def test_new_plugin_refuses_bad_names_and_non_empty_folders(tmp_path, capsys):
    assert main(["new-plugin", "quant", "Bad Name", "--dir", str(tmp_path / "x")]) == 2
    assert "is not valid" in capsys.readouterr().out
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    assert main(["new-plugin", "quant", "q", "--dir", str(tmp_path / "full")]) == 2
    assert "not empty" in capsys.readouterr().out
    assert (tmp_path / "full" / "keep.txt").read_text() == "mine"
    assert main(["new-plugin", "quant", "q", "--package", "not-an-id", "--dir", str(tmp_path / "y")]) == 2
