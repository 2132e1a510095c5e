"""`vllm-graft new-plugin`: the generated package registers, builds, and fails the
conformance kit with NotImplementedError until its reference is written."""
import importlib
import sys

import pytest

from vllm_graft.hooks import CONTRACTS, KINDS, Kind, Registration
from vllm_graft.hooks.registry import Entry, Source
from vllm_graft.integration.cli import main
from vllm_graft.kit.conformance import checks as c


@pytest.mark.parametrize("kind", list(Kind), ids=lambda k: k.value)
def test_generated_package_registers_and_builds(kind, tmp_path, monkeypatch, capsys):
    out = tmp_path / "pkg"
    assert main(["new-plugin", kind.value, f"my-{kind.value}", "--dir", str(out)]) == 0
    package = f"graft_my_{kind.value}"
    assert {p.name for p in out.iterdir()} == {"pyproject.toml", "README.md", package, "tests"}
    assert f'my-{kind.value} = "{package}"' in (out / "pyproject.toml").read_text()
    monkeypatch.syspath_prepend(str(out))
    module = importlib.import_module(package)
    got = []
    getattr(module, KINDS[kind].hook)(got.append)
    (reg,) = got
    reg = Registration(**{**reg.model_dump(), "params": reg.params, "kind": kind})
    target = c.Target(Entry(reg, Source("graft-test", "0.1.0", reg.name)), {})
    assert "builds" in c.check_registration(target)
    c.check_params_roundtrip(target)
    c.check_params_reject(target)
    impl = c.build(target)
    assert isinstance(impl, CONTRACTS[kind])
    with pytest.raises(NotImplementedError, match="write the reference"):
        c.check_contract(target)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(NotImplementedError, match="write the"):
        c.check_parity(target)
    for name in [m for m in sys.modules if m.startswith(package)]:
        monkeypatch.delitem(sys.modules, name)


def test_new_plugin_refuses_bad_names_and_non_empty_folders(tmp_path, capsys):
    assert main(["new-plugin", "quant", "Bad Name", "--dir", str(tmp_path / "x")]) == 2
    assert "is not valid" in capsys.readouterr().out
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    assert main(["new-plugin", "quant", "q", "--dir", str(tmp_path / "full")]) == 2
    assert "not empty" in capsys.readouterr().out
    assert (tmp_path / "full" / "keep.txt").read_text() == "mine"
    assert main(["new-plugin", "quant", "q", "--package", "not-an-id", "--dir", str(tmp_path / "y")]) == 2
