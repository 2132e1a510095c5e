"""The MILLION page format (product-quantised K and V) and its paged attention through
query-centroid lookup tables, in plain PyTorch: the CPU path (no Triton kernel yet).

Product quantisation (Wang et al. 2025, MILLION, arXiv:2504.03661)
------------------------------------------------------------------
A key or value head vector ``x`` of ``D`` channels is cut into ``M = D / sub_dim`` sub-vectors
``x_m`` of ``sub_dim`` contiguous channels. Sub-space ``m`` of KV head ``h`` in layer ``l`` has
its own codebook of ``K = 2**bits`` centroids ``C[l, h, m, k]`` (calibrated offline on the
model by k-means: ``vllm-graft calibrate million``; one codebook for keys, one for values).
``x`` is stored as ``M`` codes, ``code_m = argmin_k |x_m - C[l, h, m, k]|^2``, and read back as
the concatenation of its centroids.

Page layout
-----------
vLLM gives each layer a ``uint8`` cache ``[num_blocks, H_kv, B, C]``; ``C = 2 * CB`` where
``CB = ceil(M * bits / 8)`` (:func:`.layout.bytes_per_token`). Row ``t`` of block ``b``, head
``h`` holds the token's key codes at bytes ``[0, CB)`` and its value codes at ``[CB, C)``: one
byte per code with ``bits`` 8; with ``bits`` 4 byte ``j`` = ``code[2j] | code[2j+1] << 4``.
Nothing else is stored per token or per block: no scales (the codebooks are the only
parameters, held outside the paged pool: ``2 * L * H_kv * D * K`` floats in all). A token is
encoded from its own K/V alone, so a write touches only its own row (no block state).

Attention
---------
Decode rows (one query each) never rebuild keys: for query head ``q`` (reading KV head ``h``)
the lookup table ``T[m, k] = scale * q_m . C_K[h, m, k]`` (``M x K`` entries) gives each cached
token's score as ``sum_m T[m, code_m]``. The softmax probabilities ``p_t`` are then summed per
value centroid, ``W[m, k] = sum_{t: vcode_m(t) = k} p_t``, and the output's sub-vector ``m`` is
``sum_k W[m, k] C_V[h, m, k]``: the values are rebuilt from the value codebooks only as this
weighted sum, never token by token. Rows with several queries (prefill chunks) read the
decoded K/V through the shared fused causal attention (``q . k`` over decoded keys is the
lookup-table sum up to float rounding; for a chunk of ``n`` queries over ``L`` tokens the
tables cost more than decoding, ``n * L * M`` gathers against ``L * D`` reads). With
``observe`` (an eviction compressor that needs scores) the shared exact attention with mass
runs over the decoded blocks.

What vLLM's paged cache changes from the paper: the prefill chunk's own tokens are read back
from the cache after they are written (vLLM writes a step's K/V before its attention), so the
prompt's attention already sees quantised K/V, where MILLION's prefill attends to the
full-precision ones; and no window of recent tokens is kept in full precision (it would live
outside vLLM's block accounting).
"""

from __future__ import annotations

from typing import Any

import torch

from ....hooks import AttentionLayer, KVCacheFormat, PagedBatch
from ...attention._shared import flat_blocks, fused_causal_attention, paged_attention_with_mass
from .._shared.reference import live_slots

from . import codebooks as cb
from .layout import bytes_per_token, unsupported

#: float elements of a [tokens x heads x sub-spaces x centroids] intermediate per chunk
_BUDGET = 1 << 23


# --------------------------------------------------------------------------- the format
def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes ``[..., M]`` -> bytes ``[..., CB]``."""
    c = codes.to(torch.uint8)
    return c if bits == 8 else c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """bytes ``[..., CB]`` -> codes ``[..., M]`` (int64, for indexing)."""
    if bits == 8:
        return packed.long()
    return torch.stack([packed & 15, packed >> 4], dim=-1).flatten(-2).long()


def encode(x: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
    """Vectors ``x [T, H, D]`` -> nearest-centroid codes ``[T, H, M]`` (uint8), against
    ``centroids [H, M, K, d]``."""
    T, H, D = x.shape
    _, M, K, d = centroids.shape
    xs = x.float().reshape(T, H, M, d)
    c = centroids.float()
    cn = (c * c).sum(-1)  # [H, M, K]; |x_m|^2 is the same for every k and drops out
    out = torch.empty(T, H, M, dtype=torch.uint8, device=x.device)
    step = max(1, _BUDGET // max(1, H * M * K))
    for s in range(0, T, step):
        d2 = cn - 2 * torch.einsum("thmd,hmkd->thmk", xs[s : s + step], c)
        out[s : s + step] = d2.argmin(dim=-1).to(torch.uint8)
    return out


def decode(codes: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
    """Codes ``[..., H, X, M]`` (any integer dtype) -> vectors ``[..., H, X, D]`` (float32),
    each sub-vector the centroid its code names in its head's and sub-space's codebook."""
    H, M, _, d = centroids.shape
    h = torch.arange(H, device=codes.device).view(H, 1, 1)
    m = torch.arange(M, device=codes.device).view(1, 1, M)
    out = centroids.float()[h, m, codes.long()]  # [..., H, X, M, d]
    return out.reshape(*out.shape[:-2], M * d)


def decode_block_rows(
    rows: torch.Tensor, ck: torch.Tensor, cv: torch.Tensor, bits: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(keys, values) ``[..., H, B, D]`` float32 of whole blocks ``rows [..., H, B, C]``."""
    half = rows.shape[-1] // 2
    return decode(unpack_codes(rows[..., :half], bits), ck), decode(unpack_codes(rows[..., half:], bits), cv)


