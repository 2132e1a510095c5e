"""Engines at one or more tensor-parallel ranks for the TP e2e tests, run one after another in one
interpreter (``python -m tests.e2e.tp_engines CASES.json``: one import of vLLM; every engine
starts its own engine-core and worker processes, one worker per rank, each bound to one CPU by
``launch.apply_env_defaults``).

A case: ``{"id", "kwargs" (vLLM's LLM arguments), "prompts" (token ids), "nll" (also score the
prompts), "reports" (a folder for VLLM_GRAFT_REPORT_DIR), "trace" (VLLM_GRAFT_KVCOMPRESS_TRACE or
null)}``. Per case :func:`run` returns the greedy tokens, the prompts' mean negative
log-likelihood (``nll`` cases), the plugins' events (``read_reports``: one rank of each
tensor-parallel group), the plugins that counted events on each rank, and each worker's dropped
KV blocks per request (from the trace), or ``error`` where the engine did not start (the other
cases still run).
"""
from __future__ import annotations

import collections
import gc
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
MAX_TOKENS = 24


def _main(path: str) -> None:
    from vllm_graft.launch import engine as launch
    from vllm_graft.integration.runtime import write_report_now

    cases = json.loads(Path(path).read_text())
    from vllm import LLM, SamplingParams

    for case in cases:
        os.environ["VLLM_GRAFT_REPORT_DIR"] = case["reports"]
        if case.get("trace"):
            os.environ["VLLM_GRAFT_KVCOMPRESS_TRACE"] = case["trace"]
        else:
            os.environ.pop("VLLM_GRAFT_KVCOMPRESS_TRACE", None)
        launch.apply_env_defaults(engine=case["kwargs"])
        try:
            llm = LLM(**case["kwargs"])
        except Exception as e:  # noqa: BLE001 - reported with the case; the others still run
            print("RESULT " + json.dumps({"id": case["id"], "error": repr(e)[-2000:]}), flush=True)
            continue
        batch = [{"prompt_token_ids": p} for p in case["prompts"]]
        outs = llm.generate(batch, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                            use_tqdm=False)
        result: dict[str, Any] = {"id": case["id"], "tokens": [list(o.outputs[0].token_ids) for o in outs]}
        if case.get("nll"):
            scored = llm.generate(batch, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
            lps = [d[t].logprob for o, p in zip(scored, case["prompts"])
                   for d, t in zip(o.prompt_logprobs[1:], p[1:])]
            result["nll"] = -sum(lps) / len(lps)
        llm.collective_rpc(write_report_now)  # workers may end before their reporter writes again
        print("RESULT " + json.dumps(result), flush=True)
        llm.llm_engine.engine_core.shutdown()  # the engine core writes its last report at exit
        del llm
        gc.collect()


def run(cases: list[dict[str, Any]], folder: Path, timeout: int = 1800) -> dict[str, dict[str, Any]]:
    """Run ``cases`` (see the module docstring) in a fresh interpreter; results by case id."""
    from vllm_graft.launch.reports import read_reports

    spec = folder / "cases.json"
    spec.write_text(json.dumps(cases))
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_GRAFT_")}
    # the last: vLLM sends collective_rpc a function (write_report_now) only by pickle
    env.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_ENABLE_V1_MULTIPROCESSING="1", VLLM_ALLOW_INSECURE_SERIALIZATION="1")
    env.pop("VLLM_CPU_OMP_THREADS_BIND", None)  # the launch default binds each rank to a CPU
    out = subprocess.run([sys.executable, "-m", "tests.e2e.tp_engines", str(spec)], cwd=REPO,
                         capture_output=True, text=True, env=env, timeout=timeout)
    got = {}
    for line in out.stdout.splitlines():
        if not line.startswith("RESULT "):
            continue
        r = json.loads(line[7:])
        case = next(c for c in cases if c["id"] == r["id"])
        reports = Path(case["reports"])
        summed = read_reports(str(reports)) if reports.is_dir() else {"plugins": []}
        r["events"] = {(p["kind"], p["name"]): p["events"] for p in summed["plugins"]}
        r["ranks"] = _plugins_by_rank(reports)
        r["drops"] = _drops(case.get("trace"))
        got[r["id"]] = r
    (folder / "results.json").write_text(json.dumps(  # for a look after a failure
        {k: dict(v, events={"/".join(e): n for e, n in v["events"].items()}) for k, v in got.items()},
        indent=1, default=str))
    assert out.returncode == 0 and len(got) == len(cases), out.stderr[-6000:]
    return got


def _plugins_by_rank(folder: Path) -> dict[int, list[str]]:
    """The plugins that counted events in each tensor-parallel rank's worker."""
    ranks: dict[int, set[str]] = collections.defaultdict(set)
    for path in folder.glob("*.json") if folder.is_dir() else ():
        data = json.loads(path.read_text())
        if data.get("tensor_parallel_rank") is not None:
            ranks[data["tensor_parallel_rank"]] |= {f"{p['kind']}/{p['name']}" for p in data["plugins"]
                                                    if any(p.get("events", {}).values())}
    return {rank: sorted(names) for rank, names in ranks.items()}


def _drops(trace: str | None) -> dict[int, dict[str, list[tuple]]]:
    """Worker pid -> request -> the blocks it dropped, in order (the scores channel's trace)."""
    drops: dict[int, dict[str, list[tuple]]] = collections.defaultdict(dict)
    if trace and Path(trace).exists():
        for e in map(json.loads, Path(trace).read_text().splitlines()):
            if e["event"] == "worker_dropped":
                drops[e["pid"]].setdefault(e["req"], []).append(tuple(e["blocks"]))
    return dict(drops)


if __name__ == "__main__":
    _main(sys.argv[1])
