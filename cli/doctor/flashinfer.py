"""The doctor's FlashInfer rows: every FlashInfer name vllm-graft uses, checked against the
FlashInfer release the vLLM source pins, read statically (``ast``; FlashInfer is never imported).

* Our side: :func:`flashinfer_uses` reads vllm-graft's own files and lists each
  ``import flashinfer...``, ``from flashinfer... import name`` and each call or attribute reached
  through those names (``flashinfer.cascade.merge_state(...)``, ``top_k(x, k, sorted=True)``).
  Aliases are per file (an imported name is taken to mean the FlashInfer object throughout it);
  calls through instances (``wrapper.plan(...)``) are not followed.
* Their side: :class:`FlashInferSource` reads a ``flashinfer_python`` wheel (``make wheels``
  fetches the pinned one into ``~/.cache/vllm-graft/wheels``) or an installed ``flashinfer/``
  folder; a name resolves through top-level definitions, ``from .x import y`` re-exports and
  submodules; a call must fit the definition's signature (positional count, keyword names,
  required parameters).
* Which release: the one the vLLM source pins (``Requires-Dist: flashinfer-python==X`` in its
  METADATA; vLLM 0.33.0: METADATA:90), which must equal
  :data:`~vllm_graft.hooks.versions.FLASHINFER`. A source pinning none (the CPU build) shows the
  rows as ``n/a``; a pinned wheel that is not here shows them as ``n/a`` naming the command that
  fetches it.
"""

from __future__ import annotations

import ast
import os
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Iterable

from ...hooks.versions import FLASHINFER

from .behaviour import NotApplicable
from .source import PackageSource, VLLMSource, _absolute, _top_statements

WHEELS_ENV = "VLLM_GRAFT_WHEELS"


def wheels_dir() -> Path:
    return Path(os.environ.get(WHEELS_ENV) or Path.home() / ".cache" / "vllm-graft" / "wheels")


# ------------------------------------------------------------------------ our side
@dataclass(frozen=True)
class FlashInferUse:
    name: str  # dotted, e.g. "flashinfer.cascade.merge_state"
    where: str  # file:line of ours
    call: tuple[int, tuple[str, ...], bool] | None = None  # (positional count, keywords, *args/**kw used)


def flashinfer_uses(files: Iterable[tuple[str, str]]) -> list[FlashInferUse]:
    """Every FlashInfer name used in ``files`` ((relative path, text) pairs)."""
    out: list[FlashInferUse] = []
    for rel, text in files:
        if "flashinfer" not in text:
            continue
        tree = ast.parse(text)
        alias: dict[str, str] = {}  # local name -> dotted FlashInfer name
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.split(".")[0] == "flashinfer":
                        out.append(FlashInferUse(a.name, f"{rel}:{node.lineno}"))
                        # ``import flashinfer.x`` binds "flashinfer"; ``... as y`` binds y to x
                        if a.asname:
                            alias[a.asname] = a.name
                        else:
                            alias["flashinfer"] = "flashinfer"
            elif (
                isinstance(node, ast.ImportFrom)
                and not node.level
                and node.module
                and node.module.split(".")[0] == "flashinfer"
            ):
                for a in node.names:
                    full = f"{node.module}.{a.name}"
                    out.append(FlashInferUse(full, f"{rel}:{node.lineno}"))
                    alias[a.asname or a.name] = full
        if not alias:
            continue
        called: set[int] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                name = _dotted(node.func, alias)
                if name:
                    called.add(id(node.func))
                    star = any(isinstance(a, ast.Starred) for a in node.args) or any(
                        k.arg is None for k in node.keywords
                    )
                    pos = sum(1 for a in node.args if not isinstance(a, ast.Starred))
                    kws = tuple(k.arg for k in node.keywords if k.arg is not None)
                    out.append(FlashInferUse(name, f"{rel}:{node.lineno}", (pos, kws, star)))
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and id(node) not in called
                and not isinstance(getattr(node, "ctx", None), ast.Store)
            ):
                name = _dotted(node, alias)
                if name and name not in alias.values():
                    out.append(FlashInferUse(name, f"{rel}:{node.lineno}"))
    # an attribute chain a.b.c also yields a.b: keep only the longest chain per line
    longest = {(u.where, u.name) for u in out}
    return [
        u
        for u in out
        if u.call is not None
        or not any(w == u.where and n != u.name and n.startswith(u.name + ".") for w, n in longest)
    ]


def _dotted(expr: ast.expr, alias: dict[str, str]) -> str | None:
    parts = []
    while isinstance(expr, ast.Attribute):
        parts.append(expr.attr)
        expr = expr.value
    if isinstance(expr, ast.Name) and expr.id in alias:
        return ".".join([alias[expr.id], *reversed(parts)])
    return None


