"""`vllm-graft kvbench --compressors NAME` with a compressor from an installed third-party
package: the example package examples/graft-flexq registers the `strided` KV compressor
through its own `vllm_graft` entry point; kvbench runs it by name, with per-plugin parameters,
at the smallest settings (one text, two needles, one budget), through the console script."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.e2e

CONTEXT, BLOCK = 512, 32
BUDGET = CONTEXT // BLOCK // 2  # --fractions 2


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    from vllm_graft.hooks import get_registry

    if ("kvcompress", "strided") not in get_registry():
        pytest.skip("the example package is not installed: pip install -e examples/graft-flexq")
    out = tmp_path_factory.mktemp("kvbench")
    script = os.path.join(os.path.dirname(sys.executable), "vllm-graft")  # CI does not activate the venv
    cmd = [script, "kvbench", "--compressors", 'strided:{"stride": 2}', "--fractions", "2",
           "--context", str(CONTEXT), "--block", str(BLOCK), "--chunk", "64", "--texts", "1", "--gen-tokens", "32",
           "--needles", "2", "--decode-tokens", "32", "--pool-blocks", "64", "--json", str(out / "rows.json")]
    # not the deployment an earlier in-process engine of this pytest run exported (VLLM_GRAFT_*)
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_GRAFT_")}
    env["VLLM_CPU_KVCACHE_SPACE"] = os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=out, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "strided 1/2" in proc.stdout  # the table's row
    return {r["arm"]: r for r in json.loads((out / "rows.json").read_text())}


def test_third_party_compressor_runs_by_name_and_evicts(rows):
    assert list(rows) == ["plain", "strided 1/2"]
    plain, strided = rows["plain"], rows["strided 1/2"]
    # kvbench gave it the budget and a sink through its parameter model's fields; the
    # per-plugin JSON added the stride
    assert strided["kvcompress"] == {"plugin": "strided",
                                     "params": {"budget_blocks": BUDGET, "sink_blocks": 1, "stride": 2}}
    # it really freed blocks in vLLM's pool: at most its budget while decoding, fewer than plain
    assert strided["median_blocks_decode"] <= BUDGET < plain["median_blocks_decode"]
    assert strided["median_blocks_gen"] <= BUDGET < plain["median_blocks_gen"]
    assert strided["peak_blocks"] < plain["peak_blocks"]
    assert strided["gen_tokens"] == plain["gen_tokens"] == 32 and strided["ppl"] > 0
