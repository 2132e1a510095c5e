"""The doctor's ``attribute`` rows: every attribute vllm-graft reads from a vLLM object, collected
from our source with ``ast``, checked against where the vLLM class of each source sets it (a class
attribute, a dataclass field or method, or ``self.<name> = ...`` in one of its methods, its vLLM
bases included). Two kinds of read are collected:

* through ``self`` in a subclass of a vLLM class (its own methods and those of the mixins it lists);
* from a parameter of a method overriding vLLM's (or a plain alias of it), where vLLM's method
  annotates that parameter with a vLLM class (``build(..., common_attn_metadata:
  CommonAttentionMetadata)``); the ``graft_*`` attributes our code sets on vLLM's objects are ours.

* from a parameter of any function of ours that annotates it with a vLLM class (imported at run
  time or under ``TYPE_CHECKING``, e.g. ``cm: "CommonAttentionMetadata"``).

Not collected: reads from parameters typed ``Any`` or not at all, and through ``getattr``. vLLM 0.33's ``FlashInferImpl`` takes ``attn_type`` and never stores it: a mixin that
read ``self.attn_type`` failed at the first graft step, and only this kind of row sees it without
a GPU. Reads through ``getattr(self, name, default)`` tolerate a missing attribute and are not
rows; attributes our classes set themselves are ours, not vLLM's.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from typing import Callable, Iterable

from .behaviour import NotApplicable
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


def _vllm_subclasses(files: list[tuple[str, str]]):
    """Per class of ours with a vLLM base: (file, class, the base, [(file, body)] of the class and
    of our mixins it lists)."""
    classes: dict[str, tuple[str, ast.ClassDef]] = {}
    found = []
    for rel, text in files:
        tree = ast.parse(text)
        imported = vllm_imported(tree)
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            classes.setdefault(cls.name, (rel, cls))
            names = [b.id for b in cls.bases if isinstance(b, ast.Name)]
            for b in names:
                if b in imported:
                    found.append((rel, cls, imported[b], [x for x in names if x not in imported]))
    return [
        (rel, cls, base, [(rel, cls)] + [classes[m] for m in mixins if m in classes])
        for rel, cls, base, mixins in found
    ]


def attribute_reads(files: Iterable[tuple[str, str]]) -> list[AttributeRead]:
    """Every ``self.<name>`` a subclass of a vLLM class of ours (with our mixins among its bases)
    reads and does not define; ``files``: (relative path, text) pairs."""
    out = []
    for rel, cls, base, bodies in _vllm_subclasses(list(files)):
        defined = set().union(*(_defined(c.body) for _, c in bodies))
        seen: set[str] = set()
        for where, c in bodies:
            for name, line in sorted(_self_reads(c.body).items()):
                if name in defined or name in seen or name.startswith("__"):
                    continue
                seen.add(name)
                out.append(AttributeRead(cls.name, base, name, f"{where}:{line} ({c.name})"))
    return out


@dataclass(frozen=True)
class ParameterRead:
    cls: str  # our class
    base: tuple[str, str]  # (vLLM module, class) whose method ours overrides
    method: str
    param: str  # the parameter's name in our method
    position: int  # its position (self excluded)
    name: str  # the attribute read from it
    where: str


def _stored_on_others(files: list[tuple[str, str]]) -> set[str]:
    """The ``graft_*`` attributes our code sets on vLLM's objects (e.g. ``metadata.graft_batch``):
    ours to read back, whatever vLLM's class declares."""
    out: set[str] = set()
    for _, text in files:
        for n in ast.walk(ast.parse(text)):
            if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store) and "graft" in n.attr:
                if not (isinstance(n.value, ast.Name) and n.value.id == "self"):
                    out.add(n.attr)
    return out


def parameter_reads(files: Iterable[tuple[str, str]]) -> list[ParameterRead]:
    """Attributes our overriding methods (in a vLLM subclass of ours or a mixin it lists) read from
    their parameters (or a plain alias ``cm = common_attn_metadata``): vLLM hands those objects in,
    and its method's annotation says of which class they are (checked by :func:`parameter_check`)."""
    files = list(files)
    ours = _stored_on_others(files)
    out = []
    for rel, cls, base, bodies in _vllm_subclasses(files):
        for where, c in bodies:
            for fn in c.body:
                if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) or fn.name.startswith("__"):
                    continue
                params = [a.arg for a in (*fn.args.posonlyargs, *fn.args.args)][1:]
                for param, attr, line in _reads_of(fn, params, ours):
                    out.append(
                        ParameterRead(
                            cls.name, base, fn.name, param, params.index(param), attr, f"{where}:{line} ({c.name})"
                        )
                    )
    return out


@dataclass(frozen=True)
class AnnotatedRead:
    func: str  # our function (or method) whose parameter is annotated with a vLLM class
    typed: tuple[str, str]  # (vLLM module, class) of the annotation
    param: str
    name: str
    where: str


def _annotation_name(ann: ast.expr | None) -> str | None:
    if isinstance(ann, ast.Constant) and isinstance(ann.value, str):
        try:
            ann = ast.parse(ann.value, mode="eval").body
        except SyntaxError:
            return None
    while isinstance(ann, ast.BinOp):  # X | None
        ann = ann.left
    return ann.id if isinstance(ann, ast.Name) else None


