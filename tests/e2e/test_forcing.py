"""Teacher-forced decoding (`integration.forcing`), which `vllm-graft kvbench` uses for the
perplexity of a decoded continuation: in plain vLLM, the log-probabilities of forced decode
steps equal the prompt log-probabilities of the same tokens (the model's own distribution,
step by step), and the forced tokens are generated even where greedy decoding picks others."""
from __future__ import annotations

import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

pytestmark = pytest.mark.e2e

MODEL = Path(__file__).resolve().parents[2] / "models" / "graft-tiny-llama"


def test_forced_decoding_reports_the_models_own_logprobs():
    from vllm import LLM, SamplingParams

    from vllm_graft.integration.forcing import ForceTokens, forced_logprobs, forced_params
    from vllm_graft.tools.workloads import Tokenizer, stdlib_texts

    tok = Tokenizer.from_model(str(MODEL))
    (ids, _), = stdlib_texts(tok, num=1, tokens=200, seed=3)
    prompt, rest = list(ids[:136]), list(ids[136:])
    llm = LLM(model=str(MODEL), dtype="float32", max_model_len=512, enforce_eager=True, seed=0,
              logits_processors=[ForceTokens])
    try:
        full = llm.generate([{"prompt_token_ids": list(ids)}],
                            SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0), use_tqdm=False)[0]
        teacher = [full.prompt_logprobs[136 + i][t].logprob for i, t in enumerate(rest)]
        out = llm.generate([{"prompt_token_ids": prompt}], forced_params(rest), use_tqdm=False)[0]
        forced = forced_logprobs(out, rest)
        greedy = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=len(rest), temperature=0.0,
                                                                               ignore_eos=True), use_tqdm=False)[0]
    finally:
        llm.llm_engine.engine_core.shutdown()
    worst = max(abs(a - b) for a, b in zip(forced, teacher))
    print(f"forced vs prompt log-probs over {len(rest)} tokens: max |diff| {worst:.2e}, "
          f"nll {-sum(forced) / len(rest):.4f} vs {-sum(teacher) / len(rest):.4f}")
    assert worst < 1e-3
    # the forcing did something: greedy decoding departs from the text somewhere
    assert list(greedy.outputs[0].token_ids) != rest
    assert min(forced) < -0.5  # some forced tokens were unlikely, yet generated
