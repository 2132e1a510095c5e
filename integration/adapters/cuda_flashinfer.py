"""vllm-graft's seams on vLLM's FLASHINFER backend (see :mod:`.cuda_backends`).

A module of its own because ``vllm.v1.attention.backends.flashinfer`` imports the ``flashinfer``
package (0.33: flashinfer.py:12-26), which only CUDA installs have (vLLM 0.33 pins
``flashinfer-python==0.7.2.post1``). Where it is missing, importing this module raises the
ImportError, and vLLM's selector counts FLASHINFER as unavailable (platforms/cuda.py:398-409).
"""

from __future__ import annotations

from vllm.v1.attention.backends.flashinfer import (
    FlashInferBackend,
    FlashInferImpl,
    FlashInferMetadataBuilder,
)

from .cuda_backends import GraftBackendMixin, GraftBuilderMixin, GraftImplMixin


class GraftFlashInferMetadataBuilder(GraftBuilderMixin, FlashInferMetadataBuilder):
    pass


class GraftFlashInferImpl(GraftImplMixin, FlashInferImpl):
    pass


class GraftFlashInferBackend(GraftBackendMixin, FlashInferBackend):
    graft_builder = GraftFlashInferMetadataBuilder
    graft_impl = GraftFlashInferImpl


__all__ = ["GraftFlashInferBackend"]
