"""Attention adapter: the enabled attention plugin computes every decoder layer's attention.

vLLM route: the backend vLLM selects is overridden with a subclass of its own that carries
the seams (:mod:`..backend`: CPU_ATTN on CPU; :mod:`..cuda_backends`: FLASH_ATTN, FLASHINFER,
TRITON_ATTN on CUDA). Its metadata builder calls ``AttentionMethod.plan(batch)`` once per step
and its impl calls ``AttentionMethod.forward(query, kv_cache, batch, layer, plan)``. vLLM writes
the new keys/values into the paged cache before ``forward`` (``do_kv_cache_update``), so a
plugin reads the whole context, new tokens included, from ``kv_cache``, in the layout
``layer.kv_layout`` names (``blocked`` on CPU, ``packed`` on CUDA); a plugin whose
``kv_layouts`` lacks the route's layout is refused here.

A method that ``uses_host_kernel`` (plain attention: the ``noop``'s default) is not called:
vLLM's own cache write and kernel compute every layer (and on CUDA keep their CUDA graphs).
vllm-graft's generic backend (the CPU test switch; CUDA's CUSTOM fallback) has no host kernel
to hand it to, and says so in the log.

vLLM's own kernels a plugin may call are put in ``HOST_KERNELS`` while it is active
(``merge_attn_states``, for hydragen's merge on CUDA).

Events counted: ``plan`` (steps) and ``forward`` (layer calls), or ``host`` (layer calls
computed by the host's kernel).
"""

from __future__ import annotations

import logging

from ....hooks import Kind
from ....hooks.contracts.attention import HOST_KERNELS

from ... import targets
from .. import Adapter, attention_backend_overrides, backend

OWNER = targets.ATTENTION
log = logging.getLogger("vllm_graft")


def provide_host_kernels() -> None:
    """vLLM's kernels that plugins may call (:data:`~vllm_graft.hooks.contracts.attention.HOST_KERNELS`):
    ``merge_attn_states`` (vLLM's CUDA or Triton merge on CUDA; hydragen merges its partials with it)."""
    from vllm.v1.attention.ops.merge_attn_states import merge_attn_states

    HOST_KERNELS["merge_attn_states"] = merge_attn_states


class AttentionAdapter(Adapter):
    kind = Kind.ATTENTION
    owner = OWNER

    def engine_overrides(self, enabled, plan):
        return attention_backend_overrides(plan)

    def activate(self, enabled, plan, runtime):
        (e,) = enabled  # the deployment allows one attention plugin
        method = runtime.instance(e)
        host = bool(method.uses_host_kernel()) and backend.host_kernel_available(plan)
        if not host:  # the method reads the cache: it must read the route's layout
            backend.require_layout(e.name, getattr(method, "kv_layouts", ()), plan, "attention plugin")
        backend.install(OWNER)
        backend.SEAMS.method = method
        backend.SEAMS.method_name = e.name
        backend.SEAMS.host_kernel = host
        if method.uses_host_kernel() and not host:
            log.warning(
                "vllm-graft: attention plugin %r asks for the host's own attention "
                "kernel; this route (vllm-graft's generic backend) has none, so the "
                "plugin's forward computes every layer",
                e.name,
            )
        backend.SEAMS.count = lambda event, n: runtime.count(Kind.ATTENTION, e.name, event, n)
        provide_host_kernels()

    def deactivate(self):
        HOST_KERNELS.clear()
        backend.SEAMS.method, backend.SEAMS.method_name, backend.SEAMS.count = None, "", None
        backend.SEAMS.host_kernel = False
        backend.uninstall(OWNER)


ADAPTER = AttentionAdapter()
