"""The xquant page format (the quantised latent of the layer input, from which keys and values
are rematerialised) and its paged attention, in plain PyTorch: the CPU path (no Triton kernel).

XQuant (Tomar et al. 2025, arXiv:2508.10395)
--------------------------------------------
XQuant caches the quantised layer input X instead of K and V and recomputes ``K = X Wk``,
``V = X Wv`` when attending. For a GQA model X is the larger of the two (SmolLM2: 576 values a
token against K's and V's 192 each), so the paper's GQA variant caches X projected onto the
right singular vectors of ``Wk`` and of ``Wv``: with ``W = U diag(S) Vh``, the latents
``X Vh_k^T`` and ``X Vh_v^T`` (``n = H_kv * D`` values each), from which ``K = lat diag(S) U^T``.
vLLM hands the cache K (after RoPE) and V, not X; the latents are exact functions of them,
``lat = (K_pre - b) U diag(1/S)`` with ``K_pre`` the key with RoPE undone at the token's
position, so the format computes them at write time from what it is given (:mod:`.bases`:
the decompositions, calibrated once from the weights).

Page layout
-----------
vLLM gives each layer a ``uint8`` cache ``[num_blocks, H_kv, B, C]``. Latent channels
``h * D .. (h + 1) * D`` (in singular-value order) live in head ``h``'s rows. Row ``t`` of block
``b``, head ``h`` holds, at the offsets of :func:`.layout.offsets`:

* the key latent's codes, then the value latent's (``D * bits / 8`` bytes each, packed
  ``8 / bits`` to a byte: :mod:`.._shared.quant`);
* the key latent's float16 scale and minimum of each of its ``D / G`` channel groups, then the
  value latent's (per token, asymmetric: XQuant quantises X per token);
* the token's position, int32 (RoPE is re-applied at read time at this position, so blocks
  may be evicted by a compressor composed with the format).

A token is encoded from its own K/V alone: a write touches only its own row.

Attention
---------
Every read dequantises the blocks' latents, rematerialises K (``lat diag(S) U^T + b``, then
RoPE at the stored positions) and V, and runs the shared exact attention over them (with the
block mass when an eviction compressor ``observe``\\ s). On a GPU XQuant wins by trading this
recompute for memory traffic; in this reference path it is all extra work.

What vLLM changes from the paper: the prefill chunk's own tokens are read back from the cache
after they are written, so the prompt's attention already sees rematerialised K/V; no window of
recent tokens is kept in full precision; XQuant-CL (cross-layer deltas of X) is not done: each
layer's latent is its own.
"""

from __future__ import annotations

from typing import Any

import torch

from ....hooks import AttentionLayer, KVCacheFormat, PagedBatch
from ...attention._shared import paged_attention, paged_attention_with_mass
from .._shared.quant import dequantize_groups, quantize_groups
from .._shared.reference import live_rows

from . import bases as xb
from .layout import bytes_per_token, offsets, unsupported


