"""The project's layering (README.md "Where things live" and docs/plugins.md "Plugin files"), checked on the source with ``ast``:

* hooks/ and plugins/ never import vLLM;
* vLLM's internals (anything but its public ``LLM``/``SamplingParams`` API) are imported only in
  integration/, the bridge; tools/ and kit/ import even the public API only inside functions;
* launch/, tools/ and kit/ reach plugins only through the registry (``Registration.load()`` /
  ``Registration.part(module)``), never by importing ``vllm_graft.plugins``;
* folders point one way: hooks <- plugins <- integration <- launch <- tools <- kit <- cli
  (:data:`RANK`, one rank each: no two folders import each other), counting module paths written
  in strings (entry points, ``import_module``, ``f"vllm_graft.x.{...}"``);
* no module of the package imports another that imports it back (function-level imports
  count: a cycle is a cycle in the design even when deferred).
"""
import ast
import re
from pathlib import Path

from .builds import vllm_loaded_by

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = {"hooks": "vllm_graft.hooks", "plugins": "vllm_graft.plugins",
           "integration": "vllm_graft.integration", "launch": "vllm_graft.launch", "cli": "vllm_graft.cli",
           "kit": "vllm_graft.kit", "tools": "vllm_graft.tools"}
#: The folders' direction: a module may import (or name in a string, as entry points and
#: ``import_module`` do) only its own folder or a lower one. hooks/ is the contract, plugins/
#: implement it, integration/ is what vLLM loads and patches, launch/ starts vLLM with a plan and
#: reads what it reports; the measurement tools stand on it, the conformance kit on the tools (their
#: workloads), and the command line, which assembles every command, on top. Every folder has a rank
#: of its own, so no two import each other (docs/architecture.md draws it).
RANK = {"hooks": 0, "plugins": 1, "integration": 2, "launch": 3, "tools": 4, "kit": 5, "cli": 6}
#: vLLM's public API that the tools may use to drive an engine
VLLM_PUBLIC = {"vllm", "vllm.sampling_params", "vllm.inputs"}


def _modules(root=None):
    """Module name -> (path, is_package) for every module of the package."""
    root = root or ROOT
    out = {}
    for folder, pkg in FOLDERS.items():
        for path in (root / folder).rglob("*.py"):
            parts = [pkg, *path.relative_to(root / folder).with_suffix("").parts]
            is_pkg = parts[-1] == "__init__"
            out[".".join(parts[:-1] if is_pkg else parts)] = (path, is_pkg)
    return out


