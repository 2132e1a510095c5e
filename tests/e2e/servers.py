"""What the tests that start vLLM's OpenAI server share: a free loopback port, and the server's
environment (no VLLM_GRAFT_* variable an earlier in-process engine of the same pytest run
exported; a 1 GiB CPU KV cache; vLLM's multiprocess engine)."""
from __future__ import annotations

import os

from vllm_graft.tools.soak.server import free_port

__all__ = ["free_port", "server_env"]


def server_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_GRAFT_")}
    env.update({"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}, **extra)
    return env
