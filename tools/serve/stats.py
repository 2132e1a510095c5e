"""The figures of a serving sweep from its per-request records: latency percentiles, TTFT,
TPOT, throughput, the SLO classification, goodput, the ratios to plain vLLM, the greedy
comparison and the table. Pure: no vLLM, no network.

Definitions (also written into the JSON, ``measurement``):

* a request's **latency**: from the moment the client sent it to the last byte of its stream;
  **TTFT**: to the first chunk carrying a choice (vLLM's first token); **TPOT**: (latency -
  TTFT) / (output tokens - 1), undefined for a one-token output; output tokens are vLLM's own
  count (``usage.completion_tokens`` of the stream's last chunk), not chunks (speculative
  decoding sends several tokens a chunk).
* a phase's **duration**: from its start (the first send) to the last request's end;
  **throughput**: output tokens of the answered requests / duration.
* a request **meets the SLO** when it was answered and each limit given holds (TTFT <=
  ``ttft``, TPOT <= ``tpot``, latency <= ``latency``; a request with no TPOT meets the TPOT
  limit); **goodput**: requests that met it / duration (requests per second).
* **x plain**: the arm's figure / plain vLLM's at the same phase.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

from ..bench.stats import percentile

MEASUREMENT = __doc__.split("Definitions (also written into the JSON, ``measurement``):\n\n", 1)[1].strip()

#: The default SLO (no ``--slo-*`` flag): each limit this many times plain vLLM's own figure
#: for a request sent alone (the median over the calibration requests), TTFT and TPOT.
DEFAULT_SLO_FACTOR = 5.0


@dataclass
class Record:
    """One request's outcome in a phase."""

    index: int
    ok: bool
    error: str = ""
    scheduled: float = 0.0  # planned send time, s from the phase's start (open loop)
    sent: float = 0.0  # actual send time, s from the phase's start
    ttft: float | None = None
    latency: float | None = None
    output_tokens: int = 0
    text: str = ""
    finish_reason: str | None = None

    @property
    def tpot(self) -> float | None:
        if not self.ok or self.ttft is None or self.latency is None or self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)

    @property
    def end(self) -> float | None:
        return None if self.latency is None else self.sent + self.latency

    def to_json(self, *, text: bool = True) -> dict[str, Any]:
        out = asdict(self)
        out["tpot"] = self.tpot
        if not text:
            out.pop("text")
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "Record":
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})


@dataclass(frozen=True)
class SLO:
    """Latency limits in seconds (None: no limit) and where they came from."""

    ttft: float | None = None
    tpot: float | None = None
    latency: float | None = None
    source: str = "given"

    def __post_init__(self) -> None:
        for name in ("ttft", "tpot", "latency"):
            v = getattr(self, name)
            if v is not None and not v > 0:
                raise ValueError(f"SLO {name} {v}: a limit must be a positive number of seconds")
        if self.ttft is None and self.tpot is None and self.latency is None:
            raise ValueError("an SLO needs at least one limit (TTFT, TPOT or latency)")

    def met(self, r: Record) -> bool:
        if not r.ok or r.latency is None:
            return False
        if self.ttft is not None and (r.ttft is None or r.ttft > self.ttft):
            return False
        if self.tpot is not None and r.tpot is not None and r.tpot > self.tpot:
            return False
        if self.latency is not None and r.latency > self.latency:
            return False
        return True

    def describe(self) -> str:
        parts = []
        if self.ttft is not None:
            parts.append(f"TTFT <= {self.ttft:.3g} s")
        if self.tpot is not None:
            parts.append(f"TPOT <= {self.tpot * 1000:.3g} ms")
        if self.latency is not None:
            parts.append(f"latency <= {self.latency:.3g} s")
        return ", ".join(parts)

    def to_json(self) -> dict[str, Any]:
        return {
            "ttft_s": self.ttft,
            "tpot_s": self.tpot,
            "latency_s": self.latency,
            "source": self.source,
            "text": self.describe(),
        }