# ----------------------------------------------------------------------------- RoPE
def rope(x: torch.Tensor, positions: torch.Tensor, theta: float, inverse: bool = False) -> torch.Tensor:
    """NeoX-style rotary embedding of ``x [T, H, D]`` (float32) at ``positions [T]``, computed as
    vLLM's ``RotaryEmbedding`` builds its cache (float32 ``inv_freq``, ``pos * inv_freq``);
    ``inverse`` undoes it."""
    D = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, D, 2, dtype=torch.float, device=x.device) / D))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    cos, sin = freqs.cos()[:, None, :], freqs.sin()[:, None, :]
    if inverse:
        sin = -sin
    x1, x2 = x[..., : D // 2], x[..., D // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


# --------------------------------------------------------------------------- the basis
class Basis:
    """One layer's decompositions (``u [n, n]``, ``s [n]``, ``bias [n]`` for K and for V) and
    the model's RoPE base: the latent of a key and the key of a latent."""

    def __init__(self, t: dict[str, torch.Tensor], theta: float) -> None:
        self.t, self.theta = t, theta

    def latent(self, x: torch.Tensor, p: str) -> torch.Tensor:
        """``[..., H_kv, D]`` -> the latent, same shape (float32)."""
        flat = x.float().reshape(*x.shape[:-2], -1) - self.t[f"{p}_bias"]
        return ((flat @ self.t[f"{p}_u"]) / self.t[f"{p}_s"]).reshape(x.shape)

    def rematerialise(self, lat: torch.Tensor, p: str) -> torch.Tensor:
        """Inverse of :meth:`latent`."""
        flat = lat.reshape(*lat.shape[:-2], -1) * self.t[f"{p}_s"]
        return (flat @ self.t[f"{p}_u"].T + self.t[f"{p}_bias"]).reshape(lat.shape)


# --------------------------------------------------------------------------- the format
def encode_rows(
    key: torch.Tensor, value: torch.Tensor, positions: torch.Tensor | None, bits: int, G: int, basis: Basis | None
) -> torch.Tensor:
    """The page rows ``[T, H_kv, C]`` (uint8) of ``key``/``value`` ``[T, H_kv, D]`` (post-RoPE, as
    vLLM hands them) at ``positions [T]`` (needed with a basis; -1 is stored without)."""
    T, H, D = key.shape
    if basis is not None:
        k = basis.latent(rope(key.float(), positions, basis.theta, inverse=True), "k")
        v = basis.latent(value, "v")
    else:
        k, v = key.float(), value.float()
    kc, kpar = quantize_groups(k, G, bits)
    vc, vpar = quantize_groups(v, G, bits)
    pos = positions if positions is not None else torch.full((T,), -1, device=key.device)
    pos_bytes = pos.to(torch.int32).contiguous().view(torch.uint8).view(T, 1, 4).expand(T, H, 4)
    return torch.cat([kc, vc, kpar, vpar, pos_bytes], dim=-1)


def decode_block_rows(
    rows: torch.Tensor, D: int, bits: int, G: int, basis: Basis | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(keys, values) ``[n, H_kv, B, D]`` float32 of whole blocks ``rows [n, H_kv, B, C]``:
    rematerialised, with RoPE at the stored positions (a basis), or as stored (``identity``)."""
    vo, kp, vp, pp, _ = offsets(D, bits, G)
    k = dequantize_groups(rows[..., :vo], rows[..., kp:vp], G, bits)
    v = dequantize_groups(rows[..., vo:kp], rows[..., vp:pp], G, bits)
    if basis is None:
        return k, v
    n, H, B, _ = rows.shape
    pos = rows[:, 0, :, pp:].contiguous().view(torch.int32).reshape(n * B)  # [n, B] -> flat
    k = basis.rematerialise(k.permute(0, 2, 1, 3), "k").reshape(n * B, H, D)  # [n, B, H, D] -> tokens
    k = rope(k, pos, basis.theta).reshape(n, B, H, D).permute(0, 2, 1, 3)
    v = basis.rematerialise(v.permute(0, 2, 1, 3), "v").permute(0, 2, 1, 3)
    return k, v


def write(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    positions: torch.Tensor | None,
    bits: int,
    G: int,
    basis: Basis | None,
) -> None:
    """Encode and store ``key``/``value`` ``[T, H_kv, D]`` at ``slot_mapping`` (negative =
    padding) in the uint8 cache ``[N, H_kv, B, C]`` (see the module doc)."""
    D = key.shape[-1]
    what = f"xquant: for head size {D}, bits {bits}, group size {G}"
    n = slot_mapping.shape[0]
    if basis is not None and positions is None:
        raise ValueError(
            "xquant: rematerialising keys needs each written token's position (KVCacheFormat.write's "
            "positions) and this route passed none; use bases: identity, or a route that passes them"
        )
    rows = encode_rows(key[:n], value[:n], None if positions is None else positions[:n], bits, G, basis)
    live = live_rows(slot_mapping, kv_cache, bytes_per_token(D, bits, G), what, rows)
    if live is None:
        return
    blocks, offs, rows = live
    kv_cache[blocks, :, offs] = rows


# ----------------------------------------------------------------------------- plugin
class XQuant(KVCacheFormat):
    """The ``xquant`` storage format (see the module doc). Its bases are read from
    ``params.bases`` on first use (once per process), per layer by the layer's index."""

    #: The page is xquant's own byte rows (no K|V split), indexed as ``[N, H_kv, B, C]``.
    kv_layouts = ("blocked", "packed")

    def __init__(self, params: Any) -> None:
        super().__init__(params)
        self._file: tuple[dict[str, torch.Tensor], dict[str, str]] | None = None
        self._on: dict[Any, Basis] = {}  # (device, layer) -> its basis

    def bytes_per_token(self, head_size: int, block_size: int) -> int:
        return bytes_per_token(head_size, self.params.bits, self.params.group_size)

    def unsupported(self, head_size: int, block_size: int) -> str | None:
        why = unsupported(head_size, self.params.bits, self.params.group_size)
        if why is None and self.params.bases != xb.IDENTITY:
            why = xb.mismatch(xb.read_header(self.params.bases), self.params.bases, head_size=head_size)
        return why

    def basis(
        self, layer: AttentionLayer | None, num_kv_heads: int, head_size: int, device: torch.device
    ) -> Basis | None:
        """The layer's :class:`Basis` on ``device``; None with ``bases: identity``."""
        if self.params.bases == xb.IDENTITY:
            return None
        index = -1 if layer is None else layer.index
        if (device, index) in self._on:
            return self._on[(device, index)]
        if self._file is None:
            self._file = xb.load(self.params.bases)
        t, meta = self._file
        L = int(meta["num_layers"])
        if not 0 <= index < L:
            raise xb.BasesError(
                f"xquant: bases are per decoder layer, and this call gives layer index {index} (the file "
                f"{self.params.bases!r} holds layers 0..{L - 1}); "
                + ("the route must pass the layer" if layer is None else "the model has more layers than the file's")
            )
        why = xb.mismatch(meta, self.params.bases, num_kv_heads=num_kv_heads, head_size=head_size)
        if why:
            raise xb.BasesError(why)
        self._on[(device, index)] = Basis({k: v[index].to(device) for k, v in t.items()}, float(meta["rope_theta"]))
        return self._on[(device, index)]

    def write(self, key, value, kv_cache, slot_mapping, layer=None, positions=None) -> None:
        basis = self.basis(layer, kv_cache.shape[1], key.shape[-1], kv_cache.device)
        write(key, value, kv_cache, slot_mapping, positions, self.params.bits, self.params.group_size, basis)

    def forward(self, query, kv_cache, batch: PagedBatch, layer, observe=None):
        D = query.shape[-1]
        basis = self.basis(layer, kv_cache.shape[1], D, kv_cache.device)
        p = self.params

        def gather(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return decode_block_rows(kv_cache.index_select(0, ids), D, p.bits, p.group_size, basis)

        if observe is not None:
            return paged_attention_with_mass(query, kv_cache, batch, layer, observe, gather=gather)
        return paged_attention(query, kv_cache, batch, layer, gather=gather), None

    def describe(self):
        return self.params.model_dump()
