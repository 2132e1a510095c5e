import torch.nn.functional as F

from ....hooks import QuantMethod


class FullPrecision(QuantMethod):
    def quantize(self, weight):
        return {"weight": weight}

    def apply(self, tensors, x, bias):
        return F.linear(x, tensors["weight"], bias)

    def checkpoint_params(self):
        return self.params.model_dump(mode="json", exclude={"host_gemm"})  # how it computes, not what it stores

    def dense_weight(self, tensors):
        return tensors["weight"] if self.params.host_gemm else None