def derived_slo(alone: Sequence[Record], factor: float = DEFAULT_SLO_FACTOR) -> SLO:
    """The default SLO: ``factor`` x plain vLLM's median TTFT and median TPOT of requests sent
    alone (the calibration requests). Scale-free: the same rule on a GPU and on 2 CPU cores."""
    if not factor > 0:
        raise ValueError(f"--slo-factor {factor}: must be positive")
    ttfts = [r.ttft for r in alone if r.ok and r.ttft is not None]
    tpots = [t for t in (r.tpot for r in alone) if t is not None]
    if not ttfts:
        raise ValueError("no calibration request of plain vLLM was answered: no SLO to derive; give --slo-*")
    ttft = percentile(ttfts, 50)
    tpot = percentile(tpots, 50) if tpots else None
    assert ttft is not None
    return SLO(
        ttft=factor * ttft,
        tpot=factor * tpot if tpot is not None else None,
        source=f"{factor:g} x plain vLLM's median TTFT ({ttft:.3g} s)"
        + (f" and TPOT ({tpot * 1000:.3g} ms)" if tpot is not None else "")
        + f" of {len(ttfts)} requests sent alone",
    )


def _pct(values: Sequence[float], q: float) -> float | None:
    return percentile([v for v in values if v is not None], q)


def summarize(records: Sequence[Record], slo: SLO, *, duration: float | None = None) -> dict[str, Any]:
    """A phase's figures. ``duration``: seconds from the phase's start to its last request's
    end (default: from the records, the latest end)."""
    ok = [r for r in records if r.ok]
    if duration is None:
        duration = max((r.end for r in records if r.end is not None), default=0.0)
    met = [r for r in records if slo.met(r)]
    tokens = sum(r.output_tokens for r in ok)
    lat = [r.latency for r in ok if r.latency is not None]
    ttft = [r.ttft for r in ok if r.ttft is not None]
    tpot = [t for t in (r.tpot for r in ok) if t is not None]
    lag = [r.sent - r.scheduled for r in records]
    return {
        "requests": len(records),
        "ok": len(ok),
        "failed": len(records) - len(ok),
        "errors": sorted({r.error for r in records if not r.ok})[:5],
        "duration_s": duration,
        "output_tokens": tokens,
        "throughput_tok_s": tokens / duration if duration > 0 else None,
        "request_rate": len(ok) / duration if duration > 0 else None,
        "latency_s": {"p50": _pct(lat, 50), "p90": _pct(lat, 90)},
        "ttft_s": {"p50": _pct(ttft, 50), "p90": _pct(ttft, 90)},
        "tpot_s": {"p50": _pct(tpot, 50), "p90": _pct(tpot, 90)},
        "slo_met": len(met),
        "goodput_rps": len(met) / duration if duration > 0 else None,
        "send_lag_s_max": max(lag, default=0.0),
    }


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, None where either is missing or b is 0."""
    if a is None or b is None or b == 0:
        return None
    return a / b


def vs_plain(arm: dict[str, Any], plain: dict[str, Any]) -> dict[str, float | None]:
    """An arm's throughput and goodput over plain vLLM's at the same phase; goodput's ratio is
    None where plain's goodput is 0 (an arm can then still meet the SLO: see the counts)."""
    return {
        "throughput": ratio(arm.get("throughput_tok_s"), plain.get("throughput_tok_s")),
        "goodput": ratio(arm.get("goodput_rps"), plain.get("goodput_rps")),
    }


def compare_greedy(arm: Sequence[Record], plain: Sequence[Record]) -> dict[str, Any]:
    """Each request both answered: the arm's greedy text against plain vLLM's."""
    theirs = {r.index: r for r in plain if r.ok}
    both = [(r, theirs[r.index]) for r in arm if r.ok and r.index in theirs]
    differ = [r.index for r, p in both if r.text != p.text]
    return {"compared": len(both), "identical": len(both) - len(differ), "differ": differ}


@dataclass
class Row:
    """One line of the table: an arm at a phase."""

    arm: str
    phase: str
    figures: dict[str, Any]
    vs: dict[str, float | None] = field(default_factory=dict)
    greedy: str = "-"
    preemptions: float | None = None


COLUMNS = (
    "arm",
    "load",
    "ok",
    "out tok/s",
    "x plain",
    "latency p50/p90 s",
    "TTFT p50/p90 s",
    "TPOT p50/p90 ms",
    "goodput req/s (met)",
    "x plain goodput",
    "preempt",
    "greedy = plain",
)


