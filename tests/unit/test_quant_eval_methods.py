"""`vllm-graft quant-eval --method NAME[:{JSON}]`: any registered quant plugin applied at load,
named and validated before any engine starts (the engine run itself: the quant e2e tests)."""
from __future__ import annotations

from vllm_graft.cli.main import main
from vllm_graft.launch.engine import models_dir


def test_unknown_method_and_bad_params_are_refused_before_any_engine(capsys):
    model = str(models_dir() / "graft-tiny-llama")
    assert main(["quant-eval", model, "--method", "tova"]) == 2
    out = " ".join(capsys.readouterr().out.split())  # rich wraps lines
    assert "no quant plugin named 'tova'; registered: " in out and "w4a8" in out
    assert main(["quant-eval", model, "--method", 'w4a8:{"bogus": 1}']) == 2
    assert "invalid parameters" in " ".join(capsys.readouterr().out.split())
    assert main(["quant-eval", model, "--method", "w4a8", "--params", "{not json"]) == 2
    assert "not JSON" in " ".join(capsys.readouterr().out.split())
