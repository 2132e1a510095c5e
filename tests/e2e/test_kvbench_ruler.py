"""`vllm-graft kvbench --suite ruler` through the console script at the smallest settings (a
512-token context, one case per task, plain vLLM and streaming at one budget): every arm scores
every case, the scores are score_case on the outputs vLLM gave, the compressor held its budget
while decoding, and the summary, tables and plot agree with the rows."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "models" / "graft-tiny-llama-recall"
CONTEXT, BLOCK = 512, 32
BUDGET = CONTEXT // BLOCK // 2  # --fractions 2
TASKS = ("single", "multikey", "multivalue", "vartrack")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("kvbench-ruler")
    script = os.path.join(os.path.dirname(sys.executable), "vllm-graft")  # CI does not activate the venv
    cmd = [
        script, "kvbench", "--model", str(MODEL), "--compressors", "streaming", "--fractions", "2",
        "--context", str(CONTEXT), "--block", str(BLOCK), "--chunk", "64", "--pool-blocks", "64",
        "--suite", "ruler", "--ruler-tasks", ",".join(TASKS), "--ruler-cases", "1",
        "--ruler-out", str(out / "ruler.json"),
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_GRAFT_")}
    env["VLLM_CPU_KVCACHE_SPACE"] = os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=out, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout, json.loads((out / "ruler.json").read_text()), (out / "ruler.svg").read_text()


def test_every_arm_scores_every_case_from_its_outputs(run):
    from vllm_graft.tools.kvcompress.kvbench import RULER_ROOM
    from vllm_graft.tools.workloads import Tokenizer
    from vllm_graft.tools.workloads.ruler import ruler_suite, score_case

    _, summary, _ = run
    rows = {r["arm"]: r for r in summary["rows"]}
    assert list(rows) == ["plain", "streaming 1/2"]
    cases = ruler_suite(Tokenizer.from_model(MODEL), tasks=TASKS, num_per_task=1, context_tokens=CONTEXT - RULER_ROOM)
    for r in rows.values():
        assert r["ruler_tasks"] == list(TASKS)
        assert len(r["ruler_outputs"]) == len(cases) and all(r["ruler_outputs"])
        assert r["ruler_scores"] == [score_case(c, o) for c, o in zip(cases, r["ruler_outputs"])]
    # streaming evicted: at most its budget while decoding, plain held the whole prompt
    assert rows["streaming 1/2"]["ruler_median_blocks_decode"] <= BUDGET < rows["plain"]["ruler_median_blocks_decode"]


def test_summary_tables_and_plot(run):
    stdout, summary, svg = run
    assert summary["tasks"] == list(TASKS) and summary["cases_per_task"] == 1 and summary["context"] == CONTEXT
    for a, r in zip(summary["arms"], summary["rows"]):
        assert a["arm"] == r["arm"]
        assert a["scores"] == dict(zip(r["ruler_tasks"], r["ruler_scores"]))  # one case per task
        assert a["average"] == pytest.approx(sum(r["ruler_scores"]) / len(TASKS))
    plain, streaming = summary["arms"]
    assert "| compressor | kept 1 | kept 1/2 |" in stdout
    assert f"| streaming |  | {streaming['average']:.3f} |" in stdout
    assert f"| plain | {plain['average']:.3f} |  |" in stdout
    root = ET.fromstring(svg)
    circles = [c for c in root.iter("{http://www.w3.org/2000/svg}circle")]
    assert [c.get("data-compressor") for c in circles] == ["streaming"]
