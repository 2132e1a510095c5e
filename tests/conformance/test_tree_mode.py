"""The conformance kit on a proposer in tree mode (``Proposer.propose_tree``; the engine run
verifies its trees in vLLM: integration/adapters/speculative/tree.py)."""
import pytest


@pytest.mark.graft_conformance("speculative:token-recycling",
                               params={"tree": True, "num_speculative_tokens": 12, "k": 4})
def test_conformance_tree_mode(graft_check):
    graft_check()
