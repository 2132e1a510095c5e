"""vLLM's OpenAI server for a soak: started on loopback with a capped KV pool, watched, stopped.

The server is ``python -m vllm.entrypoints.openai.api_server`` (what `vllm-graft serve` runs)
with the deployment's engine arguments, ``--kv-cache-memory-bytes`` set so the pool holds
``kv_tokens`` tokens (``VLLM_CPU_KVCACHE_SPACE`` is removed from its environment: vLLM's CPU
platform lets it override that argument), and ``VLLM_GRAFT_REPORT_DIR`` set so every vLLM
process writes its plugins' events and per-request table sizes
(:meth:`~vllm_graft.integration.runtime.Runtime.state_sizes`) where the soak reads them.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from ...launch.engine import SERVER_MODULE, engine_flags
from ...integration.lifetime import ENV_DIE_WITH_PARENT, set_parent_death_signal

SERVED_NAME = "soak"
#: vLLM's /metrics samples the soak reads (labels summed).
KV_USAGE = "vllm:kv_cache_usage_perc"
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
PREEMPTIONS = "vllm:num_preemptions_total"
DTYPE_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2}


class ServerError(RuntimeError):
    """The server did not start or died; the message carries the end of its log."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kv_bytes_per_token(model: str, dtype: str | None) -> int:
    """K and V bytes of one token over all layers, from the model's config.json (unquantized KV)."""
    cfg = json.loads((Path(model) / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    name = str(dtype or cfg.get("torch_dtype") or cfg.get("dtype") or "float32").replace("torch.", "")
    if name == "auto":
        name = str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32")
    if name not in DTYPE_BYTES:
        raise ValueError(f"dtype {name!r}: the soak sizes the KV pool for {', '.join(DTYPE_BYTES)}")
    return 2 * cfg["num_hidden_layers"] * kv_heads * head_dim * DTYPE_BYTES[name]


def server_env(report_dir: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_GRAFT_") and k != "VLLM_CPU_KVCACHE_SPACE"}
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    env[ENV_DIE_WITH_PARENT] = "1"  # the server's engine core ends with the server (integration/lifetime.py)
    if report_dir is not None:
        env["VLLM_GRAFT_REPORT_DIR"] = report_dir
    return env


class Server:
    """One server process; ``with Server(...) as s:`` starts it and always stops it."""

    def __init__(
        self,
        engine_kwargs: dict[str, Any],
        folder: Path,
        name: str,
        *,
        report: bool = True,
        start_timeout: float = 600,
        env: dict[str, str] | None = None,
    ) -> None:
        """``env``: variables set in the server's environment on top of :func:`server_env`'s
        (none for the soak; `vllm-graft servebench` gives the bench's ``VLLM_CPU_KVCACHE_SPACE``)."""
        self.kwargs, self.folder, self.name = engine_kwargs, folder, name
        self.extra_env = dict(env or {})
        # a name may be a deployment's path (servebench's arm for a second `plain.yaml`): one file name
        stem = re.sub(r"[^A-Za-z0-9._-]+", "_", name)
        self.report_dir = str(folder / f"{stem}-reports") if report else None
        self.log_path = folder / f"{stem}-server.log"
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.start_timeout = start_timeout
        self.proc: subprocess.Popen | None = None

    def argv(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            SERVER_MODULE,
            *engine_flags(self.kwargs),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--served-model-name",
            SERVED_NAME,
            "--disable-uvicorn-access-log",
        ]

    def __enter__(self) -> "Server":
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def start(self) -> None:
        import httpx

        if self.report_dir:
            os.makedirs(self.report_dir, exist_ok=True)
        with open(self.log_path, "w") as log:
            log.write("$ " + " ".join(self.argv()) + "\n")
            log.flush()
            self.proc = subprocess.Popen(
                self.argv(),
                env={**server_env(self.report_dir), **self.extra_env},
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.folder,
                start_new_session=True,
                # the server ends (SIGTERM: it stops its engine core) with this process, however
                # this one ends; its own children do so by ENV_DIE_WITH_PARENT
                preexec_fn=set_parent_death_signal,
            )
        deadline = time.monotonic() + self.start_timeout
        while True:
            if self.proc.poll() is not None:
                raise ServerError(
                    f"the {self.name} server exited ({self.proc.returncode}) while starting; "
                    f"the end of {self.log_path}:\n{self.log_tail()}"
                )
            try:
                if httpx.get(self.base + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise ServerError(
                    f"the {self.name} server did not answer /health in {self.start_timeout:.0f} s; "
                    f"the end of {self.log_path}:\n{self.log_tail()}"
                )
            time.sleep(1)

    def stop(self) -> None:
        """SIGTERM to the server (vLLM stops its engine core with it), SIGKILL to the whole
        process group after 30 s."""
        if self.proc is None or self.proc.poll() is not None:
            return
        import signal

        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        # the engine core and any other child of the group, should one outlive the server
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no log)"

    def metrics(self) -> dict[str, float]:
        import httpx

        from ...launch.reports import parse_metrics

        return parse_metrics(httpx.get(self.base + "/metrics", timeout=10).text)

    def rss_mb(self) -> dict[str, float]:
        """Resident memory (MiB) of the server and each of its child processes (engine core...)."""
        import psutil

        out: dict[str, float] = {}
        if self.proc is None:  # not started: nothing resident, as for a server that has exited
            return out
        try:
            root = psutil.Process(self.proc.pid)
            procs = [root] + root.children(recursive=True)
        except psutil.Error:
            return out
        for p in procs:
            try:
                label = "server" if p.pid == root.pid else _role(p)
                out[f"{label} ({p.pid})"] = p.memory_info().rss / 2**20
            except psutil.Error:
                continue
        return out

    def state_sizes(self) -> dict[str, int]:
        """Per-request table sizes from every process's last report, ``process:label -> n``."""
        out: dict[str, int] = {}
        if not self.report_dir:
            return out
        for path in sorted(Path(self.report_dir).glob("*.json")):
            try:
                data = json.loads(path.read_text())
            except (OSError, ValueError):
                continue  # being replaced
            for label, n in (data.get("state_sizes") or {}).items():
                out[f"{data.get('process')}:{label}"] = int(n)
        return out

    def reports_written_at(self) -> float:
        newest = 0.0
        for path in Path(self.report_dir or "/nonexistent").glob("*.json"):
            try:
                newest = max(newest, float(json.loads(path.read_text()).get("written_at") or 0))
            except (OSError, ValueError):
                continue
        return newest


def _role(p: Any) -> str:
    try:
        cmd = " ".join(p.cmdline())
        name = p.name()
    except Exception:  # noqa: BLE001 - a process that just ended
        return "child"
    if "multiprocessing" in cmd and "resource_tracker" in cmd:
        return "resource_tracker"
    return name or "child"
