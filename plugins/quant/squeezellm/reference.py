"""SqueezeLLM in plain PyTorch: the quantiser (sensitivity-weighted k-means per output
channel, dense-and-sparse split) and the reference compute path (dequantise, matmul, add
the sparse part).

Stored per ``[out, in]`` weight (``bits`` = 3 or 4; ``in`` a multiple of 8):

* ``codes`` uint8 ``[out, bits * in / 8]``: the LUT indices as bit planes: bytes
  ``[b*in/8, (b+1)*in/8)`` of a row hold bit ``b`` of the indices, column ``k`` in bit
  ``k % 8`` of byte ``k // 8``;
* ``lut`` float16 ``[out, 2**bits]``: each output channel's centroids;
* the sparse part, CSR per shard (ragged): ``sparse_rowptr`` int32 ``[out+1]``,
  ``sparse_cols`` int32 ``[nnz]``, ``sparse_vals`` float16 ``[nnz]`` = the exact weight minus
  its dense (LUT) value, so dense + sparse gives those weights back in fp16.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ....hooks import QuantMethod, StoredTensor

from .._shared import fallback_once, scratch
from .cpu import dequantize_rows, fused_linear


# ---------------------------------------------------------------------------- packing
def pack_bitplanes(idx: torch.Tensor, bits: int) -> torch.Tensor:
    """``[out, in]`` indices (< 2**bits) -> uint8 ``[out, bits*in/8]`` bit planes."""
    out, n = idx.shape
    if n % 8:
        raise ValueError(f"squeezellm packs 8 columns per byte: in_features {n} is not a multiple of 8")
    idx = idx.to(torch.int32)
    weights = 1 << torch.arange(8, dtype=torch.int32, device=idx.device)
    planes = [(((idx >> b) & 1).view(out, n // 8, 8) * weights).sum(-1) for b in range(bits)]
    return torch.cat(planes, 1).to(torch.uint8)


def unpack_bitplanes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack_bitplanes`: int64 ``[out, in]``."""
    out, width = codes.shape
    n8 = width // bits
    c = codes.to(torch.int64).view(out, bits, n8, 1)
    bit = (c >> torch.arange(8, dtype=torch.int64, device=c.device)) & 1  # [out, bits, n8, 8]
    return (bit.view(out, bits, n8 * 8) << torch.arange(bits, device=c.device).view(1, bits, 1)).sum(1)


# -------------------------------------------------------------------------- quantiser
def weighted_kmeans_rows(w: torch.Tensor, s: torch.Tensor, k: int, iters: int) -> tuple[torch.Tensor, torch.Tensor]:
    """1-D k-means of every row of ``w`` ``[R, C]`` with sample weights ``s`` ``[R, C]``
    (0 leaves a value out). Returns ``(centroids [R, k], assignment [R, C])``, float32/int64.
    Initialised at the rows' weighted quantiles; an empty cluster keeps its centroid."""
    w, s = w.float(), s.float()
    order = w.argsort(1)
    ws = w.gather(1, order)
    cs = s.gather(1, order).cumsum(1)
    total = cs[:, -1:].clamp_min(1e-30)
    qs = (torch.arange(k, dtype=torch.float32, device=w.device) + 0.5) / k
    pos = torch.searchsorted(cs / total, qs.expand(w.shape[0], k).contiguous()).clamp_max(w.shape[1] - 1)
    c = ws.gather(1, pos)
    for _ in range(iters):
        a = (w.unsqueeze(-1) - c.unsqueeze(1)).abs().argmin(-1)
        num = torch.zeros_like(c).scatter_add_(1, a, s * w)
        den = torch.zeros_like(c).scatter_add_(1, a, s)
        c = torch.where(den > 0, num / den.clamp_min(1e-30), c)
    a = (w.unsqueeze(-1) - c.unsqueeze(1)).abs().argmin(-1)
    return c, a