def _imports(name, path, is_pkg, modules, top_only=False):
    """(line, imported module, at module level) for each import in the file, relative ones
    resolved; ``from pkg import sub`` counts as importing ``pkg.sub`` when that is a module."""
    tree = ast.parse(path.read_text(), str(path))
    top = {id(n) for n in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[:len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in modules else mod for a in node.names]
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", ""))
              in ("import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant)):
            targets = [str(node.args[0].value)]
        else:
            continue
        found += [(node.lineno, t, id(node) in top) for t in targets]
    return found


_NAMED = re.compile(r"\bvllm_graft\.(" + "|".join(FOLDERS) + r")\b")


def _docstrings(tree):
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def _folder_references(path, root=None):
    """(line, folder) for every import of ``vllm_graft.<folder>`` in the file, relative ones
    resolved (``from ...launch import x`` in tools/bench/ is ``vllm_graft.launch``), and every
    string (docstrings aside) that names one: a module path in a string is an import deferred."""
    tree = ast.parse(path.read_text(), str(path))
    docs = _docstrings(tree)
    parts = path.relative_to(root or ROOT).with_suffix("").parts
    package = ["vllm_graft", *parts[:-1]]  # the file's package (a package's __init__ is its own)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level:
            base = package[: len(package) - (node.level - 1)]
            names = [".".join(base + ([node.module] if node.module else []))]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            names = [node.value]
        else:
            continue
        found += [(node.lineno, m.group(1)) for n in names for m in _NAMED.finditer(n)]
    return found


def folder_direction(root=None):
    """``path:line: folder -> folder`` for every reference that points to a higher folder."""
    root = root or ROOT
    bad = []
    for folder in FOLDERS:
        for path in sorted((root / folder).rglob("*.py")):
            for line, target in _folder_references(path, root):
                if RANK[target] > RANK[folder]:
                    bad.append(f"{path.relative_to(root)}:{line}: {folder} -> {target}")
    return bad


def _is(module, prefix):
    return module == prefix or module.startswith(prefix + ".")


def violations(rule, modules=None):
    modules = modules or _modules()
    bad = []
    for name, (path, is_pkg) in sorted(modules.items()):
        for line, target, at_top in _imports(name, path, is_pkg, modules):
            where = f"{path.relative_to(path.parents[len(name.split('.')) - (1 if is_pkg else 2)])}:{line}: {target}"
            if rule(name, target, at_top):
                bad.append(where)
    return bad


def no_vllm_in_hooks_or_plugins(name, target, at_top):
    return _is(target, "vllm") and (_is(name, "vllm_graft.hooks") or _is(name, "vllm_graft.plugins"))


def vllm_internals_only_in_integration(name, target, at_top):
    if not _is(target, "vllm") or _is(name, "vllm_graft.integration"):
        return False
    return target not in VLLM_PUBLIC or at_top


def plugins_only_through_the_registry(name, target, at_top):
    return any(_is(name, f"vllm_graft.{f}") for f in ("launch", "tools", "kit")) and _is(target, "vllm_graft.plugins")


def cycles(modules=None):
    """Groups of modules that import each other (strongly connected components > 1)."""
    modules = modules or _modules()
    graph = {m: {t for _, t, _ in _imports(m, p, pkg, modules) if t in modules and t != m}
             for m, (p, pkg) in modules.items()}
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


# ------------------------------------------------------------------- the checks can fail
def _fake_tree(tmp_path, files):
    for folder in FOLDERS:
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "__init__.py").write_text("")
    for rel, text in files.items():
        (tmp_path / rel).write_text(text)
    return _modules(tmp_path)


def test_the_checks_find_what_they_look_for(tmp_path):
    mods = _fake_tree(tmp_path, {
        "plugins/p.py": "def f():\n    from vllm.config import X\n",
        "tools/t.py": "from vllm import LLM\nfrom vllm_graft.plugins import p\n",
        "kit/k.py": "def f():\n    from vllm import SamplingParams\n",
        "hooks/a.py": "from . import b\n",
        "hooks/b.py": "def f():\n    from .a import x\n",
    })
    assert violations(no_vllm_in_hooks_or_plugins, mods) == ["plugins/p.py:2: vllm.config"]
    assert violations(vllm_internals_only_in_integration, mods) == [
        "plugins/p.py:2: vllm.config", "tools/t.py:1: vllm"]  # kit's function-level public import is fine
    assert violations(plugins_only_through_the_registry, mods) == ["tools/t.py:2: vllm_graft.plugins.p"]
    assert cycles(mods) == [["vllm_graft.hooks.a", "vllm_graft.hooks.b"]]


def test_the_folder_direction_check_fails_on_a_planted_violation(tmp_path):
    _fake_tree(tmp_path, {
        "hooks/h.py": 'ADAPTER = "vllm_graft.integration.adapters.x"\n',  # a string import
        "plugins/p.py": "from vllm_graft.hooks import h\n",  # down: fine
        "integration/i.py": "def f():\n    from vllm_graft.cli import main\n",  # deferred, still up
        "launch/l.py": "from vllm_graft.integration import i\nEXIT = 'vllm_graft.tools.t'\n",  # down, then up
        "cli/c.py": '"""See vllm_graft.launch.x."""\nfrom vllm_graft.tools import t\n',  # down: fine
        "tools/t.py": "import importlib\nimportlib.import_module(f'vllm_graft.plugins.{x}')\n",
        "kit/k.py": "from vllm_graft.cli import c\nfrom vllm_graft.tools import t\n",  # up, then down
        "tools/u.py": "def f():\n    from vllm_graft.kit import k\n",  # the kit sits above the tools
        "plugins/q.py": "from ..integration import i\nfrom ..hooks import h\n",  # relative: up, then down
        "launch/m.py": "from . import l\nfrom ..cli.c import x\n",  # its own folder, then up
    })
    assert folder_direction(tmp_path) == ["hooks/h.py:1: hooks -> integration",
                                          "plugins/q.py:1: plugins -> integration",
                                          "integration/i.py:2: integration -> cli",
                                          "launch/l.py:2: launch -> tools",
                                          "launch/m.py:2: launch -> cli",
                                          "kit/k.py:1: kit -> cli",
                                          "tools/u.py:2: tools -> kit"]


# ------------------------------------------------------------------------- the real tree
def test_hooks_and_plugins_do_not_import_vllm():
    assert violations(no_vllm_in_hooks_or_plugins) == []


def test_vllm_internals_are_imported_only_by_integration():
    assert violations(vllm_internals_only_in_integration) == []


def test_tools_and_kit_reach_plugins_only_through_the_registry():
    assert violations(plugins_only_through_the_registry) == []


def test_folders_point_one_way():
    assert folder_direction() == []


def test_the_architecture_page_draws_the_ranks_the_check_holds():
    """docs/architecture.md's one-line order is RANK's, and its table has a row per folder."""
    page = (ROOT / "docs" / "architecture.md").read_text()
    order = " <- ".join(sorted(RANK, key=RANK.get))
    assert f"    {order}\n" in page, f"docs/architecture.md should draw the floors as {order!r}"
    rows = re.findall(r"^\| `(\w+)/` \|", page, re.M)
    assert rows == sorted(RANK, key=RANK.get), rows


def test_the_package_imports_itself_relatively():
    """A plain static reader (an editor without the import map) resolves every import: inside the
    package they are relative (``from ..hooks import X``); ``vllm_graft.X`` is named only in strings
    (entry points, ``impl``) and by code outside the package (tests, benchmarks, plugins)."""
    absolute = [
        f"{path.relative_to(ROOT)}:{node.lineno}"
        for path, _ in _modules().values()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "vllm_graft"
        or isinstance(node, ast.Import) and any(a.name.split(".")[0] == "vllm_graft" for a in node.names)
    ]
    assert absolute == [], f"absolute imports of the package inside it: {absolute}"


def test_no_import_cycles():
    assert cycles() == []


def test_importing_hooks_plugins_and_cli_loads_no_vllm():
    code = ("import vllm_graft.hooks, vllm_graft.cli.main as c; "
            "from vllm_graft.hooks import get_registry\n"
            "[e.registration.load() for e in get_registry().entries()]\n"
            "c.build_parser()")
    assert vllm_loaded_by(code) == "[]"
