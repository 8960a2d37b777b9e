"""The draft governor: drafting at a batch size continues only while steps with drafts emit
more tokens per second than steps without (unit rules, then the engine core on a fake worker
whose step time is a clock it advances)."""
from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from engine_fakes import FakeExecutor, make_config
from llmsvc.config import SpeculativeConfig
from llmsvc.core import draft_governor, engine_core
from llmsvc.core.draft_governor import EXPLORE_EVERY, PROBE_STEPS, DraftGovernor
from llmsvc.core.engine_core import EngineCore
from llmsvc.core.request import Request
from llmsvc.sampling_params import SamplingParams


def feed(g: DraftGovernor, n: int, rate_with: float, rate_without: float, steps: int) -> list[bool]:
    """Run `steps` decode-only steps of n requests; each step's rate is that of its kind."""
    decisions = []
    for _ in range(steps):
        d = g.should_draft(n)
        decisions.append(d)
        g.scheduled(drafted=d, decode_only=True)
        g.step_done(num_tokens=100, seconds=100 / (rate_with if d else rate_without))
    return decisions


def test_probes_each_kind_then_keeps_the_faster_and_explores(caplog):
    caplog.set_level("INFO", logger="llmsvc.core.draft_governor")
    g = DraftGovernor()
    d = feed(g, 16, rate_with=150.0, rate_without=250.0, steps=48)
    assert d[:2 * PROBE_STEPS] == [True] * PROBE_STEPS + [False] * PROBE_STEPS
    later = d[2 * PROBE_STEPS:]
    assert later.count(True) == len(later) // EXPLORE_EVERY  # only the exploring steps draft
    assert g.drafting() == {5: False}
    # the text changes and drafts start to pay: the exploring steps notice, and drafting resumes
    d = feed(g, 16, rate_with=400.0, rate_without=250.0, steps=48)
    assert d[-16:].count(True) == 16 - 16 // EXPLORE_EVERY and g.drafting() == {5: True}
    lines = [r.getMessage() for r in caplog.records]  # one line per change of choice
    assert [m.split(":")[0] for m in lines] == ["speculative decoding off at 16-31 running requests",
                                               "speculative decoding on at 16-31 running requests"]
    assert "150.0 output tokens/s with drafts, 250.0 without" in lines[0]


def test_buckets_are_separate_and_only_decode_only_steps_count():
    g = DraftGovernor()
    feed(g, 16, rate_with=100.0, rate_without=300.0, steps=24)
    feed(g, 1, rate_with=90.0, rate_without=45.0, steps=24)
    assert g.drafting() == {1: True, 5: False}
    assert [DraftGovernor.bucket_of(n) for n in (1, 2, 3, 4, 7, 8, 16, 31)] == [1, 2, 2, 3, 3, 4, 5, 5]
    before = g.buckets[5].count
    g.should_draft(16)
    g.scheduled(drafted=True, decode_only=False)  # a prefill chunk rode along: not timed
    g.step_done(num_tokens=10, seconds=1.0)
    g.step_done(num_tokens=10, seconds=1.0)  # nothing scheduled: nothing to attribute
    assert g.buckets[5].count == before
    assert g.should_draft(16, allowed=False) is False and g.buckets[5].steps == 25  # not a decision
    g.scheduled(drafted=False, decode_only=True)  # but timed, as a step without drafts
    g.step_done(num_tokens=10, seconds=1.0)
    assert g.buckets[5].count == (before[0] + 1, before[1])


class ClockedExecutor(FakeExecutor):
    """A fake worker whose step takes fixed + per_token * tokens seconds of a fake clock."""

    def __init__(self, *a, fixed: float, per_token: float, **kw):
        super().__init__(*a, **kw)
        self.fixed, self.per_token, self.now = fixed, per_token, 0.0

    def execute_model(self, so, non_block: bool = False):
        self.now += self.fixed + self.per_token * so.total_num_scheduled_tokens
        return super().execute_model(so, non_block)


def often_wrong(tokens: list[int]) -> int:
    """Repeats what it said 4 tokens ago, but at every 4th position: a lookup draft holds about
    one or two right tokens before a wrong one."""
    return tokens[-4] if len(tokens) % 4 else (tokens[-1] * 7 + len(tokens)) % 997


@pytest.mark.parametrize("fixed,per_token,drafts", [(0.0, 1e-3, False), (0.05, 1e-4, True)],
                         ids=["bound-by-arithmetic", "bound-by-weights"])
def test_engine_core_stops_drafting_where_drafts_cost_more_than_they_give(monkeypatch, fixed, per_token, drafts):
    cfg = make_config(num_blocks=256, max_num_batched_tokens=256, max_num_seqs=16)
    cfg.speculative_config = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=2)
    ex = ClockedExecutor(cfg, num_blocks=256, token_fn=often_wrong, fixed=fixed, per_token=per_token)
    monkeypatch.setattr(engine_core, "time", SimpleNamespace(perf_counter=lambda: ex.now, time=time.time,
                                                            monotonic=time.monotonic))
    core = EngineCore(cfg, ex)
    for i in range(16):
        core.add_request(Request(f"r{i}", [5, 6, 5, 6, 5, 6, i], SamplingParams(max_tokens=120), eos_token_ids=[]))
    while core.has_unfinished():
        core.step()
    spec = core.stats.spec_decode
    assert core.scheduler.speculator.governor.drafting()[draft_governor.DraftGovernor.bucket_of(16)] is drafts
    assert spec.num_drafts > 0 and spec.num_accepted_tokens > 0
