"""Plain causal attention over a paged KV cache, in PyTorch (slow, exact): the contract class
is the attention kind's shared exact attention (``attention/_shared.py``), unchanged."""
from __future__ import annotations

from .._shared import PagedAttention

__all__ = ["PagedAttention"]
