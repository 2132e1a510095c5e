"""The block planners now live with the keep policy in ``vllm_graft.hooks.contracts.kvpolicy``;
this module keeps their old import path (tests and third-party code import it)."""

from vllm_graft.hooks.contracts.kvpolicy import adaptive_head_budget, sink_window, top_blocks, with_pinned

__all__ = ["adaptive_head_budget", "sink_window", "top_blocks", "with_pinned"]
