"""The layering rule of DESIGN.md: hooks/ and plugins/ never import vllm."""
import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def vllm_imports(folder):
    found = []
    for path in (ROOT / folder).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) in (
                    "import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant):
                names = [str(node.args[0].value)]
            found += [f"{path.relative_to(ROOT)}:{node.lineno}: {n}" for n in names
                      if n == "vllm" or n.startswith("vllm.")]
    return found


def test_scanner_finds_an_import(tmp_path, monkeypatch):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "m.py").write_text("def f():\n    from vllm.config import X\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert vllm_imports("x") == ["x/m.py:2: vllm.config"]


def test_hooks_and_plugins_do_not_import_vllm():
    assert vllm_imports("hooks") == []
    assert vllm_imports("plugins") == []


def test_importing_hooks_plugins_and_cli_loads_no_vllm():
    code = ("import sys, vllm_graft.hooks, vllm_graft.integration.cli as c; "
            "from vllm_graft.hooks import get_registry\n"
            "[e.registration.load() for e in get_registry().entries()]\n"
            "print(sorted(m for m in sys.modules if m == 'vllm' or m.startswith('vllm.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
