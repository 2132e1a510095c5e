"""expert-mask (MoTE): the mask policy, its file format and validation, the masking of router
logits (property tests over random masks and logits), and the calibration contrast. No vLLM."""
import json
import random

import pytest
import torch
from pydantic import ValidationError

from vllm_graft.hooks import MoEModel
from vllm_graft.integration.adapters.moe.chain import MoEChain
from vllm_graft.plugins.moe.expert_mask import Params
from vllm_graft.plugins.moe.expert_mask.policy import (
    ExpertMask, MaskError, activation_frequency, contrast, mask_from, most_distinctive)
from vllm_graft.plugins.moe.expert_mask.reference import ExpertMaskScheduler, mask_logits
from vllm_graft.plugins.moe.noop.reference import softmax_topk

MODEL = MoEModel(num_layers=4, num_experts=8, top_k=2, model="tiny")


def random_mask(rng, E=8, L=4, k=2):
    off, on = {}, {}
    for layer in range(L):
        experts = list(range(E))
        rng.shuffle(experts)
        n_off = rng.randint(0, E - k)
        n_on = rng.randint(0, k)
        off[str(layer)] = experts[:n_off]
        on[str(layer)] = experts[n_off:n_off + n_on]
    return ExpertMask.from_dict({"off": off, "on": on})


@pytest.mark.parametrize("seed", range(40))
def test_masks_are_respected_by_topk_routing(seed):
    """Property: whatever the logits, no token routes to a switched-off expert, every forced
    expert is in every token's top-k, and the routing stays a valid softmax top-k."""
    rng = random.Random(seed)
    mask = random_mask(rng)
    assert mask.problems(4, 8, 2) == []
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(16, 8, generator=g) * rng.choice([0.1, 1.0, 10.0])
    if seed % 5 == 0:  # ties
        logits = logits.round()
    s = ExpertMaskScheduler(Params(off={k: sorted(v) for k, v in mask.off.items()},
                                   on={k: sorted(v) for k, v in mask.on.items()}))
    s.bind(MODEL)
    for layer in range(4):
        out = s.adjust_logits(layer, logits)
        weights, ids = softmax_topk(out, 2, True)
        chosen = [set(r) for r in ids.tolist()]
        assert all(not (c & mask.off_in(layer)) for c in chosen), (layer, mask.off_in(layer))
        assert all(mask.on_in(layer) <= c for c in chosen), (layer, mask.on_in(layer))
        assert torch.isfinite(weights).all() and torch.allclose(weights.sum(-1), torch.ones(16))
        untouched = sorted(set(range(8)) - mask.off_in(layer) - mask.on_in(layer))
        assert torch.equal(out[:, untouched], logits[:, untouched])  # the others keep their logits


def test_empty_mask_returns_the_logits_unchanged():
    s = ExpertMaskScheduler(Params())
    s.bind(MODEL)
    x = torch.randn(5, 8)
    assert s.adjust_logits(2, x) is x
    assert s.describe()["masked_layer_calls"] == 0


def test_forcing_an_expert_already_on_top_keeps_its_weight():
    x = torch.tensor([[5.0, 1.0, 0.0, -1.0]])
    out = mask_logits(x, None, torch.tensor([0]))
    assert torch.equal(out, x)
    out = mask_logits(x, None, torch.tensor([3]))  # raised just above expert 0
    assert out[0, 3] > 5.0 and out[0, 3] - 5.0 < 1e-5
    assert set(softmax_topk(out, 1, True)[1].flatten().tolist()) == {3}


def test_mask_file_round_trip_and_star_layer(tmp_path):
    m = ExpertMask.from_dict({"off": {"*": [1], "2": [3, 4]}, "on": {"0": [7]}, "num_experts": 8})
    assert m.off_in(2) == {1, 3, 4} and m.off_in(0) == {1} and m.on_in(0) == {7} and m.on_in(1) == set()
    path = tmp_path / "m.json"
    m.save(path)
    data = json.loads(path.read_text())
    assert data["format"] == "vllm-graft/expert-mask" and data["off"] == {"*": [1], "2": [3, 4]}
    again = ExpertMask.load(path)
    assert again.to_dict() == m.to_dict()
    p = Params(mask_file=str(path), off={"1": [0]})
    assert p.mask().off_in(1) == {0, 1} and p.mask_file == str(path.resolve())


@pytest.mark.parametrize("data, message", [
    ({"off": {"x": [1]}}, "layer key 'x' is not a layer index"),
    ({"off": {"-1": [1]}}, "layer key '-1'"),
    ({"off": {"0": [-2]}}, "-2 is not an expert index"),
    ({"off": {"0": "3"}}, "expected a list of expert indices"),
    ({"format": "other"}, "format 'other'"),
    ({"offf": {}}, "unknown field(s) ['offf']"),
])
def test_malformed_masks_are_refused_with_the_entry_named(data, message):
    with pytest.raises(MaskError) as e:
        ExpertMask.from_dict(data)
    assert message in str(e.value)


