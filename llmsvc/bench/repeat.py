"""Repeated measurements of several systems on one workload: the systems take turns (A, B, A,
B, ...) so that load drifting on a shared machine biases none of them, and each is reported by
the median of its runs with the min and max beside it."""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Callable

# the figures repeated runs are summarised by: (name, how to read it from a summary)
FIGURES: dict[str, Callable[[dict], float | None]] = {
    "output_tok_s": lambda s: s["output_tok_s"],
    "ttft_p50_s": lambda s: s["ttft_s"]["p50"],
    "ttft_p99_s": lambda s: s["ttft_s"]["p99"],
}


@dataclass
class System:
    key: str  # its key in the JSON results ("offline", "serve", "hf", "vllm")
    label: str  # how result lines name it
    run: Callable[[], dict]  # one measurement: a metrics.summarize() dict


def spread(values: list[float]) -> dict:
    """{"median", "min", "max", "n"} of the values that exist (None: a run without that figure)."""
    xs = [v for v in values if v is not None]
    if not xs:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def summarize_runs(runs: list[dict]) -> dict:
    return {name: spread([get(s) for s in runs]) for name, get in FIGURES.items()}


def median_run(runs: list[dict]) -> dict:
    """The run whose output tok/s is the median (the lower middle one for an even count): the
    summary that stands for the system where a single one is wanted."""
    order = sorted(runs, key=lambda s: s["output_tok_s"])
    return order[(len(order) - 1) // 2]


def alternate(systems: list[System], repeat: int, report: Callable[[System, int, dict], None],
              before: Callable[[System], object] | None = None) -> dict[str, list[dict]]:
    """Run every system `repeat` times, taking turns; before(system) ahead of each run (the
    peer frozen or resumed, the idle check: fairness.Turns), report(system, run index, summary)
    after it. Returns the summaries by system key, in run order."""
    runs: dict[str, list[dict]] = {s.key: [] for s in systems}
    for i in range(repeat):
        for s in systems:
            if before is not None:
                before(s)
            summary = s.run()
            runs[s.key].append(summary)
            report(s, i, summary)
    return runs


def ratio(ours: dict, peer: dict, figure: str) -> float | None:
    """ours / peer of one figure's median (None when either is missing or the peer's is 0)."""
    a, b = ours[figure]["median"], peer[figure]["median"]
    return a / b if a is not None and b else None


def fmt_spread(d: dict, scale: float = 1.0, digits: int = 1) -> str:
    if d["median"] is None:
        return "-"
    f = f"{{:.{digits}f}}"
    med, lo, hi = (f.format(scale * d[k]) for k in ("median", "min", "max"))
    return med if d["n"] == 1 else f"{med} ({lo}-{hi})"


def fmt_runs(stats: dict) -> str:
    """One line: output tok/s and TTFT p50 / p99 as median (min-max)."""
    return (f"{fmt_spread(stats['output_tok_s'])} out tok/s  TTFT p50 {fmt_spread(stats['ttft_p50_s'], 1e3, 0)} ms"
            f"  p99 {fmt_spread(stats['ttft_p99_s'], 1e3, 0)} ms")
