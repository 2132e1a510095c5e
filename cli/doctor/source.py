"""A vLLM source tree read without importing it: an installed ``site-packages`` folder, an
unpacked one, or a wheel (``pip download vllm==0.33.0 --no-deps``) read as a zip.

:class:`VLLMSource` answers the questions the doctor asks: which version and build, does a
module exist, which names it defines, which methods (with which parameters) a class has,
following its bases within vLLM.
"""

from __future__ import annotations

import ast
import re
import zipfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path


@dataclass(frozen=True)
class Method:
    name: str
    params: tuple[str, ...]  # positional and keyword-only parameter names, in order
    varargs: bool  # *args or **kwargs: accepts what it is not named for


class PackageSource:
    """Files of a Python package read without importing it, from a wheel (a zip) or a folder
    (``root``); subclasses open ``location`` and set ``_zip``/``_names`` or ``root``."""

    location: Path
    root: Path
    _zip: zipfile.ZipFile | None = None
    _names: set[str]

    def _open_wheel(self, location: str | Path) -> bool:
        """Set ``location``; open it as a zip when it is a wheel (True), else leave ``root`` to
        the subclass (False)."""
        self.location = Path(location)
        self._zip = None
        if self.location.is_file() and self.location.suffix == ".whl":
            self._zip = zipfile.ZipFile(self.location)
            self._names = set(self._zip.namelist())
            return True
        return False

    def read(self, path: str) -> str | None:
        if self._zip is not None:
            return self._zip.read(path).decode() if path in self._names else None
        f = self.root / path
        return f.read_text() if f.is_file() else None

    def module_path(self, module: str) -> str | None:
        base = module.replace(".", "/")
        for path in (f"{base}.py", f"{base}/__init__.py"):
            if self.read(path) is not None:
                return path
        return None


