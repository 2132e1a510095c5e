"""`vllm-graft kvbench`'s arms (no engine): budgets per fraction, h2o's recent share, the
h2o-mean label, kv4 compositions, and a clear refusal of an unknown compressor."""

import pytest

from vllm_graft.tools.kvcompress.kvbench import _arms


def test_arms_budgets_and_h2o_variants():
    arms = dict(_arms(2048, 32, ["streaming", "h2o", "h2o-mean"], (2, 8), h2o_recent=0.75))
    assert arms["plain"] is None
    assert arms["streaming 1/2"] == {"plugin": "streaming", "params": {"budget_blocks": 32, "sink_blocks": 1}}
    assert arms["h2o 1/2"]["params"] == {"budget_blocks": 32, "sink_blocks": 1, "recent_blocks": 24}
    assert arms["h2o-mean 1/8"] == {
        "plugin": "h2o",
        "params": {"budget_blocks": 8, "sink_blocks": 1, "recent_blocks": 6, "score": "mean"},
    }
    # kvpress's leaderboard ratio 0.25 removed: 3/4 of the 64 blocks kept
    assert dict(_arms(2048, 32, ["streaming"], ["3/4"]))["streaming 3/4"]["params"]["budget_blocks"] == 48
    default = dict(_arms(2048, 32, ["h2o"], (4,)))
    assert default["h2o 1/4"]["params"]["recent_blocks"] == 8  # half, as in the H2O paper
    # d2o drops what h2o drops: the same recent share, its own parameters on top
    d2o = dict(_arms(2048, 32, ['d2o:{"threshold": 0.9}'], (4,)))
    assert d2o["d2o 1/4"] == {
        "plugin": "d2o",
        "params": {"budget_blocks": 16, "sink_blocks": 1, "recent_blocks": 8, "threshold": 0.9},
    }


def test_kv4_compositions_and_unknown_names():
    arms = dict(_arms(2048, 32, ["kv4", "kv4+h2o-mean"], (4,)))
    assert arms["kv4"] == {"plugin": "kv4"}
    assert arms["kv4+h2o-mean 1/4"][1] == {"plugin": "kv4"}
    assert arms["kv4+h2o-mean 1/4"][0]["params"]["score"] == "mean"
    with pytest.raises(SystemExit, match="unknown compressor 'h3o'.*h2o-mean"):
        _arms(2048, 32, ["h3o"])


def test_snapkv_variants():
    arms = dict(_arms(2048, 32, ["snapkv", "snapkv-recent", "snapkv-wide"], (2, 8)))
    assert arms["snapkv 1/8"] == {
        "plugin": "snapkv",
        "params": {"budget_blocks": 8, "sink_blocks": 1, "window_tokens": 32},
    }
    assert arms["snapkv-recent 1/2"]["params"]["recent_blocks"] == 16
    assert arms["snapkv-wide 1/2"] == {
        "plugin": "snapkv",
        "params": {"budget_blocks": 32, "sink_blocks": 1, "window_tokens": 512},
    }
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


def test_any_registered_compressor_by_name_with_params():
    from vllm_graft.hooks import get_registry

    # a registered plugin kvbench has no arm of its own for: the budget through its parameter
    # model's budget_blocks/sink_blocks; `noop` has no budget_blocks, so it runs once
    arms = dict(_arms(2048, 32, ["noop", 'streaming:{"sink_blocks": 2}'], (2, 8), params={}))
    assert arms["noop"] == {"plugin": "noop", "params": {}}
    assert arms["streaming 1/8"]["params"] == {"budget_blocks": 8, "sink_blocks": 2}
    # --params apply to every compressor, a NAME:{JSON} entry's win; both validated by the plugin
    arms = dict(_arms(2048, 32, ["h2o", 'streaming:{"budget_blocks": 5}'], (4,), params={"sink_blocks": 3}))
    assert arms["h2o 1/4"]["params"]["sink_blocks"] == 3
    assert arms["streaming 1/4"]["params"] == {"budget_blocks": 5, "sink_blocks": 3}
    with pytest.raises(SystemExit, match=r"streaming.*invalid parameters.*sink_blocks"):
        _arms(2048, 32, ["streaming"], (4,), params={"sink_blocks": 40})
    with pytest.raises(SystemExit, match=r"streaming.*invalid parameters.*window"):
        _arms(2048, 32, ['streaming:{"window": 3}'], (4,))
    if ("kvcompress", "strided") in get_registry():  # the example package's (tests/e2e/test_kvbench_third_party.py)
        arms = dict(_arms(2048, 32, ["strided", "kv4+strided"], (2,)))
        assert arms["strided 1/2"] == {"plugin": "strided", "params": {"budget_blocks": 32, "sink_blocks": 1}}
        assert arms["kv4+strided 1/2"][0]["plugin"] == "strided"
        with pytest.raises(SystemExit, match="unknown compressor 'no-such'.*strided"):
            _arms(2048, 32, ["no-such"])


def test_comma_lists_keep_json_whole():
    from vllm_graft.tools.plugin_args import PluginArgError, parse_spec, split_list

    assert split_list('streaming,h2o:{"a": 1, "b": [1, 2]},snapkv') == [
        "streaming",
        'h2o:{"a": 1, "b": [1, 2]}',
        "snapkv",
    ]
    assert parse_spec('h2o:{"score": "mean"}') == ("h2o", {"score": "mean"})
    with pytest.raises(PluginArgError, match="not JSON"):
        parse_spec("h2o:{score}")
