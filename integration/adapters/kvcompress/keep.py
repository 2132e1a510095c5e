"""The rules of :meth:`~vllm_graft.hooks.KVCompressor.keep`, checked on every answer by the
KV-compression adapter and by the conformance kit. vLLM-free."""
from __future__ import annotations

from typing import Any, Sequence

from vllm_graft.hooks import BlockView, KVCompressor, NoParams


class KeepError(ValueError):
    """A :meth:`KVCompressor.keep` answer breaks the rules (the message names the plugin)."""


def check_keep(view: BlockView, kept: Any, plugin: str = "?") -> list[int]:
    """``kept`` (what ``keep(view)`` returned) as a list of ints, if it follows the rules of
    :meth:`KVCompressor.keep` that one answer can show; else :class:`KeepError`.

    (The "once dropped, stays dropped" rule spans calls: the adapter checks it against the
    blocks it already freed.)
    """
    def fail(why: str) -> KeepError:
        shown = kept if not isinstance(kept, (list, tuple)) or len(kept) <= 16 else \
            f"{list(kept[:16])}... ({len(kept)} items)"
        return KeepError(
            f"kvcompress plugin {plugin!r}: keep() returned {shown!r} for {view.num_tokens} tokens "
            f"in {view.num_blocks} blocks of {view.block_size} (prompt {view.num_prompt_tokens} "
            f"tokens, pinned {sorted(view.pinned)}); {why}")

    if hasattr(kept, "tolist") and not isinstance(kept, (list, tuple)):
        kept = kept.tolist()  # a numpy array or torch tensor
    if not isinstance(kept, (list, tuple, range)):
        raise fail("it must be a list of block indices")
    from operator import index  # accepts ints and numpy/torch integer scalars

    out: list[int] = []
    for i in kept:
        try:
            if isinstance(i, bool):
                raise TypeError
            out.append(index(i))
        except TypeError:
            raise fail(f"{i!r} is not a block index (an int)") from None
    n = view.num_blocks
    bad = [i for i in out if not 0 <= i < n]
    if bad:
        raise fail(f"block(s) {bad} are out of range(0, {n})")
    if any(a >= b for a, b in zip(out, out[1:])):
        raise fail("indices must be sorted ascending, without duplicates")
    if n and out[-1:] != [n - 1]:
        raise fail(f"the last block ({n - 1}, being written) must be kept")
    missing = sorted(view.pinned - set(out))
    if missing:
        raise fail(f"pinned block(s) {missing} (shared with other requests) must be kept")
    return out


def check_keep_heads(view: BlockView, kept: Any, plugin: str = "?") -> list[list[int]]:
    """``kept`` (what ``keep_heads(view)`` returned, a per-head compressor's answer) as one
    list of ints per KV head, each following the rules of :func:`check_keep`; else
    :class:`KeepError`. The block-level answer is their union (:func:`union_of_heads`)."""
    heads = len(view.head_scores or ())
    if not isinstance(kept, (list, tuple)) or len(kept) != heads:
        raise KeepError(
            f"kvcompress plugin {plugin!r}: keep_heads() returned {kept!r:.200} for {view.num_tokens} tokens "
            f"in {view.num_blocks} blocks; it must be a list of {heads} block lists, one per KV head "
            "(len(view.head_scores))")
    out = []
    for h, blocks in enumerate(kept):
        try:
            out.append(check_keep(view, blocks, plugin))
        except KeepError as e:
            raise KeepError(f"{e} (the list of KV head {h} in keep_heads())") from None
    return out


def union_of_heads(kept: Sequence[Sequence[int]]) -> list[int]:
    """The blocks some head keeps (a block is freed only when no head keeps it), ascending."""
    return sorted(set().union(*map(set, kept))) if kept else []


def dropped_blocks(view: BlockView, kept: Sequence[int]) -> list[int]:
    """The blocks of ``view`` not in ``kept``, ascending."""
    keep = set(kept)
    return [i for i in range(view.num_blocks) if i not in keep]


class KeepAll(KVCompressor):
    """The eviction half of a deployment whose ``kvcompress:`` has only a storage format
    (e.g. ``kv4`` alone): every block stays."""

    def __init__(self) -> None:
        super().__init__(NoParams())

    def keep(self, view: BlockView) -> list[int]:
        return list(range(view.num_blocks))
