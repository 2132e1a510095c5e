"""kv4's page arithmetic, without torch (deployment validation reads it): the bytes one token
of one KV head takes, where each part of a token row starts, and the shapes the layout cannot
hold (the layout is described in :mod:`.reference`; the reference and the Triton kernel both
read it from here)."""

from __future__ import annotations


def bytes_per_token(head_size: int, block_size: int, value_group: int) -> int:
    """Bytes one token of one KV head takes: K and V codes, V group parameters, its share of
    the block's per-channel K parameters."""
    D, B, G = head_size, block_size, value_group
    return D + 4 * (D // G) + (4 * D) // B


def unsupported(head_size: int, block_size: int, value_group: int) -> str | None:
    D, B, G = head_size, block_size, value_group
    if D % 2:
        return f"head size {D} is odd; kv4 packs two 4-bit channels per byte (use an even head size)"
    if D % G:
        return (
            f"value_group_size {G} does not divide head size {D}; choose a divisor of {D} "
            f"(e.g. {32 if D % 32 == 0 else D})"
        )
    if (2 * D) % B:
        return (
            f"block size {B} does not divide 2 x head size ({2 * D}): the block's per-channel key "
            f"scales ({4 * D} bytes) must split evenly over its {B} token rows; use a block size "
            f"that divides {2 * D} (e.g. 16 or 32)"
        )
    return None


def offsets(D: int, B: int, G: int) -> tuple[int, int, int, int]:
    """(value-code offset, value-param offset, key-param offset, key-param bytes per row)."""
    return D // 2, D, D + 4 * (D // G), (4 * D) // B
