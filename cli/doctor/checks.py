"""The doctor's checks: what vllm-graft needs from vLLM, and whether a source tree has it.

:func:`needs` lists the requirements, each a :class:`Need` with a key (the same in every
source, so one table can show several), who needs it and a ``check(source) -> problem | None``:

* ``version``: the source's release is in :data:`~vllm_graft.hooks.versions.SUPPORTED_VLLM`;
* ``import``: every ``from vllm... import name`` (and ``import vllm...``) in vllm-graft's own
  files resolves (found by reading them with ``ast``: nothing to keep in sync);
* ``patch`` / ``use``: every entry of the patch register (:mod:`..targets`) exists, with the
  parameters its replacement relies on;
* ``override``: every method a vLLM subclass of ours overrides still exists in the vLLM base and
  every parameter vLLM passes it is accepted by ours (an override is a method the base defines
  in any of the sources given, or in the installed vLLM);
* ``runner``: the facts about model-runner selection that :mod:`..runner` rests on;
* ``behaviour``: what vLLM does that the adapters rest on (async scheduling's default and the
  output it wraps, splitting ops vs our custom ops, MoE kernel selection), read statically
  (:mod:`.behaviour`); a row may be ``n/a`` on a build without that behaviour;
* ``attribute``: every attribute our subclasses of vLLM classes (and their mixins) read through
  ``self`` from vLLM's object is set by that class (:mod:`.attributes`);
* ``flashinfer``: the FlashInfer release the source pins equals ours, and every FlashInfer name
  and call of ours exists in it with a fitting signature (:mod:`.flashinfer`; ``n/a`` where the
  build pins none or the pinned wheel is not here, naming how to fetch it).
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from ...hooks.versions import SUPPORTED_VLLM
from ...integration.targets import RUNNER_FACTS, TARGETS, Target

from .attributes import attribute_rows
from .behaviour import NotApplicable, facts as behaviour_facts, our_custom_ops
from .flashinfer import flashinfer_needs
from .source import Method, VLLMSource, _method, vllm_imported

PACKAGE = Path(__file__).resolve().parents[2]  # the folder holding hooks/, integration/, ...
SCANNED = ("integration", "launch", "kit", "tools", "hooks", "plugins")


@dataclass(frozen=True)
class Need:
    what: str  # version | import | patch | use | override | runner
    key: str  # what is needed, e.g. "vllm.v1.request.Request.__init__(cache_salt)"
    owner: str  # who needs it (a file of ours, or a register owner)
    runner: str  # "v1", "any" or "-"
    check: Callable[[VLLMSource], str | None]  # None: present; NotApplicable: n/a; else what is wrong
    reads: tuple[str, ...] = ()  # the vLLM files a behaviour row reads


# ------------------------------------------------------------------------ our own sources
def our_files() -> list[Path]:
    return sorted(p for root in SCANNED for p in (PACKAGE / root).rglob("*.py"))


def _rel(path: Path) -> str:
    return str(path.relative_to(PACKAGE))


@dataclass(frozen=True)
class VLLMImport:
    module: str
    name: str | None  # None: ``import vllm.x``
    where: str  # file:line of ours


def vllm_imports(files: Iterable[Path] | None = None) -> list[VLLMImport]:
    out = []
    for f in files if files is not None else our_files():
        for node in ast.walk(ast.parse(f.read_text())):
            if (
                isinstance(node, ast.ImportFrom)
                and not node.level
                and node.module
                and (node.module == "vllm" or node.module.startswith("vllm."))
            ):
                out += [VLLMImport(node.module, a.name, f"{_rel(f)}:{node.lineno}") for a in node.names]
            elif isinstance(node, ast.Import):
                out += [
                    VLLMImport(a.name, None, f"{_rel(f)}:{node.lineno}")
                    for a in node.names
                    if a.name == "vllm" or a.name.startswith("vllm.")
                ]
    return out


@dataclass(frozen=True)
class Subclass:
    name: str  # our class
    base: tuple[str, str]  # (vLLM module, class)
    methods: dict[str, Method]
    where: str


def vllm_subclasses(files: Iterable[Path] | None = None) -> list[Subclass]:
    """Our classes with a base imported from vLLM (found anywhere in the same file)."""
    out = []
    for f in files if files is not None else our_files():
        tree = ast.parse(f.read_text())
        imported = vllm_imported(tree)
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            methods = {m.name: _method(m) for m in cls.body if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef))}
            for b in cls.bases:
                b = b.value if isinstance(b, ast.Subscript) else b
                if isinstance(b, ast.Name) and b.id in imported:
                    out.append(Subclass(cls.name, imported[b.id], methods, f"{_rel(f)}:{cls.lineno}"))
    return out


# ------------------------------------------------------------------------ the requirements
def _version_check(src: VLLMSource) -> str | None:
    try:
        v = Version(src.version)
    except InvalidVersion:
        return f"no release number in vllm/_version.py ({src.version!r})"
    if not SpecifierSet(SUPPORTED_VLLM).contains(v.base_version, prereleases=True):
        return f"vLLM {src.version} is outside the supported range {SUPPORTED_VLLM} (hooks/versions.py)"
    return None


def _import_check(imp: VLLMImport) -> Callable[[VLLMSource], str | None]:
    def check(src: VLLMSource) -> str | None:
        path = src.module_path(imp.module)
        if path is None:
            return f"module {imp.module} not found (imported at {imp.where})"
        if imp.name is not None and not src.has(imp.module, imp.name):
            return f"{path} defines no {imp.name!r} (imported at {imp.where})"
        return None

    return check


def _target_check(t: Target) -> Callable[[VLLMSource], str | None]:
    def check(src: VLLMSource) -> str | None:
        path = src.module_path(t.module)
        if path is None:
            return f"module {t.module} not found"
        if not t.qualname:
            return None if src.has(t.module, t.attribute) else f"{path} defines no {t.attribute!r}"
        members = src.members(t.module, t.qualname)
        if members is None:
            return f"{path} defines no class {t.qualname!r}"
        if t.attribute not in members:
            return f"{path}: {t.qualname} (with its vLLM bases) has no {t.attribute!r}"
        m = members[t.attribute]
        missing = [p for p in t.params if m is None or p not in m.params]
        if missing:
            return (
                f"{path}: {t.qualname}.{t.attribute} has no parameter(s) {missing}"
                f"{f' (it takes {list(m.params)})' if m else ''}"
            )
        return None

    return check


def _override_check(sub: Subclass, name: str) -> Callable[[VLLMSource], str | None]:
    ours = sub.methods[name]

    def check(src: VLLMSource) -> str | None:
        members = src.members(*sub.base)
        if members is None:
            return f"base class {sub.base[0]}.{sub.base[1]} not found"
        theirs = members.get(name)
        if theirs is None:
            return f"{sub.base[1]} no longer has {name!r}: {sub.name}.{name} ({sub.where}) overrides nothing"
        if ours.varargs:
            return None
        extra = [p for p in theirs.params if p not in ours.params]
        if extra:
            return (
                f"{sub.base[1]}.{name} takes {list(theirs.params)}; {sub.name}.{name} "
                f"({sub.where}) does not accept {extra}"
            )
        return None

    return check


def _fact_check(pattern: str, file: str) -> Callable[[VLLMSource], str | None]:
    def check(src: VLLMSource) -> str | None:
        body = src.read(file)
        if body is None:
            return f"{file} not found"
        return None if re.search(pattern, body) else f"{file} has nothing matching {pattern!r}"

    return check


def needs(sources: Iterable[VLLMSource] = ()) -> list[Need]:
    """Every requirement; ``sources`` (and the installed vLLM, if any) decide which of our
    methods are overrides."""
    out = [Need("version", f"vLLM {SUPPORTED_VLLM}", "hooks/versions.py", "-", _version_check)]
    seen = set()
    for imp in vllm_imports():
        key = f"{imp.module}.{imp.name}" if imp.name else imp.module
        if key not in seen:
            seen.add(key)
            out.append(Need("import", key, imp.where, "-", _import_check(imp)))
    for t in TARGETS:
        params = f"({', '.join(t.params)})" if t.params else ""
        out.append(Need(t.action, t.where + params, t.owner, t.runner, _target_check(t)))
    references = [*sources, *([installed] if (installed := installed_source()) else [])]
    for sub in vllm_subclasses():
        for name in sorted(sub.methods):
            # a constructor's parameters are its caller's business (vLLM builds some of these
            # classes, we build others); everything else vLLM calls with its own arguments
            if name != "__init__" and any(name in (r.members(*sub.base) or {}) for r in references):
                out.append(
                    Need(
                        "override", f"{sub.base[1]}.{name} <- {sub.name}", sub.where, "any", _override_check(sub, name)
                    )
                )
    for fact in RUNNER_FACTS:
        out.append(Need("runner", fact.claim, fact.file, "v1", _fact_check(fact.pattern, fact.file)))
    texts = [(_rel(f), f.read_text()) for f in our_files()]
    ops = our_custom_ops(texts)
    for b in behaviour_facts(ops):
        out.append(Need("behaviour", b.claim, b.owner, b.runner, b.check, b.reads))
    for fi in flashinfer_needs(texts):
        out.append(Need("flashinfer", fi.key, fi.owner, "any", fi.check))
    for key, owner, check in attribute_rows(texts, references):
        out.append(Need("attribute", key, owner, "any", check))
    return out


def is_problem(result: str | None) -> bool:
    """A check's result is a failure: a problem, not ``None`` (ok) or :class:`NotApplicable`."""
    return bool(result) and not isinstance(result, NotApplicable)


def status(result: str | None) -> str:
    return "ok" if result is None else "n/a" if isinstance(result, NotApplicable) else "problem"


def installed_source() -> VLLMSource | None:
    """The installed vLLM's source (found without importing it), or None."""
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.origin:
        return None
    return VLLMSource(Path(spec.origin).parent.parent)
