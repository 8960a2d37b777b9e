"""The engine-core loop's burst wait (llmsvc/core/proc.py): after an idle spell, requests that
keep arriving within the gap join the first step; a lone request waits one gap; the gap
shrinks to 2% of the queued step's expected time where steps are cheap. Virtual time: a fake
input socket advances a clock instead of sleeping, so the arrival pattern is exact."""
from __future__ import annotations

import pytest
import zmq

from llmsvc.config import SchedulerConfig
from llmsvc.core import messages as m
from llmsvc.core import burst, proc
from llmsvc.core.request import Request
from llmsvc.sampling_params import SamplingParams


class Clock:
    def __init__(self):
        self.t = 0.0

    def monotonic(self):
        return self.t


class Frame:
    def __init__(self, data: bytes):
        self.buffer = memoryview(data)


class FakeInput:
    """Messages that arrive at given virtual times; poll advances the clock to the arrival or by
    its whole timeout."""

    def __init__(self, clock: Clock, arrivals: list[tuple[float, tuple]]):
        self.clock, self.items = clock, sorted(arrivals, key=lambda a: a[0])
        self.polls: list[float] = []  # timeouts asked for, ms

    def poll(self, timeout_ms):
        self.polls.append(timeout_ms)
        if self.items and self.items[0][0] <= self.clock.t + timeout_ms / 1e3:
            self.clock.t = max(self.clock.t, self.items[0][0])
            return True
        self.clock.t += timeout_ms / 1e3
        return False

    def recv(self, flags=0, copy=True):
        if self.items and self.items[0][0] <= self.clock.t:
            return Frame(m.encode(self.items.pop(0)[1]))
        raise zmq.Again()


class FakeOutput:
    def send(self, data, copy=True):
        pass


class FakeExecutor:
    def check_health(self):
        pass


class FakeCore:
    """Records the requests queued when each step starts; a step finishes them all."""

    def __init__(self, clock: Clock, seconds_per_token=None):
        self.clock, self.seconds_per_token = clock, seconds_per_token
        self.queued: list[str] = []
        self.steps: list[tuple[float, list[str]]] = []
        self.executor, self.stats = FakeExecutor(), None

    def add_request(self, request):
        self.queued.append(request.request_id)

    def has_unfinished(self):
        return bool(self.queued)

    def step(self):
        self.steps.append((self.clock.t, self.queued))
        self.queued = []
        return [], True

    def abort_requests(self, ids, reason):
        return []

    def drain_kv_events(self):
        return []

    def shutdown(self):
        pass


def _add(i: int, tokens: int = 128) -> tuple:
    return (m.ADD, Request(f"r{i}", list(range(tokens)), SamplingParams(max_tokens=4)))


def _run(monkeypatch, arrivals, burst_wait_ms=5.0, seconds_per_token=None, **sched):
    clock = Clock()
    monkeypatch.setattr(burst.time, "monotonic", clock.monotonic)  # the burst window reads the clock
    core = FakeCore(clock, seconds_per_token)
    inp = FakeInput(clock, arrivals + [(100.0, (m.SHUTDOWN,))])
    config = SchedulerConfig(burst_wait_ms=burst_wait_ms, **sched)
    assert proc.EngineCoreLoop(core, inp, FakeOutput(), config).run() == 0
    return core, inp


def test_a_burst_starts_as_one_step(monkeypatch):
    # 1-3 ms apart, as a gRPC client's batch reaches the core
    arrivals = [(1.0 + t, _add(i)) for i, t in enumerate([0, 0.0013, 0.0016, 0.0033, 0.0050])]
    core, _ = _run(monkeypatch, arrivals)
    assert [ids for _, ids in core.steps] == [["r0", "r1", "r2", "r3", "r4"]]
    assert core.steps[0][0] <= 1.0 + 0.0050 + 0.005  # one gap after the last arrival at most


def test_without_the_wait_the_first_request_steps_alone(monkeypatch):
    arrivals = [(1.0 + 0.001 * i, _add(i)) for i in range(4)]
    core, _ = _run(monkeypatch, arrivals, burst_wait_ms=0)
    assert [len(ids) for _, ids in core.steps][0] == 1


def test_the_burst_ends_at_a_gap_at_the_budget_and_at_ten_gaps(monkeypatch):
    # a 7 ms silence ends it
    core, _ = _run(monkeypatch, [(1.0, _add(0)), (1.002, _add(1)), (1.009, _add(2))])
    assert [ids for _, ids in core.steps][0] == ["r0", "r1"]
    # a full token budget (2 x 128 tokens) steps at once
    core, _ = _run(monkeypatch, [(1.0 + 0.001 * i, _add(i)) for i in range(4)], max_num_batched_tokens=256)
    assert [ids for _, ids in core.steps][0] == ["r0", "r1"]
    # a steady trickle, 4 ms apart: the first step starts after 10 gaps (50 ms)
    core, _ = _run(monkeypatch, [(1.0 + 0.004 * i, _add(i, tokens=16)) for i in range(30)])
    first_t, first_ids = core.steps[0]
    assert first_ids == [f"r{i}" for i in range(13)] and abs(first_t - 1.05) < 1e-9


def test_a_lone_request_waits_one_gap_scaled_to_the_step_cost(monkeypatch):
    core, inp = _run(monkeypatch, [(1.0, _add(0))])
    assert core.steps[0][0] == 1.005  # no cost known yet: burst_wait_ms
    # 2 us per prompt token (a GPU): 2% of a 128-token step is 5.1 us
    core, inp = _run(monkeypatch, [(1.0, _add(0))], seconds_per_token=2e-6)
    assert abs(core.steps[0][0] - (1.0 + 0.02 * 2e-6 * 128)) < 1e-9
    # 2 ms per token (two CPU cores in fp32): 2% is 5.1 ms, so burst_wait_ms caps it
    core, inp = _run(monkeypatch, [(1.0, _add(0))], seconds_per_token=2e-3)
    assert core.steps[0][0] == 1.005


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_the_core_learns_its_seconds_per_token_from_prefill_sized_steps(monkeypatch, async_scheduling):
    """EngineCore.seconds_per_token, the burst gap's scale: the model's time per token of steps of
    256 tokens or more (a fake model taking 1 ms per token on a virtual clock), in both modes;
    decode-sized steps leave it alone."""
    from engine_fakes import FakeExecutor, make_config
    from llmsvc.core import engine_core
    from llmsvc.core.engine_core import EngineCore
    from test_scheduler import run as run_core

    clock = Clock()
    monkeypatch.setattr(engine_core.time, "perf_counter", clock.monotonic)

    class TimedExecutor(FakeExecutor):
        def execute_model(self, so, non_block=False):
            out, cost = super().execute_model(so, non_block), 1e-3 * so.total_num_scheduled_tokens
            if not non_block:
                clock.t += cost
                return out

            class Running:  # the model computes while the host waits on the result
                def result(self):
                    clock.t += cost
                    return out.result()
            return Running()

    cfg = make_config(num_blocks=400, max_num_batched_tokens=512, max_num_seqs=4)
    cfg.scheduler_config.async_scheduling = async_scheduling
    core = EngineCore(cfg, TimedExecutor(cfg, num_blocks=400))
    core.add_request(Request("short", list(range(1, 40)), SamplingParams(max_tokens=3)))
    run_core(core)
    assert core.seconds_per_token is None  # 39-token steps only
    for i in range(2):
        core.add_request(Request(f"long{i}", list(range(1, 300)), SamplingParams(max_tokens=3)))
    run_core(core)
    assert core.seconds_per_token == pytest.approx(1e-3)
