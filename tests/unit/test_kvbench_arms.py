"""`vllm-graft kvbench`'s arms (no engine): budgets per fraction, h2o's recent share, the
h2o-mean label, kv4 compositions, and a clear refusal of an unknown compressor."""
import pytest

from vllm_graft.tools.kvcompress.kvbench import _arms


def test_arms_budgets_and_h2o_variants():
    arms = dict(_arms(2048, 32, ["streaming", "h2o", "h2o-mean"], (2, 8), h2o_recent=0.75))
    assert arms["plain"] is None
    assert arms["streaming 1/2"] == {"plugin": "streaming", "params": {"budget_blocks": 32, "sink_blocks": 1}}
    assert arms["h2o 1/2"]["params"] == {"budget_blocks": 32, "sink_blocks": 1, "recent_blocks": 24}
    assert arms["h2o-mean 1/8"] == {"plugin": "h2o", "params": {"budget_blocks": 8, "sink_blocks": 1,
                                                              "recent_blocks": 6, "score": "mean"}}
    default = dict(_arms(2048, 32, ["h2o"], (4,)))
    assert default["h2o 1/4"]["params"]["recent_blocks"] == 8  # half, as in the H2O paper


def test_kv4_compositions_and_unknown_names():
    arms = dict(_arms(2048, 32, ["kv4", "kv4+h2o-mean"], (4,)))
    assert arms["kv4"] == {"plugin": "kv4"}
    assert arms["kv4+h2o-mean 1/4"][1] == {"plugin": "kv4"}
    assert arms["kv4+h2o-mean 1/4"][0]["params"]["score"] == "mean"
    with pytest.raises(SystemExit, match="unknown compressor 'h3o'.*h2o-mean"):
        _arms(2048, 32, ["h3o"])


def test_snapkv_variants():
    arms = dict(_arms(2048, 32, ["snapkv", "snapkv-recent", "snapkv-wide"], (2, 8)))
    assert arms["snapkv 1/8"] == {"plugin": "snapkv", "params": {"budget_blocks": 8, "sink_blocks": 1,
                                                                "window_tokens": 32}}
    assert arms["snapkv-recent 1/2"]["params"]["recent_blocks"] == 16
    assert arms["snapkv-wide 1/2"] == {"plugin": "snapkv", "params": {"budget_blocks": 32, "sink_blocks": 1,
                                                                     "window_tokens": 512}}
    assert arms["snapkv-wide 1/8"]["params"]["window_tokens"] == 128


def test_adakv_arms_hold_snapkvs_memory():
    from vllm_graft.hooks import get_registry

    arms = dict(_arms(2048, 32, ["snapkv", "adakv", "adakv-half"], (2, 8)))
    reg = get_registry().get("kvcompress", "adakv").registration
    for frac, budget in (("1/2", 32), ("1/8", 8)):
        snap = arms[f"snapkv {frac}"]["params"]
        for name, per_head in (("adakv", budget), ("adakv-half", max(3, budget // 2))):
            p = arms[f"{name} {frac}"]
            assert p["plugin"] == "adakv" and p["params"]["held_blocks"] == snap["budget_blocks"] == budget
            assert p["params"]["budget_blocks"] == per_head and p["params"]["window_tokens"] == snap["window_tokens"]
            reg.params(**p["params"])  # valid parameters
