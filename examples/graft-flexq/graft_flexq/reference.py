"""The reference implementation of `flexq`: plain PyTorch, readable beside the paper.
It is the CPU path and the oracle the Triton kernel is tested against."""
from __future__ import annotations

from vllm_graft.hooks import QuantMethod


class Flexq(QuantMethod):
    def quantize(self, weight) -> dict:
        """The tensors that replace weight [out, in]."""
        if self.params.kernel == "triton":
            from . import kernel

            return kernel.quantize(self, weight)
        raise NotImplementedError("flexq: write the reference quantize() in graft_flexq/reference.py")

    def apply(self, tensors: dict, x, bias):
        """x @ W.T + bias from the quantised tensors, [T, out] in x's dtype."""
        if self.params.kernel == "triton":
            from . import kernel

            return kernel.apply(self, tensors, x, bias)
        raise NotImplementedError("flexq: write the reference apply() in graft_flexq/reference.py")
