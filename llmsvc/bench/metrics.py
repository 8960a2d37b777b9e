"""Per-request timing records and the summary a benchmark prints (vLLM bench serve's figures)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestRecord:
    prompt_len: int
    start: float  # when the request was sent / added
    token_times: list[float] = field(default_factory=list)  # arrival time of each output token
    end: float = 0.0
    error: str | None = None
    cached_tokens: int = 0  # prompt tokens the server took from its prefix cache
    # as the engine timed it (None: not reported): arrival to the first step that scheduled the
    # request, and that step to the first token (the other requests' work in those steps included)
    queue: float | None = None
    prefill: float | None = None

    @property
    def output_len(self) -> int:
        return len(self.token_times)

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.start

    @property
    def tpot(self) -> float | None:  # time per output token after the first
        n = len(self.token_times)
        return (self.token_times[-1] - self.token_times[0]) / (n - 1) if n > 1 else None

    def itls(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]


def percentiles(xs: list[float]) -> dict:
    if not xs:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    s = sorted(xs)

    def pct(p: float) -> float:  # linear interpolation, as numpy's default
        k = (len(s) - 1) * p / 100
        lo = int(k)
        hi = min(lo + 1, len(s) - 1)
        return s[lo] + (s[hi] - s[lo]) * (k - lo)

    return {"mean": sum(s) / len(s), "p50": pct(50), "p90": pct(90), "p99": pct(99)}


def _prefill_tok_s(ok: list[RequestRecord]) -> float:
    """Prompt tokens over the time until the last request got its first token (0 if none did)."""
    if not ok:
        return 0.0
    span = max(r.token_times[0] for r in ok) - min(r.start for r in ok)
    return sum(r.prompt_len for r in ok) / span if span > 0 else 0.0


def summarize(records: list[RequestRecord], wall_s: float) -> dict:
    ok = [r for r in records if r.error is None and r.token_times]
    out_tokens = sum(r.output_len for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    itl = [x for r in ok for x in r.itls()]
    return {
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "wall_s": wall_s,
        "request_throughput": len(ok) / wall_s,
        "input_tok_s": in_tokens / wall_s,
        "output_tok_s": out_tokens / wall_s,
        "total_tok_s": (in_tokens + out_tokens) / wall_s,
        "ttft_s": percentiles([r.ttft for r in ok]),
        "tpot_s": percentiles([t for r in ok if (t := r.tpot) is not None]),
        "itl_s": percentiles(itl),
        "e2e_s": percentiles([r.end - r.start for r in ok]),
        "errors": sorted({r.error for r in records if r.error})[:5],
        "prefill_tok_s": _prefill_tok_s(ok),
        "prompt_tokens": in_tokens,
        "cached_prompt_tokens": sum(r.cached_tokens for r in ok),
        "engine_queue_s": percentiles([r.queue for r in ok if r.queue is not None]),
        "engine_prefill_s": percentiles([r.prefill for r in ok if r.prefill is not None]),
    }


def fmt_ms(d: dict) -> str:
    if d["mean"] is None:
        return "-"
    return "mean {:.0f} / p50 {:.0f} / p90 {:.0f} / p99 {:.0f} ms".format(
        *(1000 * d[k] for k in ("mean", "p50", "p90", "p99")))
