"""hydragen in vLLM's CPU engine: the same tokens as plain vLLM on the shared-prefix workload
(greedy) and with n>1 samples per prompt (greedy through top_k=1, and seeded sampling), with
shared prefixes actually found (tree depth 2: the group's system prompt and few-shot examples,
then each prompt's own tail shared by its samples)."""
from __future__ import annotations

import pytest

from .engines import LLAMA  # first: the in-process engine's environment, before vLLM is imported
from vllm_graft.integration.plan import plan_for

pytestmark = pytest.mark.e2e

ENGINE = {"dtype": "float32", "max_model_len": 1536, "block_size": 32, "enforce_eager": True}
NEW_TOKENS = 12
N = 4


def _runs(graft: bool) -> dict:
    from vllm import SamplingParams

    from vllm_graft.launch import engine as launch

    from vllm_graft.tools import workloads
    from vllm_graft.integration.runtime import RUNTIME

    tok = workloads.Tokenizer.from_model(LLAMA)
    (ps,) = workloads.build(["shared-prefix"], tok, num_prompts=8, max_tokens=NEW_TOKENS,
                            max_model_len=ENGINE["max_model_len"])
    prompts = [{"prompt_token_ids": list(p.token_ids)} for p in ps.prompts]
    plan = plan_for({"model": LLAMA, "engine": ENGINE, "attention": {"plugin": "hydragen"}})
    with launch.in_process_engine(plan, graft=graft, seed=0) as llm:
        out = {}
        for name, params in {
            "greedy": SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True),
            "n4-greedy": SamplingParams(n=N, temperature=1.0, top_k=1, max_tokens=NEW_TOKENS, ignore_eos=True),
            "n4-seeded": SamplingParams(n=N, temperature=0.8, seed=7, max_tokens=NEW_TOKENS, ignore_eos=True),
        }.items():
            res = llm.generate(prompts, params, use_tqdm=False)
            out[name] = [[list(c.token_ids) for c in r.outputs] for r in res]
        if graft:
            (impl,) = RUNTIME.instances.values()
            out["describe"] = impl.describe()
            out["counts"] = RUNTIME.counts("attention", "hydragen")
        out["shared_prefix_tokens"] = ps.stats["shared_prefix_tokens"]
        return out


@pytest.fixture(scope="module")
def plain():
    return _runs(graft=False)


@pytest.fixture(scope="module")
def hydragen(plain):  # after plain: one engine at a time
    return _runs(graft=True)


@pytest.mark.parametrize("mode", ["greedy", "n4-greedy", "n4-seeded"])
def test_same_tokens_as_plain_vllm(plain, hydragen, mode):
    assert hydragen[mode] == plain[mode]
    if mode == "n4-greedy":  # top_k=1: the N samples of a prompt are its greedy continuation
        assert all(s == [g[0]] * N for s, g in zip(hydragen[mode], hydragen["greedy"]))


def test_shared_prefixes_were_found_and_read_once(hydragen):
    d = hydragen["describe"]
    print("hydragen:", d, hydragen["counts"], "workload shared prefix:", hydragen["shared_prefix_tokens"])
    assert hydragen["counts"]["forward"] > 0 and hydragen["counts"]["plan"] > 0
    assert d["max_tree_depth"] == 2  # group prefix (32 sequences), then each prompt's tail (N samples)
    # 8 prompts x 4 samples over a ~900-token shared prefix: far less KV read than plain
    assert d["kv_read_ratio"] > 4
