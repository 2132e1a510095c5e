"""Pre-quantised checkpoints without vLLM: the quantization_config checks, checkpoint tensor
names, the StoredTensor checks, the deployment a checkpoint implies, and `vllm-graft
quantize` (files written, refusals). Loading in vLLM: tests/e2e/test_quant_checkpoints.py."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from vllm_graft.hooks import QuantMethod, StoredTensor
from vllm_graft.cli import main as cli
from vllm_graft.integration.adapters.quant import checkpoint as quant
from vllm_graft.tools.quant.quantize import QuantizeError, quantize_checkpoint
from vllm_graft.integration.plan import plan_for

MODEL = Path(__file__).resolve().parents[2] / "models" / "graft-tiny-llama"


def cfg(**kw):
    return {"quant_method": "graft-dfloat11", "graft_format": 1, "params": {}, "embeddings": True, **kw}


def test_checkpoint_config_accepts_what_quantize_writes_and_refuses_the_rest():
    assert quant.checkpoint_config(cfg(), "graft-dfloat11")["embeddings"] is True
    with pytest.raises(ValueError, match="quant_method is 'gptq'"):
        quant.checkpoint_config(cfg(quant_method="gptq"), "graft-dfloat11")
    with pytest.raises(ValueError, match="graft_format is 7"):
        quant.checkpoint_config(cfg(graft_format=7), "graft-dfloat11")
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['bits'\]"):
        quant.checkpoint_config(cfg(bits=4), "graft-dfloat11")
    with pytest.raises(ValueError, match="params must be a mapping"):
        quant.checkpoint_config(cfg(params=[1]), "graft-dfloat11")
    with pytest.raises(ValueError, match="embeddings must be true or false"):
        quant.checkpoint_config(cfg(embeddings="yes"), "graft-dfloat11")


def test_checkpoint_tensor_names_follow_the_checkpoint_not_vllms_fused_layers():
    name = quant.checkpoint_tensor_name
    assert name("model.layers.0.self_attn.qkv_proj", "exponents", 1, 3) == "model.layers.0.self_attn.k_proj.exponents"
    assert name("model.layers.2.mlp.gate_up_proj", "codes", 0, 2) == "model.layers.2.mlp.gate_proj.codes"
    assert name("model.layers.2.mlp.gate_up_proj", "codes", None, 2) == "model.layers.2.mlp.gate_up_proj.codes"
    assert name("model.layers.2.mlp.down_proj", "codes", None, 1) == "model.layers.2.mlp.down_proj.codes"
    assert name("x.fused", "t", 1, 2) == "x.fused.t (shard 1)"


class _Specs(QuantMethod):
    def __init__(self, specs):
        self._specs = specs

    def quantize(self, weight):
        return {}

    def apply(self, tensors, x, bias):
        return x

    def stored_tensors(self, out_features, in_features):
        return self._specs


def test_stored_specs_checks():
    ok = {"codes": StoredTensor((8, 4), "uint8"), "blob": StoredTensor((-1,), "uint8", ragged=True)}
    assert quant.stored_specs(_Specs(ok), "p", 8, 16) is ok
    for bad, msg in [(None, "online only"), ({}, "non-empty"),
                     ({"weight": StoredTensor((8, 4), "uint8")}, "other than 'weight'"),
                     ({"c": (8, 4)}, "must be a StoredTensor"),
                     ({"c": StoredTensor((5, 4), "uint8")}, "multiple of the 8 output rows"),
                     ({"c": StoredTensor((8,), "uint8", ragged=True)}, r"shape \(-1,\)")]:
        with pytest.raises((TypeError, ValueError), match=msg):
            quant.stored_specs(_Specs(bad), "p", 8, 16)


def test_checkpoint_deployment(tmp_path):
    assert quant.checkpoint_deployment(MODEL) is None  # unquantised
    assert quant.checkpoint_deployment(tmp_path / "missing") is None
    assert quant.checkpoint_deployment(None) is None
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": cfg(params={"chunk": 64})}))
    assert quant.checkpoint_deployment(tmp_path) == {"quant": {"plugin": "dfloat11", "params": {"chunk": 64}}}
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "gptq"}}))
    assert quant.checkpoint_deployment(tmp_path) is None  # not ours: vLLM's business


def test_quantize_writes_a_checkpoint(tmp_path):
    from safetensors import safe_open

    out = tmp_path / "df11"
    report = quantize_checkpoint("dfloat11", str(MODEL), str(out), {"chunk": 64}, dtype="bfloat16",
                                 log=lambda *a: None)
    print(json.dumps(report))
    assert report["layers"] == 4 * 7 + 2 and report["embeddings_quantised"]
    assert report["ratio_to_bfloat16"] <= 0.72
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"] == {"quant_method": "graft-dfloat11", "graft_format": 1,
                                             "params": {"chunk": 64, "max_code_len": 12}, "embeddings": True}
    assert config["dtype"] == "bfloat16"
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / f).read_bytes() == (MODEL / f).read_bytes()
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "model.layers.0.self_attn.q_proj.exponents" in keys
    assert "model.layers.0.self_attn.q_proj.weight" not in keys
    assert "model.norm.weight" in keys and "lm_head.header" in keys


@pytest.mark.parametrize("argv,msg", [
    (["nope"], "unknown quant plugin 'nope'"),
    (["noop"], "online only"),
    (["dfloat11"], "supports dtype.*bfloat16.*pass --dtype bfloat16"),
    (["dfloat11", "--dtype", "bfloat16", "-p", "chunk=2"], "bad parameters for 'dfloat11'"),
    (["dfloat11", "--dtype", "bfloat16", "-p", "chunk"], "write KEY=VALUE"),
])
def test_quantize_command_refuses(tmp_path, capsys, argv, msg):
    import re

    rc = cli.main(["quantize", argv[0], str(MODEL), str(tmp_path / "out"), *argv[1:]])
    text = " ".join(capsys.readouterr().out.split())
    assert rc == cli.EXIT_INVALID and re.search(msg, text), text
    assert not (tmp_path / "out").exists()


def test_quantize_refuses_a_non_empty_folder_and_a_quantised_model(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "x").write_text("")
    with pytest.raises(QuantizeError, match="not empty"):
        quantize_checkpoint("dfloat11", str(MODEL), str(tmp_path / "out"), {}, dtype="bfloat16")
    quantize_checkpoint("dfloat11", str(MODEL), str(tmp_path / "q"), {}, dtype="bfloat16", log=lambda *a: None)
    with pytest.raises(QuantizeError, match="already quantised"):
        quantize_checkpoint("dfloat11", str(tmp_path / "q"), str(tmp_path / "q2"), {}, dtype="bfloat16")


def test_a_deployment_without_quant_gets_the_checkpoints_plugin(tmp_path):
    from vllm_graft.integration import bridge

    out = tmp_path / "df11"
    quantize_checkpoint("dfloat11", str(MODEL), str(out), {"chunk": 64}, dtype="bfloat16", log=lambda *a: None)
    plan = plan_for({"attention": {"plugin": "noop"}}, source="t", engine_model=str(out))
    assert sorted(f"{e.kind}:{e.name}" for e in plan.enabled) == ["attention:noop", "quant:dfloat11"]
    assert plan.deployment.quant.params == {"chunk": 64, "max_code_len": 12}
    plan = plan_for({"attention": {"plugin": "noop"}}, source="t", engine_model=str(MODEL))
    assert [f"{e.kind}:{e.name}" for e in plan.enabled] == ["attention:noop"]  # unquantised: unchanged
