"""The kvcompress adapter's per-request decisions, vLLM-free: the logical blocks the scheduler
frees (:func:`blocks_to_free`), those a worker row leaves out of attention
(:func:`blocks_to_skip`), and how a block-table row is compacted (:func:`compact_rows`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from ....hooks import BlockView, KVCompressor
from .keep import KeepError, ask, check_keep, dropped_blocks

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
    view = BlockView(
        num_tokens=num_tokens,
        block_size=block_size,
        num_prompt_tokens=num_prompt_tokens,
        pinned=pinned,
        request_id=request_id,
    )
    kept = check_keep(view, ask(compressor, view, plugin), plugin)
    back = [i for i in kept if held[i][0]]
    if back:
        raise KeepError(
            f"kvcompress plugin {plugin!r}: keep() returned {kept} for {num_tokens} tokens, but "
            f"block(s) {back} were dropped at an earlier step and their KV is gone; a dropped "
            "block must stay dropped"
        )
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
    view = BlockView(
        num_tokens=num_tokens, block_size=block_size, num_prompt_tokens=num_prompt_tokens, request_id=request_id
    )
    return dropped_blocks(view, check_keep(view, ask(compressor, view, plugin), plugin))


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
        table[i, : row.numel()] = row
        table[i, row.numel() :] = 0
        lens[i] -= block_size * len(skip)
    return table, lens


def compaction_index(
    skips: Sequence[Sequence[int]],
    seq_lens_host: Sequence[int],
    block_size: int,
    width: int,
    blocks_per_block: int = 1,
):
    """The host half of :meth:`RowBuffers.fill`: one int32 array ``[rows with skips, 2 + W]``,
    per such row its index, the tokens it loses (``block_size`` per skipped block) and the
    gather index of its first ``W`` columns (``W``: the widest such row's used columns,
    ``ceil(seq_len / column size)``): new column j reads old column ``index[j]``, or is the
    null block where ``index[j]`` is -1. Returns None when no row skips a block.

    ``skips[i]``: ascending logical blocks of ``block_size`` tokens; the table's columns may
    be kernel blocks, ``blocks_per_block`` of them per logical block (vLLM splits a KV-cache
    block into kernel blocks when a backend needs smaller ones). ``seq_lens_host``: each row's
    length, known on the host. Raises :class:`KVCompressError` if a skipped block is not a
    full block before the row's last one."""
    import numpy as np

    rows = [i for i, s in enumerate(skips) if s]
    if not rows:
        return None
    column = block_size // blocks_per_block
    used = {i: min(width, -(-int(seq_lens_host[i]) // column)) for i in rows}
    w = max(used.values())
    out: np.ndarray = np.full((len(rows), 2 + w), -1, dtype=np.int32)
    for k, i in enumerate(rows):
        skip = np.asarray(skips[i], dtype=np.int64)
        last = (int(seq_lens_host[i]) - 1) // block_size  # the row's last logical block: kept
        if skip[0] < 0 or skip[-1] >= last or (skip[-1] + 1) * blocks_per_block > used[i]:
            raise KVCompressError(
                f"row {i} (length {int(seq_lens_host[i])}, {used[i]} of {width} columns of "
                f"{column} tokens): skipped blocks {list(skips[i])} must be full blocks before the "
                "row's last one"
            )
        cols = (skip[:, None] * blocks_per_block + np.arange(blocks_per_block)).ravel()
        keep: np.ndarray = np.ones(used[i], dtype=bool)
        keep[cols] = False
        kept = np.flatnonzero(keep)
        out[k, 0] = i
        out[k, 1] = len(skip) * block_size
        out[k, 2 : 2 + kept.size] = kept
    return out


class RowBuffers:
    """A metadata builder's fixed-address block table ``[rows, width]`` and ``seq_lens
    [rows]``, on the device of the runner's. With full CUDA graphs the attention kernels keep
    the addresses seen at capture, so the rewriter hands these (views of their first rows) at
    capture and at every step after, filled with the step's values; the runner's tensors are
    only read."""

    def __init__(self, rows: int, block_table: "torch.Tensor", seq_lens: "torch.Tensor") -> None:
        import torch

        self.table = torch.zeros((rows, block_table.shape[1]), dtype=block_table.dtype, device=block_table.device)
        self.seq_lens = torch.zeros(rows, dtype=seq_lens.dtype, device=seq_lens.device)

    def fits(self, block_table: "torch.Tensor") -> bool:
        return (
            block_table.shape[0] <= self.table.shape[0]
            and block_table.shape[1] == self.table.shape[1]
            and block_table.dtype == self.table.dtype
            and block_table.device == self.table.device
        )

    def fill(self, block_table: "torch.Tensor", seq_lens: "torch.Tensor", index=None):
        """Copy the step's ``block_table``/``seq_lens`` in, then compact the rows of ``index``
        (:func:`compaction_index`; None: none) on the device: one host-to-device copy of the
        index, no read back. Returns the views ``(table[:rows], seq_lens[:rows])``."""
        import torch

        n = block_table.shape[0]
        table, lens = self.table[:n], self.seq_lens[:n]
        table.copy_(block_table)
        lens.copy_(seq_lens[:n])
        if index is None:
            return table, lens
        host = torch.from_numpy(index)
        if table.is_cuda and torch.cuda.is_available():
            # a fresh pinned tensor from torch's caching host allocator, which keeps it until
            # the asynchronous copy has read it
            pinned = torch.empty(host.shape, dtype=host.dtype, pin_memory=True)
            pinned.copy_(host)
            host = pinned
        dev = host.to(table.device, non_blocking=True)
        rows = dev[:, 0].long()
        lose = dev[:, 1].to(lens.dtype)
        gather = dev[:, 2:].long()
        w = gather.shape[1]
        values = block_table[:, :w].index_select(0, rows).gather(1, gather.clamp(min=0))
        values = values.masked_fill(gather < 0, 0)  # vLLM's null block
        table[:, :w].index_copy_(0, rows, values)
        lens.index_copy_(0, rows, seq_lens.index_select(0, rows) - lose)
        return table, lens
