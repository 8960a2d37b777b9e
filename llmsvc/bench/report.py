"""One run's result as the lines `llmsvc bench` prints."""
from __future__ import annotations

from dataclasses import dataclass

from llmsvc.bench.metrics import fmt_ms


def result_line(tag: str, s: dict) -> str:
    return (f"  {tag:<28} {s['output_tok_s']:8.1f} out tok/s  {s['input_tok_s']:8.1f} in tok/s  "
            f"{s['request_throughput']:6.2f} req/s  TTFT {fmt_ms(s['ttft_s'])}  TPOT {fmt_ms(s['tpot_s'])}"
            + (f"  FAILED {s['failed']}: {s['errors']}" if s["failed"] else "")
            + _cached_note(s) + _engine_note(s))


def _engine_note(s: dict) -> str:
    """Where TTFT went inside the engine (queue, then the prefill step), when it reported it."""
    q, p = s.get("engine_queue_s"), s.get("engine_prefill_s")
    if not q or q["p50"] is None or not p or p["p50"] is None:
        return ""
    return (f"\n  {'':<28} TTFT inside the engine: queue p50 {1e3 * q['p50']:.0f} / p99 {1e3 * q['p99']:.0f} ms,"
            f" prefill p50 {1e3 * p['p50']:.0f} / p99 {1e3 * p['p99']:.0f} ms")


def _cached_note(s: dict) -> str:
    """Prompt tokens served from the prefix cache: a shared prefix, or an earlier run's prompts
    still cached in a long-running server (--server), which flatters prefill figures."""
    cached, total = s.get("cached_prompt_tokens", 0), s.get("prompt_tokens", 0)
    if not (cached and total):
        return ""
    return (f"\n  {'':<28} {cached} of {total} prompt tokens ({100 * cached / total:.0f}%) came from "
            "the prefix cache")


@dataclass
class Tally:
    """Requests sent and failed over every run of a bench, for its exit code."""
    requests: int = 0
    failed: int = 0

    def report(self, label: str, summary: dict) -> None:
        """Print a run's result line, counting its requests."""
        self.requests += summary["completed"] + summary["failed"]
        self.failed += summary["failed"]
        print(result_line(label, summary))
