"""The bundled tiny models load in vLLM's CPU engine and in transformers, and
both engines produce the same greedy continuation (fp16 weights run in fp32).

This is the first end-to-end check of everything built on these models: the
same architecture, weights and tokenizer through two independent engines.
"""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process engine: fast start
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; the default check fails on small VMs

import gc  # noqa: E402
import json  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

pytestmark = pytest.mark.e2e

MODELS_DIR = Path(__file__).resolve().parents[2] / "models"
MODEL_NAMES = ["graft-tiny-llama", "graft-tiny-mixtral", "graft-tiny-llama-recall"]
NEW_TOKENS = 24

# Real code (not from the held-out split), each ending mid-line: byte-level BPE
# merges a newline with the next line's indentation, so a prompt ending in "\n"
# is out of distribution. Chosen so that no greedy step is a near-tie: the
# smallest top-1/top-2 logit gap along the 24 greedy tokens in transformers fp32
# is 0.026 (the two engines' log-probabilities differ by < 1e-5).
PROMPTS = [
    "import os\nimport sys\n\n\ndef main(argv=None):\n    if argv is None:\n        argv = sys.argv[1:]\n"
    "    for arg in argv:",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):",
    "def read_config(path):\n    \"\"\"Return the parsed contents of the file at *path*.\"\"\"\n    with open(path",
    "    def close(self):\n        if self._file is not None:\n            self._file.close()",
]


@pytest.fixture(scope="module", params=MODEL_NAMES)
def engines(request):
    """(path, vLLM engine, transformers model, tokenizer), built once per model."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm import LLM  # a missing vllm must fail, not skip

    path = MODELS_DIR / request.param
    tokenizer = AutoTokenizer.from_pretrained(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    hf.eval()
    llm = LLM(model=str(path), dtype="float32", max_model_len=2048, seed=0, enforce_eager=True)
    yield path, llm, hf, tokenizer
    del llm
    gc.collect()


def test_architecture(engines):
    path, _, hf, _ = engines
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["head_dim"] == 64
    assert cfg["num_key_value_heads"] < cfg["num_attention_heads"]  # grouped-query attention
    assert cfg["max_position_embeddings"] >= 2048
    assert "rope_parameters" in cfg or "rope_theta" in cfg
    if cfg["model_type"] == "mixtral":
        assert (cfg["num_local_experts"], cfg["num_experts_per_tok"]) == (8, 2)
    else:
        assert cfg["model_type"] == "llama"
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), "pt") as f:
        dtypes = {str(f.get_slice(k).get_dtype()) for k in f.keys()}
    assert dtypes == {"F16"}
    n_params = sum(p.numel() for p in hf.parameters())
    assert 1_000_000 < n_params < 10_000_000


def test_weights_budget():
    sizes = [(MODELS_DIR / n / "model.safetensors").stat().st_size for n in MODEL_NAMES]
    assert max(sizes) < 12.5 * 1024 * 1024
    assert sum(sizes) < 35 * 1024 * 1024


def test_has_learnt(engines):
    """Cheap sanity check of the weights (quality figures: models/evaluate.py): a random
    model has perplexity ~4096 on these prompts, the trained ones ~15-50."""
    import math

    import torch

    _, _, hf, tokenizer = engines
    nll, n = 0.0, 0
    for prompt in PROMPTS:
        ids = torch.tensor([tokenizer(prompt, add_special_tokens=False)["input_ids"]])
        with torch.no_grad():
            logits = hf(input_ids=ids).logits[0, :-1]
        nll += torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum").item()
        n += ids.shape[1] - 1
    assert math.exp(nll / n) < 100


def test_same_tokenization(engines):
    _, llm, _, tokenizer = engines
    vtok = llm.get_tokenizer()
    for prompt in PROMPTS:
        ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        assert vtok.encode(prompt, add_special_tokens=False) == ids
        assert tokenizer.decode(ids) == prompt  # byte-level BPE round-trips


def test_same_greedy_continuation(engines):
    import torch
    from vllm import SamplingParams

    _, llm, hf, tokenizer = engines
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS), use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        assert list(out.prompt_token_ids) == ids
        with torch.no_grad():
            ref = hf.generate(
                torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
            )[0, len(ids):].tolist()
        got = list(out.outputs[0].token_ids)
        assert got == ref, f"prompt {prompt!r}:\n vLLM {tokenizer.decode(got)!r}\n HF   {tokenizer.decode(ref)!r}"
        assert len(got) == NEW_TOKENS or got[-1] == tokenizer.eos_token_id


# ----------------------------------------------------------------------------- copying (transformers only)
COPY_SPAN = 64  # random tokens per copy
COPY_CUE = 8  # tokens of the second copy given in the prompt


def _copy_prompt(distance_text: bool):
    """<|endoftext|>, 64 random token ids, optionally ~1000 tokens of stdlib source, then the
    first 8 of the 64 again; the rest of the span (56 tokens) is what a copying model continues."""
    import random as _random

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(MODELS_DIR / "graft-tiny-llama")
    rng = _random.Random(7)
    span = [rng.randint(1, tokenizer.vocab_size - 1) for _ in range(COPY_SPAN)]
    filler = []
    if distance_text:
        import json as _json

        text = Path(_json.__file__).with_name("decoder.py").read_text()
        filler = tokenizer(text, add_special_tokens=False)["input_ids"][:1000]
    return [0, *span, *filler, *span[:COPY_CUE]], span[COPY_CUE:]


def _copy_losses(name: str, distance_text: bool) -> tuple[float, float]:
    """Mean NLL (nats, transformers fp32) of the span's first copy and of the 56 tokens of its
    second copy after the cue."""
    import torch
    from transformers import AutoModelForCausalLM

    prompt, rest = _copy_prompt(distance_text)
    ids = torch.tensor([prompt + rest])
    model = AutoModelForCausalLM.from_pretrained(MODELS_DIR / name, dtype=torch.float32,
                                                 attn_implementation="sdpa").eval()
    with torch.no_grad():
        nll = torch.nn.functional.cross_entropy(model(input_ids=ids).logits[0, :-1], ids[0, 1:], reduction="none")
    first = nll[1:COPY_SPAN].mean().item()  # targets 2..64: the span after its first token
    second = nll[len(prompt) - 1:].mean().item()  # targets: the rest of the second copy
    return first, second


@pytest.mark.parametrize("distance_text", [False, True], ids=["adjacent", "after-1000-tokens"])
def test_recall_model_copies(distance_text):
    """Why graft-tiny-llama-recall exists: on a span of random tokens seen before (right before,
    or ~1000 tokens of code before), its loss drops well below the first copy's; the dense model
    it was fine-tuned from gets no such drop (it has no induction heads). Measured 8.70 -> 1.14
    (adjacent) and 8.70 -> 1.31 (after ~1000 tokens); models/EVAL.md: 91% top-1 on the repeat."""
    r_first, r_second = _copy_losses("graft-tiny-llama-recall", distance_text)
    d_first, d_second = _copy_losses("graft-tiny-llama", distance_text)
    print(f"NLL first/second copy: recall {r_first:.2f}/{r_second:.2f}, dense {d_first:.2f}/{d_second:.2f}")
    assert r_second < r_first - 5.0
    assert d_second > d_first - 0.3
