"""The vllm-graft conformance kit on this plugin: registration, parameters, the
quant contract on generated inputs, Triton-vs-reference parity, and (with vLLM
installed) a run in vLLM's CPU engine. `pytest --graft-no-engine` skips the engine."""
import pytest

pytestmark = pytest.mark.graft_conformance("quant:flexq")


def test_conformance(graft_check):
    graft_check()
