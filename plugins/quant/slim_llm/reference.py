"""SliM-LLM in plain PyTorch: the salience, the bit allocation at an exact average, the
per-group quantiser and its packing, and the reference compute path (dequantise, matmul).

Groups. Row ``r`` of a weight ``[out, in]`` is cut into ``G = ceil(in / group_size)`` groups of
``group_size`` consecutive input columns (the last one shorter when ``group_size`` does not
divide ``in``). Group ``(r, g)`` is quantised at its own width ``b[r, g]`` in
``{bits - spread, bits, bits + spread}``.

Salience (what this file computes). With ``h[r, j]`` the importance of weight ``(r, j)``:

* ``calibration: activations`` (the default of ``vllm-graft quantize``): ``h[r, j] = E[x_j^2]``,
  the mean squared input activation of channel ``j`` over the calibration tokens, i.e.
  ``diag(X^T X) / T``, the same for every row;
* ``calibration: gradients``: ``h[r, j]`` the summed squared gradient of the loss (the
  diagonal Fisher squeezellm uses);
* ``calibration: none`` (online quantisation, which sees no calibration data): ``h = 1``;

the salience of group ``(r, g)`` is ``S[r, g] = sum_{j in g} h[r, j] * w[r, j]^2``: the
activation-weighted weight magnitude, the expected squared output a group carries. The paper
(as we read it) takes the OBS/SparseGPT salience ``w^2 / [H^-1]_jj^2`` with the full inverse of
the Hessian ``H = 2 X^T X``; here the Hessian is taken as diagonal (no inverse, no
off-diagonal terms), which is the diag(X^T X)-weighted magnitude above.

Allocation (exact average). In each row the full-length groups are ranked by salience; the
``k`` most salient get ``bits + spread`` and the ``k`` least salient ``bits - spread``, the
rest (and a shorter last group) ``bits``. Every row therefore holds exactly ``bits * in``
code bits. ``k`` is ``raised_fraction`` of the row's full groups, or (default) searched per
row over ``0 .. n_full // 2``: the ``k`` with the least salience-weighted quantisation error
``sum_j h[r, j] (w[r, j] - w_hat[r, j])^2`` (the expected squared output error of the row
under diagonal activation statistics). The paper searches the number of raised/lowered groups
per layer against the layer's output error and shares one width across a column block of all
rows; here the allocation is per row, so that every row stores the same number of bytes (a
fixed ``[out, bits * in / 8]`` codes tensor, rows independent, as vLLM's row-wise fusing of
q/k/v and gate/up shards needs).

Quantiser. Per group, uniform asymmetric min-max over ``[min(w, 0), max(w, 0)]`` (zero kept
on the grid): ``step = range / (2^b - 1)`` in fp16, integer ``zero``, codes
``clamp(round(w / step) + zero, 0, 2^b - 1)``, ``w_hat = (code - zero) * step``. The paper's
SliM-LLM quantises with GPTQ (Hessian error compensation) and tunes each group's step with its
salience-weighted quantiser calibration (SQC); neither is done here. SliM-LLM+ (OmniQuant-style
learned clipping) is out of scope.

Stored per ``[out, in]`` weight (``in`` a multiple of 8), no name containing "scale" (vLLM's
Llama loader renames those):

* ``codes`` uint8 ``[out, bits * in / 8]``: each row's groups in order; group ``g`` of width
  ``b`` takes ``b * len_g / 8`` bytes, its codes as ``b`` bit planes of ``len_g / 8`` bytes
  each (plane ``p`` holds bit ``p`` of the group's codes, column ``c`` of the group in bit
  ``c % 8`` of the plane's byte ``c // 8``);
* ``group_bits`` uint8 ``[out, G]``: the bit map (each group's width);
* ``group_step`` float16 ``[out, G]`` and ``group_zero`` uint8 ``[out, G]``.

Bits per weight stored: ``bits + 32 * G / in`` (``bits + 32 / group_size`` when ``group_size``
divides ``in``: 3.25 at the defaults), see :func:`stored_bits_per_weight`.

Compute: ``apply`` unpacks nothing per call: :meth:`SliMLLM.load` unpacks the codes once to one
byte per weight, and each call dequantises them (``(code - zero) * step``) and multiplies
(``F.linear``). There is no Triton kernel for the mixed-width GEMM yet.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ....hooks import QuantMethod, StoredTensor


# ------------------------------------------------------------------------------ layout
def group_lengths(n_in: int, group_size: int) -> list[int]:
    """The column count of each of a row's groups (the last one may be shorter)."""
    full, tail = divmod(n_in, group_size)
    return [group_size] * full + ([tail] if tail else [])


