"""The scored compressors' worker half (h2o, snapkv, adakv: the step's plan, the scoring
attention over every layer, finalize) with vLLM's inputs on the device: the step's observe
mask and its mass must follow the query's device (issue 32, breakage 1)."""
from __future__ import annotations

import types

import pytest
import torch

from tests.fakedevice import plan_and_layers
from vllm_graft.hooks import get_registry
from vllm_graft.integration.adapters.kvcompress.rows import step_rows
from vllm_graft.integration.adapters.kvcompress.scores import _Scores, _ScoringAttention
from vllm_graft.kit.conformance.exercises.attention import ATTENTION_SEQS, attention_case

PARAMS = {"h2o": {"budget_blocks": 2, "sink_blocks": 1, "recent_blocks": 1},
          "snapkv": {"budget_blocks": 2, "sink_blocks": 1, "window_tokens": 4},
          "adakv": {"budget_blocks": 2, "sink_blocks": 1, "window_tokens": 4}}
LAYERS = 3


def _compressor(name):
    reg = get_registry().get("kvcompress", name).registration
    return reg.load()(reg.params(**PARAMS[name]))


def _step(device, name):
    """One step of three layers: (outputs, the drops reported, blocks dropped per KV head)."""
    q, kv, batch, layer = attention_case((4, 2, 16, 4), "float32", seed=5)
    events = []
    sc = _Scores(_compressor(name), name, lambda ev, n: events.append((ev, n)))
    att = _ScoringAttention(sc)
    rows = [(f"r{i}", n - qn, qn, n if qn > 1 else n - 1, []) for i, (n, qn) in enumerate(ATTENTION_SEQS)]
    # what the rows' pass notes from vLLM's metadata: the host copy of query_start_loc
    step_rows.step = types.SimpleNamespace(rows=rows, block_size=layer.block_size,
                                           query_start_loc=batch.query_start_loc.tolist())
    try:
        with device:
            q, kv = device.put(q, kv)
            batch = type(batch)(*device.put(batch.query_start_loc, batch.seq_lens, batch.block_table))
            _, outs = plan_and_layers(device, att, q, kv, batch, layer, LAYERS)
            with device.region("finalize (step)"):
                drops = sc.finalize()
    finally:
        step_rows.step = None
    dropped = sum(len(d) for st in sc.reqs.values() for d in (st.head_dropped or [st.dropped]))
    return outs, drops, dropped


@pytest.mark.parametrize("name", sorted(PARAMS))
def test_a_scored_step_runs_on_the_device_and_syncs_once_per_step(device, name):
    outs, drops, dropped = _step(device, name)
    assert all(o.device == outs[0].device for o in outs)
    assert dropped  # the budget is below every prompt: something is dropped (per KV head: adakv)
    if getattr(device, "real", False):
        return
    # the step's plan reads the batch layout from vLLM's host copy (no sync), the first layer
    # indexes the step (a few syncs, once per step), the other layers read nothing back to the
    # host, and finalize reads the mass summed over the layers once
    per = device.sync_counts()
    assert all(per.get(f"layer {i}", 0) == 0 for i in range(1, LAYERS)), device.report()
    assert per.get("layer 0", 0) <= 4, device.report()
    assert per.get("plan (step)", 0) == 0 and per.get("finalize (step)", 0) <= 1, device.report()


def test_the_host_and_the_device_step_decide_the_same_drops(device):
    from vllm_graft.kit.fakedevice import FakeDevice

    host_outs, host_drops, _ = _step(FakeDevice(), "h2o")  # nothing put: every tensor on the host
    dev_outs, dev_drops, _ = _step(device, "h2o")
    assert dev_drops == host_drops
    torch.testing.assert_close(dev_outs[-1].cpu(), host_outs[-1])


def test_the_mode_catches_the_step_mask_left_on_the_host(monkeypatch):
    """The bug this suite was built for, put back: the step's observe mask and mass made on
    the host (as before the fix) fail at the first scored layer on the fake device."""
    from vllm_graft.kit.fakedevice import DeviceMixError, FakeDevice

    original = _Scores.plan

    def host_plan(self, batch):
        plan = original(self, batch)
        plan.observe, plan.mass = plan.observe.cpu(), plan.mass.cpu()
        return plan

    monkeypatch.setattr(_Scores, "plan", host_plan)
    with pytest.raises(DeviceMixError, match="mixes a device tensor with a host tensor"):
        _step(FakeDevice(), "h2o")
