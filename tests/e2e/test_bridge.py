"""The bridge inside real vLLM engines: every route, every process, and no change without
a deployment."""
from __future__ import annotations

import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import gc  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import urllib.request  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from vllm_graft.hooks import DeploymentError  # noqa: E402
from vllm_graft.integration import bridge  # noqa: E402
from vllm_graft.launch import engine as launch
from vllm_graft.integration.patches import PATCHES  # noqa: E402
from vllm_graft.integration.plan import plan_for  # noqa: E402
from vllm_graft.integration.runtime import RUNTIME  # noqa: E402

from .servers import free_port, stop  # noqa: E402

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
LLAMA = str(REPO / "models" / "graft-tiny-llama")
PROMPTS = ["def read_config(path):\n    with open(path", "class Stack:\n    def push(self, item):"]
ENGINE = {"dtype": "float32", "max_model_len": 512}

# Runs one engine in a fresh interpreter and prints its greedy tokens as JSON.
SCRIPT = """
import json, os, sys
if __name__ == "__main__":
    from vllm import LLM, SamplingParams
    kwargs = json.loads(sys.argv[1])
    llm = LLM(**kwargs)
    outs = llm.generate(json.loads(sys.argv[2]), SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    print("TOKENS=" + json.dumps([list(o.outputs[0].token_ids) for o in outs]))
"""


def run_script(kwargs: dict, env: dict[str, str]) -> list[list[int]]:
    full = {**os.environ, **env}
    proc = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(kwargs), json.dumps(PROMPTS)],
                          env=full, capture_output=True, text=True, timeout=240)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("TOKENS=")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1][len("TOKENS="):])


def generate(llm) -> list[list[int]]:
    from vllm import SamplingParams

    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def plain_tokens():
    """Greedy tokens of plain vLLM, with vllm-graft's entry point not even loaded."""
    return run_script({"model": LLAMA, **ENGINE},
                      {"VLLM_PLUGINS": "lora_filesystem_resolver", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})


def test_no_deployment_changes_nothing(plain_tokens):
    from vllm import LLM
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    llm = LLM(model=LLAMA, **ENGINE)
    try:
        assert RUNTIME.registered  # our entry point ran in this process...
        assert not RUNTIME.active  # ...and activated nothing
        assert [p.owner for p in PATCHES.applied()] == ["bridge"]
        assert not AttentionBackendEnum.CPU_ATTN.is_overridden()
        assert generate(llm) == plain_tokens
    finally:
        del llm
        gc.collect()


def test_bad_deployment_fails_before_the_engine_starts():
    from vllm import LLM

    t0 = time.perf_counter()
    with pytest.raises(DeploymentError) as e:
        LLM(model=LLAMA, **ENGINE, additional_config={"graft": {
            "attention": {"plugin": "noopp"}, "quant": {"plugin": "noop", "params": {"bits": 3}}}})
    text = str(e.value)
    assert "attention.plugin" in text and "Did you mean 'noop'" in text  # both problems, at once
    assert "quant.params.bits" in text
    assert time.perf_counter() - t0 < 30  # raised from config creation, no engine start-up
    assert not RUNTIME.active and bridge.ENV_CONFIG not in os.environ


def test_env_file_route_in_process(tmp_path, monkeypatch, plain_tokens):
    from vllm import LLM

    deploy = tmp_path / "d.yaml"
    deploy.write_text(f"model: {LLAMA}\nattention:\n  plugin: noop\n")
    monkeypatch.setenv(bridge.ENV_FILE, str(deploy))
    llm = LLM(model=LLAMA, **ENGINE)
    try:
        assert RUNTIME.active and RUNTIME.source.startswith(bridge.ENV_FILE + "=")
        assert generate(llm) == plain_tokens
        assert RUNTIME.counts("attention", "noop")["host"] > 0  # vLLM's kernel, behind the graft backend
    finally:
        del llm
        gc.collect()
    monkeypatch.delenv(bridge.ENV_FILE)
    llm = LLM(model=LLAMA, **ENGINE)  # the next engine without a deployment is plain again
    try:
        assert not RUNTIME.active
    finally:
        del llm
        gc.collect()


