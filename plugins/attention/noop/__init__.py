"""`noop` attention: plain causal attention over the paged KV cache, no changes.

By default (``host_kernel``) the host engine's own kernel computes it: what the noop then
costs is vllm-graft's backend seams alone. With ``host_kernel: false`` its forward is the
attention kind's shared exact attention (``attention/_shared.py``), the oracle other attention
plugins are compared with, so the plugin path is exercised end to end.
"""

from pydantic import Field

from ....hooks import Capabilities, Params, Registration, hookimpl
from ....hooks.registry import ATTENTION_BACKEND_LIMITS


class NoopParams(Params):
    host_kernel: bool = Field(
        True,
        description=(
            "Let the host engine's own attention kernel compute every layer (vLLM's C++ CPU "
            "attention, in its own cache layout), so the noop costs only vllm-graft's backend seams. "
            "false: the shared PyTorch paged attention computes every layer, the route the other "
            "attention plugins take; use it to exercise or measure that route"
        ),
    )


@hookimpl
def graft_register_attention(register):
    register(
        Registration(
            name="noop",
            summary="Plain causal attention over the paged KV cache (the baseline; changes nothing)",
            paper="-",
            params=NoopParams,
            impl="vllm_graft.plugins.attention.noop.reference:NoopAttention",
            capabilities=Capabilities(
                parallelism=("tp", "dp"), lossless=True, unsupported_features=ATTENTION_BACKEND_LIMITS
            ),
        )
    )
