"""One per-process runtime object owns the adapters' state (issue 36): what a deployment's
activation sets, and what is said once, lives on ``integration.runtime.RUNTIME``, so that
deactivation is one ``RUNTIME.reset()``. The AST check below keeps module-level mutable state
out of ``integration/`` (outside ``runtime.py`` and the documented caches of :data:`ALLOWED`)."""
from __future__ import annotations

import ast
import os
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

from vllm_graft.integration import bridge, model_runner
from vllm_graft.integration.patches import PATCHES
from vllm_graft.integration.runtime import RUNTIME
from vllm_graft.integration.targets import CREATE_ENGINE_CONFIG, Target

INTEGRATION = Path(__file__).resolve().parents[2] / "integration"

#: Module-level mutable tables that may stay, each a cache whose content is the same for every
#: deployment of a process (so deactivation has nothing to undo there), by (file, name).
ALLOWED = {
    # kind -> the ADAPTER object of the kind's module: an import cache (importlib's own, by kind)
    ("adapters/__init__.py", "_cache"),
    # member name -> the guard subclass of vLLM's backend made for it: vLLM imports it by path
    # (module __getattr__) and must get the same class every time; it reads needs_seams() live
    ("adapters/cuda_backends.py", "_guards"),
    # quantization name -> the config class made for it: registered into vLLM and rebuilt by
    # pickle (_restore_config) by name, so it must stay the same class across deployments
    ("adapters/quant/vllm_method.py", "_classes"),
    # read-only tables (constants: never written after import)
    ("adapters/backend.py", "CUDA_PATHS"),  # CUDA backend member -> vllm-graft's subclass, by path
    ("adapters/quant/checkpoint.py", "FUSED_LAYERS"),  # vLLM's fused layer -> its checkpoint parts
    ("adapters/speculative/tree.py", "_NEUTRAL"),  # sampling parameters' values that change nothing
    ("env.py", "VLLM_DISTRIBUTIONS"),  # vLLM distribution -> its platform
}

_MUTABLE_CALLS = {"set", "dict", "list", "defaultdict", "OrderedDict", "Counter", "deque", "bytearray",
                  "WeakValueDictionary", "WeakKeyDictionary", "WeakSet", "count"}


def _mutable(value: ast.expr | None) -> bool:
    if isinstance(value, (ast.Set, ast.Dict, ast.List, ast.SetComp, ast.DictComp, ast.ListComp)):
        return True
    if isinstance(value, ast.Call):
        f = value.func
        name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
        return name in _MUTABLE_CALLS
    return False


def module_state(root: Path) -> list[str]:
    """``file:line name`` of every module-level assignment of a mutable value (set/dict/list
    literals, comprehensions, calls of their constructors, weak tables, counters) and every
    ``global`` statement under ``root``, except ``runtime.py`` and :data:`ALLOWED`."""
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel == "runtime.py":
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in tree.body:
            if isinstance(node, ast.Assign):
                targets, value = node.targets, node.value
            elif isinstance(node, ast.AnnAssign):
                targets, value = [node.target], node.value
            else:
                continue
            if not _mutable(value):
                continue
            for t in targets:
                name = getattr(t, "id", ast.unparse(t))
                if (rel, name) not in ALLOWED and name != "__all__":
                    found.append(f"{rel}:{node.lineno} {name}")
        for node in ast.walk(tree):
            if isinstance(node, ast.Global):
                found.append(f"{rel}:{node.lineno} global {', '.join(node.names)}")
    return found


def test_integration_keeps_no_module_level_mutable_state_outside_the_runtime():
    assert module_state(INTEGRATION) == [], (
        "module-level mutable state in integration/: put it on integration/runtime.py's Runtime "
        "(cleared by reset() if a deployment sets it), or add a cache to ALLOWED with why")


