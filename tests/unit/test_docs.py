"""Every hook in the hookspec module is documented, with its exact signature."""
import importlib.util
import inspect
from pathlib import Path

from vllm_graft.hooks import specs

ROOT = Path(__file__).resolve().parents[2]


def generator():
    spec = importlib.util.spec_from_file_location("docs_generate", ROOT / "docs" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def hookspecs():
    return [f for name, f in inspect.getmembers(specs, inspect.isfunction)
            if hasattr(f, f"{specs.PROJECT}_spec")]


def test_there_are_five_hookspecs():
    assert len(hookspecs()) == 5


def test_every_hook_documented_with_exact_signature():
    gen = generator()
    docs = (ROOT / "README.md").read_text() + "".join(p.read_text() for p in (ROOT / "docs").glob("*.md"))
    for func in hookspecs():
        sig = gen.signature(func)
        assert sig.startswith(func.__name__ + "(register: Register)")
        assert sig in docs, f"{sig} is not documented in README.md or docs/"
        assert func.__doc__ and ":param register:" in func.__doc__ and "Example::" in func.__doc__


def test_hook_reference_page_is_current():
    assert (ROOT / "docs" / "hooks.md").read_text() == generator().render(), \
        "docs/hooks.md is stale: run `python docs/generate.py`"


def test_plugin_table_is_current():
    assert (ROOT / "docs" / "plugins.md").read_text() == generator().render_plugins(), \
        "docs/plugins.md is stale: run `python docs/generate.py`"
