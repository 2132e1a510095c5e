"""The patch registry: every place vllm-graft replaces an attribute inside vLLM.

vLLM has hooks for most of what the adapters do (backend registry, ``custom_class``
proposers, ``register_quantization_config``, KV-spec registry, ``register_oot``). Where it
has none, an adapter patches, and only through :data:`PATCHES`, which records who patched
what and why, checks the installed vLLM against the versions the patch was written for,
refuses a second patch of the same attribute, and can undo everything it applied.

Every patch an adapter applies is an entry of the patch register, :mod:`.targets`
(:meth:`PatchRegistry.ensure_target`); :meth:`applied` lists what this process applied
(``vllm-graft patches``), each with its :attr:`Patch.runner`.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from packaging.specifiers import SpecifierSet
from packaging.version import Version

if TYPE_CHECKING:
    from .targets import Target

log = logging.getLogger("vllm_graft")


class PatchError(RuntimeError):
    """A patch cannot be applied (already patched, attribute missing, vLLM version unchecked)."""


@dataclass
class Patch:
    owner: str  # who needs it, e.g. "adapters.speculative"
    target: Any  # the object patched (a class or module)
    attribute: str
    reason: str  # why vLLM's own hooks are not enough
    versions: str  # vLLM versions this patch was checked against (PEP 440 specifier)
    original: Any = None
    had_attribute: bool = True
    runner: str = "any"  # "v1": only Model Runner V1 calls it (see targets.Target.runner)

    @property
    def where(self) -> str:
        name = getattr(self.target, "__qualname__", None) or getattr(self.target, "__name__", repr(self.target))
        module = getattr(self.target, "__module__", "")
        return f"{module + '.' if module and module != name else ''}{name}.{self.attribute}"


class PatchRegistry:
    def __init__(self) -> None:
        self._applied: dict[tuple[int, str], Patch] = {}

    def apply(
        self,
        owner: str,
        target: Any,
        attribute: str,
        replacement: Any | Callable[[Any], Any],
        *,
        reason: str,
        versions: str,
        vllm_version: str | None = None,
        wrap: bool = False,
    ) -> Patch:
        """Set ``target.attribute`` to ``replacement`` (or ``replacement(original)`` with ``wrap``).

        Refuses a second patch of the same attribute (by any owner), an attribute that does
        not exist (vLLM moved it: the patch must be re-checked), and a vLLM version outside
        ``versions``.
        """
        key = (id(target), attribute)
        if key in self._applied:
            prev = self._applied[key]
            raise PatchError(
                f"{prev.where} is already patched by {prev.owner} ({prev.reason}); {owner} "
                f"cannot patch it again. Undo the first patch, or extend it.")
        if not hasattr(target, attribute):
            raise PatchError(
                f"{owner} wants to patch {getattr(target, '__qualname__', target)}.{attribute}, which "
                f"this vLLM does not have; the patch was written for vLLM {versions}.")
        if vllm_version is not None and not SpecifierSet(versions).contains(
                Version(vllm_version).base_version, prereleases=True):
            raise PatchError(
                f"{owner}'s patch of {getattr(target, '__qualname__', target)}.{attribute} was checked "
                f"against vLLM {versions}, not {vllm_version}; re-check it before widening the range.")
        original = getattr(target, attribute)
        patch = Patch(owner, target, attribute, reason, versions, original)
        setattr(target, attribute, replacement(original) if wrap else replacement)
        self._applied[key] = patch
        log.debug("vllm-graft: patched %s for %s (%s)", patch.where, owner, reason)
        return patch

    def ensure(self, owner: str, target: Any, attribute: str, replacement: Any, *, reason: str,
               versions: str, wrap: bool = False) -> Patch:
        """:meth:`apply` against the installed vLLM's version, unless ``owner`` already
        patched ``target.attribute`` (idempotent: adapters activate once per engine)."""
        from .env import installed_vllm

        prev = self._applied.get((id(target), attribute))
        if prev is not None and prev.owner == owner:
            return prev
        found = installed_vllm()
        return self.apply(owner, target, attribute, replacement, reason=reason, versions=versions,
                          vllm_version=found[1] if found else None, wrap=wrap)

    def ensure_target(self, target: "Target", replacement: Any, *, wrap: bool = True) -> Patch:
        """:meth:`ensure` for an entry of the patch register (:data:`.targets.PATCH_TARGETS`):
        owner, reason and checked range come from the entry; imports vLLM."""
        patch = self.ensure(target.owner, target.resolve(), target.attribute, replacement,
                            reason=target.reason, versions=target.versions, wrap=wrap)
        patch.runner = target.runner
        return patch

    def undo(self, owner: str | None = None) -> list[Patch]:
        """Restore the originals of ``owner``'s patches (all patches with None)."""
        undone = []
        for key, patch in list(self._applied.items()):
            if owner is None or patch.owner == owner:
                setattr(patch.target, patch.attribute, patch.original)
                del self._applied[key]
                undone.append(patch)
        return undone

    def applied(self) -> list[Patch]:
        return list(self._applied.values())

    def is_patched(self, target: Any, attribute: str) -> bool:
        return (id(target), attribute) in self._applied


#: The process-wide registry every adapter patches through.
PATCHES = PatchRegistry()
