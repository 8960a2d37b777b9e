"""AsyncEngine with an inline engine core gathers a burst before its first step, as the engine-core
process does (llmsvc/core/burst.py; the process loop's own test is test_core_burst.py)."""
from __future__ import annotations

import asyncio

from llmsvc.engine_request import EngineRequest
from llmsvc.core.burst import BurstWindow
from llmsvc.engine.async_engine import AsyncEngine
from llmsvc.sampling_params import SamplingParams
from tests.fake_engine import FakeEngine


class RecordingEngine(FakeEngine):
    """Records the requests each step computes for."""

    def __init__(self, burst_wait_ms: float, engine_core: str = "inline", **kw):
        super().__init__(**kw)
        self.config.scheduler_config.burst_wait_ms = burst_wait_ms
        self.config.engine_core = engine_core
        self.step_reqs: list[list[str]] = []

    def step(self):
        self.step_reqs.append([r.rid for r in self._running()])
        return super().step()


def _first_step(engine: RecordingEngine, gap_s: float) -> list[str]:
    """Two requests gap_s apart into an idle engine: the requests of its first step."""
    async def main():
        ae = AsyncEngine(engine)
        await ae.start()

        async def one(rid, delay):
            await asyncio.sleep(delay)
            async for _ in ae.generate(EngineRequest(rid, [5], SamplingParams(max_tokens=20))):
                pass

        await asyncio.gather(one("a", 0.0), one("b", gap_s))
        await ae.shutdown()

    asyncio.run(asyncio.wait_for(main(), 30))
    return engine.step_reqs[0]


def test_inline_core_takes_a_burst_whose_requests_come_within_the_gap():
    assert _first_step(RecordingEngine(burst_wait_ms=500.0, step_delay=0.01), 0.05) == ["a", "b"]


def test_without_the_wait_or_with_a_core_process_the_first_request_steps_alone():
    assert _first_step(RecordingEngine(burst_wait_ms=0.0, step_delay=0.01), 0.05) == ["a"]
    # a core process gathers its bursts itself: the front end's thread must not wait as well
    assert _first_step(RecordingEngine(burst_wait_ms=500.0, engine_core="process", step_delay=0.01), 0.05) == ["a"]


def test_burst_window_gap_budget_and_deadline():
    w = BurstWindow(burst_wait_ms=5.0, max_num_batched_tokens=256, max_num_seqs=4)
    assert not w.start(0.0, None)  # nothing queued
    w.add(128)
    assert w.start(1.0, None) and w.wait_s(1.0) == 0.005
    assert abs(w.wait_s(1.048) - 0.002) < 1e-9 and w.wait_s(1.05) == 0.0  # 10 gaps in all
    w.add(128)
    assert w.wait_s(1.0) == 0.0  # a step's token budget is queued
    w.reset()
    w.add(100)
    assert w.start(0.0, 1e-5) and abs(w.gap - 0.02 * 1e-5 * 100) < 1e-12  # cheap steps: 2% of one
    off = BurstWindow(0.0, 256, 4)
    off.add(10)
    assert not off.start(0.0, None)
