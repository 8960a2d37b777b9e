"""AsyncEngine against FakeEngine: one engine thread, coalescing, backlog abort, cancel, death."""
from __future__ import annotations

import asyncio
import threading

import pytest

from llmsvc.engine_request import EngineRequest
from llmsvc.engine.async_engine import AsyncEngine, EngineDeadError, EngineStoppedError, OutputBacklogError
from llmsvc.core.errors import DuplicateRequestError, QueueFullError
from llmsvc.engine.output_stream import merge_delta
from llmsvc.outputs import ABORT, LENGTH, CompletionOutput, RequestOutput
from llmsvc.sampling_params import SamplingParams
from tests.fake_engine import FakeEngine, FakeEngineError, InvalidRequestError


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


async def _started(engine: FakeEngine, **kw) -> AsyncEngine:
    ae = AsyncEngine(engine, **kw)
    await ae.start()
    return ae


async def _collect(agen):
    outs = []
    async for o in agen:
        outs.append(o)
    return outs


async def _wait_for(cond, timeout=10.0):
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not cond():
        assert loop.time() < end, "condition not reached"
        await asyncio.sleep(0.005)


def test_generate_streams_deltas_from_one_engine_thread():
    fe = FakeEngine()

    async def main():
        ae = await _started(fe)
        outs = await asyncio.gather(*[_collect(ae.generate(EngineRequest(f"r{i}", [10 * i + 1], SamplingParams(max_tokens=5))))
                                      for i in range(4)])
        await ae.shutdown()
        return outs

    results = run(main())
    for i, outs in enumerate(results):
        ids = [t for o in outs for t in o.outputs[0].token_ids]
        assert ids == [(10 * i + 1 + 1 + k) % 1000 for k in range(5)]
        assert outs[-1].finished and outs[-1].outputs[0].finish_reason == LENGTH
        assert all(not o.finished for o in outs[:-1])
    assert len(fe.threads) == 1 and threading.get_ident() not in fe.threads
    assert fe.is_shutdown


def test_engine_thread_sleeps_when_idle():
    fe = FakeEngine()

    async def main():
        ae = await _started(fe)
        await _collect(ae.generate(EngineRequest("a", [1], SamplingParams(max_tokens=2))))
        steps = fe.steps
        await asyncio.sleep(0.2)
        assert fe.steps == steps  # no spinning step() calls while idle
        await ae.shutdown()

    run(main())


def test_slow_consumer_gets_coalesced_deltas():
    fe = FakeEngine(step_delay=0.005)

    async def main():
        ae = await _started(fe)
        agen = ae.generate(EngineRequest("slow", [5], SamplingParams(max_tokens=20, n=2)))
        first = await agen.__anext__()
        assert not first.finished
        await _wait_for(lambda: "slow" not in ae._streams)  # the engine ran ahead while we did not read
        rest = await _collect(agen)
        return first, rest

    first, rest = run(main())
    assert len(rest) == 1  # all pending deltas folded into one output
    for idx in (0, 1):
        ids = [t for o in [first] + rest for c in o.outputs if c.index == idx for t in c.token_ids]
        assert ids == [(5 + 1 + k + 7 * idx) % 1000 for k in range(20)]
        text = "".join(c.text for o in [first] + rest for c in o.outputs if c.index == idx)
        assert text == "".join(f"<{t}>" for t in ids)
    assert rest[0].finished and {c.finish_reason for c in rest[0].outputs} == {LENGTH}


def test_merge_delta_concatenates_per_index():
    a = RequestOutput("r", None, [1], [CompletionOutput(0, "ab", [1, 2], num_output_tokens=2)], False)
    b = RequestOutput("r", None, [1], [CompletionOutput(1, "x", [9], num_output_tokens=1),
                                      CompletionOutput(0, "c", [3], finish_reason="stop", stop_reason=3,
                                                       num_output_tokens=3)], True)
    merge_delta(a, b)
    by = {c.index: c for c in a.outputs}
    assert (by[0].text, by[0].token_ids, by[0].finish_reason, by[0].num_output_tokens) == ("abc", [1, 2, 3], "stop", 3)
    assert (by[1].text, by[1].token_ids) == ("x", [9])
    assert a.finished


