"""The 4-bit KV page format (quantise/pack, unpack/dequantise) and the plain-PyTorch paged
attention over it: the oracle of the Triton kernel (:mod:`.kernel`) and the CPU path.

Page layout
-----------
vLLM gives each layer a ``uint8`` cache ``[num_blocks, H_kv, B, C]``: for each block and KV
head, ``B`` token rows of ``C = bytes_per_token(D, B, G)`` bytes. Row ``t`` of block ``b``,
head ``h`` holds, at byte offsets:

* ``[0, D/2)``: the token's key codes, 4 bits each: byte ``j`` = ``code[2j] | code[2j+1] << 4``;
* ``[D/2, D)``: the token's value codes, packed the same way;
* ``[D, D + 4*D/G)``: the token's value parameters, float16: the scale of each of its
  ``D/G`` channel groups, then each group's minimum (value = min + code * scale);
* ``[D + 4*D/G, C)``: ``KS = 4*D/B`` bytes of the *block's* key parameters. The ``B`` rows'
  slices, concatenated in row order, are ``4*D`` bytes = float16 ``[2, D]``: each channel's
  scale, then each channel's minimum, shared by the block's tokens (key = min[c] + code * scale[c]).

Keys are quantised per channel (KIVI, Liu et al. 2024; QServe's SmoothAttention also treats
key outliers per channel), values per token in groups of ``G`` channels (KIVI). Codes are
asymmetric uint4 ``0..15``: scale = (max - min) / 15, parameters rounded to float16 before
the codes are computed, so dequantisation reproduces what the codes were computed against.

Per-channel key scales and tokens that arrive one at a time
-----------------------------------------------------------
A channel's range over a block is known only once the block is full, but decode writes one
token per step. :func:`write` keeps, per block, the running range of every key channel over
the tokens written so far: when a write brings a value outside the range, the block's
earlier keys are dequantised and re-quantised with the widened range (from their 4-bit
codes: no full-precision copy is kept anywhere, so the page accounting is the whole cost).
A prefill chunk writes whole blocks at once (exactly KIVI's per-channel quantisation of a
full group); decode blocks pay a re-rounding of their earlier keys each time the range
widens (each adds at most half a step of the new range to those keys' error). Compute: every
write re-encodes the keys of the blocks it touches, ``B * D`` values per block and head.
KIVI instead keeps the open group's keys in full precision (a residual outside the paged
pool); that memory would not show in vLLM's block accounting, so it is not done here.

Requirements: ``D`` even and ``G`` dividing ``D``; ``B`` dividing ``2 * D`` (so the block's
``4*D`` key-parameter bytes split evenly, in whole float16 values, over its ``B`` rows).
"""

from __future__ import annotations

import torch

from ....hooks import AttentionLayer, PagedBatch
from ...attention._shared import flat_blocks, fused_causal_attention, paged_attention_with_mass
from .._shared.quant import dequantize_groups, group_codes, group_params, pack_bits, quantize_groups, unpack_bits
from .._shared.reference import live_slots

from .layout import bytes_per_token, offsets, unsupported

LEVELS = 15  # uint4 codes 0..15


