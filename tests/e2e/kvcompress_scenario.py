"""One engine scenario for the KV-compression e2e tests, run in-process by the tests and in
vLLM's default multiprocess mode by ``python -m tests.e2e.kvcompress_scenario '[KVCOMPRESS, ...]'``
(one engine after another in one process; prints each result as JSON): requests that arrive over time (one shares another's prompt,
so it hits the prefix cache), a KV pool too small for all of them (so requests are
preempted and resumed), and one request aborted mid-generation."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any
from vllm_graft.integration.plan import plan_for

LLAMA = Path(__file__).resolve().parents[2] / "models" / "graft-tiny-llama"
BLOCK = 32
POOL_BLOCKS = 14
ENGINE = {"dtype": "float32", "max_model_len": 384, "block_size": BLOCK, "enforce_eager": True,
          "enable_prefix_caching": True, "num_gpu_blocks_override": POOL_BLOCKS, "max_num_seqs": 8}
PROMPTS = [
    "import os\nimport sys\n\n\ndef main(argv=None):\n    if argv is None:\n        argv = sys.argv[1:]\n"
    "    for arg in argv:",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n"
    "        self.items.append(item)\n\n    def pop(self):\n        return self.items.pop()\n\n"
    "    def peek(self):\n        return self.items[-1]\n\n    def __len__(self):",
    "def read_config(path):\n    \"\"\"Return the parsed contents of the file at *path*.\"\"\"\n"
    "    with open(path) as f:\n        return json.load(f)\n\n\n",
]
NEW_TOKENS = 150
# (step at which it is added, request id, prompt index); r2 repeats r1's prompt once r1's
# prompt is cached; r4 is aborted ABORT_AT steps after it arrives.
ARRIVALS = [(0, "r0", 0), (0, "r1", 1), (4, "r2", 1), (4, "r3", 2), (6, "r4", 0), (8, "r5", 2)]
ABORT = ("r4", 14)


def run(kvcompress: dict[str, Any] | None) -> dict[str, Any]:
    from vllm import LLM, SamplingParams

    from vllm_graft.launch import engine as launch

    data = {"model": str(LLAMA), "engine": ENGINE}
    if kvcompress:
        data["kvcompress"] = kvcompress
    plan = plan_for(data)
    llm = LLM(**launch.llm_kwargs(plan, graft=bool(kvcompress)), seed=0, disable_log_stats=False)
    engine = llm.llm_engine
    in_process = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"
    core = engine.engine_core.engine_core if in_process else None
    try:
        tok = llm.get_tokenizer()
        ids = [tok(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
        params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
        free_start = core.scheduler.kv_cache_manager.block_pool.get_num_free_blocks() if core else None
        out: dict[str, Any] = {"tokens": {}, "logprobs": {}, "cached": {}, "aborted": [], "max_held": 0}
        step = 0
        salts: set[str] = set()
        pending = list(ARRIVALS)
        while pending or engine.has_unfinished_requests():
            for arrival in [a for a in pending if a[0] <= step]:
                engine.add_request(arrival[1], {"prompt_token_ids": ids[arrival[2]]}, params)
                pending.remove(arrival)
            if step == dict((a[1], a[0]) for a in ARRIVALS)[ABORT[0]] + ABORT[1]:
                engine.abort_request([ABORT[0]])
                out["aborted"].append(ABORT[0])
            for o in engine.step():
                if o.finished and o.request_id not in out["aborted"]:
                    c = o.outputs[0]
                    out["tokens"][o.request_id] = list(c.token_ids)
                    out["logprobs"][o.request_id] = [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)]
                    out["cached"][o.request_id] = o.num_cached_tokens
            if core is not None:
                (mgr,) = core.scheduler.kv_cache_manager.coordinator.single_type_managers
                salts |= {r.cache_salt or "" for r in core.scheduler.requests.values()}
                for blocks in mgr.req_to_blocks.values():
                    out["max_held"] = max(out["max_held"], sum(not b.is_null for b in blocks))
            step += 1
        metrics = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
        out["preemptions"] = metrics.get("vllm:num_preemptions")
        if core is not None:
            kv = core.scheduler.kv_cache_manager
            out["leaked"] = free_start - kv.block_pool.get_num_free_blocks()
            (mgr,) = kv.coordinator.single_type_managers
            out["left"] = sorted(mgr.req_to_blocks)
            out["manager"] = type(mgr).__name__
            out["salts"] = sorted(salts)
            out["page_bytes"] = mgr.kv_cache_spec.page_size_bytes
            from vllm_graft.integration.runtime import RUNTIME

            out["events"] = {f"{name}:{ev}": n for (_, name, ev), n in RUNTIME.events.items()}
        return out
    finally:
        if in_process:
            engine.engine_core.shutdown()
        else:
            llm.llm_engine.engine_core.shutdown()
        del llm


_once: dict[str, dict[str, Any]] = {}


def _run_once(measure: Any, kvcompress: dict[str, Any] | None) -> dict[str, Any]:
    """``measure(kvcompress)``, once per process and configuration: test modules share plain's."""
    key = json.dumps([measure.__name__, kvcompress], sort_keys=True)
    if key not in _once:
        _once[key] = measure(kvcompress)
    return _once[key]