def test_drafts_ride_with_the_output_in_a_multiprocess_engine(tmp_path, plain_tokens):
    """The engine core reads each step's drafts from the worker's sample_tokens output, not in a
    round trip of its own (adapters/speculative/engine.py): same greedy tokens as plain vLLM,
    drafts verified, and the engine-core process counts the steps whose drafts rode."""
    reports = tmp_path / "reports"
    plan = plan_for({"model": LLAMA, "engine": ENGINE, "speculative": {"plugin": "lookahead"}})
    tokens = run_script(launch.llm_kwargs(plan), {"VLLM_ENABLE_V1_MULTIPROCESSING": "1",
                                                  "VLLM_GRAFT_REPORT_DIR": str(reports)})
    assert tokens == plain_tokens
    events = [e for f in reports.glob("*.json") for r in json.loads(f.read_text()).get("plugins", [])
              if r.get("name") == "lookahead" for e in [r.get("events", {})]]
    rode = sum(e.get("drafts_with_output", 0) for e in events)
    verified = sum(e.get("verified", 0) for e in events)
    assert rode > 0 and verified > 0, events


def test_loads_in_every_process_of_a_multiprocess_engine(tmp_path, plain_tokens):
    log = tmp_path / "activations.jsonl"
    plan = plan_for({"model": LLAMA, "engine": ENGINE, "attention": {"plugin": "noop"}})
    tokens = run_script(launch.llm_kwargs(plan), {"VLLM_ENABLE_V1_MULTIPROCESSING": "1",
                                                  bridge.ENV_ACTIVATION_LOG: str(log)})
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    pids = {x["pid"] for x in lines}
    assert len(pids) >= 2, lines  # the front end and the engine-core process (which runs the worker)
    assert {x["source"] for x in lines} == {"additional_config.graft", bridge.ENV_CONFIG}
    assert all(x["plugins"] == ["attention:noop"] for x in lines)
    assert tokens == plain_tokens


def test_serve_applies_the_deployment(tmp_path, plain_tokens):
    """`vllm-graft serve`: an OpenAI-compatible server whose processes run the deployment."""
    deploy = tmp_path / "d.yaml"
    deploy.write_text(f"model: {LLAMA}\nengine:\n  dtype: float32\n  max_model_len: 512\n"
                      "attention:\n  plugin: noop\n")
    log = tmp_path / "activations.jsonl"
    port = free_port()
    env = {**os.environ, bridge.ENV_ACTIVATION_LOG: str(log), "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    server = subprocess.Popen([sys.executable, "-m", "vllm_graft.cli.main", "serve", str(deploy),
                               "--port", str(port), "--served-model-name", "tiny"],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}/v1"
        deadline = time.time() + 180
        while True:
            assert server.poll() is None, server.stdout.read()[-3000:]
            try:
                urllib.request.urlopen(url + "/models", timeout=2)
                break
            except OSError:
                assert time.time() < deadline, "server did not come up in 180 s"
                time.sleep(1)
        body = json.dumps({"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0,
                           "return_token_ids": True}).encode()
        req = urllib.request.Request(url + "/completions", body, {"Content-Type": "application/json"})
        reply = json.loads(urllib.request.urlopen(req, timeout=60).read())
        choice = reply["choices"][0]
        assert choice["text"]
        if choice.get("token_ids") is not None:
            assert list(choice["token_ids"]) == plain_tokens[0]
        lines = [json.loads(x) for x in log.read_text().splitlines()]
        assert len({x["pid"] for x in lines}) >= 2 and all(x["plugins"] == ["attention:noop"] for x in lines)
    finally:
        stop(server)