def sparse_mask(w: torch.Tensor, sens: torch.Tensor, outliers: float, sensitive: float) -> torch.Tensor:
    """Weights kept exactly: the ``outliers`` fraction of largest magnitudes and the
    ``sensitive`` fraction of largest sensitivities (of the whole matrix)."""
    mask = torch.zeros(w.shape, dtype=torch.bool, device=w.device)
    n = w.numel()
    for score, frac in ((w.float().abs(), outliers), (sens.float(), sensitive)):
        k = int(round(frac * n))
        if k:
            mask.view(-1)[score.reshape(-1).topk(k).indices] = True
    return mask


def quantize(
    w: torch.Tensor, sens: torch.Tensor | None, bits: int, outliers: float, sensitive: float, iters: int
) -> dict[str, torch.Tensor]:
    out, n = w.shape
    if sens is None:
        sens = torch.ones_like(w, dtype=torch.float32)
    sens = sens.float().clamp_min(0)
    # A small floor so channels with vanishing gradients still fit their values.
    sens = sens + 1e-3 * sens.mean().clamp_min(1e-30)
    mask = sparse_mask(w, sens, outliers, sensitive)
    c, a = weighted_kmeans_rows(w, torch.where(mask, torch.zeros_like(sens), sens), 1 << bits, iters)
    lut = c.to(torch.float16)
    dense = lut.gather(1, a)
    rows, cols = mask.nonzero(as_tuple=True)
    vals = (w.float()[rows, cols] - dense.float()[rows, cols]).to(torch.float16)
    rowptr = torch.zeros(out + 1, dtype=torch.int32, device=w.device)
    rowptr[1:] = torch.bincount(rows, minlength=out).cumsum(0).to(torch.int32)
    return {
        "codes": pack_bitplanes(a, bits),
        "lut": lut,
        "sparse_rowptr": rowptr,
        "sparse_cols": cols.to(torch.int32),
        "sparse_vals": vals,
    }


# ---------------------------------------------------------------------------- compute
def dequantize(codes: torch.Tensor, lut: torch.Tensor, bits: int) -> torch.Tensor:
    """The dense part ``[out, in]`` in the LUT's dtype."""
    return lut.gather(1, unpack_bitplanes(codes, bits))


def add_sparse(
    y: torch.Tensor, x: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, vals: torch.Tensor
) -> torch.Tensor:
    """``y + x @ S.T`` for the sparse ``S`` given as COO (``rows``, ``cols``, ``vals``)."""
    if rows.numel() == 0:
        return y
    y2 = y.reshape(-1, y.shape[-1])
    contrib = x.reshape(-1, x.shape[-1])[:, cols].float() * vals.float()
    return y2.float().index_add_(1, rows, contrib).to(y.dtype).reshape(y.shape)


