"""What the tests that run vLLM's engine inside the pytest process share: vLLM's in-process
engine and a 1 GiB CPU KV cache, set where the caller has not before vLLM is first imported
(import this module before any that may import vLLM), and the bundled dense model."""
from __future__ import annotations

import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from pathlib import Path  # noqa: E402

__all__ = ["LLAMA", "MODELS", "long_context", "refusal"]

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


def long_context(plugin: str, params: dict | None, engine: dict, new_tokens: int) -> dict:
    """Greedy ``new_tokens`` for two long-context prompts on the bundled llama in vLLM's
    in-process engine with ``engine``'s arguments and attention plugin ``plugin`` at ``params``
    (``None``: plain vLLM). ``{"tokens", "prompt_lens"}``, and the plugin's ``describe()`` as
    ``"describe"`` when it ran."""
    from vllm import SamplingParams

    from vllm_graft.integration.plan import plan_for
    from vllm_graft.integration.runtime import RUNTIME
    from vllm_graft.launch import engine as launch
    from vllm_graft.tools import workloads

    tok = workloads.Tokenizer.from_model(LLAMA)
    (ps,) = workloads.build(["long-context"], tok, num_prompts=2, max_tokens=new_tokens,
                            max_model_len=engine["max_model_len"])
    plan = plan_for({"model": LLAMA, "engine": engine, "attention": {"plugin": plugin, "params": params or {}}})
    with launch.in_process_engine(plan, graft=params is not None, seed=0) as llm:
        res = llm.generate([{"prompt_token_ids": list(p.token_ids)} for p in ps.prompts],
                           SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True),
                           use_tqdm=False)
        out = {"tokens": [list(r.outputs[0].token_ids) for r in res],
               "prompt_lens": [len(p.token_ids) for p in ps.prompts]}
        if params is not None:
            (impl,) = RUNTIME.instances.values()
            out["describe"] = impl.describe()
        return out
