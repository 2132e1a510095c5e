"""The doctor's ``attribute`` rows: every attribute vllm-graft reads from a vLLM object through
``self`` in a subclass of a vLLM class (its own methods and those of the mixins it lists first),
collected from our source with ``ast``, checked against where the vLLM class of each source sets
it: a class attribute or method, or ``self.<name> = ...`` in one of its methods (its vLLM bases
included). vLLM 0.33's ``FlashInferImpl`` takes ``attn_type`` and never stores it: a mixin that
read ``self.attn_type`` failed at the first graft step, and only this kind of row sees it without
a GPU. Reads through ``getattr(self, name, default)`` tolerate a missing attribute and are not
rows; attributes our classes set themselves are ours, not vLLM's.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from typing import Callable, Iterable

from .source import VLLMSource, vllm_imported


@dataclass(frozen=True)
class AttributeRead:
    cls: str  # our class
    base: tuple[str, str]  # (vLLM module, class) it subclasses
    name: str  # the attribute read
    where: str  # file:line of the first read


def _self_reads(body: list[ast.stmt]) -> dict[str, int]:
    """``self.<name>`` loads in the functions of a class body (name -> first line)."""
    out: dict[str, int] = {}
    for node in body:
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for n in ast.walk(node):
            if (
                isinstance(n, ast.Attribute)
                and isinstance(n.ctx, ast.Load)
                and isinstance(n.value, ast.Name)
                and n.value.id == "self"
            ):
                out.setdefault(n.attr, n.lineno)
    return out


def _defined(body: list[ast.stmt]) -> set[str]:
    """What a class body defines itself: methods, class attributes, ``self.x =`` assignments."""
    out: set[str] = set()
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, ast.Assign):
            out |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out.add(node.target.id)
        for n in ast.walk(node):
            if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store) and isinstance(n.value, ast.Name):
                if n.value.id == "self":
                    out.add(n.attr)
    return out


def attribute_reads(files: Iterable[tuple[str, str]]) -> list[AttributeRead]:
    """Every ``self.<name>`` a subclass of a vLLM class of ours (with our mixins among its bases)
    reads and does not define; ``files``: (relative path, text) pairs."""
    classes: dict[str, tuple[str, ast.ClassDef]] = {}
    vllm_bases: list[tuple[str, ast.ClassDef, tuple[str, str], list[str]]] = []
    for rel, text in files:
        tree = ast.parse(text)
        imported = vllm_imported(tree)
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            classes.setdefault(cls.name, (rel, cls))
            names = [b.id for b in cls.bases if isinstance(b, ast.Name)]
            for b in names:
                if b in imported:
                    vllm_bases.append((rel, cls, imported[b], [x for x in names if x not in imported]))
    out = []
    for rel, cls, base, mixins in vllm_bases:
        bodies = [(rel, cls)] + [classes[m] for m in mixins if m in classes]
        defined = set().union(*(_defined(c.body) for _, c in bodies))
        seen: set[str] = set()
        for where, c in bodies:
            for name, line in sorted(_self_reads(c.body).items()):
                if name in defined or name in seen or name.startswith("__"):
                    continue
                seen.add(name)
                out.append(AttributeRead(cls.name, base, name, f"{where}:{line} ({c.name})"))
    return out


def instance_attributes(src: VLLMSource, module: str, name: str, _depth: int = 0) -> set[str] | None:
    """What a vLLM class (with its vLLM bases) sets: members and ``self.x =`` in its methods."""
    found = src.find_class(module, name)
    if found is None:
        return None
    mod, cls = found
    out = set(_defined(cls.body))
    for b in cls.bases:
        ref = src.resolve_name(mod, b)
        if ref and ref[0].startswith("vllm") and _depth < 8:
            out |= instance_attributes(src, *ref, _depth=_depth + 1) or set()
    return out


def attribute_check(read: AttributeRead) -> Callable[[VLLMSource], str | None]:
    def check(src: VLLMSource) -> str | None:
        attrs = instance_attributes(src, *read.base)
        if attrs is None:
            return f"base class {read.base[0]}.{read.base[1]} not found"
        if read.name not in attrs:
            return (
                f"{read.base[1]} (with its vLLM bases) never sets {read.name!r}, which "
                f"{read.cls} reads at {read.where}: take it from what vLLM passes, or keep a copy"
            )
        return None

    return check


def attribute_rows(files: Iterable[tuple[str, str]]) -> list[tuple[str, str, Callable[[VLLMSource], str | None]]]:
    """``(key, owner, check)`` per attribute read."""
    return [
        (f"{r.base[1]}.{r.name} <- {r.cls}", r.where.split(" ")[0], attribute_check(r)) for r in attribute_reads(files)
    ]


__all__ = ["AttributeRead", "attribute_reads", "attribute_rows", "attribute_check", "instance_attributes"]