# ------------------------------------------------------------------------ their side
@dataclass(frozen=True)
class Signature:
    positional: tuple[str, ...]  # positional-or-keyword parameters, in order (self dropped)
    keyword_only: tuple[str, ...]
    required: tuple[str, ...]  # parameters without a default
    varargs: bool
    varkw: bool


class FlashInferSource(PackageSource):
    """A FlashInfer release read without importing it: a wheel or a folder holding flashinfer/."""

    def __init__(self, location: str | Path) -> None:
        if self._open_wheel(location):
            pass
        elif (self.location / "flashinfer" / "__init__.py").is_file():
            self.root = self.location
        else:
            raise FileNotFoundError(f"{self.location}: not a flashinfer wheel or a folder holding flashinfer/")
        self.version = self._version()

    def _version(self) -> str:
        text = self.read("flashinfer/_build_meta.py") or ""
        m = re.search(r"""__version__\s*=\s*['"]([^'"]+)['"]""", text)
        return m.group(1) if m else "unknown"

    @lru_cache(maxsize=None)
    def _top(self, module: str) -> dict[str, Any]:
        """Top-level name -> its node, or ``("from", module, name)`` / ``("import", module)``."""
        path = self.module_path(module)
        out: dict[str, Any] = {}
        text = self.read(path) if path is not None else None
        if path is None or text is None:
            return out
        for node in _top_statements(ast.parse(text).body):
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                out[node.name] = node  # a later definition (e.g. after a try/except) wins
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    for n in ast.walk(t):
                        if isinstance(n, ast.Name):
                            out.setdefault(n.id, node)
            elif isinstance(node, ast.ImportFrom):
                package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
                origin = _absolute(package, node)
                for a in node.names:
                    out.setdefault(a.asname or a.name, ("from", origin, a.name))
            elif isinstance(node, ast.Import):
                for a in node.names:
                    out.setdefault(a.asname or a.name.split(".")[0], ("import", a.name))
        return out

    def resolve(self, dotted: str, _depth: int = 0) -> tuple[str, ast.AST | None, str] | None:
        """``flashinfer.a.b`` -> (module where found, its node, kind: module | def | class |
        method | other), or None if the release has no such name."""
        parts = dotted.split(".")
        module = parts[0]
        if self.module_path(module) is None:
            return None
        i = 1
        while (
            i < len(parts)
            and self.module_path(f"{module}.{parts[i]}") is not None
            and not isinstance(self._top(module).get(parts[i]), (ast.FunctionDef, ast.ClassDef))
        ):
            module = f"{module}.{parts[i]}"
            i += 1
        if i == len(parts):
            return module, None, "module"
        node = self._top(module).get(parts[i])
        rest = parts[i + 1 :]
        if isinstance(node, tuple) and _depth < 10:  # re-exported: follow it
            target = f"{node[1]}.{node[2]}" if node[0] == "from" else node[1]
            if not target.startswith("flashinfer"):
                return None
            return self.resolve(".".join([target, *rest]), _depth + 1)
        if node is None:
            return None
        if rest:  # a method of a class
            if isinstance(node, ast.ClassDef) and len(rest) == 1:
                for b in node.body:
                    if isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef)) and b.name == rest[0]:
                        return module, b, "method"
            return None
        kind = (
            "def"
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            else "class"
            if isinstance(node, ast.ClassDef)
            else "other"
        )
        return module, node, kind

    def signature(self, dotted: str) -> Signature | None:
        """The call signature of a FlashInfer function, method or class (its ``__init__``);
        None where it is not a ``def`` (e.g. an assigned wrapper: only the name is checked)."""
        found = self.resolve(dotted)
        if found is None:
            return None
        node: Any = found[1]  # a def or class here (kind says which)
        kind = found[2]
        if kind == "class":
            node = next((b for b in node.body if isinstance(b, ast.FunctionDef) and b.name == "__init__"), None)
            if node is None:
                return None
        elif kind not in ("def", "method"):
            return None
        a = node.args
        pos = [x.arg for x in (*a.posonlyargs, *a.args)]
        required = pos[: len(pos) - len(a.defaults)]
        required += [k.arg for k, d in zip(a.kwonlyargs, a.kw_defaults) if d is None]
        if kind == "class" and pos:  # a method reached by a dotted name is called unbound: self stays
            required = [r for r in required if r != pos[0]]
            pos = pos[1:]
        return Signature(tuple(pos), tuple(k.arg for k in a.kwonlyargs), tuple(required), bool(a.vararg), bool(a.kwarg))


