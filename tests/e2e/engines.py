"""What the tests that run vLLM's engine inside the pytest process share: vLLM's in-process
engine and a 1 GiB CPU KV cache, set where the caller has not before vLLM is first imported
(import this module before any that may import vLLM), and the bundled dense model."""
from __future__ import annotations

import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from pathlib import Path  # noqa: E402

__all__ = ["LLAMA", "MODELS", "refusal"]

MODELS = Path(__file__).resolve().parents[2] / "models"
LLAMA = str(MODELS / "graft-tiny-llama")


def refusal(plan) -> str:
    """The message of the DeploymentError that starting vLLM's engine with ``plan``'s
    deployment raises (the test fails if it starts, or fails otherwise)."""
    import pytest
    from vllm import LLM

    from vllm_graft.hooks import DeploymentError
    from vllm_graft.launch import engine as launch

    with pytest.raises(DeploymentError) as info:
        LLM(**launch.llm_kwargs(plan))
    return str(info.value)
