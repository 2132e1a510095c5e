"""The docs are current: every hook documented with its exact signature, the generated pages
(docs/hooks.md, docs/plugins.md) equal to what docs/generate.py writes, the README short and
pointing to BENCHMARKS.md, every built-in plugin in the README's table and in BENCHMARKS.md,
every command, path and link the docs cite existing, and the supported vLLM range written once."""
import argparse
import importlib.util
import inspect
import re
from pathlib import Path

import pytest

from vllm_graft.hooks import specs

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
BENCHMARKS = ROOT / "BENCHMARKS.md"
KINDS = ("attention", "kvcompress", "speculative", "quant", "moe")


def generator():
    spec = importlib.util.spec_from_file_location("docs_generate", ROOT / "docs" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def hookspecs():
    return [f for name, f in inspect.getmembers(specs, inspect.isfunction)
            if hasattr(f, f"{specs.PROJECT}_spec")]


def doc_files() -> list[Path]:
    """The hand-written and generated project docs (not a plugin package's own README), with the
    pages BENCHMARKS.md and the README moved their detail to (docs/benchmarks/, docs/status.md)."""
    return [README, BENCHMARKS, *sorted((ROOT / "docs").rglob("*.md"))]


def section(text: str, heading: str) -> str:
    """The body of the `## heading` section of a markdown text."""
    match = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert match, f"no '## {heading}' section"
    return match.group(1)


def builtin_plugins() -> list[tuple[str, str]]:
    from vllm_graft.hooks import get_registry
    from vllm_graft.kit.conformance.checks import BUILTIN_PACKAGE
    return [(e.kind.value, e.name) for e in get_registry().entries()
            if e.source.package == BUILTIN_PACKAGE]


# ------------------------------------------------------------------------------ hooks
def test_there_are_five_hookspecs():
    assert len(hookspecs()) == 5


def test_every_hook_documented_with_exact_signature():
    gen = generator()
    docs = "".join(p.read_text() for p in doc_files())
    for func in hookspecs():
        sig = gen.signature(func)
        assert sig.startswith(func.__name__ + "(register: Register)")
        assert sig in docs, f"{sig} is not documented in README.md or docs/"
        assert func.__doc__ and ":param register:" in func.__doc__ and "Example::" in func.__doc__


# ------------------------------------------------------------------------------ generated pages
def test_hook_reference_page_is_current():
    assert (ROOT / "docs" / "hooks.md").read_text() == generator().render(), \
        "docs/hooks.md is stale: run `python docs/generate.py`"


def test_plugin_table_is_current():
    assert (ROOT / "docs" / "plugins.md").read_text() == generator().render_plugins(), \
        "docs/plugins.md is stale: run `python docs/generate.py`"


# ------------------------------------------------------------------------------ README / BENCHMARKS
def test_readme_is_short_and_points_to_the_results():
    text = README.read_text()
    lines = text.count("\n")
    assert lines <= 150, f"README.md has {lines} lines: measurements go to BENCHMARKS.md, detail to docs/"
    long = [n for n, line in enumerate(text.splitlines(), 1) if len(line) > 120]
    assert not long, f"README.md lines {long} run over 120 characters: put long figures behind a link"
    assert "(BENCHMARKS.md)" in text
    for heading in ("Set-up: two commands", "Plugins", "Commands", "Where things live",
                    "Writing a plugin", "Status"):
        section(text, heading)


def test_the_markdown_stays_short():
    """Pages hold the current figures with their commands; what a figure replaced is in git history
    and a page's short changelog, not in a diary (issue 63: under ~200 KB of tracked markdown)."""
    import subprocess

    files = subprocess.run(["git", "ls-files", "*.md"], cwd=ROOT, capture_output=True, text=True, check=True)
    sizes = {f: (ROOT / f).stat().st_size for f in files.stdout.split() if (ROOT / f).is_file()}
    total = sum(sizes.values())
    biggest = sorted(sizes, key=sizes.get, reverse=True)[:3]
    assert total <= 200_000, f"{total} bytes of markdown (largest: {biggest}): cut the diary, keep the figures"


def test_readme_keeps_the_test_command():
    """.ci/run calls `make test`, the README's test command; both set-up commands are in the README."""
    setup = section(README.read_text(), "Set-up: two commands")
    assert "make demo" in setup and "make test" in setup
    assert "make test" in (ROOT / ".ci" / "run").read_text()


def test_every_builtin_plugin_in_the_readme_table_and_in_benchmarks():
    table = section(README.read_text(), "Plugins")
    rows = {tuple(c.strip().strip("`") for c in line.split("|")[1:3])
            for line in table.splitlines() if line.startswith("| ")}
    bench = BENCHMARKS.read_text()
    for kind, name in builtin_plugins():
        if name == "noop":
            assert ("every kind", "noop") in rows
            continue
        assert (kind, name) in rows, f"{kind}:{name} is missing from the README's plugin table"
        assert f"`{name}`" in bench or f"**{name}**" in bench or f"### {name}" in bench, \
            f"{kind}:{name} is not in BENCHMARKS.md"


def test_benchmarks_has_a_section_per_kind_and_says_what_ran_on_a_gpu():
    text = BENCHMARKS.read_text()
    head = text[:text.index("\n## ", text.index("\n## ") + 1)]  # title + the first section
    assert "GPU figures: kernels only" in head and "No engine has run on a GPU" in head and "CPU" in head
    for title in ("Attention plugins", "KV-compression plugins", "Speculative plugins",
                  "Quant plugins", "MoE plugins"):
        assert "](docs/benchmarks/" in section(text, title), f"BENCHMARKS.md, {title}: no link to its page"


def test_benchmarks_is_led_by_the_suite_table():
    """How to read, then the table `vllm-graft bench --suite` writes; the history lives below docs/."""
    from vllm_graft.tools.bench import suite
    headings = re.findall(r"^## (.+)$", BENCHMARKS.read_text(), re.M)
    assert headings[:2] == ["How to read", "The suite: every plugin against plain vLLM, one command"]
    assert suite.MARK_START in section(BENCHMARKS.read_text(), headings[1])


def test_supported_vllm_range_written_once():
    """hooks/versions.py derives it; the README states it (once), other docs point there."""
    from vllm_graft.hooks.registry import SUPPORTED_VLLM
    readme = README.read_text()
    assert readme.count(f"`{SUPPORTED_VLLM}`") == 1, f"README.md should state {SUPPORTED_VLLM} once"
    written = re.compile(r">=\d+\.\d+,<\d+\.\d+")  # as versions are written (bounds have spaces)
    for path in doc_files():
        found = written.findall(path.read_text())
        allowed = 1 if path == README else 0
        assert len(found) <= allowed, f"{path.name} writes a vLLM range; refer to SUPPORTED_VLLM"


# ------------------------------------------------------------------------------ stale references
DEAD_NAMES = ("ready_kinds", "AdapterMissing", "ADAPTERS_READY", "hooks/contracts.py",
              "integration/bench.py", "integration/conformance", "integration/scaffold",
              "integration/kvbench", "integration/specbench", "integration/workloads",
              "integration/calibrate", "DESIGN.md", "adapters/kvcompress.py", "adapters/quant.py",
              "tools/bench.py", "tools/workloads.py")


def source_files() -> list[Path]:
    """The package's and the tests' Python files (their docstrings cite paths too), but this one."""
    files = [p for folder in ("hooks", "plugins", "integration", "launch", "cli", "kit", "tools", "tests")
             for p in sorted((ROOT / folder).rglob("*.py"))]
    return [p for p in files if p != Path(__file__).resolve()]


@pytest.mark.parametrize("path", doc_files() + source_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_dead_names(path):
    text = path.read_text()
    for name in DEAD_NAMES:
        assert name not in text, f"{path.relative_to(ROOT)} cites {name!r}, which no longer exists"


def subcommands() -> set[str]:
    from vllm_graft.cli.main import build_parser
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return set(action.choices)


def test_every_cited_command_exists_and_the_readme_lists_them_all():
    commands = subcommands()
    cited = re.compile(r"(?:^|`|\$ )vllm-graft ([a-z][a-z-]*)", re.M)
    for path in doc_files():
        for name in cited.findall(path.read_text()):
            assert name in commands, f"{path.name} cites `vllm-graft {name}`, which does not exist"
    listed = section(README.read_text(), "Commands")
    for name in commands:
        assert re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", listed), \
            f"`vllm-graft {name}` is missing from the README's Commands list"


REPO_PATH = re.compile(r"`((?:hooks|plugins|integration|cli|kit|tools|tests|deployments|models|"
                       r"benchmarks|examples|docs)/[^`\s:]*)")
#: The tutorial cites files of the plugin package it builds, examples/graft-flexq.
EXTRA_ROOTS = {"tutorial.md": [ROOT / "examples" / "graft-flexq"]}


@pytest.mark.parametrize("path", doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_cited_repo_paths_exist(path):
    roots = [ROOT, *EXTRA_ROOTS.get(path.name, [])]
    for cited in REPO_PATH.findall(path.read_text()):
        if any(c in cited for c in "<>*{}"):
            continue  # a pattern such as plugins/<kind>/<name>/
        assert any((r / cited).exists() for r in roots), f"{path.name} cites {cited}, which does not exist"


def slug(heading: str) -> str:
    """GitHub's anchor for a markdown heading."""
    text = heading.strip().lower().replace("`", "")
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.M | re.S)
    return {slug(h) for h in re.findall(r"^#{1,6} (.+)$", text, re.M)}


@pytest.mark.parametrize("path", doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path):
    for target in re.findall(r"\]\(([^)\s]+)\)", path.read_text()):
        if re.match(r"[a-z]+:", target):
            continue  # https:, mailto:
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        assert dest.exists(), f"{path.name} links to {target}, which does not exist"
        if anchor and dest.suffix == ".md":
            assert anchor in anchors(dest), f"{path.name} links to {target}: no such heading"


# ------------------------------------------------------------------------------ the tutorial's plugins
TUTORIAL = ROOT / "docs" / "tutorial.md"
#: ``<!-- docs-test: KIND NAME params|reference.py -->`` right before a python code block
TUTORIAL_BLOCK = re.compile(r"^<!-- docs-test: (\w+) ([\w-]+) (params|reference\.py) -->\n```python\n(.*?)^```",
                            re.M | re.S)


def tutorial_plugins() -> dict[str, tuple[str, dict[str, str]]]:
    """Per kind, the tutorial's minimal plugin: (name, {"params": ..., "reference.py": ...})."""
    out: dict[str, tuple[str, dict[str, str]]] = {}
    for kind, name, part, code in TUTORIAL_BLOCK.findall(TUTORIAL.read_text()):
        got = out.setdefault(kind, (name, {}))
        assert got[0] == name, f"tutorial: two {kind} plugins ({got[0]}, {name})"
        got[1][part] = code
    return out


def test_the_tutorial_has_a_minimal_plugin_of_each_kind():
    plugins = tutorial_plugins()
    assert sorted(plugins) == sorted(KINDS)
    for kind, (name, parts) in plugins.items():
        assert set(parts) == {"params", "reference.py"}, f"tutorial's {kind} plugin {name}: {sorted(parts)}"


def _with_tutorial_params(init: str, name: str, params: str) -> str:
    """The scaffold's ``__init__.py`` with the tutorial's parameter class in place of the generated one."""
    from vllm_graft.kit.scaffold import camel

    generated = re.compile(rf"^class {camel(name)}Params\(Params\):\n.*?(?=\n\n\n@hookimpl)", re.M | re.S)
    init, n = generated.subn(lambda _: params.rstrip("\n"), init)
    assert n == 1, "the scaffold's parameter class is not where the tutorial says"
    return init


def _tutorial_files(kind: str, name: str, parts: dict[str, str]) -> dict[str, str]:
    """The tutorial's plugin of ``kind`` as its two files: ``__init__.py`` and ``reference.py``."""
    from vllm_graft.hooks import Kind
    from vllm_graft.kit.scaffold import render

    init = render(Kind(kind), name, "pkg")["pkg/__init__.py"]
    return {"__init__.py": _with_tutorial_params(init, name, parts["params"]), "reference.py": parts["reference.py"]}


def test_the_tutorial_counts_what_each_minimal_plugin_imports():
    """Its table lists, per kind, the names of ``vllm_graft.hooks`` the two files use (an import
    the file never uses does not count): the surface a plugin author of that kind needs."""
    import ast

    rows = re.search(r"<!-- docs-test: imports -->\n(.*?)\n\n", TUTORIAL.read_text(), re.S)
    assert rows, "docs/tutorial.md lost its table of imports"
    table = {}
    for line in rows.group(1).splitlines()[2:]:
        kind, count, names = (c.strip() for c in line.strip("|").split("|"))
        table[kind] = (int(count), sorted(n.strip(" `") for n in names.split(",")))
    for kind, (name, parts) in tutorial_plugins().items():
        used = set()
        for text in _tutorial_files(kind, name, parts).values():
            tree = ast.parse(text)
            loaded = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | {
                n.value.id for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)}
            used |= {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
                     and (n.module or "").startswith("vllm_graft.hooks") for a in n.names} & loaded
        assert table[kind] == (len(used), sorted(used)), f"tutorial's {kind} row: {table[kind]}, the files use {sorted(used)}"


@pytest.mark.parametrize("kind", KINDS)
def test_the_tutorials_plugin_builds_from_the_scaffold_and_passes_the_kit(kind, tmp_path, monkeypatch, capsys):
    """`vllm-graft new-plugin KIND NAME`, the tutorial's parameter class put in the generated
    ``__init__.py`` and its ``reference.py`` written, registered with a plugin manager (nothing
    installed): every check of the kit but the engine's passes (or does not apply)."""
    import sys

    from vllm_graft.hooks import make_plugin_manager
    from vllm_graft.cli.main import main
    from vllm_graft.kit.conformance import checks as c

    name, parts = tutorial_plugins()[kind]
    out = tmp_path / name
    assert main(["new-plugin", kind, name, "--dir", str(out)]) == 0
    package = "graft_" + name.replace("-", "_")
    init = out / package / "__init__.py"
    init.write_text(_with_tutorial_params(init.read_text(), name, parts["params"]))
    (out / package / "reference.py").write_text(parts["reference.py"])

    monkeypatch.syspath_prepend(str(out))
    for mod in [m for m in sys.modules if m == package or m.startswith(package + ".")]:
        monkeypatch.delitem(sys.modules, mod)
    module = __import__(package)
    pm = make_plugin_manager(entry_points=False)
    pm.register(module, name=name)
    entry = pm.build_registry().get(kind, name)
    target = c.Target(entry, c.example_params(entry))
    ran = []
    for check in c.CHECKS:
        if check.engine or (check.kinds is not None and entry.kind not in check.kinds):
            continue
        try:
            print(f"{kind}:{name}/{check.name}: {check.func(target)}")
        except c.Skipped:
            assert check.name == "parity", f"{kind}:{name}: {check.name} skipped"  # no kernel: no parity
            continue
        ran.append(check.name)
    assert {"registration", "params-roundtrip", "params-reject", "contract", "device"} <= set(ran)