def test_backlog_cap_aborts_request_and_raises():
    fe = FakeEngine(max_model_len=10_000, step_delay=0.001)  # paced: the cap, not max_tokens, ends it

    async def main():
        ae = await _started(fe, max_backlog_bytes=200)
        agen = ae.generate(EngineRequest("big", [1], SamplingParams(max_tokens=5000)))
        with pytest.raises(OutputBacklogError):
            async for _ in agen:
                await asyncio.sleep(0.05)  # a slow reader
        assert fe.steps < 5000
        await _wait_for(lambda: "big" not in ae._streams)  # id released once the engine confirmed
        other = await _collect(ae.generate(EngineRequest("ok", [1], SamplingParams(max_tokens=3))))
        await ae.shutdown()
        return other

    other = run(main())
    assert other[-1].outputs[0].finish_reason == LENGTH
    assert fe.reqs == {}


def test_cancel_aborts_and_reserves_id_until_confirmed():
    # paced steps: an unpaced fake engine could finish all max_tokens before the gate closes
    fe = FakeEngine(max_model_len=100_000, step_delay=0.002)

    async def main():
        ae = await _started(fe)
        agen = ae.generate(EngineRequest("c", [1], SamplingParams(max_tokens=50_000)))
        await agen.__anext__()
        fe.gate.clear()  # hold the engine inside its next step
        await agen.aclose()  # the consumer goes away
        with pytest.raises(DuplicateRequestError):  # abort not confirmed yet: id still reserved
            await ae.generate(EngineRequest("c", [1], SamplingParams(max_tokens=1))).__anext__()
        fe.gate.set()
        await _wait_for(lambda: "c" not in ae._streams)
        again = await _collect(ae.generate(EngineRequest("c", [1], SamplingParams(max_tokens=2))))
        await ae.shutdown()
        return again

    again = run(main())
    assert fe.aborted == ["c"]
    assert again[-1].finished and again[-1].outputs[0].finish_reason == LENGTH
    assert fe.get_stats().num_free_kv_blocks == fe.num_blocks


