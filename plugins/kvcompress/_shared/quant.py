"""Per-token uniform quantisation in channel groups, as KV storage formats store it (``kv4``'s
values, ``xquant``'s latents): each group of ``G`` channels of a vector gets a float16 scale and
minimum (asymmetric: ``x ~ min + code * scale``, codes ``0 .. 2**bits - 1``), rounded to float16
before the codes are computed so that dequantisation reproduces what the codes were computed
against; codes are packed ``8 / bits`` to a byte, lowest channel in the lowest bits."""

from __future__ import annotations

import torch

#: the code widths a byte holds a whole number of
PACKED_BITS = (2, 4, 8)


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes ``[..., D]`` (``0 .. 2**bits - 1``) -> bytes ``[..., D * bits / 8]``: channel
    ``k * j + i`` (``k = 8 / bits`` codes a byte) in bits ``bits * i`` of byte ``j``."""
    c = codes.to(torch.uint8)
    if bits == 8:
        return c
    per = 8 // bits
    c = c.reshape(*c.shape[:-1], c.shape[-1] // per, per)
    out = c[..., 0].clone()
    for i in range(1, per):
        out |= c[..., i] << (bits * i)
    return out


def unpack_bits(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: bytes ``[..., D * bits / 8]`` -> codes ``[..., D]`` (uint8)."""
    if bits == 8:
        return packed
    mask = (1 << bits) - 1
    parts = [(packed >> (bits * i)) & mask for i in range(8 // bits)]
    return torch.stack(parts, dim=-1).flatten(-2)


def group_params(mn: torch.Tensor, mx: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, min) as float16 for the range ``[mn, mx]`` over ``levels`` steps (a constant range
    gets scale 1 and codes 0)."""
    scale = ((mx - mn) / levels).to(torch.float16)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return scale, mn.to(torch.float16)


def group_codes(x: torch.Tensor, scale: torch.Tensor, mn: torch.Tensor, levels: int) -> torch.Tensor:
    """uint8 codes of ``x`` against float16 ``scale`` and ``mn`` (broadcast)."""
    return torch.clamp(torch.round((x - mn.float()) / scale.float()), 0, levels).to(torch.uint8)


def quantize_groups(x: torch.Tensor, G: int, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Vectors ``[..., D]`` -> (packed codes ``[..., D * bits / 8]``, parameter bytes
    ``[..., 4 * D / G]``: the float16 scale of each of the ``D / G`` groups, then each minimum)."""
    levels = (1 << bits) - 1
    shape = x.shape
    g = x.float().reshape(*shape[:-1], shape[-1] // G, G)
    scale, mn = group_params(g.amin(-1), g.amax(-1), levels)
    codes = group_codes(g, scale[..., None], mn[..., None], levels).reshape(shape)
    params = torch.cat([scale, mn], dim=-1).contiguous().view(torch.uint8)
    return pack_bits(codes, bits), params


def dequantize_groups(packed: torch.Tensor, params: torch.Tensor, G: int, bits: int) -> torch.Tensor:
    """Inverse of :func:`quantize_groups` (float32 ``[..., D]``)."""
    codes = unpack_bits(packed, bits).float()
    D = codes.shape[-1]
    p = params.contiguous().view(torch.float16).float()
    ng = D // G
    scale, mn = p[..., :ng], p[..., ng:]
    g = codes.reshape(*codes.shape[:-1], ng, G)
    return (mn[..., None] + g * scale[..., None]).reshape(codes.shape)
