"""StreamingLLM at block granularity: sinks + recent window (see ``__init__``)."""

from vllm_graft.hooks import BlockView, KVCompressor

from .._shared.policy import sink_window, with_pinned


class Streaming(KVCompressor):
    def keep(self, view: BlockView) -> list[int]:
        p = self.params
        mine = sink_window(view.num_blocks, p.sink_blocks, p.budget_blocks - p.sink_blocks)
        return with_pinned(mine, view.pinned)

    def describe(self):
        return {"budget_blocks": self.params.budget_blocks, "sink_blocks": self.params.sink_blocks}