def test_the_check_finds_a_planted_table_and_global(tmp_path):
    (tmp_path / "adapters").mkdir()
    (tmp_path / "runtime.py").write_text("STATE = {}\n")  # the runtime's own module is exempt
    (tmp_path / "adapters" / "__init__.py").write_text("_cache: dict = {}\n")  # allowed
    (tmp_path / "adapters" / "planted.py").write_text(textwrap.dedent("""\
        import itertools, weakref
        NAMES = ("a", "b")  # a tuple: fine
        LIMIT = 3
        _seen: set[str] = set()
        TABLE = {"a": 1}
        _keys = itertools.count()
        _live = weakref.WeakValueDictionary()
        _done = False


        def mark():
            global _done
            _done = True
        """))
    assert module_state(tmp_path) == [
        "adapters/planted.py:4 _seen", "adapters/planted.py:5 TABLE", "adapters/planted.py:6 _keys",
        "adapters/planted.py:7 _live", "adapters/planted.py:12 global _done"]


def adapter_attributes(root: Path) -> list[str]:
    """``file:line Class.attr`` for every attribute an ``Adapter`` subclass sets on itself
    (``self.x = ...``, in any method): the ADAPTER objects are module-level, so what a
    deployment sets belongs on ``Adapter.state`` (the runtime's), not on them."""
    found = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for cls in ast.walk(tree):
            if not (isinstance(cls, ast.ClassDef) and any(getattr(b, "id", "") == "Adapter" for b in cls.bases)):
                continue
            for node in ast.walk(cls):
                targets = (node.targets if isinstance(node, ast.Assign)
                           else [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
                for t in targets:
                    if isinstance(t, ast.Attribute) and getattr(t.value, "id", "") == "self":
                        found.append(f"{path.relative_to(root).as_posix()}:{node.lineno} {cls.name}.{t.attr}")
    return found


def test_the_adapters_hold_no_state_of_their_own():
    assert adapter_attributes(INTEGRATION) == [], "put it in the adapter's State (Adapter.state)"


def test_the_adapter_check_finds_a_planted_attribute(tmp_path):
    (tmp_path / "a.py").write_text(textwrap.dedent("""\
        class Adapter: ...


        class Mine(Adapter):
            State = dict

            def activate(self, plan):
                self.state["chain"] = plan  # on the runtime: fine
                self.chain = plan
        """))
    assert adapter_attributes(tmp_path) == ["a.py:9 Mine.chain"]


# ----------------------------------------------------------------- deactivation is one reset
class _Adapter:
    def __init__(self, kind: str, undone: list[str]) -> None:
        self.kind, self.undone = kind, undone

    def deactivate(self) -> None:
        self.undone.append(self.kind)


@pytest.fixture
def fresh_runtime(monkeypatch):
    """RUNTIME as a test leaves it: no deployment active; the process-lifetime state kept."""
    assert not RUNTIME.active and not RUNTIME.adapters, "a deployment was left active"
    monkeypatch.delenv(model_runner.ENV_RUNNER, raising=False)
    yield RUNTIME
    bridge.deactivate()


def test_deactivate_clears_every_adapters_state(fresh_runtime, monkeypatch):
    from vllm_graft.integration.adapters import attention_backend_overrides
    from vllm_graft.integration.adapters.kvcompress import channel
    from vllm_graft.integration.adapters.kvcompress import state as kv_state
    from vllm_graft.integration.adapters.quant.tensors import register_linear
    from vllm_graft.hooks import Kind
    from vllm_graft.integration.adapters.speculative import tree

    rt = fresh_runtime
    undone: list[str] = []
    rt.plan, rt.source = SimpleNamespace(by_kind=lambda kind: [], enabled=[]), "test"
    rt.adapters += [_Adapter("kvcompress", undone), _Adapter("speculative", undone)]
    # kvcompress: the active compressor (what its activate sets), and the async output warned once
    kv_state.set_active(kv_state.Active(compressor=object(), name="c", count=lambda event, n=1: None))
    assert kv_state.get_active() is not None
    kv_state.get_active().scored = SimpleNamespace(finalize=lambda: {"r": [1]})
    out = channel._attach_drops(SimpleNamespace(_model_runner_output=SimpleNamespace()))
    assert out._model_runner_output.graft_kv_drops == {"r": [1]} and "kvcompress async output" in rt.said
    # speculative: the tree verifier the tree attention reads
    verifier = tree.activate_verifier(lambda *a: None)
    assert tree.current_verifier() is verifier and rt.adapter_state[Kind.SPECULATIVE].tree_verifier is verifier
    # the generic backend's reference attention; the adapters' once-only warnings
    rt.seams.reference_attention = object()
    attention_backend_overrides(SimpleNamespace(platform="cuda", deployment=SimpleNamespace(
        engine={"attention_backend": "FLEX_ATTENTION"})))
    # model runner: VLLM_USE_V2_MODEL_RUNNER=0 set for the deployment
    model_runner.before_config([SimpleNamespace(owner="adapters.kvcompress", where="x", runner="v1")])
    assert os.environ[model_runner.ENV_RUNNER] == "0" and rt.runner_env_set
    # a patch of an adapter, beside the bridge's own config hook (which stays)
    host = SimpleNamespace(method=lambda: "original", hook=lambda: "original")
    PATCHES.apply(Target("adapters.test", __name__, "", "method", "test"), lambda orig: lambda: "patched",
                  on=host, vllm_version="0.32.0")
    keep = Target(CREATE_ENGINE_CONFIG.owner, __name__, "", "hook", "test")
    PATCHES.apply(keep, lambda orig: lambda: "patched", on=host, vllm_version="0.32.0")
    # process-lifetime: a linear method of a model (kept: the model outlives the deployment)
    method = _Adapter("linear", [])  # any object a weak reference can hold
    key = register_linear(method)
    registered = rt.registered
    # the backend's seams and the MoE and quant adapters' state (all on the runtime)
    from vllm_graft.integration.adapters import adapter_for
    from vllm_graft.integration.adapters.backend import SEAMS
    from vllm_graft.integration.adapters.moe.engine import SKIP_MIN_DEFAULT

    SEAMS.rewriters.append(lambda builder, cm: cm)
    SEAMS.owners.add("adapters.kvcompress")
    SEAMS.method_name = "m"
    moe = adapter_for("moe")
    moe.state.chain, moe.state.skip_min = object(), 7
    adapter_for("quant").state.registered.append("graft-x")
    assert SEAMS is rt.seams and set(rt.adapter_state) == {Kind.KVCOMPRESS, Kind.SPECULATIVE, Kind.MOE, Kind.QUANT}

    bridge.deactivate()

    assert undone == ["speculative", "kvcompress"]  # last activated, first undone
    assert not rt.active and rt.adapters == [] and rt.source is None
    assert kv_state.get_active() is None and tree.current_verifier() is None
    assert rt.seams.reference_attention is None
    assert rt.said == set() and not rt.runner_env_set
    assert model_runner.ENV_RUNNER not in os.environ
    assert host.method() == "original"  # the adapter's patch undone
    assert host.hook() == "patched"  # the bridge's kept
    assert SEAMS is rt.seams and SEAMS.rewriters == [] and SEAMS.owners == set() and SEAMS.method_name == ""
    assert rt.adapter_state == {} and moe.state.chain is None and moe.state.skip_min == SKIP_MIN_DEFAULT
    assert adapter_for("quant").state.registered == []
    assert rt.linear_methods[key] is method and rt.registered == registered
    del rt.linear_methods[key]
    PATCHES._applied.pop((id(host), "hook"))  # only this test's (the real config hook may be there)


def test_a_separate_runtime_resets_without_touching_the_process_patches():
    from vllm_graft.integration.runtime import Runtime

    host = SimpleNamespace(method=lambda: "original")
    PATCHES.apply(Target("adapters.test", __name__, "", "method", "test"), lambda orig: lambda: "patched",
                  on=host, vllm_version="0.32.0")
    try:
        rt = Runtime()
        rt.once("x")
        rt.reset()
        assert host.method() == "patched" and rt.said == set()
    finally:
        PATCHES.undo("adapters.test")
    assert host.method() == "original"
