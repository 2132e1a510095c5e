"""DFloat11's Triton decoder: every program decodes ``BL`` chunks side by side (one lane
each), ``CHUNK`` steps: read 3 bytes at the lane's bit position, take the next
``MAX_LEN`` bits, look up (symbol, code length) in the lane's shard table, advance. The
decoded exponents are then joined with sign and mantissa (``reference.join_bf16``)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _huffman_decode(
    stream_ptr,
    n_bytes,
    pos_ptr,
    base_ptr,
    sym_ptr,
    len_ptr,
    out_ptr,
    n_lanes,
    CHUNK: tl.constexpr,
    MAX_LEN: tl.constexpr,
    BL: tl.constexpr,
):
    lane = tl.program_id(0) * BL + tl.arange(0, BL)
    live = lane < n_lanes
    pos = tl.load(pos_ptr + lane, mask=live, other=0)
    base = tl.load(base_ptr + lane, mask=live, other=0)
    for j in range(CHUNK):
        byte = tl.minimum(pos >> 3, n_bytes - 3)
        b0 = tl.load(stream_ptr + byte, mask=live, other=0).to(tl.int64)
        b1 = tl.load(stream_ptr + byte + 1, mask=live, other=0).to(tl.int64)
        b2 = tl.load(stream_ptr + byte + 2, mask=live, other=0).to(tl.int64)
        w = (b0 << 16) | (b1 << 8) | b2
        idx = ((w >> (24 - MAX_LEN - (pos & 7))) & ((1 << MAX_LEN) - 1)) + base
        sym = tl.load(sym_ptr + idx, mask=live, other=0)
        ln = tl.load(len_ptr + idx, mask=live, other=0).to(tl.int64)
        tl.store(out_ptr + lane * CHUNK + j, sym, mask=live)
        pos += ln


def decode_exponents(
    stream: torch.Tensor,
    chunk_pos: torch.Tensor,
    table_base: torch.Tensor,
    sym_table: torch.Tensor,
    len_table: torch.Tensor,
    chunk: int,
    max_len: int,
    *,
    block: int = 64,
) -> torch.Tensor:
    """Same contract as ``reference.decode_exponents``: uint8 ``[C, chunk]``."""
    n = chunk_pos.numel()
    out = torch.empty((n, chunk), dtype=torch.uint8, device=stream.device)
    _huffman_decode[(triton.cdiv(n, block),)](
        stream,
        stream.numel(),
        chunk_pos.to(torch.int64).contiguous(),
        table_base.to(torch.int64).contiguous(),
        sym_table.contiguous(),
        len_table.contiguous(),
        out,
        n,
        CHUNK=chunk,
        MAX_LEN=max_len,
        BL=block,
    )
    return out
