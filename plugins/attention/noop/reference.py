"""Plain causal attention over a paged KV cache, in PyTorch (slow, exact): the attention kind's
shared exact attention (``attention/_shared.py``), unchanged; by default the host's own kernel
computes it instead (``uses_host_kernel``)."""

from __future__ import annotations

from .._shared import PagedAttention


class NoopAttention(PagedAttention):
    """:class:`PagedAttention`, handed to the host kernel unless ``host_kernel`` is false."""

    def uses_host_kernel(self) -> bool:
        return bool(self.params.host_kernel)


__all__ = ["NoopAttention", "PagedAttention"]