class SqueezeLLM(QuantMethod):
    needs_calibration = True

    def quantize(self, weight, sensitivity=None):
        p = self.params
        return quantize(weight, sensitivity, p.bits, p.outliers, p.sensitive, p.kmeans_iters)

    def checkpoint_params(self):
        return self.params.model_dump(mode="json", exclude={"kernel", "cpu_weights", "cpu_dequant"})

    def error_bound(self, layer):
        # measured on the kit's layers (fp16 and fp32; outliers and sensitive 0 to the defaults):
        # 4 bits at most 0.122 random, 0.159 structured; 3 bits 0.192 and 0.276
        if self.params.bits == 4:
            return 0.17 if layer == "random" else 0.22
        return 0.27 if layer == "random" else 0.38

    def stored_tensors(self, out_features, in_features):
        b = self.params.bits
        return {
            "codes": StoredTensor((out_features, b * in_features // 8), "uint8"),
            "lut": StoredTensor((out_features, 1 << b), "float16"),
            "sparse_rowptr": StoredTensor((-1,), "int32", ragged=True),
            "sparse_cols": StoredTensor((-1,), "int32", ragged=True),
            "sparse_vals": StoredTensor((-1,), "float16", ragged=True),
        }

    def verify(self, shard):
        rows = shard["codes"].shape[0]
        ptr, cols, vals = shard["sparse_rowptr"], shard["sparse_cols"], shard["sparse_vals"]
        n_in = shard["codes"].shape[1] * 8 // self.params.bits
        if ptr.numel() != rows + 1:
            raise ValueError(f"sparse_rowptr: {ptr.numel()} entries, expected {rows + 1}")
        if int(ptr[0]) != 0 or bool((ptr[1:] < ptr[:-1]).any()) or int(ptr[-1]) != cols.numel():
            raise ValueError(f"sparse_rowptr: not a CSR row pointer for {cols.numel()} values")
        if vals.numel() != cols.numel():
            raise ValueError(f"sparse_vals: {vals.numel()} values for {cols.numel()} columns")
        if cols.numel() and (int(cols.min()) < 0 or int(cols.max()) >= n_in):
            raise ValueError(f"sparse_cols: column out of range(0, {n_in})")
        if not bool(torch.isfinite(shard["lut"]).all()) or not bool(torch.isfinite(vals).all()):
            raise ValueError("lut/sparse_vals: non-finite values")

    def load(self, stored, shard_rows):
        rows, cols, vals = [], [], []
        base = 0
        for ptr, c, v in zip(stored["sparse_rowptr"], stored["sparse_cols"], stored["sparse_vals"]):
            n = ptr.numel() - 1
            rows.append(torch.repeat_interleave(torch.arange(n, device=ptr.device) + base, (ptr[1:] - ptr[:-1]).long()))
            cols.append(c.long())
            vals.append(v)
            base += n

        def cat(t):
            return t[0] if len(t) == 1 else torch.cat(t, 0)

        out = {
            "codes": cat(stored["codes"]),
            "lut": cat(stored["lut"]),
            "sparse_rows": torch.cat(rows),
            "sparse_cols": torch.cat(cols),
            "sparse_vals": torch.cat(vals),
        }
        if self.params.kernel == "reference" and self.params.cpu_weights == "indices":
            out["indices"] = unpack_bitplanes(out["codes"], self.params.bits).to(torch.uint8)
            # the sparse part as CSR over the joined rows too (the fused CPU path's)
            counts = torch.bincount(out["sparse_rows"], minlength=out["codes"].shape[0])
            out["sparse_rowptr"] = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
        return out

    def dense_from_indices(self, tensors, reuse: bool = False) -> torch.Tensor:
        """The dense part from the byte indices: the C++ loop (``cpu_dequant: cpp``; into a
        buffer reused from call to call with ``reuse``), else a torch gather. The same values
        either way (the LUT's, widened exactly)."""
        if self.params.cpu_dequant == "cpp":
            idx = tensors["indices"]
            w, reason = dequantize_rows(
                idx, tensors["lut"], scratch(idx.shape, torch.float32, idx.device) if reuse else None
            )
            if w is not None:
                return w
            fallback_once("squeezellm", "dequantisation", reason, "cpu_dequant")
        return tensors["lut"].gather(1, tensors["indices"].long())

    def apply(self, tensors, x, bias):
        if self.params.kernel == "triton":
            from .kernel import lut_matmul

            y = lut_matmul(x, tensors["codes"], tensors["lut"], self.params.bits)
        elif "indices" in tensors:  # unpacked once at load: the same weight, without the unpacking
            y = None
            if self.params.cpu_dequant == "cpp":  # decode-sized: the weight never written out
                y = fused_linear(x.reshape(-1, x.shape[-1]), tensors)
            if y is not None:  # the sparse part included
                y = y.to(x.dtype).reshape(*x.shape[:-1], y.shape[-1])
                return y if bias is None else y + bias
            y = F.linear(x, self.dense_from_indices(tensors, reuse=True).to(x.dtype))
        else:
            y = F.linear(x, dequantize(tensors["codes"], tensors["lut"], self.params.bits).to(x.dtype))
        y = add_sparse(y, x, tensors["sparse_rows"], tensors["sparse_cols"], tensors["sparse_vals"])
        return y if bias is None else y + bias