def _f(v: float | None, fmt: str = "{:.2f}") -> str:
    return "-" if v is None else fmt.format(v)


def _pair(d: dict[str, float | None], scale: float = 1.0, fmt: str = "{:.2f}") -> str:
    p50, p90 = d.get("p50"), d.get("p90")
    return f"{_f(None if p50 is None else p50 * scale, fmt)} / {_f(None if p90 is None else p90 * scale, fmt)}"


def cells(row: Row) -> list[str]:
    f = row.figures
    return [
        row.arm,
        row.phase,
        f"{f['ok']}/{f['requests']}",
        _f(f["throughput_tok_s"], "{:.1f}"),
        _f(row.vs.get("throughput"), "{:.2f}x"),
        _pair(f["latency_s"]),
        _pair(f["ttft_s"]),
        _pair(f["tpot_s"], 1000, "{:.0f}"),
        f"{_f(f['goodput_rps'], '{:.3f}')} ({f['slo_met']}/{f['requests']})",
        _f(row.vs.get("goodput"), "{:.2f}x"),
        _f(row.preemptions, "{:.0f}"),
        row.greedy,
    ]


def rows(result: dict[str, Any]) -> list[Row]:
    """The table's rows from a sweep's result (:func:`~.run.sweep`'s JSON), arm by arm, each
    phase in order."""
    out = []
    for arm in result["arms"]:
        for ph in arm.get("phases", []):
            g = ph.get("greedy")
            if arm["name"] == "plain" or g is None:
                greedy = "-"
            else:
                greedy = f"{g['identical']}/{g['compared']}"
                if arm.get("lossless") is False:
                    greedy += " (lossy)"
                elif g["differ"]:
                    greedy = "**" + greedy + "**"
            out.append(
                Row(
                    arm["name"],
                    ph["phase"]["label"],
                    ph["figures"],
                    ph.get("vs_plain") or {},
                    greedy,
                    ph.get("preemptions"),
                )
            )
    return out


def markdown(table_rows: Sequence[Row]) -> str:
    """The table as Markdown (for the docs page)."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in table_rows:
        lines.append("| " + " | ".join(c.replace("|", "/") for c in cells(r)) + " |")
    return "\n".join(lines)


def by_load(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Each arm's throughput over plain vLLM's at each load, round by round (``--rounds``), with
    the median and range of the rounds quoted: 2..R when there are several (round 1 runs on a
    cold server), else the one round."""
    out = []
    for arm in result["arms"][1:]:
        per_load: dict[str, dict[int, float | None]] = {}
        for ph in arm.get("phases", []):
            p = ph["phase"]
            per_load.setdefault(p["load"], {})[p["round"]] = (ph.get("vs_plain") or {}).get("throughput")
        for load, rounds in per_load.items():
            first = 2 if len(rounds) > 1 else 1
            quoted = sorted(v for k, v in rounds.items() if k >= first and v is not None)
            out.append(
                {
                    "arm": arm["name"],
                    "load": load,
                    "rounds": {str(k): v for k, v in sorted(rounds.items())},
                    "quoted_from_round": first,
                    "median": percentile(quoted, 50) if quoted else None,
                    "min": quoted[0] if quoted else None,
                    "max": quoted[-1] if quoted else None,
                }
            )
    return out


def summary_lines(result: dict[str, Any]) -> list[str]:
    """One line per arm and load of :func:`by_load` (kept in the result by ``finish``) when the
    sweep ran more than one round."""
    loads = result["by_load"]
    if all(len(s["rounds"]) == 1 for s in loads):
        return []
    lines = []
    for s in loads:
        every = ", ".join(f"{v:.2f}" if v is not None else "-" for v in s["rounds"].values())
        med = "-" if s["median"] is None else f"{s['median']:.2f}x ({s['min']:.2f}-{s['max']:.2f})"
        lines.append(
            f"{s['arm']} at {s['load']}: throughput x plain {med} over rounds {s['quoted_from_round']}.."
            f"{len(s['rounds'])}; by round {every}"
        )
    return lines