def write(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    ck: torch.Tensor,
    cv: torch.Tensor,
    bits: int,
) -> None:
    """Encode and store ``key``/``value`` ``[T, H_kv, D]`` at ``slot_mapping`` (negative =
    padding) in the uint8 cache ``[N, H_kv, B, C]`` (see the module doc)."""
    N, H, B, C = kv_cache.shape
    D = key.shape[-1]
    sub_dim = ck.shape[-1]
    what = f"million: for head size {D}, sub_dim {sub_dim}, bits {bits}"
    rows = live_slots(key, value, slot_mapping, kv_cache, bytes_per_token(D, sub_dim, bits), what)
    if rows is None:
        return
    blocks, offs, key, value = rows
    half = C // 2
    kv_cache[blocks, :, offs, :half] = pack_codes(encode(key, ck), bits)
    kv_cache[blocks, :, offs, half:] = pack_codes(encode(value, cv), bits)


# -------------------------------------------------------------------------- attention
def lut_decode_attention(
    q: torch.Tensor,
    kcodes: torch.Tensor,
    vcodes: torch.Tensor,
    lens: torch.Tensor,
    ck: torch.Tensor,
    cv: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One query per sequence through the lookup tables: ``q [S, H, D]``, codes
    ``[S, H_kv, T, M]`` (int64), ``lens [S]`` (tokens each sequence reads; the codes past them
    are ignored) -> ``out [S, H, D]`` float32."""
    S, H, D = q.shape
    Hkv, M, K, d = ck.shape
    g = H // Hkv
    T = kcodes.shape[2]
    off = torch.arange(M, device=q.device) * K
    lut = torch.einsum("shgmd,hmkd->shgmk", q.float().reshape(S, Hkv, g, M, d), ck.float()) * scale
    kidx = (kcodes + off).reshape(S, Hkv, 1, T * M).expand(S, Hkv, g, T * M)
    s = lut.reshape(S, Hkv, g, M * K).gather(-1, kidx).view(S, Hkv, g, T, M).sum(-1)
    past = torch.arange(T, device=q.device)[None, :] >= lens[:, None]
    p = torch.softmax(s.masked_fill(past[:, None, None, :], float("-inf")), dim=-1)  # [S, Hkv, g, T]
    vidx = (vcodes + off).reshape(S, Hkv, 1, T * M).expand(S, Hkv, g, T * M)
    w = torch.zeros(S, Hkv, g, M * K, device=q.device)
    w.scatter_add_(-1, vidx, p[..., None].expand(S, Hkv, g, T, M).reshape(S, Hkv, g, T * M))
    out = torch.einsum("shgmk,hmkd->shgmd", w.view(S, Hkv, g, M, K), cv.float())
    return out.reshape(S, H, D)


def paged_attention_million(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    batch: PagedBatch,
    layer: AttentionLayer,
    ck: torch.Tensor,
    cv: torch.Tensor,
    bits: int,
    observe: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Causal attention of ``query [T, H, D]`` over the million cache: ``(out, mass)`` (the
    mass ``[num_seqs, max_blocks]`` only with ``observe``, as ``KVCompressor.attend``)."""
    if observe is not None:
        return paged_attention_with_mass(
            query,
            kv_cache,
            batch,
            layer,
            observe,
            gather=lambda ids: decode_block_rows(kv_cache[ids], ck, cv, bits),
        )
    T, H, D = query.shape
    _, Hkv, B, C = kv_cache.shape
    M = ck.shape[1]
    half = C // 2
    qsl = batch.query_start_loc.tolist()
    lens = batch.seq_lens.tolist()
    out = torch.zeros(T, H, D, dtype=query.dtype, device=query.device)
    decode_rows = [i for i in range(len(lens)) if qsl[i + 1] - qsl[i] == 1 and lens[i] > 0]
    if decode_rows:
        nb = max(-(-lens[i] // B) for i in decode_rows)
        per = max(1, _BUDGET // max(1, H * nb * B * M))  # sequences per chunk
        for c0 in range(0, len(decode_rows), per):
            seqs = decode_rows[c0 : c0 + per]
            S = len(seqs)
            ids = batch.block_table[seqs, :nb].long()  # columns past a row's blocks are masked
            pages = kv_cache[ids]  # [S, nb, Hkv, B, C]
            kc = unpack_codes(pages[..., :half], bits).permute(0, 2, 1, 3, 4).reshape(S, Hkv, nb * B, M)
            vc = unpack_codes(pages[..., half:], bits).permute(0, 2, 1, 3, 4).reshape(S, Hkv, nb * B, M)
            rows = torch.tensor([qsl[i] for i in seqs], device=query.device)
            seq_lens = torch.tensor([lens[i] for i in seqs], device=query.device)
            o = lut_decode_attention(query[rows], kc, vc, seq_lens, ck, cv, layer.scale)
            out[rows] = o.to(out.dtype)
    for i in range(len(lens)):
        q0, q1 = qsl[i], qsl[i + 1]
        L = lens[i]
        if q1 - q0 <= 1 or L <= 0:
            continue
        k, v = decode_block_rows(kv_cache[batch.block_table[i, : -(-L // B)].long()], ck, cv, bits)
        out[q0:q1] = fused_causal_attention(query[q0:q1], flat_blocks(k, L), flat_blocks(v, L), layer.scale).to(
            out.dtype
        )
    return out, None


# ----------------------------------------------------------------------------- plugin
class Million(KVCacheFormat):
    """The ``million`` storage format (see the module doc). Its codebooks are read from
    ``params.codebooks`` on first use (once per process), per layer by the layer's index."""

    #: The page is million's own byte rows (no K|V split): written and read by indexing the
    #: 4-D ``[N, H_kv, B, C]`` view, which follows its strides in either layout.
    kv_layouts = ("blocked", "packed")

    def __init__(self, params: Any) -> None:
        super().__init__(params)
        self._file: tuple[torch.Tensor, torch.Tensor, dict[str, str]] | None = None
        self._on: dict[Any, tuple[torch.Tensor, torch.Tensor]] = {}  # (device, layer) -> codebooks

    @property
    def bits(self) -> int:
        return self.params.bits

    def bytes_per_token(self, head_size: int, block_size: int) -> int:
        return bytes_per_token(head_size, self.params.sub_dim, self.params.bits)

    def unsupported(self, head_size: int, block_size: int) -> str | None:
        why = unsupported(head_size, self.params.sub_dim, self.params.bits)
        if why is None and self.params.codebooks != cb.GAUSSIAN:
            meta = cb.read_header(self.params.codebooks)
            why = cb.mismatch(
                meta, self.params.codebooks, head_size=head_size, sub_dim=self.params.sub_dim, bits=self.params.bits
            )
        return why

    def codebooks(
        self, layer: AttentionLayer | None, num_kv_heads: int, head_size: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(keys, values)`` centroids ``[H_kv, M, K, sub_dim]`` of the layer, on ``device``."""
        p = self.params
        if p.codebooks == cb.GAUSSIAN:
            key: Any = (device, "gaussian", num_kv_heads, head_size)
            if key not in self._on:
                c = cb.gaussian_centroids(p.sub_dim, p.bits).to(device)
                M = head_size // p.sub_dim
                books = c.expand(num_kv_heads, M, *c.shape)
                self._on[key] = (books, books)
            return self._on[key]
        index = -1 if layer is None else layer.index
        key = (device, index)
        if key in self._on:
            return self._on[key]
        if self._file is None:
            self._file = cb.load(p.codebooks)
        keys, values, meta = self._file
        L = keys.shape[0]
        if not 0 <= index < L:
            raise cb.CodebookError(
                f"million: codebooks are per decoder layer, and this call gives layer index {index} "
                f"(the file {p.codebooks!r} holds layers 0..{L - 1}); "
                + (
                    "the route passes no layer to write(): it must (KVCacheFormat.write's layer argument)"
                    if layer is None
                    else "the model has more layers than the model the file was calibrated on"
                )
            )
        # under tensor parallelism this rank holds num_kv_heads of the model's (vLLM's split)
        tp = 1 if layer is None else layer.tp_size
        total = int(meta.get("num_kv_heads", -1))
        model_heads = total if num_kv_heads == max(1, total // tp) else num_kv_heads * tp
        why = cb.mismatch(
            meta, p.codebooks, num_kv_heads=model_heads, head_size=head_size, sub_dim=p.sub_dim, bits=p.bits
        )
        if why:
            raise cb.CodebookError(why)
        first = 0 if layer is None else layer.first_kv_head(total)
        heads = slice(first, first + num_kv_heads)
        self._on[key] = (keys[index, heads].to(device), values[index, heads].to(device))
        return self._on[key]

    def write(self, key, value, kv_cache, slot_mapping, layer=None) -> None:
        ck, cv = self.codebooks(layer, kv_cache.shape[1], key.shape[-1], kv_cache.device)
        write(key, value, kv_cache, slot_mapping, ck, cv, self.params.bits)

    def forward(self, query, kv_cache, batch, layer, observe=None):
        ck, cv = self.codebooks(layer, kv_cache.shape[1], query.shape[-1], kv_cache.device)
        return paged_attention_million(query, kv_cache, batch, layer, ck, cv, self.params.bits, observe)

    def describe(self):
        return self.params.model_dump()