def run_shared(kvcompress: dict[str, Any] | None) -> dict[str, Any]:
    """:func:`run`, once per process and configuration."""
    return _run_once(run, kvcompress)


def storage(kvcompress: dict[str, Any] | None) -> dict[str, Any]:
    """:func:`_storage`, once per process and configuration (plain measured once for every format)."""
    return _run_once(_storage, kvcompress)


def _storage(kvcompress: dict[str, Any] | None) -> dict[str, Any]:
    """What a KV storage format does to vLLM's pool in the launch default's KV memory
    (``VLLM_CPU_KVCACHE_SPACE``, no block override): ``blocks``, ``page_bytes`` (per layer),
    ``dtype``, ``memory`` (bytes of every KV tensor), and ``text``, the greedy continuation of
    ``PROMPTS[0]`` (48 tokens)."""
    from vllm import SamplingParams

    from vllm_graft.launch import engine as launch

    engine = {k: v for k, v in ENGINE.items() if k != "num_gpu_blocks_override"}
    data = {"model": str(LLAMA), "engine": engine, **({"kvcompress": kvcompress} if kvcompress else {})}
    with launch.in_process_engine(plan_for(data), graft=bool(kvcompress), seed=0) as llm:
        config = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_config
        (group,) = config.kv_cache_groups
        sp = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
        return {
            "blocks": config.num_blocks,
            "page_bytes": group.kv_cache_spec.page_size_bytes,
            "dtype": str(group.kv_cache_spec.dtype),
            "memory": sum(t.size for t in config.kv_cache_tensors),
            "text": llm.generate([PROMPTS[0]], sp, use_tqdm=False)[0].outputs[0].text,
        }


def check_pool(name: str, plain: dict[str, Any], out: dict[str, Any], *, page_bytes: int) -> None:
    """Assert that a storage format's page is ``page_bytes`` of uint8 per layer where plain's is
    float32 (graft-tiny-llama: 2 KV heads of 64, blocks of 32 tokens), and that the same KV memory
    holds as many blocks of it as fit, in no more memory than plain's."""
    print(f"KV pool: plain {plain}, {name} {out}")
    assert (plain["page_bytes"], plain["dtype"]) == (2 * BLOCK * 2 * 64 * 4, "torch.float32")
    assert (out["page_bytes"], out["dtype"]) == (page_bytes, "torch.uint8")
    space = int(os.environ["VLLM_CPU_KVCACHE_SPACE"]) << 30
    layers = 4
    assert plain["blocks"] == space // (layers * plain["page_bytes"])
    assert out["blocks"] == space // (layers * page_bytes)
    assert out["memory"] <= plain["memory"]


def agreement(a: dict[str, list[int]], b: dict[str, list[int]]) -> float:
    """Fraction of positions where two requests' greedy tokens agree, over all requests."""
    same = sum(x == y for r in a for x, y in zip(a[r], b[r]))
    return same / sum(len(a[r]) for r in a)


def check_close_to_plain(name: str, plain: dict[str, Any], out: dict[str, Any], page_bytes: int,
                         min_first: int) -> None:
    """Assert that a lossy KV format ``name`` ran the whole scenario (preemption, the abort,
    prefix hits, no leaked block, its write/forward seams) and stays close to the plain run:
    every request's first ``min_first`` tokens equal plain's and over 20% of them agree."""
    assert out["manager"] == "GraftKVCompressManager" and out["page_bytes"] == page_bytes
    assert out["preemptions"] > 0 and out["aborted"] == ["r4"]
    assert sorted(out["tokens"]) == sorted(plain["tokens"])
    assert all(len(t) == NEW_TOKENS for t in out["tokens"].values())
    assert out["leaked"] == 0 and out["left"] == []
    assert out["cached"]["r2"] > 0 and out["cached"]["r5"] > 0  # its blocks are prefix-cached
    assert out["events"][f"{name}:write"] > 0 and out["events"][f"{name}:forward"] > 0
    agree = agreement(plain["tokens"], out["tokens"])
    first = {r: next((i for i, (x, y) in enumerate(zip(plain["tokens"][r], t)) if x != y), len(t))
             for r, t in out["tokens"].items()}
    print(f"{name} vs plain: {100 * agree:.1f}% of greedy tokens agree; first difference per request {first}")
    assert all(n >= min_first for n in first.values()), first
    assert agree > 0.2


if __name__ == "__main__":
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    for kvcompress in json.loads(sys.argv[1]):  # a list of kvcompress sections (null: plain)
        print("GRAFT-RESULT " + json.dumps(run(kvcompress)), flush=True)


def million_books(out: Path) -> dict[str, Any]:
    """Calibrate ``million``'s codebooks (sub_dim 2, 8 bits) on the tiny model into ``out``, as
    the e2e tests use them (1,536 tokens of the bundled corpus, 5 k-means iterations)."""
    from vllm_graft.tools.kvcompress.calibrate_million import calibrate, text_windows

    windows, source = text_windows(str(LLAMA), [], window=256, tokens=1536, seed=0)
    return calibrate(str(LLAMA), str(out), windows, sub_dim=2, bits=8, iters=5, max_tokens=1536, source=source)