class VLLMSource(PackageSource):
    def __init__(self, location: str | Path) -> None:
        if self._open_wheel(location):
            pass
        elif self.location.is_dir():
            if (self.location / "vllm").is_dir():
                self.root = self.location
            elif self.location.name == "vllm" and (self.location / "__init__.py").is_file():
                self.root = self.location.parent
            else:
                raise FileNotFoundError(
                    f"{self.location}: no vllm/ package in this folder; give "
                    "the folder that holds vllm/ (e.g. site-packages) or a wheel"
                )
        else:
            raise FileNotFoundError(f"{self.location}: not a folder or a .whl file")
        self.version = self._version()
        self.distribution = self._distribution()

    # ------------------------------------------------------------------ files
    def _version(self) -> str:
        text = self.read("vllm/_version.py") or ""
        m = re.search(r"""__version__\s*=\s*(?:version\s*=\s*)?['"]([^'"]+)['"]""", text)
        return m.group(1) if m else "unknown"

    def _distribution(self) -> str:
        if self._zip is not None:
            metas = [n for n in self._names if n.endswith(".dist-info/METADATA")]
            text = self._zip.read(metas[0]).decode() if metas else ""
        else:
            files = [
                m
                for m in sorted(self.root.glob("vllm*.dist-info/METADATA"))
                if not m.parent.name.startswith("vllm_graft")
            ]
            text = files[0].read_text() if files else ""
        m = re.search(r"^Name:\s*(\S+)", text, re.M)
        return m.group(1).replace("_", "-").lower() if m else "unknown"

    @lru_cache(maxsize=None)
    def tree(self, module: str) -> ast.Module | None:
        path = self.module_path(module)
        text = self.read(path) if path else None
        return ast.parse(text) if text is not None else None

    # ------------------------------------------------------------------ names
    def top_level(self, module: str) -> dict[str, ast.AST]:
        """Names a module binds at top level (also inside top-level if/try blocks)."""
        tree = self.tree(module)
        out: dict[str, ast.AST] = {}
        if tree is None:
            return out
        for node in _top_statements(tree.body):
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                out.setdefault(node.name, node)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    for n in ast.walk(t):
                        if isinstance(n, ast.Name):
                            out.setdefault(n.id, node)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                for a in node.names:
                    out.setdefault((a.asname or a.name).split(".")[0], node)
        if "__getattr__" in out:  # lazy exports: string keys of module-level dicts
            for node in _top_statements(tree.body):
                if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, ast.Dict):
                    for k in node.value.keys:
                        if isinstance(k, ast.Constant) and isinstance(k.value, str):
                            out.setdefault(k.value, node)
        return out

    def has(self, module: str, name: str) -> bool:
        """``from module import name`` works: a top-level name or a submodule."""
        return name in self.top_level(module) or self.module_path(f"{module}.{name}") is not None

    def imported_from(self, module: str, name: str) -> tuple[str, str] | None:
        """Where ``module`` imports ``name`` from (absolute module, name there)."""
        tree = self.tree(module)
        if tree is None:
            return None
        package = module if (self.module_path(module) or "").endswith("__init__.py") else module.rpartition(".")[0]
        for node in _top_statements(tree.body):
            if isinstance(node, ast.ImportFrom):
                for a in node.names:
                    if (a.asname or a.name) == name:
                        return _absolute(package, node), a.name
        return None

    # ------------------------------------------------------------------ classes
    def find_class(self, module: str, name: str, _depth: int = 0) -> tuple[str, ast.ClassDef] | None:
        node = self.top_level(module).get(name)
        if isinstance(node, ast.ClassDef):
            return module, node
        origin = self.imported_from(module, name)
        if origin and origin[0].startswith("vllm") and _depth < 8:
            return self.find_class(*origin, _depth=_depth + 1)
        return None

    def members(self, module: str, name: str) -> dict[str, Method | None] | None:
        """Attributes of a vLLM class, its vLLM bases' included (a method maps to its
        :class:`Method`, another attribute to None); None if the class is not found."""
        found = self.find_class(module, name)
        if found is None:
            return None
        mod, cls = found
        out: dict[str, Method | None] = {}
        for node in cls.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out.setdefault(node.name, _method(node))
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    if isinstance(t, ast.Name):
                        out.setdefault(t.id, None)
        for base in cls.bases:
            ref = self.resolve_name(mod, base)
            if ref and ref[0].startswith("vllm"):
                for k, v in (self.members(*ref) or {}).items():
                    out.setdefault(k, v)
        return out

    def resolve_name(self, module: str, expr: ast.expr) -> tuple[str, str] | None:
        """A class expression in ``module`` (``Name`` or ``pkg.Name``) -> (module, name)."""
        if isinstance(expr, ast.Subscript):  # Generic[T]
            expr = expr.value
        if isinstance(expr, ast.Name):
            if isinstance(self.top_level(module).get(expr.id), ast.ClassDef):
                return module, expr.id
            return self.imported_from(module, expr.id)
        return None  # pkg.Name bases: none in vLLM's classes that vllm-graft extends


def vllm_imported(tree: ast.Module) -> dict[str, tuple[str, str]]:
    """Names a file of ours binds with ``from vllm.x import y [as z]``: local name -> (module, y)."""
    return {
        (a.asname or a.name): (n.module, a.name)
        for n in ast.walk(tree)
        if isinstance(n, ast.ImportFrom) and not n.level and n.module and n.module.startswith("vllm.")
        for a in n.names
    }


def _top_statements(body):
    for node in body:
        yield node
        if isinstance(node, ast.If):
            yield from _top_statements(node.body)
            yield from _top_statements(node.orelse)
        elif isinstance(node, ast.Try):
            yield from _top_statements(node.body)
            for h in node.handlers:
                yield from _top_statements(h.body)
            yield from _top_statements(node.orelse)


def _absolute(package: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    parts = package.split(".")
    base = parts[: len(parts) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def _method(node: ast.FunctionDef | ast.AsyncFunctionDef) -> Method:
    a = node.args
    names = tuple(x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs))
    return Method(node.name, names, varargs=bool(a.vararg or a.kwarg))
