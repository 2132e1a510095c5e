"""TOVA at block granularity (Oren et al. 2024, arXiv:2401.06104): over budget, keep the
``budget_blocks`` blocks with the most attention from the current query (``sink_blocks``
leading ones and the block being written always among them): the current-query scorer under
the keep policy (``hooks.contracts.kvpolicy``). The current query is the prompt's last token at
prefill, then each generated token; mid-prefill (chunked) nothing is dropped, as no query of
the step is the current one."""

from vllm_graft.hooks import CurrentMass


class TOVA(CurrentMass):
    pass
