"""RazorAttention calibration: head classification from echo/induction scores, the probe on the
bundled model, and the head map it writes being what squeezed's streaming-heads mode reads."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from vllm_graft.tools.attention import calibrate_razor as razor
from vllm_graft.cli.main import main
from vllm_graft.plugins.attention.squeezed import SqueezedParams
from vllm_graft.plugins.attention.squeezed.policy import load_head_map
from vllm_graft.plugins.attention.squeezed.reference import Squeezed

LLAMA = Path(__file__).resolve().parents[2] / "models" / "graft-tiny-llama"


def test_classify_marks_top_heads_and_their_kv_heads():
    echo = torch.zeros(3, 4)
    induction = torch.zeros(3, 4)
    induction[1, 3] = 0.9  # an induction head: query head 3 of layer 1 -> KV head 1 (group 2)
    induction[2, 0] = 0.5
    echo[0, 1] = 0.7  # an echo head
    chosen, kv = razor.classify(echo, induction, num_kv_heads=2, induction_fraction=2 / 12,
                                echo_fraction=1 / 12)
    assert chosen.nonzero().tolist() == [[0, 1], [1, 3], [2, 0]]
    assert kv == [[True, False], [False, True], [True, False]]
    _, none = razor.classify(echo, induction, 2, 0.0, 0.0)
    assert none == [[False, False]] * 3


def test_probe_scores_measure_attention_to_earlier_copies():
    """A model whose every head attends only to the previous copy of the current token gets
    echo 1 and induction 0."""
    class Echo:
        def __call__(self, input_ids, output_attentions):
            n = input_ids.shape[1]
            a = torch.zeros(1, 2, n, n)
            for q in range(n):
                a[0, :, q, q - 8 if q >= 8 else q] = 1.0
            return type("Out", (), {"attentions": (a,)})()

    e, i = razor.probe_scores(Echo(), vocab=100, probe_len=8, repeats=2, seed=0)
    assert torch.allclose(e, torch.ones(1, 2)) and torch.allclose(i, torch.zeros(1, 2))


def test_calibrate_razor_on_the_bundled_model_writes_a_head_map_squeezed_reads(tmp_path, capsys):
    out = tmp_path / "heads.json"
    rc = main(["calibrate", "razor", "--model", str(LLAMA), "--out", str(out), "--probe-len", "32",
               "--repeats", "2", "--seeds", "1", "--induction-fraction", "0.25", "--echo-fraction", "0"])
    assert rc == 0
    data = json.loads(out.read_text())
    cfg = json.loads((LLAMA / "config.json").read_text())
    assert data["num_layers"] == cfg["num_hidden_layers"] and data["num_kv_heads"] == cfg["num_key_value_heads"]
    assert sum(map(sum, data["retrieval_query_heads"])) == 4  # 25% of 16 query heads
    heads = load_head_map(out)
    assert len(heads) == 4 and all(len(r) == 2 for r in heads) and 1 <= sum(map(sum, heads)) <= 4
    Squeezed(SqueezedParams(mode="streaming-heads", head_map=str(out)))  # loads
    assert "head map written" in capsys.readouterr().out


def test_calibrate_razor_refuses_bad_arguments(tmp_path, capsys):
    assert main(["calibrate", "razor", "--out", str(tmp_path / "h.json"), "--echo-fraction", "2"]) == 2
    assert main(["calibrate", "razor", "--out", str(tmp_path / "h.json"), "--probe-len", "1500"]) == 2
    assert not (tmp_path / "h.json").exists()
    with pytest.raises(SystemExit):
        main(["calibrate", "razor"])  # --out is required
    assert razor.NAME == "razor" and razor.PLUGIN == "attention:squeezed" and razor.HELP