# --------------------------------------------------------------------------- the format
def pack4(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes ``[..., D]`` (0..15) -> bytes ``[..., D/2]``: channel 2j low nibble, 2j+1 high."""
    return pack_bits(codes, 4)


def unpack4(packed: torch.Tensor) -> torch.Tensor:
    """bytes ``[..., D/2]`` -> codes ``[..., D]`` (uint8, 0..15); inverse of :func:`pack4`."""
    return unpack_bits(packed, 4)


def _params(mn: torch.Tensor, mx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, min) as float16, for the range [mn, mx]."""
    return group_params(mn, mx, LEVELS)


def _codes(x: torch.Tensor, scale: torch.Tensor, mn: torch.Tensor) -> torch.Tensor:
    return group_codes(x, scale, mn, LEVELS)


def _f16_bytes(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float16).contiguous().view(torch.uint8)


def quantize_values(v: torch.Tensor, G: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Values ``[..., D]`` -> (packed codes ``[..., D/2]``, param bytes ``[..., 4*D/G]``)."""
    return quantize_groups(v, G, 4)


def dequantize_values(packed: torch.Tensor, params: torch.Tensor, G: int) -> torch.Tensor:
    """Inverse of :func:`quantize_values` (float32)."""
    return dequantize_groups(packed, params, G, 4)


def key_params(rows: torch.Tensor, kp: int, KS: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-channel (scale, min) float16 ``[..., D]`` of blocks ``rows [..., B, C]``."""
    raw = rows[..., kp : kp + KS].contiguous()
    p = raw.reshape(*raw.shape[:-2], -1).view(torch.float16)
    D = p.shape[-1] // 2
    return p[..., :D], p[..., D:]


def dequantize_keys(rows: torch.Tensor, D: int, B: int, G: int) -> torch.Tensor:
    """Keys ``[..., B, D]`` (float32) of blocks ``rows [..., B, C]``."""
    _, _, kp, KS = offsets(D, B, G)
    scale, mn = key_params(rows, kp, KS)
    codes = unpack4(rows[..., : D // 2]).float()
    return mn.float()[..., None, :] + codes * scale.float()[..., None, :]


def dequantize_block_rows(rows: torch.Tensor, D: int, B: int, G: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(keys, values) ``[..., B, D]`` float32 of whole blocks ``rows [..., B, C]``."""
    vo, vp, kp, _ = offsets(D, B, G)
    k = dequantize_keys(rows, D, B, G)
    v = dequantize_values(rows[..., vo:vp], rows[..., vp:kp], G)
    return k, v


def write(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor, value_group: int
) -> None:
    """Quantise and store ``key``/``value`` ``[T, H_kv, D]`` at ``slot_mapping`` (negative =
    padding) in the uint8 cache ``[N, H_kv, B, C]`` (see the module doc). Within a block,
    tokens arrive in order (a block's earlier rows are its earlier tokens)."""
    N, H, B, C = kv_cache.shape
    D = key.shape[-1]
    G = value_group
    vo, vp, kp, KS = offsets(D, B, G)
    what = f"kv4: for head size {D}, block size {B}, value group {G}"
    rows = live_slots(key, value, slot_mapping, kv_cache, bytes_per_token(D, B, G), what)
    if rows is None:
        return
    blocks, offs, key, value = rows
    # values: per token, stored directly
    vcodes, vparams = quantize_values(value, G)  # [T, H, D/2], [T, H, 4D/G]
    kv_cache[blocks, :, offs, vo:vp] = vcodes
    kv_cache[blocks, :, offs, vp:kp] = vparams
    # keys: per channel over each touched block, re-encoding the block's earlier keys
    touched, inv = torch.unique(blocks, return_inverse=True)
    U = touched.numel()
    first = torch.full((U,), B, dtype=torch.long, device=blocks.device).scatter_reduce(0, inv, offs, reduce="amin")
    rows = kv_cache[touched]  # [U, H, B, C] (a copy)
    old = dequantize_keys(rows, D, B, G)  # [U, H, B, D]
    ar = torch.arange(B, device=blocks.device)
    have = ar[None, :] < first[:, None]  # [U, B] earlier tokens of the block
    k_all = torch.where(have[:, None, :, None], old, torch.zeros((), dtype=old.dtype))
    k_all[inv, :, offs] = key.float()
    have = have.clone()
    have[inv, offs] = True
    m = have[:, None, :, None]
    mn = torch.where(m, k_all, torch.full((), float("inf"))).amin(dim=2)  # [U, H, D]
    mx = torch.where(m, k_all, torch.full((), float("-inf"))).amax(dim=2)
    scale, mnh = _params(mn, mx)
    codes = _codes(k_all, scale[:, :, None, :], mnh[:, :, None, :])
    codes = torch.where(m, codes, torch.zeros((), dtype=codes.dtype))
    rows[..., : D // 2] = pack4(codes)
    pbytes = _f16_bytes(torch.cat([scale, mnh], dim=-1))  # [U, H, 4D]
    rows[..., kp : kp + KS] = pbytes.view(U, H, B, KS)
    kv_cache[touched] = rows


# -------------------------------------------------------------------------- attention
def paged_attention_kv4(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    batch: PagedBatch,
    layer: AttentionLayer,
    value_group: int,
    observe: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Causal attention of ``query [T, H, D]`` over the kv4 cache: ``(out, mass)``.

    Sequence i's queries are rows ``query_start_loc[i]:query_start_loc[i+1]``, the last
    ``q`` of its ``seq_lens[i]`` positions; its keys are the first ``seq_lens[i]`` slots of
    blocks ``block_table[i]``, dequantised to float32. ``mass`` (when ``observe`` is given)
    is ``[num_seqs, max_blocks]``: the probability the observed queries put on each
    block-table column, summed over heads and those queries (``KVCompressor.attend``).

    Without ``observe`` (the CPU path of every step), the decode rows (one query each) are
    computed together, as one batched attention over their dequantised blocks; rows with
    several queries (prefill chunks) one by one, by the attention kind's shared exact attention
    (which, with ``observe``, also gives the mass)."""
    if observe is not None:
        return _attention_with_mass(query, kv_cache, batch, layer, value_group, observe)
    T, H, D = query.shape
    _, Hkv, B, _ = kv_cache.shape
    group = H // Hkv
    qsl = batch.query_start_loc.tolist()
    lens = batch.seq_lens.tolist()
    out = torch.zeros(T, H, D, dtype=query.dtype, device=query.device)
    decode = [i for i in range(len(lens)) if qsl[i + 1] - qsl[i] == 1 and lens[i] > 0]
    if decode:
        S = len(decode)
        nb = max(-(-lens[i] // B) for i in decode)
        ids = batch.block_table[decode, :nb].long()  # columns past a row's blocks are masked
        k, v = dequantize_block_rows(kv_cache[ids], D, B, value_group)  # [S, nb, Hkv, B, D]
        k = k.permute(0, 2, 1, 3, 4).reshape(S, Hkv, nb * B, D)
        v = v.permute(0, 2, 1, 3, 4).reshape(S, Hkv, nb * B, D)
        rows = torch.tensor([qsl[i] for i in decode], device=query.device)
        q = query[rows].float().view(S, Hkv, group, D)
        s = torch.matmul(q, k.transpose(-1, -2)) * layer.scale  # [S, Hkv, group, nb*B]
        past = (
            torch.arange(nb * B, device=query.device)[None, :]
            >= torch.tensor([lens[i] for i in decode], device=query.device)[:, None]
        )
        s = s.masked_fill(past[:, None, None, :], float("-inf"))
        o = torch.matmul(torch.softmax(s, dim=-1), v)  # [S, Hkv, group, D]
        out[rows] = o.reshape(S, H, D).to(out.dtype)
    for i in range(len(lens)):
        q0, q1 = qsl[i], qsl[i + 1]
        L = lens[i]
        if q1 - q0 <= 1 or L <= 0:
            continue
        nbi = -(-L // B)
        k, v = dequantize_block_rows(kv_cache[batch.block_table[i, :nbi].long()], D, B, value_group)
        out[q0:q1] = fused_causal_attention(query[q0:q1], flat_blocks(k, L), flat_blocks(v, L), layer.scale).to(
            out.dtype
        )
    return out, None


def _attention_with_mass(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    batch: PagedBatch,
    layer: AttentionLayer,
    value_group: int,
    observe: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`paged_attention_kv4` with the attention mass: the shared exact attention with
    mass (the scored compressors' reference), reading the blocks through this format's
    dequantisation."""
    D, B = query.shape[2], kv_cache.shape[2]
    return paged_attention_with_mass(
        query,
        kv_cache,
        batch,
        layer,
        observe,
        gather=lambda ids: dequantize_block_rows(kv_cache[ids], D, B, value_group),
    )


# ----------------------------------------------------------------------------- plugin
from ....hooks import KVCacheFormat  # noqa: E402


class KV4(KVCacheFormat):
    """The ``kv4`` storage format (see the module doc)."""

    #: The page is kv4's own byte rows (no K|V split, so the layout's split does not apply): the
    #: reference writes and reads it by indexing the 4-D ``[N, H_kv, B, C]`` view (which follows
    #: its strides) and the kernel takes the view's strides, so it holds in either layout and any
    #: physical order of the first three dims (tests/kernels/test_layouts.py).
    kv_layouts = ("blocked", "packed")

    def bytes_per_token(self, head_size: int, block_size: int) -> int:
        return bytes_per_token(head_size, block_size, self.params.value_group_size)

    def unsupported(self, head_size: int, block_size: int) -> str | None:
        return unsupported(head_size, block_size, self.params.value_group_size)

    def write(self, key, value, kv_cache, slot_mapping, layer=None) -> None:
        write(key, value, kv_cache, slot_mapping, self.params.value_group_size)  # the same for every layer

    def forward(self, query, kv_cache, batch, layer, observe=None):
        if self.params.kernel == "triton" and observe is None:
            from .kernel import paged_attention_kv4_triton

            return paged_attention_kv4_triton(query, kv_cache, batch, layer, self.params.value_group_size), None
        # the Triton kernel emits no attention mass: with a scored evictor, the reference runs
        return paged_attention_kv4(query, kv_cache, batch, layer, self.params.value_group_size, observe)

    def describe(self):
        return self.params.model_dump()
