"""`noop` attention: plain causal attention over the paged KV cache, no changes.

It exists so the attention path is exercised end to end before real methods land; its
reference is the attention kind's shared exact attention (``attention/_shared.py``), the
oracle other attention plugins are compared with.
"""
from vllm_graft.hooks import Capabilities, NoParams, Registration, hookimpl
from vllm_graft.hooks.registry import ATTENTION_BACKEND_LIMITS


@hookimpl
def graft_register_attention(register):
    register(Registration(
        name="noop",
        summary="Plain causal attention over the paged KV cache (the baseline; changes nothing)",
        paper="-",
        params=NoParams,
        impl="vllm_graft.plugins.attention.noop.reference:PagedAttention",
        capabilities=Capabilities(lossless=True, unsupported_features=ATTENTION_BACKEND_LIMITS),
    ))
