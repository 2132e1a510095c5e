"""benchmarks/cpu_paths.py (the per-call figures BENCHMARKS.md cites) runs, and each old path
agrees with the fast path that replaced it on the benchmark's own inputs."""
from __future__ import annotations

from tests.scripts import load_script


def test_every_timed_pair_agrees():
    mod = load_script("cpu_paths.py")
    rows = (mod.quant_rows(1, out=64, inp=256, tokens=3) + mod.attention_rows(1)
            + mod.hydragen_rows(1, cases=((4, 1, 2, 40), (4, 2, 2, 130))) + mod.squeezed_rows(1, cases=((3, 700),)))
    assert len(rows) == 10
    assert all(r[4] > 0 for r in rows[-3:])  # vLLM's kernel ran (installed here) and agreed
    for name, old, new, agree, _ in rows:
        assert agree, name
        assert old > 0 and new > 0, name
