"""The patch registry: every place vllm-graft replaces an attribute inside vLLM.

vLLM has hooks for most of what the adapters do (backend registry, ``custom_class``
proposers, ``register_quantization_config``, KV-spec registry, ``register_oot``). Where it
has none, an adapter patches, and only through :data:`PATCHES`, which records who patched
what and why, checks the installed vLLM against the versions the patch was written for,
refuses a second patch of the same attribute, and can undo everything it applied.

Every patch is an entry of the patch register, :mod:`.targets`, applied by
:meth:`PatchRegistry.apply` (the only way); :meth:`applied` lists what this process applied
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
    owner: str  # who needs it, e.g. "adapters.speculative" (KindSpec.owner)
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


def _qualified(fn: Any) -> str:
    """``module:qualname`` of a function or bound method, ``vllm_graft.`` left off."""
    fn = getattr(fn, "__func__", fn)
    module = getattr(fn, "__module__", "?").removeprefix("vllm_graft.")
    return f"{module}:{getattr(fn, '__qualname__', repr(fn))}"


class PatchRegistry:
    def __init__(self) -> None:
        self._applied: dict[tuple[int, str], Patch] = {}

    def apply(
        self, target: "Target", replacement: Callable[[Any], Any], *, on: Any = None, vllm_version: str | None = None
    ) -> Patch:
        """The one way to patch vLLM: wrap ``target``'s attribute with ``replacement(original)``.

        ``target`` is an entry of the patch register (:mod:`.targets`): the owner, the reason and
        the checked vLLM range come from it, and ``replacement`` must be the wrapper the entry
        names (:attr:`~.targets.Target.wrapper`), so the register says where every patch lives.
        ``on`` is the object patched when it is an instance (the bench samples one engine's
        scheduler); by default the entry's class or module (imports vLLM).

        Idempotent for the entry's owner (adapters activate once per engine). Refuses a second
        patch of the same attribute by another owner, an attribute that does not exist (vLLM
        moved it: the patch must be re-checked), a vLLM version (``vllm_version``, default the
        installed one) outside the entry's range, and a replacement the entry does not name.
        """
        obj = target.resolve() if on is None else on
        key = (id(obj), target.attribute)
        prev = self._applied.get(key)
        if prev is not None:
            if prev.owner == target.owner:
                return prev
            raise PatchError(
                f"{prev.where} is already patched by {prev.owner} ({prev.reason}); {target.owner} "
                f"cannot patch it again. Undo the first patch, or extend it."
            )
        if target.wrapper and _qualified(replacement) != target.wrapper:
            raise PatchError(
                f"{target.owner}'s patch of {target.where} must be {target.wrapper} (its entry in "
                f"vllm_graft/integration/targets.py), not {_qualified(replacement)}: name the new "
                "wrapper in the entry."
            )
        if not hasattr(obj, target.attribute):
            raise PatchError(
                f"{target.owner} wants to patch {getattr(obj, '__qualname__', obj)}.{target.attribute}, "
                f"which this vLLM does not have; the patch was written for vLLM {target.versions}."
            )
        if vllm_version is None:
            from .env import installed_vllm

            found = installed_vllm()
            vllm_version = found[1] if found else None
        if vllm_version is not None and not SpecifierSet(target.versions).contains(
            Version(vllm_version).base_version, prereleases=True
        ):
            raise PatchError(
                f"{target.owner}'s patch of {getattr(obj, '__qualname__', obj)}.{target.attribute} was "
                f"checked against vLLM {target.versions}, not {vllm_version}; re-check it before "
                "widening the range."
            )
        original = getattr(obj, target.attribute)
        patch = Patch(
            target.owner, obj, target.attribute, target.reason, target.versions, original, runner=target.runner
        )
        setattr(obj, target.attribute, replacement(original))
        self._applied[key] = patch
        log.debug("vllm-graft: patched %s for %s (%s)", patch.where, target.owner, target.reason)
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
