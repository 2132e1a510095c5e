"""million's page arithmetic, without torch (deployment validation reads it): the bytes one
token of one KV head takes and the shapes the layout cannot hold (the layout itself is
described in :mod:`.reference`).

A head vector of ``D`` channels is cut into ``M = D / sub_dim`` sub-vectors of ``sub_dim``
contiguous channels; each is stored as the index of its nearest centroid among ``2**bits``
(one byte per code with ``bits`` 8, two codes per byte with ``bits`` 4). A token row holds its
key codes, then its value codes; nothing else (the codebooks live outside the paged pool, one
set per layer and KV head, loaded once).
"""

from __future__ import annotations


def sub_vectors(head_size: int, sub_dim: int) -> int:
    """``M``: sub-vectors per head vector."""
    return head_size // sub_dim


def code_bytes(head_size: int, sub_dim: int, bits: int) -> int:
    """Bytes of one head vector's codes (keys or values)."""
    return (sub_vectors(head_size, sub_dim) * bits + 7) // 8


def bytes_per_token(head_size: int, sub_dim: int, bits: int) -> int:
    """Bytes one token of one KV head takes: its key codes and its value codes."""
    return 2 * code_bytes(head_size, sub_dim, bits)


def unsupported(head_size: int, sub_dim: int, bits: int) -> str | None:
    D = head_size
    if D % sub_dim:
        fits = [s for s in (1, 2, 4, 8) if D % s == 0]
        return (
            f"sub_dim {sub_dim} does not divide head size {D}: each head vector is cut into "
            f"sub-vectors of sub_dim channels; choose one of {fits}"
        )
    if bits == 4 and sub_vectors(D, sub_dim) % 2:
        return (
            f"bits 4 packs two codes per byte, but head size {D} / sub_dim {sub_dim} gives an odd "
            f"number of sub-vectors ({sub_vectors(D, sub_dim)}); use bits 8 or a smaller sub_dim"
        )
    return None
