"""Plugins under vLLM's tensor parallelism: the vLLM CPU engine at ``tensor_parallel_size=2``
(the multiprocess executor, one worker process per rank, each rank bound to one of the two
CPUs by ``launch.apply_env_defaults``), against the same deployment at one rank.

Scored KV compressors (``h2o``, ``snapkv``) are where ranks can disagree: each rank holds half
of the KV heads, so the attention mass it sees is partial, yet the block table and what is
freed are shared. The adapter sums the mass over the ranks before deciding
(``kvcompress.engine._tensor_parallel_sum``); without that sum the two ranks of the h2o case
below drop different blocks for some requests (seen once with the sum switched off: rank 0
dropped (4, 5, 6), rank 1 (3, 5, 6)), and a rank would go on reading blocks the scheduler
has freed. The trace of every worker's decisions shows both ranks dropping the same blocks,
the same as one rank does.

Only the plugins a test here runs at two ranks declare ``"tp"`` in their capabilities; the
others are refused under tensor parallelism (``test_deployment.py``).
"""
from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
LLAMA = str(REPO / "models" / "graft-tiny-llama")

SCRIPT = """
import json, sys
if __name__ == "__main__":
    from vllm_graft.integration import launch
    kwargs, prompts = json.loads(sys.argv[1]), json.loads(sys.argv[2])
    launch.apply_env_defaults(engine=kwargs)
    from vllm import LLM, SamplingParams
    llm = LLM(**kwargs)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    print("RESULT " + json.dumps([list(o.outputs[0].token_ids) for o in outs]))
"""


@pytest.fixture(scope="module")
def prompts():
    """Four 900-token windows of stdlib source (8 blocks of 128 each, with the output)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(LLAMA) / "tokenizer.json"))
    src = Path(json.__file__).with_name("decoder.py").read_text() + Path(json.__file__).with_name("encoder.py").read_text()
    ids = tok.encode(src).ids
    assert len(ids) >= 3600
    return [ids[i * 900:(i + 1) * 900] for i in range(4)]


def run(tmp_path: Path, name: str, tp: int, graft: dict, prompts) -> dict:
    """One engine in a fresh interpreter: greedy tokens, each worker's dropped blocks (from the
    scores-channel trace) and the plugin reports of every process."""
    trace, reports = tmp_path / f"{name}-tp{tp}.trace", tmp_path / f"{name}-tp{tp}-reports"
    kwargs = {"model": LLAMA, "dtype": "float32", "max_model_len": 1024, "tensor_parallel_size": tp,
              "enforce_eager": True,  # both arms: no torch.compile at load (~20 s an engine here)
              "additional_config": {"graft": graft}}
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_GRAFT_")}
    env.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_ENABLE_V1_MULTIPROCESSING="1",
               VLLM_GRAFT_KVCOMPRESS_TRACE=str(trace), VLLM_GRAFT_REPORT_DIR=str(reports))
    env.pop("VLLM_CPU_OMP_THREADS_BIND", None)  # the launch default binds each rank to a CPU
    out = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(kwargs), json.dumps(prompts)],
                         capture_output=True, text=True, env=env, timeout=600)
    lines = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
    assert out.returncode == 0 and lines, out.stderr[-4000:]
    drops = collections.defaultdict(dict)  # worker pid -> request -> blocks in the order dropped
    if trace.exists():
        for e in map(json.loads, trace.read_text().splitlines()):
            if e["event"] == "worker_dropped":
                drops[e["pid"]].setdefault(e["req"], []).append(tuple(e["blocks"]))
    from vllm_graft.integration.run import read_reports

    events = {(p["kind"], p["name"]): p["events"] for p in read_reports(str(reports))["plugins"]}
    return {"tokens": json.loads(lines[0][7:]), "drops": dict(drops), "events": events}


def _by_prompt(per_request: dict) -> list:
    """A worker's drops keyed by request, as a sorted list (request ids differ between engines)."""
    return sorted(map(tuple, per_request.values()))


@pytest.mark.parametrize("name,params", [("h2o", {"budget_blocks": 5}),
                                         ("snapkv", {"budget_blocks": 5, "window_tokens": 32})])
def test_scored_compressor_ranks_drop_the_same_blocks_as_one_rank(tmp_path, prompts, name, params):
    graft = {"kvcompress": {"plugin": name, "params": params}}
    one = run(tmp_path, name, 1, graft, prompts)
    two = run(tmp_path, name, 2, graft, prompts)
    assert len(one["drops"]) == 1 and len(two["drops"]) == 2, (one["drops"], two["drops"])
    (single,) = one["drops"].values()
    rank0, rank1 = two["drops"].values()
    assert len(single) == len(prompts) and any(len(b) for blocks in single.values() for b in blocks)
    assert rank0 == rank1, "the two ranks dropped different blocks"  # same request ids in one engine
    assert _by_prompt(rank0) == _by_prompt(single), "two ranks decided differently from one"
    assert two["tokens"] == one["tokens"]
    freed = lambda r: r["events"][("kvcompress", name)].get("blocks_freed", 0)  # noqa: E731
    assert freed(two) == freed(one) > 0


def test_streaming_with_lookahead_at_two_ranks_equals_one_rank(tmp_path, prompts):
    graft = {"kvcompress": {"plugin": "streaming", "params": {"budget_blocks": 4, "sink_blocks": 1}},
             "speculative": {"plugin": "lookahead"}}
    one = run(tmp_path, "streaming-lookahead", 1, graft, prompts)
    two = run(tmp_path, "streaming-lookahead", 2, graft, prompts)
    assert two["tokens"] == one["tokens"]
    kv = lambda r: r["events"][("kvcompress", "streaming")]  # noqa: E731
    assert kv(two)["blocks_freed"] == kv(one)["blocks_freed"] > 0
    spec = lambda r: r["events"][("speculative", "lookahead")]  # noqa: E731
    assert spec(two).get("accepted", 0) > 0 and spec(one).get("accepted", 0) > 0