def call_problem(sig: Signature, call: tuple[int, tuple[str, ...], bool]) -> str | None:
    """What is wrong with a call ``(positional count, keyword names, star)`` against ``sig``."""
    npos, kws, star = call
    if npos > len(sig.positional) and not sig.varargs:
        return f"{npos} positional arguments given, it takes at most {len(sig.positional)} ({list(sig.positional)})"
    names = set(sig.positional) | set(sig.keyword_only)
    unknown = [k for k in kws if k not in names]
    if unknown and not sig.varkw:
        return f"no parameter(s) {unknown} (it takes {list(sig.positional) + list(sig.keyword_only)})"
    given = set(sig.positional[:npos])
    twice = [k for k in kws if k in given]
    if twice:
        return f"{twice} given both by position and by keyword"
    missing = [r for r in sig.required if r not in given and r not in kws]
    if missing and not star:
        return f"required parameter(s) {missing} not given"
    return None


# ------------------------------------------------------------------------ which release
def pinned_version(src: VLLMSource) -> str | None:
    """The flashinfer-python release a vLLM source requires (unconditionally), or None."""
    if src._zip is not None:
        metas = [n for n in src._names if n.endswith(".dist-info/METADATA") and n.startswith("vllm")]
        text = src._zip.read(metas[0]).decode() if metas else ""
    else:
        files = [
            m for m in sorted(src.root.glob("vllm*.dist-info/METADATA")) if not m.parent.name.startswith("vllm_graft")
        ]
        text = files[0].read_text() if files else ""
    for line in text.splitlines():
        m = re.match(r"Requires-Dist:\s*flashinfer[-_]python\s*==\s*([^\s;]+)\s*(;.*)?$", line)
        if m and not (m.group(2) and "extra" in m.group(2)):
            return m.group(1)
    return None


def fetch_hint(version: str) -> str:
    return f"pip download flashinfer-python=={version} --no-deps -d {wheels_dir()} (`make wheels` does it)"


@lru_cache(maxsize=None)
def find_flashinfer(version: str) -> FlashInferSource | None:
    """The FlashInfer ``version``: its wheel in :func:`wheels_dir`, else an installed copy."""
    for whl in sorted(wheels_dir().glob(f"flashinfer_python-{version}-*.whl")):
        return FlashInferSource(whl)
    import importlib.util

    spec = importlib.util.find_spec("flashinfer")  # finds, does not import
    if spec is not None and spec.origin:
        src = FlashInferSource(Path(spec.origin).parent.parent)
        if src.version == version:
            return src
    return None


def _with_flashinfer(check: Callable[[FlashInferSource], str | None]) -> Callable[[VLLMSource], str | None]:
    def run(src: VLLMSource) -> str | None:
        version = pinned_version(src)
        if version is None:
            return NotApplicable(f"{src.distribution} {src.version} requires no flashinfer-python")
        fi = find_flashinfer(version)
        if fi is None:
            return NotApplicable(
                f"flashinfer-python=={version} (pinned by vLLM {src.version}) is not "
                f"here to read; skipped: {fetch_hint(version)}"
            )
        return check(fi)

    return run


def _pin_check(src: VLLMSource) -> str | None:
    version = pinned_version(src)
    if version is None:
        return NotApplicable(f"{src.distribution} {src.version} requires no flashinfer-python")
    if FLASHINFER is None or FLASHINFER.version != version:
        ours = FLASHINFER.requirement if FLASHINFER else "nothing"
        return (
            f"vLLM {src.version} requires flashinfer-python=={version}; hooks/versions.py pins "
            f"{ours}: set the build's Pin to {version} and check the rows below"
        )
    return None


def _use_check(use: FlashInferUse) -> Callable[[FlashInferSource], str | None]:
    def check(fi: FlashInferSource) -> str | None:
        found = fi.resolve(use.name)
        if found is None:
            return f"flashinfer {fi.version} has no {use.name} (used at {use.where})"
        if use.call is None:
            return None
        sig = fi.signature(use.name)
        if sig is None:
            return None  # a callable object that is not a def (an assigned wrapper): name checked only
        problem = call_problem(sig, use.call)
        where = fi.module_path(found[0])
        return f"{where}: {use.name}: {problem} (called at {use.where})" if problem else None

    return check


@dataclass(frozen=True)
class FlashInferNeed:
    key: str
    owner: str
    check: Callable[[VLLMSource], str | None]


def flashinfer_needs(files: Iterable[tuple[str, str]]) -> list[FlashInferNeed]:
    """The pin row, then one row per FlashInfer name (and per distinct call) of ours."""
    out = [
        FlashInferNeed(
            f"flashinfer-python pin ({FLASHINFER.requirement if FLASHINFER else 'none'})",
            "hooks/versions.py",
            _pin_check,
        )
    ]
    seen = set()
    for u in flashinfer_uses(files):
        key = u.name if u.call is None else f"{u.name}({', '.join(['_'] * u.call[0] + [f'{k}=' for k in u.call[1]])})"
        if (key, u.where) in seen:
            continue
        seen.add((key, u.where))
        out.append(FlashInferNeed(key, u.where, _with_flashinfer(_use_check(u))))
    return out
