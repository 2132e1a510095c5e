"""W4A8 (QServe progressive quantisation) in plain PyTorch: the quantiser and the fp32
emulation of the integer GEMM (the CPU path and the kernel's oracle).

Stored per ``[out, in]`` weight, ``G = ceil(in / group_size)`` groups per row:

* ``qweight`` uint8 ``[out, in/2]``: 4-bit codes, column ``2j`` in the low nibble of byte ``j``;
* ``group_zero`` uint8 ``[out, G]`` (4-bit zero points) and ``group_mult`` int8 ``[out, G]``
  (integer multipliers, >= 1): the int8 weight is ``clamp((q4 - zero) * mult, -128, 127)``;
* ``channel_step`` float16 ``[out, 1]``: the real weight is ``int8 weight * channel_step``.

(No tensor name contains "scale": vLLM's Llama loader renames checkpoint names ending in
``scale`` as KV-cache scales.)
"""

from __future__ import annotations

import torch

from ....hooks import QuantMethod, StoredTensor

from .._shared import quantize_activations

PROTECT = 119  # first-level range: leaves room for the second level's rounding within int8


def quantize(w: torch.Tensor, group_size: int) -> dict[str, torch.Tensor]:
    out, n = w.shape
    if n % 2:
        raise ValueError(f"w4a8 packs two 4-bit codes per byte: in_features {n} is odd")
    w = w.float()
    step = (w.abs().amax(1, keepdim=True) / PROTECT).clamp_min(1e-8)
    step = step.to(torch.float16).float()  # the stored step is fp16: quantise with it
    q8 = torch.round(w / step).clamp(-PROTECT, PROTECT)
    G = -(-n // group_size)
    pad = G * group_size - n
    q8g = torch.nn.functional.pad(q8, (0, pad)).view(out, G, group_size)
    valid = torch.nn.functional.pad(torch.ones(n, device=w.device), (0, pad)).view(G, group_size).bool()
    big = torch.tensor(1e9, device=w.device)
    lo = torch.where(valid, q8g, big).amin(-1)
    hi = torch.where(valid, q8g, -big).amax(-1)
    mult = torch.clamp(torch.ceil((hi - lo) / 15), min=1, max=127)
    zero = torch.clamp(torch.round(-lo / mult), 0, 15)
    q4 = torch.clamp(torch.round(q8g / mult[..., None]) + zero[..., None], 0, 15)
    q4 = q4.view(out, -1)[:, :n].to(torch.uint8)
    packed = q4[:, 0::2] | (q4[:, 1::2] << 4)
    return {
        "qweight": packed.contiguous(),
        "group_zero": zero.to(torch.uint8),
        "group_mult": mult.to(torch.int8),
        "channel_step": step.to(torch.float16),
    }


def int8_weight(t: dict[str, torch.Tensor], group_size: int) -> torch.Tensor:
    """The second level undone: int8 weight values ``[out, in]`` (as int32)."""
    p = t["qweight"].to(torch.int32)
    q4 = torch.stack([p & 15, p >> 4], -1).view(p.shape[0], -1)
    n = q4.shape[1]
    g = torch.arange(n, device=p.device) // group_size
    zero = t["group_zero"].to(torch.int32)[:, g]
    mult = t["group_mult"].to(torch.int32)[:, g]
    return ((q4 - zero) * mult).clamp(-128, 127)


#: CUDA's ``torch._int_mm`` (cuBLASLt int8) takes more than 16 rows, and inner and output
#: columns in multiples of 8 (PyTorch's ``_int_mm_out_cuda``); the CPU kernel takes any shape.
CUDA_MIN_ROWS = 17
CUDA_COLUMN_MULTIPLE = 8


def _ceil_to(n: int, m: int) -> int:
    return -(-n // m) * m


def int8_weight_for_int_mm(t: dict[str, torch.Tensor], group_size: int) -> torch.Tensor:
    """The int8 weight ``[out, in]`` for :func:`int8_matmul`, zero-padded to ``[out8, in8]``
    (multiples of 8, as CUDA's ``_int_mm`` needs; zero rows and columns add nothing to the
    sums), made once at load."""
    w = int8_weight(t, group_size).to(torch.int8)
    out, n = w.shape
    pad_out, pad_in = _ceil_to(out, CUDA_COLUMN_MULTIPLE) - out, _ceil_to(n, CUDA_COLUMN_MULTIPLE) - n
    return torch.nn.functional.pad(w, (0, pad_in, 0, pad_out)) if pad_out or pad_in else w


def int8_matmul(x: torch.Tensor, t: dict[str, torch.Tensor]) -> torch.Tensor:
    """What :func:`emulate` computes, from the int8 weight ``t["weight_int8"]`` unpacked once
    (:func:`int8_weight_for_int_mm`): int8 x int8 into int32 (exact: ``|sum| <= 127 * 128 * in``,
    far below 2**31), then the same scaling. Bit-identical to :func:`emulate` (an exact integer
    rounds to fp32 the same way from int32 as from fp64).

    On CUDA the activations are zero-padded to at least 17 rows (decode steps and CUDA-graph
    captures of 1-16 tokens) and to the weight's padded columns; the padding is sliced off. The
    sizes are shapes, not values: no host sync, and a captured graph holds the same ops."""
    x2 = x.reshape(-1, x.shape[-1])
    xq, sx = quantize_activations(x2)
    w = t["weight_int8"]
    rows, n = xq.shape
    out = t["channel_step"].shape[0]
    pad_rows = max(0, CUDA_MIN_ROWS - rows) if xq.is_cuda else 0
    if pad_rows or w.shape[1] != n:
        xq = torch.nn.functional.pad(xq, (0, w.shape[1] - n, 0, pad_rows))
    acc = torch._int_mm(xq, w.T)[:rows, :out]
    return (acc.float() * sx * t["channel_step"].float().T).reshape(*x.shape[:-1], -1)


def emulate(x: torch.Tensor, t: dict[str, torch.Tensor], group_size: int) -> torch.Tensor:
    """fp32 emulation of the W4A8 GEMM: every product and sum is an exact integer in fp64,
    then scaled by token step x channel step. Returns fp32 ``[M, out]``."""
    x2 = x.reshape(-1, x.shape[-1])
    xq, sx = quantize_activations(x2)
    acc = xq.double() @ int8_weight(t, group_size).double().T
    return (acc.float() * sx * t["channel_step"].float().T).reshape(*x.shape[:-1], -1)


class W4A8(QuantMethod):
    def quantize(self, weight):
        return quantize(weight, self.params.group_size)

    def error_bound(self, layer):
        # measured on the kit's layers (fp16 and fp32, group_size 8 to 4096): at most 0.114 on
        # random ones, 0.078 on the structured one (a per-row scale at group 4096 meets the
        # outlier columns); 4-bit weights dominate, int8 activations add little
        return 0.16 if layer == "random" else 0.12

    def checkpoint_params(self):
        return self.params.model_dump(mode="json", exclude={"kernel", "cpu_weights"})

    def load(self, stored, shard_rows):
        tensors = super().load(stored, shard_rows)
        if self.params.kernel == "reference" and self.params.cpu_weights == "int8":
            tensors["weight_int8"] = int8_weight_for_int_mm(tensors, self.params.group_size)
        return tensors

    def stored_tensors(self, out_features, in_features):
        G = -(-in_features // self.params.group_size)
        return {
            "qweight": StoredTensor((out_features, in_features // 2), "uint8"),
            "group_zero": StoredTensor((out_features, G), "uint8"),
            "group_mult": StoredTensor((out_features, G), "int8"),
            "channel_step": StoredTensor((out_features, 1), "float16"),
        }

    def verify(self, shard):
        if bool((shard["group_zero"] > 15).any()):
            raise ValueError("group_zero: zero points above 15 (not 4-bit)")
        if bool((shard["group_mult"] < 1).any()):
            raise ValueError("group_mult: multipliers below 1")
        if not bool(torch.isfinite(shard["channel_step"]).all()):
            raise ValueError("channel_step: non-finite values")

    def apply(self, tensors, x, bias):
        if self.params.kernel == "triton":
            from .kernel import w4a8_matmul

            y = w4a8_matmul(x, tensors, self.params.group_size)
        elif "weight_int8" in tensors:
            y = int8_matmul(x, tensors)
        else:
            y = emulate(x, tensors, self.params.group_size)
        y = y.to(x.dtype)
        return y if bias is None else y + bias
