"""`vllm-graft specbench` without an engine: run layout, summary figures, table, the new
extractive workload, and the arms' deployment files."""
from __future__ import annotations

from pathlib import Path

import pytest

from vllm_graft.hooks import get_registry
from vllm_graft.tools.speculative import specbench as S
from vllm_graft.tools import workloads as W
from vllm_graft.integration.plan import plan_for

ROOT = Path(__file__).resolve().parents[2]


def test_runs_use_disjoint_prompts_and_warm_up_first():
    for w in ("chat", S.PARALLEL):
        runs = S._runs(w, 4, [16, 32])
        assert [b for b, _, _ in runs] == [0, 0, 1, 16, 32]
        used = [i for _, sl, _ in runs for i in range(sl.start, sl.stop)]
        assert len(used) == len(set(used))  # no prompt runs twice: learning proposers gain nothing
        assert S.prompts_needed([w], 4, [16, 32]) == max(used) + 1
    # parallel sampling: batch B is B/8 prompts x 8 samples
    assert [sl.stop - sl.start for _, sl, _ in S._runs(S.PARALLEL, 4, [16, 32])] == [1, 1, 1, 2, 4]


def run(batch, out, acc, drafts, tok_s, tokens):
    return {"batch": batch, "output_tokens": out, "accepted": acc, "drafts": drafts,
            "tok_s": tok_s, "greedy_tokens": tokens}


def test_summary_figures():
    results = {
        "plain": {"chat": {"runs": [run(1, 100, 0, 0, 50.0, [[1, 2]]), run(16, 200, 0, 0, 400.0, [[3]])]}},
        "x": {"chat": {"runs": [run(1, 100, 30, 20, 75.0, [[1, 2]]), run(16, 200, 50, 40, 200.0, [[4]])]}},
    }
    rows = S.summarize(results, ["chat"])
    x = next(r for r in rows if r["arm"] == "x")
    assert x["acc_per_verify"] == pytest.approx(80 / 60)
    assert x["fwd_per_token"] == pytest.approx((300 - 80) / 300)
    assert x["speedup@1"] == pytest.approx(1.5) and x["speedup@16"] == pytest.approx(0.5)
    assert x["identical"] is False  # the batch-16 output differs
    plain = next(r for r in rows if r["arm"] == "plain")
    assert plain["fwd_per_token"] == 1.0 and plain["identical"] is True
    table = S.render(rows, [16])
    assert "| chat | x | 1.33 | 0.733 | NO (1/2; first diff at 0.0) | 75 | 1.50 | 200 | 0.50 |" in table


def test_greedy_agreement_counts_identical_requests_and_where_the_others_part():
    plain = [run(1, 0, 0, 0, 1.0, [[1, 2, 3, 4], [5, 6, 7], [8, 9]])]
    other = [run(1, 0, 0, 0, 1.0, [[1, 2, 3, 4], [5, 0, 7], [8, 9, 10]])]
    got = S.greedy_agreement(other, plain)
    # the second parts at token 1; the third is plain's plus one token: it parts where plain's ends
    assert got == {"identical_share": pytest.approx(1 / 3), "first_diff_mean": 1.5, "requests": 3}
    assert S.greedy_agreement(plain, plain)["first_diff_mean"] is None


def test_arms_are_named_in_the_deployments_folder_given(monkeypatch):
    monkeypatch.setenv(S.ARMS_DIR_ENV, str(ROOT / "deployments" / "smollm2"))
    assert S.arm_file("plain") == ROOT / "deployments" / "smollm2" / "plain.yaml"
    assert S.arm_file("lookahead") == ROOT / "deployments" / "smollm2" / "spec-lookahead.yaml"
    for arm in S.DEFAULT_ARMS + ("swift", "vllm-suffix"):
        assert S.arm_file(arm).is_file(), arm


def test_extractive_prompts_end_with_the_signature_they_repeat():
    tok = W.Tokenizer.from_model(ROOT / "models" / "graft-tiny-llama")
    (ps,) = W.build(["extractive"], tok, num_prompts=6, max_tokens=64, max_model_len=2048)
    for p in ps.prompts:
        body, _, tail = p.text.partition("\n\n\n# The same function again, unchanged:\n")
        assert tail.strip() and tail.strip().splitlines()[-1] in body
        assert len(p.token_ids) + p.max_tokens < 2048


@pytest.mark.parametrize("arm", S.DEFAULT_ARMS)
def test_every_default_arm_has_a_valid_deployment(arm):
    plan = plan_for(S.arm_file(arm))
    assert plan.deployment.model and Path(plan.deployment.model).is_dir()
    if arm == "vllm-ngram":
        assert not plan.enabled and plan.deployment.engine["speculative_config"]["method"] == "ngram"
    elif arm == "plain":
        assert not plan.enabled
    else:
        (e,) = plan.enabled
        assert e.name == arm and (e.kind, e.name) in get_registry()


def test_any_registered_proposer_is_an_arm_with_params():
    """An arm without a spec-X.yaml that names a registered proposer runs it on plain.yaml's
    model; --params (under an X:{JSON} entry's) override a proposer arm's parameters, a file's
    too; unknown names and bad parameters are refused naming the choices."""
    from vllm_graft.tools.plugin_args import PluginArgError
    from vllm_graft.tools.speculative.specbench import arm_plan

    plain = arm_plan("plain")
    swift = arm_plan('swift:{"num_speculative_tokens": 3}')
    assert swift.deployment.model == plain.deployment.model and swift.deployment.speculative.plugin == "swift"
    assert swift.deployment.speculative.params["num_speculative_tokens"] == 3
    assert arm_plan("lookahead", {"num_speculative_tokens": 2}).deployment.speculative.params == {
        "num_speculative_tokens": 2}
    assert arm_plan("plain", {"num_speculative_tokens": 2}).enabled == []  # no proposer to give them to
    with pytest.raises(PluginArgError, match="no speculative plugin named 'tova'; registered: .*lookahead"):
        arm_plan("tova")
    with pytest.raises(PluginArgError, match="invalid parameters.*bogus"):
        arm_plan('lookahead:{"bogus": 1}')
