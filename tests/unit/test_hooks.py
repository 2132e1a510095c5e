"""The hook layer: discovery through entry points, registration, allow-list, trace, errors."""
import sys
import textwrap

import pytest
from pydantic import BaseModel

from vllm_graft.hooks import (
    contract_for,
    Capabilities,
    Kind,
    PluginLoadError,
    Registration,
    RegistryError,
    get_registry,
    hookimpl,
    make_plugin_manager,
)
from vllm_graft.hooks.kinds import HOOK_KINDS

from . import sample_plugins


def make_dist(tmp_path, monkeypatch, *, module_src, dist="graft-example", version="1.2.3",
              ep_name="example", module="graft_example_mod"):
    """An installed distribution (dist-info on sys.path) with a vllm_graft entry point."""
    (tmp_path / f"{module}.py").write_text(textwrap.dedent(module_src))
    info = tmp_path / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    (info / "entry_points.txt").write_text(f"[vllm_graft]\n{ep_name} = {module}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, module, raising=False)


EXAMPLE = """
    from vllm_graft.hooks import Capabilities, Registration, hookimpl

    @hookimpl
    def graft_register_spec_proposers(register):
        register(Registration(name="ext-draft", summary="third-party drafter", paper="-",
                              impl="vllm_graft.plugins.speculative.noop.reference:NoDraft",
                              capabilities=Capabilities(lossless=True)))
"""


def test_every_hook_maps_to_a_kind():
    pm = make_plugin_manager(entry_points=False)
    specs = {name for name in dir(pm.hook) if name.startswith("graft_")}
    assert specs == set(HOOK_KINDS)
    assert set(HOOK_KINDS.values()) == set(Kind)


def test_builtins_register_through_entry_points():
    registry = get_registry()
    for kind in Kind:
        entry = registry.get(kind, "noop")
        assert entry.source.package == "vllm-graft"
        assert entry.source.plugin == f"noop-{kind.value}"
        assert entry.source.version != "?"


def test_plugin_registered_from_test_module(registry):
    entry = registry.get("kvcompress", "sample-evict")
    assert entry.kind is Kind.KVCOMPRESS  # filled in by the hook
    assert entry.source.package == sample_plugins.__name__
    names = registry.names("moe")  # sorted; the built-ins grow with the project
    assert names == sorted(names) and {"noop", "sample-mask", "sample-route"} <= set(names)


def test_plugin_from_installed_entry_point(tmp_path, monkeypatch):
    make_dist(tmp_path, monkeypatch, module_src=EXAMPLE)
    registry = make_plugin_manager().build_registry()
    entry = registry.get("speculative", "ext-draft")
    assert (entry.source.package, entry.source.version, entry.source.plugin) == ("graft-example", "1.2.3", "example")
    assert "noop" in registry.names("speculative")  # built-ins still there


def test_allow_list_from_environment(tmp_path, monkeypatch):
    make_dist(tmp_path, monkeypatch, module_src=EXAMPLE)
    monkeypatch.setenv("VLLM_GRAFT_PLUGINS", "example, noop-moe")
    registry = make_plugin_manager().build_registry()
    assert [(str(e.kind), e.name) for e in registry.entries()] == [("speculative", "ext-draft"), ("moe", "noop")]


def test_allow_list_naming_missing_plugin_fails(monkeypatch):
    monkeypatch.setenv("VLLM_GRAFT_PLUGINS", "noop-moe,not-installed")
    with pytest.raises(PluginLoadError, match=r"VLLM_GRAFT_PLUGINS names \['not-installed'\].*noop-attention"):
        make_plugin_manager()


def test_trace_switch_prints_hook_calls(monkeypatch, capsys):
    monkeypatch.setenv("VLLM_GRAFT_TRACE", "1")
    make_plugin_manager().build_registry()
    err = capsys.readouterr().err
    assert "graft_register_kv_compressors" in err and "finish" in err


def test_no_trace_by_default(capsys):
    make_plugin_manager().build_registry()
    assert "graft_register" not in capsys.readouterr().err


def test_broken_plugin_import_names_package(tmp_path, monkeypatch):
    make_dist(tmp_path, monkeypatch, module_src="raise ImportError('needs foo')", dist="graft-broken",
              ep_name="broken", module="graft_broken_mod")
    with pytest.raises(PluginLoadError, match=r"'broken'.*graft-broken 1\.2\.3.*needs foo"):
        make_plugin_manager()


def test_each_hook_is_called_once_per_plugin():
    calls = []

    class Counting:
        @hookimpl
        def graft_register_moe_schedulers(self, register):
            calls.append("moe")

        @hookimpl
        def graft_register_attention(self, register):
            calls.append("attention")

    pm = make_plugin_manager()
    pm.register(Counting(), name="counting")
    pm.register(sample_plugins, name="sample")
    pm.build_registry()
    assert sorted(calls) == ["attention", "moe"]


def _pm_with(hook_body):
    class Plugin:
        @hookimpl
        def graft_register_quant_methods(self, register):
            hook_body(register)

    pm = make_plugin_manager(entry_points=False)
    pm.register(Plugin(), name="bad-plugin")
    return pm


def _reg(**kw):
    base = dict(name="q", summary="s", paper="-", impl="m:C", capabilities=Capabilities(lossless=False))
    return Registration(**{**base, **kw})


def test_register_requires_a_registration():
    pm = _pm_with(lambda register: register({"name": "q"}))
    with pytest.raises(RegistryError, match="called register\\(\\) with dict"):
        pm.build_registry()


def test_register_from_the_wrong_hook():
    pm = _pm_with(lambda register: register(_reg(kind=Kind.MOE)))
    with pytest.raises(RegistryError, match="registered 'q' as kind moe from the quant hook"):
        pm.build_registry()


def test_duplicate_names_name_both_sources():
    pm = _pm_with(lambda register: register(_reg(name="noop")))
    pm.load_entry_points()
    with pytest.raises(RegistryError, match="quant plugin 'noop' is registered twice.*bad-plugin"):
        pm.build_registry()


def test_failing_hook_names_plugin():
    def boom(register):
        raise RuntimeError("no GPU")

    with pytest.raises(PluginLoadError, match="graft_register_quant_methods of plugin 'bad-plugin'.*no GPU"):
        _pm_with(boom).build_registry()


class Loose(BaseModel):
    x: int = 1


@pytest.mark.parametrize("kwargs, message", [
    (dict(name="Bad Name"), "String should match pattern"),
    (dict(params=Loose), "must set model_config = ConfigDict\\(extra='forbid'\\)"),
    (dict(impl="no_colon"), "String should match pattern"),
    (dict(capabilities=dict(lossless=True, dtypes=("float8",))), "unknown dtype"),
    (dict(capabilities=dict(lossless=True, platforms=("tpu",))), "unknown platform"),
    (dict(capabilities=dict(lossless=True, vllm_versions="0.32")), "not a PEP 440 version specifier"),
    (dict(capabilities=dict(dtypes=("float32",))), "lossless\n  Field required"),
])
def test_invalid_registrations_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        _reg(**kwargs)


def test_every_registered_impl_loads_and_implements_its_contract(registry):
    from vllm_graft.kit.conformance.base import example_params

    for entry in registry.entries():
        impl = entry.registration.load()
        assert issubclass(impl, contract_for(entry.kind, entry.registration.capabilities.role)), entry
        # required parameters (million's codebooks) from the model's example, as the kit takes them
        params = {"top_k": 1} if entry.name == "sample-sparse" else example_params(entry)
        impl(entry.registration.params.model_validate(params))


def test_capabilities_version_specifier():
    caps = Capabilities(lossless=True, vllm_versions=">=0.32,<0.34")
    assert caps.supports_vllm("0.32.0") and caps.supports_vllm("0.33.1")
    assert not caps.supports_vllm("0.31.9") and not caps.supports_vllm("0.34.0")
