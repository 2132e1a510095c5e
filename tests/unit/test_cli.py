"""The `vllm-graft` command: output and exit codes."""
import json
import subprocess
import sys
from pathlib import Path

import pytest


from vllm_graft.cli import main as cli

REPO_DEPLOYMENT = """
engine: {dtype: float32}
kvcompress: {plugin: noop}
moe: {plugin: noop}
"""


def run(capsys, *argv):
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_version(capsys):
    code, out, _ = run(capsys, "--version")
    assert code == 0 and out.startswith("vllm-graft 0.1.0 (")


def test_no_command_prints_help_and_exit_2(capsys):
    code, out, _ = run(capsys)
    assert code == 2 and "plugins" in out and "check" in out


def test_unknown_command_is_usage_error(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["deploy"])
    assert info.value.code == 2
    assert "invalid choice: 'deploy'" in capsys.readouterr().err


def test_plugins_table_lists_every_builtin(capsys):
    code, out, _ = run(capsys, "plugins")
    assert code == 0
    for kind in ("attention", "kvcompress", "speculative", "quant", "moe"):
        assert kind in out
    assert "vllm-graft" in out and "0.1.0" in out and "Keeps every KV block" in out


def test_plugins_json_and_kind_filter(capsys):
    code, out, _ = run(capsys, "plugins", "--kind", "kvcompress", "--json")
    data = json.loads(out)
    assert code == 0 and "noop" in [d["name"] for d in data] and {d["kind"] for d in data} == {"kvcompress"}
    d = next(d for d in data if d["name"] == "noop")
    assert d["kind"] == "kvcompress" and d["package"] == "vllm-graft" and d["entry_point"] == "noop-kvcompress"
    assert d["capabilities"]["lossless"] is True and d["params_schema"]["type"] == "object"


def test_plugins_bad_kind_is_usage_error(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["plugins", "--kind", "kv"])
    assert info.value.code == 2


def test_plugins_name_prints_its_parameters(capsys, monkeypatch):
    """`vllm-graft plugins NAME` (it was "unrecognized arguments"): each parameter with its type,
    default, bounds and description; a name in several kinds shows each; --json gives them too."""
    monkeypatch.setenv("COLUMNS", "220")
    code, out, _ = run(capsys, "plugins", "snapkv")
    assert code == 0 and "kvcompress plugin 'snapkv'" in out and "Li et al. 2024" in out
    for cell in ("budget_blocks", "int", "16", ">= 2", "prompt KV blocks a request keeps after prefill",
                 "window_tokens", "'reference' | 'triton'", "> 0.0, <= 1.0"):
        assert cell in out, cell
    code, out, _ = run(capsys, "plugins", "noop")
    assert code == 0 and all(f"{k} plugin 'noop'" in out for k in ("attention", "kvcompress", "quant", "moe"))
    code, out, _ = run(capsys, "plugins", "noop", "--kind", "quant", "--json")
    (row,) = json.loads(out)
    assert row["kind"] == "quant" and row["params"][0]["name"] == "host_gemm" and row["params"][0]["default"] == "True"
    code, out, _ = run(capsys, "plugins", "snapk")
    assert code == 2 and "no plugin 'snapk'" in out and "Did you mean 'snapkv'?" in out
    code, out, _ = run(capsys, "plugins", "--kind", "kvcompress")  # the table's parameter summary
    assert code == 0 and "budget_blocks" in out and "vllm-graft plugins NAME" in out


def test_check_valid_explains_plan(tmp_path, capsys):
    path = tmp_path / "d.yaml"
    path.write_text(REPO_DEPLOYMENT)
    code, out, _ = run(capsys, "check", str(path), "--platform", "cpu")
    assert code == 0
    assert f"✓ {path} is valid" in out
    assert "kvcompress" in out and "moe" in out and "KV-cache spec" in out
    assert "adapter not implemented" not in out  # every kind has its adapter


