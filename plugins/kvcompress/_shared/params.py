"""Parameters of the compressors that keep the top blocks by one score per block (``tova``,
``knorm``, ``keydiff``): the keep policy's (``hooks.contracts.kvpolicy.PolicyParams``) with
``sink_blocks``."""

from pydantic import Field, model_validator

from ....hooks import PolicyParams


class TopBlocksParams(PolicyParams):
    sink_blocks: int = Field(0, ge=0, description="leading blocks always kept (the papers keep none)")

    @model_validator(mode="after")
    def _room(self):
        if self.sink_blocks >= self.budget_blocks:
            raise ValueError(
                f"sink_blocks ({self.sink_blocks}) must be smaller than budget_blocks ({self.budget_blocks}): "
                "the block being written is always kept"
            )
        return self
