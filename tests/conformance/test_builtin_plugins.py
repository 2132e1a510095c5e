"""Every plugin vllm-graft registers passes the conformance kit it ships (see
vllm_graft/kit/conformance): registration, parameters, the kind's contract on
generated inputs, Triton-vs-reference parity, released state, and the engine run."""
import pytest

pytestmark = pytest.mark.graft_conformance("builtin")


def test_conformance(graft_check):
    graft_check()