def test_every_kind_has_its_adapter_module(tmp_path, capsys):
    import importlib.util

    from vllm_graft.hooks import KINDS
    from vllm_graft.integration.adapters import adapter_module

    for spec in KINDS.values():  # found without importing it (the adapter imports vLLM)
        assert importlib.util.find_spec(adapter_module(spec.kind)) is not None, spec.kind
    path = tmp_path / "d.yaml"
    path.write_text(REPO_DEPLOYMENT)
    code, out, _ = run(capsys, "check", str(path), "--platform", "cpu")
    assert code == 0
    assert "dtype: float32" in out and "platform: cpu" in out


def test_check_invalid_lists_every_problem_exit_1(tmp_path, capsys):
    path = tmp_path / "d.yaml"
    path.write_text("kvcompress: {plugin: nop}\nplatfrom: cpu\n")
    code, out, _ = run(capsys, "check", str(path))
    assert code == 1
    assert "2 problems" in out
    assert "kvcompress.plugin: unknown kvcompress plugin (got 'nop')" in out
    assert "Did you mean 'platform'?" in out


def test_check_json(tmp_path, capsys):
    path = tmp_path / "d.yaml"
    path.write_text("kvcompress: {plugin: nop}\n")
    code, out, _ = run(capsys, "check", str(path), "--json")
    data = json.loads(out)
    assert code == 1 and data["valid"] is False
    assert data["problems"][0]["path"] == "kvcompress.plugin" and data["problems"][0]["value"] == "nop"
    path.write_text(REPO_DEPLOYMENT)
    code, out, _ = run(capsys, "check", str(path), "--json", "--platform", "cpu")
    data = json.loads(out)
    assert code == 0 and data["valid"] and [p["name"] for p in data["plugins"]] == ["noop", "noop"]
    assert data["graft_config"]["kvcompress"] == {"plugin": "noop"}


def test_check_missing_file_exit_1(tmp_path, capsys):
    code, out, _ = run(capsys, "check", str(tmp_path / "nope.yaml"))
    assert code == 1 and "file not found" in out


def test_plugin_load_error_exit_3(monkeypatch, capsys):
    monkeypatch.setenv("VLLM_GRAFT_PLUGINS", "no-such-plugin")
    code, _, err = run(capsys, "plugins")
    assert code == 3 and "plugin error" in err and "no-such-plugin" in err


def test_console_script_installed():
    # pip puts console scripts beside the interpreter (the venv need not be activated)
    exe = Path(sys.executable).parent / "vllm-graft"
    assert exe.is_file(), f"the vllm-graft console script is installed at {exe}"
    proc = subprocess.run([exe, "plugins", "--json"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert {d["kind"] for d in json.loads(proc.stdout)} == {"attention", "kvcompress", "speculative", "quant", "moe"}


def test_plugins_host_syncs_reports_each_hot_method_per_step_or_layer(capsys):
    """`plugins --json --host-syncs`: the conformance exercise on a fake CUDA device, per plugin
    the host syncs each hot method costs per call; the MoE observers read the routing back to
    the host every layer, the model-order router does not."""
    assert cli.main(["plugins", "--json", "--host-syncs"]) == 0
    every = json.loads(capsys.readouterr().out)  # exercises that print (kv4) do not spoil the JSON
    assert not [r["name"] for r in every if "error" in r["host_syncs"]]
    assert {r["host_syncs"]["apply"]["syncs"] for r in every if r["kind"] == "quant"} == {0}
    rows = {r["name"]: r["host_syncs"] for r in every if r["kind"] == "moe"}
    assert rows["route-trace"]["observe"]["per"] == "layer" and rows["route-trace"]["observe"]["per_call"] > 0
    assert any("route_trace/reference.py" in w for w in rows["route-trace"]["observe"]["where"])
    assert rows["noop"]["route"] == {"per": "layer", "calls": 8, "syncs": 0, "per_call": 0.0, "where": []}