def test_params_refuse_bad_masks_at_validation(tmp_path):
    with pytest.raises(ValidationError, match="cannot read mask file"):
        Params(mask_file=str(tmp_path / "missing.json"))
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValidationError, match="is not JSON"):
        Params(mask_file=str(tmp_path / "bad.json"))
    with pytest.raises(ValidationError, match="is not an expert index"):
        Params(off={"0": [-1]})
    with pytest.raises(ValidationError, match="extra"):
        Params(of={"0": [1]})


@pytest.mark.parametrize("data, message", [
    ({"off": {"4": [1]}}, "layer(s) [4] do not exist or have no MoE block; MoE layers: 0..3"),
    ({"off": {"0": [8]}}, "off['0']: expert(s) [8] out of range; experts are 0..7"),
    ({"on": {"*": [9, 1]}}, "on['*']: expert(s) [9] out of range"),
    ({"off": {"0": [1, 2, 3, 4, 5, 6, 7]}}, "layer 0: 7 of 8 experts switched off leaves 1, fewer than the top-2"),
    ({"on": {"1": [1, 2, 3]}}, "layer 1: 3 experts forced on ([1, 2, 3]) but a token takes only top-2"),
    ({"on": {"1": [2]}, "off": {"*": [2]}}, "layer 1: expert(s) [2] are both switched off and forced on"),
    ({"num_experts": 16}, "made for a model with 16 experts, this one has 8"),
])
def test_masks_that_do_not_fit_the_model_are_refused_at_bind(data, message):
    s = ExpertMaskScheduler(Params(**{k: v for k, v in data.items() if k in ("off", "on")}))
    if "num_experts" in data:
        s.mask = ExpertMask.from_dict(data)
    with pytest.raises(MaskError) as e:
        s.bind(MODEL)
    assert message in str(e.value)


def test_mask_composes_in_a_chain_before_the_model_topk():
    s = ExpertMaskScheduler(Params(off={"*": [0, 1]}))
    s.bind(MODEL)
    chain = MoEChain([("expert-mask", s)])
    x = torch.randn(10, 8)
    x[:, 0] = 100.0  # would win everywhere
    w, ids = chain(1, x, 2, True, lambda l: softmax_topk(l, 2, True))
    assert not ({0, 1} & set(ids.flatten().tolist()))


# ------------------------------------------------------------------------- calibration
def test_contrast_picks_experts_the_behaviour_uses_more():
    fa = activation_frequency([[10, 0, 5, 5], [0, 10, 10, 0]], 10)
    fb = activation_frequency([[2, 8, 5, 5], [5, 5, 5, 5]], 10)
    assert contrast(fa, fb)[0] == pytest.approx([0.8, -0.8, 0.0, 0.0])
    top = most_distinctive(fa, fb, top=2)
    assert [(d.layer, d.expert) for d in top] == [(0, 0), (1, 1)]  # 0.8, then 0.5 (tie with (1,2): lower id)
    per = most_distinctive(fa, fb, top=1, per_layer=True)
    assert [(d.layer, d.expert) for d in per] == [(0, 0), (1, 1)]
    capped = most_distinctive(fa, fb, top=3, max_per_layer=1)
    assert [(d.layer, d.expert) for d in capped] == [(0, 0), (1, 1)]
    assert most_distinctive(fb, fb, top=3) == []  # nothing distinctive: nothing picked
    lr = contrast([[0.01, 0.5]], [[0.0, 0.4]], method="log-ratio")[0]
    assert lr[0] > lr[1] > 0
    mask = mask_from(top, "off", 2, 4)
    assert mask.off_in(0) == {0} and mask.off_in(1) == {1} and mask.problems(2, 4, 2) == []
    with pytest.raises(ValueError, match="no tokens"):
        activation_frequency([[0]], 0)


def test_a_relative_mask_file_resolves_from_the_deployment_folder(tmp_path, monkeypatch):
    ExpertMask.from_dict({"off": {"0": [1]}}).save(tmp_path / "m.json")
    monkeypatch.chdir(tmp_path.parent)
    p = Params.model_validate({"mask_file": "m.json"}, context={"base_dir": str(tmp_path)})
    assert p.mask_file == str((tmp_path / "m.json").resolve()) and p.mask().off_in(0) == {1}
    with pytest.raises(ValidationError, match="cannot read mask file"):
        Params.model_validate({"mask_file": "m.json"}, context={"base_dir": str(tmp_path.parent)})
