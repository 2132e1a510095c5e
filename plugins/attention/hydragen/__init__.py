"""`hydragen`: exact shared-prefix attention (Juravsky et al., "Hydragen: High-Throughput LLM
Inference with Shared Prefixes", arXiv:2402.05099), generalised to tree-shaped sharing.

Each step the planner (``policy``) finds the prefixes that sequences share from their block
tables (prefix caching gives them the same physical blocks), at any depth: a system prompt
shared by all, few-shot examples shared by some, a prompt shared by its n samples. Each shared
run of blocks is attended once with the queries of all its sequences stacked; each sequence's
remaining blocks are attended on their own; the partial results merge exactly by log-sum-exp.
"""

from pydantic import Field

from ....hooks import Capabilities, KernelParams, Registration, hookimpl
from ....hooks.registry import ATTENTION_BACKEND_LIMITS


class HydragenParams(KernelParams):
    min_group: int = Field(2, ge=2, description="fewest sequences that make a shared prefix group")
    min_blocks: int = Field(
        1, ge=1, description="fewest blocks in a group (shorter shared runs are attended per sequence)"
    )


@hookimpl
def graft_register_attention(register):
    register(
        Registration(
            name="hydragen",
            summary="Exact shared-prefix attention: shared blocks (found at any depth of the block "
            "tables) read once for all sharing sequences, merged by log-sum-exp",
            paper="Hydragen: High-Throughput LLM Inference with Shared Prefixes (arXiv:2402.05099)",
            params=HydragenParams,
            impl="vllm_graft.plugins.attention.hydragen.reference:Hydragen",
            capabilities=Capabilities(
                parallelism=("tp", "dp"),
                lossless=True,
                head_sizes=(32, 64, 80, 96, 112, 128, 160, 192, 224, 256),
                unsupported_features=ATTENTION_BACKEND_LIMITS,
            ),
        )
    )
