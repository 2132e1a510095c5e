"""Attention adapter: the enabled attention plugin computes every decoder layer's attention.

vLLM route: on CPU the CPU_ATTN backend is overridden with :mod:`..backend`'s subclass (on
CUDA, vLLM's CUSTOM backend is :mod:`..custom_backend`, with the same seams), whose
metadata builder calls ``AttentionMethod.plan(batch)`` once per step and whose impl calls
``AttentionMethod.forward(query, kv_cache, batch, layer, plan)``. vLLM writes the new
keys/values into the paged cache before ``forward`` (``do_kv_cache_update``), so a plugin
reads the whole context, new tokens included, from ``kv_cache`` (layout:
``hooks.contracts.split_kv_cache``).

A method that ``uses_host_kernel`` (plain attention: the ``noop``'s default) is not called on
the CPU route: vLLM's own cache write and kernel compute every layer behind vllm-graft's
backend. vllm-graft's generic backend (the CUDA route) has no host kernel to hand it to, and
says so in the log.

Events counted: ``plan`` (steps) and ``forward`` (layer calls), or ``host`` (layer calls
computed by the host's kernel).
"""
from __future__ import annotations

import logging

from vllm_graft.hooks import Kind

from vllm_graft.integration.adapters import Adapter, attention_backend_overrides, backend

OWNER = "adapters.attention"
log = logging.getLogger("vllm_graft")


class AttentionAdapter(Adapter):
    kind = Kind.ATTENTION
    owner = OWNER

    def engine_overrides(self, enabled, plan):
        return attention_backend_overrides(plan)

    def activate(self, enabled, plan, runtime):
        (e,) = enabled  # the deployment allows one attention plugin
        method = runtime.instance(e)
        backend.install(OWNER)
        backend.SEAMS.method = method
        backend.SEAMS.method_name = e.name
        backend.SEAMS.host_kernel = False
        if method.uses_host_kernel():
            if backend.SEAMS.route == backend.BACKEND_PATH:
                backend.SEAMS.host_kernel = True
            else:
                log.warning("vllm-graft: attention plugin %r asks for the host's own attention "
                            "kernel; this route (%s) has none, so the plugin's forward computes "
                            "every layer", e.name, backend.SEAMS.route)
        backend.SEAMS.count = lambda event, n: runtime.count(Kind.ATTENTION, e.name, event, n)

    def deactivate(self):
        backend.SEAMS.method, backend.SEAMS.method_name, backend.SEAMS.count = None, "", None
        backend.SEAMS.host_kernel = False
        backend.uninstall(OWNER)


ADAPTER = AttentionAdapter()
