"""The conformance kit on hyperattention with a min_seq_len below the kit's sequences and prompts,
so that the approximation itself runs in the kit's exercise (its 19-token chunk over a prefix) and
in vLLM's engine (the short code prompts' prefills); with the defaults the builtin run checks the
exact paths."""
import pytest


@pytest.mark.graft_conformance("attention:hyperattention",
                               params={"min_seq_len": 16, "block_size": 8, "sample_size": 8})
def test_conformance_hyperattention_approximating(graft_check):
    graft_check()
