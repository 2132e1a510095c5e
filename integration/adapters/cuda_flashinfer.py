"""vllm-graft's seams on vLLM's FLASHINFER backend (see :mod:`.cuda_backends`).

A module of its own because ``vllm.v1.attention.backends.flashinfer`` imports the ``flashinfer``
package (0.33: flashinfer.py:12-26), which only CUDA installs have (vLLM 0.33 pins
``flashinfer-python==0.7.2.post1``). Where it is missing, importing this module raises the
ImportError, and vLLM's selector counts FLASHINFER as unavailable (platforms/cuda.py:398-409).

With a KV storage format active the backend is invalid (:data:`FORMAT_REASON`): 0.33's FlashInfer
builder asserts that the KV spec's dtype is the model's, and a format's page is uint8
(tests/vllm033 found it; FLASH_ATTN and TRITON_ATTN take the page).
"""

from __future__ import annotations

from typing import Any

from vllm.v1.attention.backends.flashinfer import (
    FlashInferBackend,
    FlashInferImpl,
    FlashInferMetadataBuilder,
)

from .backend import SEAMS
from .cuda_backends import GraftBackendMixin, GraftBuilderMixin, GraftImplMixin

#: Why FLASHINFER cannot serve a deployment with a KV storage format (kv4).
FORMAT_REASON = (
    "vllm-graft: a KV storage format (e.g. kv4) stores a uint8 page, and vLLM's FlashInfer "
    "metadata builder requires the KV spec's dtype to be the model's (0.33 flashinfer.py:983, an "
    "assert at engine start); let vLLM choose (it takes FLASH_ATTN or TRITON_ATTN) or name one of those"
)


class GraftFlashInferMetadataBuilder(GraftBuilderMixin, FlashInferMetadataBuilder):
    pass


class GraftFlashInferImpl(GraftImplMixin, FlashInferImpl):
    pass


class GraftFlashInferBackend(GraftBackendMixin, FlashInferBackend):
    graft_builder = GraftFlashInferMetadataBuilder
    graft_impl = GraftFlashInferImpl

    @classmethod
    def validate_configuration(cls, *args: Any, **kwargs: Any) -> list[str]:
        reasons = list(super().validate_configuration(*args, **kwargs))
        if SEAMS.kv_format is not None:
            reasons.append(FORMAT_REASON)  # vLLM's selector then skips it, or names it when asked
        return reasons


__all__ = ["GraftFlashInferBackend", "FORMAT_REASON"]
