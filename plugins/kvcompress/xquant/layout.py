"""xquant's page arithmetic, without torch (deployment validation reads it): the bytes one
token of one KV head takes, where each part of a row starts, and the shapes the layout cannot
hold (the layout is described in :mod:`.reference`)."""

from __future__ import annotations

#: bytes of the token's position (int32) at the end of every row
POSITION_BYTES = 4


def offsets(D: int, bits: int, G: int) -> tuple[int, int, int, int, int]:
    """(value codes, key params, value params, position, row bytes): the byte offsets in a row."""
    codes = D * bits // 8
    params = 4 * (D // G)
    kp = 2 * codes
    pos = kp + 2 * params
    return codes, kp, kp + params, pos, pos + POSITION_BYTES


def bytes_per_token(head_size: int, bits: int, group_size: int) -> int:
    """Bytes one token of one KV head takes: the key and value latents' codes, their groups'
    float16 scales and minima, the token's position."""
    return offsets(head_size, bits, group_size)[-1]


def unsupported(head_size: int, bits: int, group_size: int) -> str | None:
    D, G = head_size, group_size
    if (D * bits) % 8:
        return f"head size {D} at {bits} bits is not a whole number of bytes; use bits 4 or 8"
    if D % G:
        return (
            f"group_size {G} does not divide head size {D}; choose a divisor of {D} (e.g. {32 if D % 32 == 0 else D})"
        )
    return None