def stored_bits_per_weight(n_out: int, n_in: int, bits: int, group_size: int) -> float:
    """Bits stored per weight: the codes (exactly ``bits`` on average) and, per group, the fp16
    step, the uint8 zero point and the uint8 bit map entry."""
    G = len(group_lengths(n_in, group_size))
    return (n_out * bits * n_in + n_out * G * (16 + 8 + 8)) / (n_out * n_in)


def _byte_layout(group_bits: torch.Tensor, n_in: int, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For every code byte column ``k`` (columns ``8k .. 8k+7``) of every row: the byte where
    plane 0 of that column byte lies in the row's codes, ``[out, in/8]``, and each group's
    plane length in bytes per column byte, ``[in/8]`` (plane ``p`` lies ``p * len / 8`` further)."""
    lens = torch.tensor(group_lengths(n_in, group_size), dtype=torch.int64, device=group_bits.device)
    nbytes = group_bits.to(torch.int64) * (lens // 8)  # [out, G]: bytes of each group
    start = torch.cumsum(nbytes, 1) - nbytes  # exclusive: where each group begins
    k = torch.arange(n_in // 8, device=group_bits.device)
    g = (8 * k) // group_size
    local = k - g * (group_size // 8)  # byte column inside its group's plane
    return start[:, g] + local, (lens // 8)[g]


def pack_codes(q: torch.Tensor, group_bits: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
    """Codes ``q`` ``[out, in]`` (group ``(r, g)`` below ``2**group_bits[r, g]``) -> uint8
    ``[out, bits * in / 8]`` (the layout of the module docstring; every row's widths average
    ``bits``)."""
    out, n = q.shape
    width = bits * n // 8
    base, plane_len = _byte_layout(group_bits, n, group_size)
    gb = group_bits.to(torch.int64)[:, (8 * torch.arange(n // 8, device=q.device)) // group_size]
    q8 = q.to(torch.int32).view(out, n // 8, 8)
    weights = 1 << torch.arange(8, dtype=torch.int32, device=q.device)
    codes = torch.zeros(out, width + 1, dtype=torch.int64, device=q.device)  # +1: a sink for unused planes
    for p in range(int(group_bits.max()) if group_bits.numel() else 0):
        plane = (((q8 >> p) & 1) * weights).sum(-1)  # [out, in/8]
        dest = torch.where(p < gb, base + p * plane_len, torch.full_like(base, width))
        codes.scatter_(1, dest, plane)
    return codes[:, :width].to(torch.uint8)


def unpack_codes(codes: torch.Tensor, group_bits: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: uint8 ``[out, in]`` codes (``in = 8 * width / bits``)."""
    out, width = codes.shape
    n = 8 * width // bits
    base, plane_len = _byte_layout(group_bits, n, group_size)
    gb = group_bits.to(torch.int64)[:, (8 * torch.arange(n // 8, device=codes.device)) // group_size]
    src = torch.cat([codes, codes.new_zeros(out, 1)], 1).to(torch.int32)
    q = torch.zeros(out, n // 8, 8, dtype=torch.int32, device=codes.device)
    shifts = torch.arange(8, dtype=torch.int32, device=codes.device)
    for p in range(int(group_bits.max()) if group_bits.numel() else 0):
        plane = src.gather(1, torch.where(p < gb, base + p * plane_len, torch.full_like(base, width)))
        q |= ((plane.unsqueeze(-1) >> shifts) & 1) << p
    return q.view(out, n).to(torch.uint8)


# --------------------------------------------------------------------------- quantiser
def _groups(t: torch.Tensor, group_size: int) -> torch.Tensor:
    """``[out, in]`` -> ``[out, G, group_size]``, the last group zero-padded."""
    out, n = t.shape
    G = -(-n // group_size)
    return F.pad(t, (0, G * group_size - n)).view(out, G, group_size)


def quantize_groups(w: torch.Tensor, group_bits: torch.Tensor, group_size: int):
    """Uniform asymmetric quantisation of every group ``(r, g)`` at width ``group_bits[r, g]``:
    ``(codes [out, in] int64, step fp16 [out, G], zero uint8 [out, G], w_hat float32 [out, in])``.
    The grid spans ``[min(w, 0), max(w, 0)]`` (zero exactly on it); the fp16 step is the one
    quantised with."""
    out, n = w.shape
    wg = _groups(w.float(), group_size)  # padding zeros lie inside [min(w,0), max(w,0)]: no effect
    levels = ((1 << group_bits.to(torch.int64)) - 1).float()  # [out, G]
    lo = wg.amin(-1).clamp(max=0)
    hi = wg.amax(-1).clamp(min=0)
    step = ((hi - lo) / levels).clamp_min(1e-6).to(torch.float16)
    s = step.float()
    zero = torch.round(-lo / s).clamp(min=torch.zeros_like(levels), max=levels)
    q = (torch.round(wg / s[..., None]) + zero[..., None]).clamp(min=0).minimum(levels[..., None])
    w_hat = (q - zero[..., None]) * s[..., None]
    return (
        q.view(out, -1)[:, :n].to(torch.int64),
        step,
        zero.to(torch.uint8),
        w_hat.view(out, -1)[:, :n],
    )


def importance(w: torch.Tensor, sensitivity: torch.Tensor | None) -> torch.Tensor:
    """``h [out, in]`` float32: ``sensitivity`` ``[in]`` (mean squared activations, broadcast
    over rows) or ``[out, in]`` (squared gradients), or ones; a floor of 1e-3 of its mean keeps
    channels the calibration never excited in the error."""
    if sensitivity is None:
        return torch.ones(w.shape, dtype=torch.float32, device=w.device)
    h = sensitivity.to(device=w.device, dtype=torch.float32).clamp_min(0)
    if h.dim() == 1:
        if h.shape[0] != w.shape[1]:
            raise ValueError(f"sensitivity has {h.shape[0]} channels for a weight with {w.shape[1]} input columns")
        h = h.expand(w.shape[0], -1)
    elif tuple(h.shape) != tuple(w.shape):
        raise ValueError(f"sensitivity {tuple(h.shape)} does not match the weight {tuple(w.shape)}")
    return h + 1e-3 * h.mean().clamp_min(1e-30)


def group_salience(w: torch.Tensor, h: torch.Tensor, group_size: int) -> torch.Tensor:
    """``S [out, G] = sum_{j in g} h[r, j] * w[r, j]^2``."""
    return _groups(h * w.float() ** 2, group_size).sum(-1)


def group_errors(w: torch.Tensor, w_hat: torch.Tensor, h: torch.Tensor, group_size: int) -> torch.Tensor:
    """``[out, G]``: ``sum_{j in g} h[r, j] * (w - w_hat)^2``."""
    return _groups(h * (w.float() - w_hat) ** 2, group_size).sum(-1)


def allocate(
    salience: torch.Tensor,
    err: dict[int, torch.Tensor],
    n_full: int,
    bits: int,
    spread: int,
    raised_fraction: float | None,
) -> torch.Tensor:
    """The bit map ``[out, G]`` (int64): in each row, the ``k`` most salient of the first
    ``n_full`` groups at ``bits + spread``, the ``k`` least salient at ``bits - spread``, the rest
    at ``bits``. ``k = round(raised_fraction * n_full)`` (at most ``n_full // 2``), or, with
    ``raised_fraction`` None, the ``k`` in ``0 .. n_full // 2`` whose summed group error
    (``err[width] [out, G]``) is least (the smallest such ``k`` on a tie)."""
    out, G = salience.shape
    group_bits = torch.full((out, G), bits, dtype=torch.int64, device=salience.device)
    kmax = n_full // 2
    if spread == 0 or kmax == 0:
        return group_bits
    order = salience[:, :n_full].argsort(dim=1, descending=True, stable=True)  # most salient first
    if raised_fraction is not None:
        k = torch.full((out,), min(int(round(raised_fraction * n_full)), kmax), device=salience.device)
    else:
        e = {b: err[b][:, :n_full].gather(1, order) for b in (bits - spread, bits, bits + spread)}
        gain_hi = torch.cumsum(e[bits + spread] - e[bits], 1)[:, :kmax]  # raising the top 1..kmax
        gain_lo = torch.cumsum((e[bits - spread] - e[bits]).flip(1), 1)[:, :kmax]  # lowering the bottom
        cost = torch.cat([torch.zeros(out, 1, device=salience.device), gain_hi + gain_lo], 1)  # k = 0..kmax
        k = cost.argmin(1)
    rank = torch.arange(n_full, device=salience.device).expand(out, -1)
    sorted_bits = torch.full((out, n_full), bits, dtype=torch.int64, device=salience.device)
    sorted_bits[rank < k[:, None]] = bits + spread
    sorted_bits[rank >= n_full - k[:, None]] = bits - spread
    group_bits[:, :n_full] = torch.empty_like(sorted_bits).scatter_(1, order, sorted_bits)
    return group_bits


def quantize(
    w: torch.Tensor,
    sensitivity: torch.Tensor | None,
    bits: int,
    group_size: int,
    spread: int,
    raised_fraction: float | None,
) -> dict[str, torch.Tensor]:
    out, n = w.shape
    if n % 8:
        raise ValueError(f"slim-llm packs 8 columns per byte: in_features {n} is not a multiple of 8")
    h = importance(w, sensitivity)
    G = -(-n // group_size)
    n_full = n // group_size
    err = {}
    if spread and raised_fraction is None:
        for b in (bits - spread, bits, bits + spread):
            full = torch.full((out, G), b, dtype=torch.int64, device=w.device)
            err[b] = group_errors(w, quantize_groups(w, full, group_size)[3], h, group_size)
    group_bits = allocate(group_salience(w, h, group_size), err, n_full, bits, spread, raised_fraction)
    q, step, zero, _ = quantize_groups(w, group_bits, group_size)
    gb = group_bits.to(torch.uint8)
    return {
        "codes": pack_codes(q, gb, bits, group_size),
        "group_bits": gb,
        "group_step": step,
        "group_zero": zero,
    }


# ----------------------------------------------------------------------------- compute
def dequantize(q: torch.Tensor, step: torch.Tensor, zero: torch.Tensor, group_size: int) -> torch.Tensor:
    """float32 ``[out, in]`` from the unpacked codes ``q`` (uint8 ``[out, in]``)."""
    g = torch.arange(q.shape[1], device=q.device) // group_size
    return (q.float() - zero.float()[:, g]) * step.float()[:, g]


class SliMLLM(QuantMethod):
    @property
    def needs_calibration(self) -> bool:
        """Whether ``vllm-graft quantize`` calibrates (with :attr:`calibration_statistic`)."""
        return self.params.calibration != "none"

    @property
    def calibration_statistic(self) -> str:
        """``activations``: ``quantize`` gets ``sensitivity`` ``[in]``, mean squared inputs;
        ``gradients``: ``[out, in]`` squared gradients."""
        return self.params.calibration

    def quantize(self, weight, sensitivity=None):
        p = self.params
        return quantize(weight, sensitivity, p.bits, p.group_size, p.spread, p.raised_fraction)

    def error_bound(self, layer):
        # measured on the kit's layers (float32, float16, bfloat16; group_size 8 to 4096): uniform
        # width b (spread 0, or the searched allocation, which never errs more than b alone in
        # the weight) at most 0.56/0.37 (b=2), 0.231/0.162 (3), 0.110/0.053 (4), 0.056/0.026 (5),
        # 0.013/0.007 (7), random/structured; a forced raised_fraction is bounded by its lowest
        # width (bits 3 spread 2 at 0.5: 0.69/0.20)
        p = self.params
        b = p.bits if p.raised_fraction is None or p.spread == 0 else p.bits - p.spread
        if layer == "random":
            return {1: 0.95, 2: 0.65}.get(b, 0.3 * 2.0 ** (3 - b))
        return {1: 0.6, 2: 0.45}.get(b, 0.2 * 2.0 ** (3 - b))

    def stored_tensors(self, out_features, in_features):
        p = self.params
        G = -(-in_features // p.group_size)
        return {
            "codes": StoredTensor((out_features, p.bits * in_features // 8), "uint8"),
            "group_bits": StoredTensor((out_features, G), "uint8"),
            "group_step": StoredTensor((out_features, G), "float16"),
            "group_zero": StoredTensor((out_features, G), "uint8"),
        }

    def verify(self, shard):
        p = self.params
        gb = shard["group_bits"].to(torch.int64)
        lo, hi = p.bits - p.spread, p.bits + p.spread
        if bool(((gb != lo) & (gb != p.bits) & (gb != hi)).any()):
            raise ValueError(f"group_bits: widths outside {{{lo}, {p.bits}, {hi}}}")
        n_in = 8 * shard["codes"].shape[1] // p.bits
        lens = torch.tensor(group_lengths(n_in, p.group_size), dtype=torch.int64, device=gb.device)
        if bool(((gb * lens).sum(1) != p.bits * n_in).any()):
            raise ValueError(f"group_bits: a row's widths do not average {p.bits} bits")
        if bool((shard["group_zero"].to(torch.int64) >= (1 << gb)).any()):
            raise ValueError("group_zero: a zero point above its group's largest code")
        if not bool(torch.isfinite(shard["group_step"]).all()):
            raise ValueError("group_step: non-finite values")

    def load(self, stored, shard_rows):
        tensors = super().load(stored, shard_rows)
        return {
            "q": unpack_codes(tensors["codes"], tensors["group_bits"], self.params.bits, self.params.group_size),
            "group_step": tensors["group_step"],
            "group_zero": tensors["group_zero"],
        }

    def dequantize(self, tensors) -> torch.Tensor:
        """The dense weight float32 ``[out, in]`` of :meth:`load`'s tensors."""
        return dequantize(tensors["q"], tensors["group_step"], tensors["group_zero"], self.params.group_size)

    def apply(self, tensors, x, bias):
        y = F.linear(x, self.dequantize(tensors).to(x.dtype))
        return y if bias is None else y + bias
