"""What the runtime reports, read from outside vLLM: the per-process report files a deployment's
processes write while ``VLLM_GRAFT_REPORT_DIR`` is set (:mod:`vllm_graft.integration.runtime`),
summed over the processes, and vLLM's own Prometheus ``/metrics`` text."""

from __future__ import annotations

import json
import time
from typing import Any

#: `vllm-graft report` reads once this many report periods (runtime.REPORT_EVERY_S) have passed
#: since it was called and since any process last rewrote its report, waiting at most REPORT_WAIT_S.
REPORT_QUIET_PERIODS = 2.5
REPORT_WAIT_S = 6.0


def read_reports(folder: str) -> dict[str, Any]:
    """The per-process reports in ``folder`` and each plugin's events summed over them, counting
    one rank of a tensor-parallel group: every rank runs a worker-side plugin on its shard of the
    same steps, so the ranks after the first repeat its counts (they are listed in
    ``processes``, with their ``tensor_parallel_rank``, but not added)."""
    from collections import Counter
    from pathlib import Path

    processes: list = []
    plugins: dict = {}
    for path in sorted(Path(folder).glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # mid-replace or foreign: the next read sees it
        rank = data.get("tensor_parallel_rank")
        processes.append(
            {
                "process": data.get("process"),
                "pid": data.get("pid"),
                "tensor_parallel_rank": rank,
                "written_at": data.get("written_at"),
                "file": path.name,
            }
        )
        if rank:  # a later rank of a tensor-parallel group
            continue
        for p in data.get("plugins", []):
            entry = plugins.setdefault(
                (p["kind"], p["name"]), {"kind": p["kind"], "name": p["name"], "events": Counter(), "processes": []}
            )
            entry["events"].update(p.get("events", {}))
            entry["processes"].append(data.get("process"))
    return {"processes": processes, "plugins": [dict(e, events=dict(e["events"])) for e in plugins.values()]}


def read_settled_reports(
    folder: str, *, quiet_s: float, timeout_s: float, clock: Any = time.time, sleep: Any = time.sleep
) -> tuple[dict[str, Any], bool]:
    """:func:`read_reports` once ``quiet_s`` has passed since this call and no process has
    rewritten its report for ``quiet_s``, waiting at most ``timeout_s``. Returns the reports and
    whether they had settled (False: a process is still counting, e.g. a busy server).

    A process rewrites its report within ``REPORT_EVERY_S`` of counting events, so the events of
    the last second before this call may not be in any file yet, and no file says so: a run of
    requests shorter than a report period (20 requests on the tiny model take ~0.5 s) left every
    file as it was at activation, long idle, and a read at once saw none of the run (a CI failure
    of tests/e2e/test_report_metrics.py). Hence the wait of ``quiet_s`` from the call, always."""
    start = clock()
    deadline = start + timeout_s
    while True:
        summed = read_reports(folder)
        newest = max((p["written_at"] for p in summed["processes"] if p.get("written_at")), default=None)
        now = clock()
        wait = max(0.0, start + quiet_s - now, 0.0 if newest is None else newest + quiet_s - now)
        if wait == 0.0:
            return summed, True
        if now + wait > deadline:
            return summed, False
        sleep(min(wait, max(0.0, deadline - now)) + 0.05)


def parse_metrics(text: str) -> dict[str, float]:
    """vLLM's Prometheus ``/metrics`` text: each sample name (labels dropped) with its values
    summed over label sets (one per engine and model)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        try:
            value = float(line.rsplit(" ", 1)[1])
        except (IndexError, ValueError):
            continue
        out[name] = out.get(name, 0.0) + value
    return out
