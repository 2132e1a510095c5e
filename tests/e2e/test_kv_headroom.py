"""`vllm-graft kv-headroom` on the recall model in transformers: with a budget of the whole
context every policy is plain attention (identical log-probabilities, so a change of exactly
0), and at a small budget the policies differ from plain and from each other."""
from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

MODEL = Path(__file__).resolve().parents[2] / "models" / "graft-tiny-llama-recall"


def test_every_policy_is_plain_attention_at_full_budget_and_differs_below_it():
    from vllm_graft.tools.kvcompress.kv_headroom import ARMS, study
    from vllm_graft.tools.workloads import Tokenizer, stdlib_texts

    texts = stdlib_texts(Tokenizer.from_model(str(MODEL)), num=2, tokens=511, seed=0)
    res = study(str(MODEL), texts, block=32, chunk=128, gen=64, fractions=(1, 2), arms=list(ARMS))
    rows = {r["arm"]: r for r in res["rows"]}
    plain = rows["plain"]["gen_ppl"]
    assert res["gen_tokens"] == 128
    for arm in ARMS:
        full = rows[f"{arm} 1/1"]
        assert full["gen_ppl"] == pytest.approx(plain, rel=1e-6), arm
        assert full["blocks"] == rows["streaming 1/1"]["blocks"]  # nothing dropped: what causal attention sees
    small = {arm: rows[f"{arm} 1/2"] for arm in ARMS}
    assert 8 <= small["streaming"]["blocks"] < 9  # sink + 7 recent (+ the one being written, briefly)
    # streaming+k holds at least what the SnapKV planner's arms hold (they keep the generated blocks)
    assert rows["streaming+2 1/2"]["blocks"] >= small["snapkv"]["blocks"] > small["streaming"]["blocks"]
    for arm, r in small.items():
        assert abs(r["change"]) > 1e-4, arm  # 8 of 16 blocks: every policy changes something
        if arm != "streaming":
            lo, hi = r["vs_streaming_90"]
            assert lo <= r["vs_streaming"] <= hi
    assert len({round(r["gen_ppl"], 6) for r in small.values()}) >= 3  # they choose differently