def test_task_cancellation_aborts():
    fe = FakeEngine(max_model_len=10_000, step_delay=0.002)

    async def main():
        ae = await _started(fe)
        task = asyncio.create_task(_collect(ae.generate(EngineRequest("t", [1], SamplingParams(max_tokens=5000)))))
        await _wait_for(lambda: fe.steps > 3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await _wait_for(lambda: not ae._streams)
        await ae.shutdown()

    run(main())
    assert fe.aborted == ["t"] and fe.reqs == {}


def test_abort_by_id_ends_stream_with_abort_reason_and_partial_output():
    fe = FakeEngine(max_model_len=10_000, step_delay=0.002)

    async def main():
        ae = await _started(fe)
        agen = ae.generate(EngineRequest("x", [1], SamplingParams(max_tokens=5000)))
        first = await agen.__anext__()
        not_found = ae.abort(["x", "nope"], reason="user asked")
        assert ae.abort(["x"]) == []  # idempotent while in flight
        rest = await _collect(agen)
        await ae.shutdown()
        return not_found, [first] + rest

    not_found, outs = run(main())
    assert not_found == ["nope"]
    final = outs[-1]
    assert final.finished and final.outputs[0].finish_reason == ABORT and final.abort_reason == "user asked"
    assert sum(len(o.outputs[0].token_ids) for o in outs) >= 1


def test_duplicate_id_and_add_errors():
    fe = FakeEngine()

    async def main():
        ae = await _started(fe)
        fe.gate.clear()
        agen = ae.generate(EngineRequest("d", [1], SamplingParams(max_tokens=3)))
        task = asyncio.create_task(agen.__anext__())
        await _wait_for(lambda: "d" in ae._streams)
        with pytest.raises(DuplicateRequestError):
            await ae.generate(EngineRequest("d", [2], SamplingParams())).__anext__()
        fe.gate.set()
        await task
        with pytest.raises(InvalidRequestError):  # raised by the engine's add_request, passed through
            await ae.generate(EngineRequest("e", [], SamplingParams())).__anext__()
        assert "e" not in ae._streams
        await _collect(agen)
        await ae.shutdown()

    run(main())


def test_sample_ids_of_an_n_request_are_reserved_too():
    """AsyncEngine's check is the serving path's only one (the engine queues what it admits): a
    request may not take a sample id of a request in flight ("0_p" of n=2 "p"), nor give its own
    samples ids in flight; once the request ends, the ids are free again."""
    fe = FakeEngine()

    async def main():
        ae = await _started(fe)
        fe.gate.clear()
        agen = ae.generate(EngineRequest("p", [1], SamplingParams(max_tokens=3, n=2)))
        task = asyncio.create_task(agen.__anext__())
        await _wait_for(lambda: "p" in ae._streams)
        for rid, n in (("0_p", 1), ("1_p", 1), ("1_p", 3)):
            with pytest.raises(DuplicateRequestError, match="sample"):
                await ae.generate(EngineRequest(rid, [2], SamplingParams(n=n))).__anext__()
        one = ae.generate(EngineRequest("0_r", [3], SamplingParams(max_tokens=2)))
        t2 = asyncio.create_task(one.__anext__())
        await _wait_for(lambda: "0_r" in ae._streams)
        with pytest.raises(DuplicateRequestError, match="would give sample 0 the id '0_r'"):
            await ae.generate(EngineRequest("r", [4], SamplingParams(n=2))).__anext__()
        fe.gate.set()
        await task
        await t2
        await _collect(agen)
        await _collect(one)
        assert await _collect(ae.generate(EngineRequest("0_p", [5], SamplingParams(max_tokens=1))))
        await ae.shutdown()

    run(main())


@pytest.mark.parametrize("max_running,cap", [(1, 2), (3, 2), (2, 0)])
def test_queue_full(max_running, cap):
    # a burst before any step: max_running of it can run at once, cap more may wait, the next is refused
    fe = FakeEngine(max_running=max_running)

    async def main():
        ae = await _started(fe, max_waiting_requests=cap)
        fe.gate.clear()
        gens = [ae.generate(EngineRequest(f"q{i}", [1], SamplingParams(max_tokens=2))) for i in range(max_running + cap)]
        tasks = [asyncio.create_task(g.__anext__()) for g in gens]
        await _wait_for(lambda: len(ae._streams) == max_running + cap)
        with pytest.raises(QueueFullError):
            await ae.generate(EngineRequest("over", [1], SamplingParams())).__anext__()
        fe.gate.set()
        await asyncio.gather(*tasks)
        for g in gens:
            await _collect(g)
        await ae.shutdown()

    run(main())


def test_queue_cap_counts_the_sequences_of_n_greater_than_1():
    # an n=2 request takes both seats; then one n=1 request may wait (cap 1) and the next is
    # refused (counting requests, not sequences, let two wait)
    fe = FakeEngine(max_running=2)

    async def main():
        ae = await _started(fe, max_waiting_requests=1)
        fe.gate.clear()
        gens = [ae.generate(EngineRequest("pair", [1], SamplingParams(max_tokens=2, n=2))),
                ae.generate(EngineRequest("one", [1], SamplingParams(max_tokens=2)))]
        tasks = [asyncio.create_task(g.__anext__()) for g in gens]
        await _wait_for(lambda: len(ae._streams) == 2)
        with pytest.raises(QueueFullError, match="1 requests are waiting"):
            await ae.generate(EngineRequest("over", [1], SamplingParams())).__anext__()
        fe.gate.set()
        await asyncio.gather(*tasks)
        for g in gens:
            await _collect(g)
        assert ae._num_seqs == 0  # every stream's sequences given back
        await ae.shutdown()

    run(main())


def test_engine_death_fails_streams_and_flips_health():
    fe = FakeEngine(max_model_len=10_000, step_delay=0.002)

    async def main():
        ae = await _started(fe)
        agens = [ae.generate(EngineRequest(f"k{i}", [1], SamplingParams(max_tokens=5000))) for i in range(3)]
        for g in agens:
            await g.__anext__()
        assert ae.is_healthy
        fe.fail_next_step = FakeEngineError("worker died")
        for g in agens:
            with pytest.raises(EngineDeadError, match="worker died"):
                await _collect(g)
        assert not ae.is_healthy and isinstance(ae.dead_error, FakeEngineError)
        with pytest.raises(EngineDeadError):
            await ae.generate(EngineRequest("new", [1], SamplingParams())).__anext__()
        await ae.shutdown()

    run(main())
    assert fe.is_shutdown


def test_shutdown_grace_then_abort():
    fe = FakeEngine(max_model_len=10_000, step_delay=0.002)

    async def main():
        ae = await _started(fe)
        short = asyncio.create_task(_collect(ae.generate(EngineRequest("s", [1], SamplingParams(max_tokens=3)))))
        agen = ae.generate(EngineRequest("long", [1], SamplingParams(max_tokens=100_000)))
        await agen.__anext__()
        await ae.shutdown(grace=0.3)
        rest = await _collect(agen)
        with pytest.raises(EngineStoppedError):
            await ae.generate(EngineRequest("late", [1], SamplingParams())).__anext__()
        return await short, rest

    short, rest = run(main())
    assert short[-1].outputs[0].finish_reason == LENGTH
    assert rest[-1].outputs[0].finish_reason == ABORT
