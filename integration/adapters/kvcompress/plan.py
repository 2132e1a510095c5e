"""The kvcompress adapter's per-request decisions, vLLM-free: the logical blocks the scheduler
frees (:func:`blocks_to_free`), those a worker row leaves out of attention
(:func:`blocks_to_skip`), and how a block-table row is compacted (:func:`compact_rows`)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from vllm_graft.hooks import BlockView, KVCompressor
from vllm_graft.integration.adapters.kvcompress.keep import KeepError, check_keep, dropped_blocks

if TYPE_CHECKING:
    import torch


class KVCompressError(RuntimeError):
    """The adapter cannot run the plugin (state, or vLLM's batch not as expected)."""


def blocks_to_free(
    compressor: KVCompressor,
    plugin: str,
    *,
    num_tokens: int,
    block_size: int,
    num_prompt_tokens: int,
    held: Sequence[tuple[bool, int]],
    request_id: str | None = None,
) -> list[int] | None:
    """The scheduler's decision for one request: the logical blocks to free now.

    ``held[i]`` is ``(is_null, ref_cnt)`` of the request's block i (null: freed earlier).
    Returns None, without calling the plugin, when the request does not yet hold a block
    for every computed token (a prefix-cache hit is added after this call; the next step
    decides). Raises :class:`KeepError` if the answer breaks a rule, including keeping a
    block that an earlier step freed.
    """
    view = BlockView(num_tokens=num_tokens, block_size=block_size, num_prompt_tokens=num_prompt_tokens)
    n = view.num_blocks
    if n == 0 or len(held) < n:
        return None
    pinned = frozenset(i for i in range(n) if not held[i][0] and held[i][1] > 1)
    view = BlockView(num_tokens=num_tokens, block_size=block_size,
                     num_prompt_tokens=num_prompt_tokens, pinned=pinned, request_id=request_id)
    kept = check_keep(view, compressor.keep(view), plugin)
    back = [i for i in kept if held[i][0]]
    if back:
        raise KeepError(
            f"kvcompress plugin {plugin!r}: keep() returned {kept} for {num_tokens} tokens, but "
            f"block(s) {back} were dropped at an earlier step and their KV is gone; a dropped "
            "block must stay dropped")
    return [i for i in dropped_blocks(view, kept) if not held[i][0]]


def blocks_to_skip(
    compressor: KVCompressor,
    plugin: str,
    *,
    num_tokens: int,
    block_size: int,
    num_prompt_tokens: int,
    request_id: str | None = None,
) -> list[int]:
    """The worker's decision for one batch row: the logical blocks its attention leaves out
    (``num_tokens`` = tokens computed before this step; ``request_id`` passed on in the view).
    Raises :class:`KeepError`."""
    if num_tokens <= 0:
        return []
    view = BlockView(num_tokens=num_tokens, block_size=block_size, num_prompt_tokens=num_prompt_tokens,
                     request_id=request_id)
    return dropped_blocks(view, check_keep(view, compressor.keep(view), plugin))


def runs(indices: Sequence[int]) -> list[tuple[int, int]]:
    """Ascending ``indices`` as half-open ranges of consecutive values: [1,2,5] -> [(1,3),(5,6)]."""
    out: list[tuple[int, int]] = []
    for i in indices:
        if out and out[-1][1] == i:
            out[-1] = (out[-1][0], i + 1)
        else:
            out.append((i, i + 1))
    return out


def compact_rows(
    block_table: "torch.Tensor",
    seq_lens: "torch.Tensor",
    skips: Sequence[Sequence[int]],
    block_size: int,
) -> tuple["torch.Tensor", "torch.Tensor"]:
    """New ``(block_table, seq_lens)`` where row i lacks the logical blocks ``skips[i]``
    (ascending, all full blocks before the row's last one): the remaining block ids move
    left in order, the freed columns at the end become 0 (vLLM's null block, never read as
    they lie past the new length), and ``seq_lens[i]`` drops by ``block_size`` per block.
    Rows past ``len(skips)`` are unchanged; the inputs are not modified."""
    import torch

    table = block_table.clone()
    lens = seq_lens.clone()
    width = table.shape[1]
    for i, skip in enumerate(skips):
        if not skip:
            continue
        if skip[-1] >= width:
            raise KVCompressError(f"row {i}: block {skip[-1]} is past the table's {width} columns")
        keep = torch.ones(width, dtype=torch.bool, device=table.device)
        keep[list(skip)] = False
        row = block_table[i][keep]
        table[i, :row.numel()] = row
        table[i, row.numel():] = 0
        lens[i] -= block_size * len(skip)
    return table, lens
