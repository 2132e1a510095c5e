"""`tova` KV compressor (TOVA, Oren et al. 2024, "Transformers are Multi-State RNNs",
arXiv:2401.06104) at block granularity: once a request holds more than ``budget_blocks``
blocks, keep those the **current** query attends to most, and drop the rest.

TOVA's policy is to evict, at each decoding step, the token with the lowest attention score of
the current query (averaged over heads), with no fixed sink or window: what stays is whatever
the latest query still reads. Here the unit is vLLM's KV block (it frees KV per block, for
every layer and head at once), and the score is the block's mass from this step's queries
(``BlockView.step_scores``), summed over heads and layers; H2O (`h2o`) ranks by the mass
accumulated since the block was written instead. ``sink_blocks`` (0 in the paper, which
observes that the first token is kept by the policy itself) can pin leading blocks.

The mass comes from the worker's shared attention with mass (``kvcompress/_shared``; TOVA
implements no ``attend``): the exact reference, or the Triton decode kernel with
``kernel: triton``. The plugin is its policy alone: ``reference.py`` is 30 lines.
"""

from pydantic import Field, model_validator

from vllm_graft.hooks import Capabilities, KernelParams, Registration, hookimpl


class TOVAParams(KernelParams):
    budget_blocks: int = Field(16, ge=2, description="KV blocks a request keeps in all")
    sink_blocks: int = Field(0, ge=0, description="leading blocks always kept (TOVA itself keeps none)")

    @model_validator(mode="after")
    def _room_for_the_query(self):
        if self.sink_blocks >= self.budget_blocks:
            raise ValueError(
                f"sink_blocks ({self.sink_blocks}) must be smaller than budget_blocks ({self.budget_blocks}): "
                "the block being written is always kept"
            )
        return self


@hookimpl
def graft_register_kv_compressors(register):
    register(
        Registration(
            name="tova",
            summary="TOVA: keeps the blocks the current query attends to most",
            paper="Oren et al. 2024, Transformers are Multi-State RNNs (arXiv:2401.06104)",
            params=TOVAParams,
            impl="vllm_graft.plugins.kvcompress.tova.reference:TOVA",
            # it scores blocks in its own attention, which an attention plugin would replace
            capabilities=Capabilities(lossless=False, incompatible_with=("attention:*",), parallelism=("tp", "dp")),
        )
    )