def _reads_of(fn: ast.FunctionDef | ast.AsyncFunctionDef, params: list[str], ours: set[str]):
    """``(param, attribute, line)`` per attribute read from ``params`` (or a plain alias) in ``fn``."""
    alias = {p: p for p in params}
    for n in ast.walk(fn):
        if isinstance(n, ast.Assign) and isinstance(n.value, ast.Name) and n.value.id in alias:
            for t in n.targets:
                if isinstance(t, ast.Name):
                    alias[t.id] = alias[n.value.id]
    seen: set[tuple[str, str]] = set()
    for n in ast.walk(fn):
        if (
            isinstance(n, ast.Attribute)
            and isinstance(n.ctx, ast.Load)
            and isinstance(n.value, ast.Name)
            and n.value.id in alias
            and n.attr not in ours
            and not n.attr.startswith("__")
            and (alias[n.value.id], n.attr) not in seen
        ):
            seen.add((alias[n.value.id], n.attr))
            yield alias[n.value.id], n.attr, n.lineno


def annotated_reads(files: Iterable[tuple[str, str]]) -> list[AnnotatedRead]:
    """Attributes our own functions read from a parameter they annotate with a vLLM class
    (imported from vllm, at run time or under ``TYPE_CHECKING``: ``cm: "CommonAttentionMetadata"``)."""
    files = list(files)
    ours = _stored_on_others(files)
    out = []
    for rel, text in files:
        tree = ast.parse(text)
        imported = vllm_imported(tree)
        for fn in (n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
            args = [*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs]
            typed = {a.arg: imported[t] for a in args if (t := _annotation_name(a.annotation)) in imported}
            for param, attr, line in _reads_of(fn, list(typed), ours):
                out.append(AnnotatedRead(fn.name, typed[param], param, attr, f"{rel}:{line} ({fn.name})"))
    return out


def annotated_check(read: AnnotatedRead) -> Callable[[VLLMSource], str | None]:
    return lambda src: _sets(src, read.typed, read.name, f"{read.func} reads from {read.param!r} at {read.where}")


def _method_node(src: VLLMSource, module: str, name: str, method: str, _depth: int = 0):
    found = src.find_class(module, name)
    if found is None:
        return None
    mod, cls = found
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == method:
            return mod, node
    for b in cls.bases:
        ref = src.resolve_name(mod, b)
        if ref and ref[0].startswith("vllm") and _depth < 8:
            got = _method_node(src, *ref, method, _depth=_depth + 1)
            if got is not None:
                return got
    return None


def annotated_class(src: VLLMSource, read: ParameterRead) -> tuple[str, str] | None:
    """The vLLM class vLLM's method annotates the parameter with (by name, else position)."""
    got = _method_node(src, *read.base, read.method)
    if got is None:
        return None
    mod, fn = got
    args = [*fn.args.posonlyargs, *fn.args.args][1:]
    arg = next((a for a in args if a.arg == read.param), args[read.position] if read.position < len(args) else None)
    ann = arg.annotation if arg is not None else None
    if isinstance(ann, ast.Constant) and isinstance(ann.value, str):
        ann = ast.parse(ann.value, mode="eval").body
    while isinstance(ann, ast.BinOp):  # X | None
        ann = ann.left
    if isinstance(ann, ast.Subscript):
        ann = ann.value
    if not isinstance(ann, ast.Name):
        return None
    ref = src.resolve_name(mod, ann)
    return ref if ref and ref[0].startswith("vllm") and src.find_class(*ref) else None


def parameter_check(read: ParameterRead) -> Callable[[VLLMSource], str | None]:
    def check(src: VLLMSource) -> str | None:
        target = annotated_class(src, read)
        if target is None:
            return NotApplicable(f"{read.base[1]}.{read.method} does not annotate {read.param!r} with a vLLM class")
        reader = f"{read.cls} reads at {read.where} from what {read.base[1]}.{read.method} is handed as {read.param!r}"
        return _sets(src, target, read.name, reader)

    return check


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


def _sets(src: VLLMSource, cls: tuple[str, str], name: str, reader: str) -> str | None:
    """None if vLLM's class ``cls`` (with its vLLM bases) sets ``name`` in ``src``, else the problem."""
    attrs = instance_attributes(src, *cls)
    if attrs is None:
        return f"class {cls[0]}.{cls[1]} not found ({reader})"
    if name not in attrs:
        return f"{cls[1]} (with its vLLM bases) never sets {name!r}, which {reader}: take it from what vLLM passes, or keep a copy"
    return None


def attribute_check(read: AttributeRead) -> Callable[[VLLMSource], str | None]:
    return lambda src: _sets(src, read.base, read.name, f"{read.cls} reads at {read.where}")


def attribute_rows(
    files: Iterable[tuple[str, str]], references: Iterable[VLLMSource] = ()
) -> list[tuple[str, str, Callable[[VLLMSource], str | None]]]:
    """``(key, owner, check)`` per attribute read through ``self``, and per attribute read from a
    parameter that vLLM's method annotates with a vLLM class in one of ``references``."""
    files = list(files)
    refs = list(references)
    rows: list[tuple[str, str, Callable[[VLLMSource], str | None]]] = [
        (f"{r.base[1]}.{r.name} <- {r.cls}", r.where.split(" ")[0], attribute_check(r)) for r in attribute_reads(files)
    ]
    for p in parameter_reads(files):
        typed = next((t for src in refs if (t := annotated_class(src, p)) is not None), None)
        if typed is not None:
            key = f"{typed[1]}.{p.name} <- {p.cls}.{p.method}({p.param})"
            rows.append((key, p.where.split(" ")[0], parameter_check(p)))
    for a in annotated_reads(files):
        rows.append((f"{a.typed[1]}.{a.name} <- {a.func}({a.param})", a.where.split(" ")[0], annotated_check(a)))
    return rows


__all__ = [
    "AnnotatedRead",
    "AttributeRead",
    "ParameterRead",
    "annotated_reads",
    "annotated_check",
    "attribute_reads",
    "parameter_reads",
    "attribute_rows",
    "attribute_check",
    "parameter_check",
    "instance_attributes",
]
