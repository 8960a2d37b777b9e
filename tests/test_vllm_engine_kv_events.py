"""VllmEngine.SubscribeKvEvents: the prefix cache's stored / removed / cleared blocks as a
cache-aware gateway reads them (real scheduler and KV cache manager, FakeExecutor)."""
from __future__ import annotations

import queue
import threading

import grpc
import pytest

from llmsvc.server.vllm_engine.proto import common_pb2 as cpb
from llmsvc.server.vllm_engine.proto import vllm_engine_pb2 as vpb
from llmsvc.server.vllm_engine.proto import vllm_engine_pb2_grpc as vgrpc
from tests.server_harness import ServerThread, fake_engine_factory
from tests.test_server import free_blocks_back

BS = 4  # fake_engine_factory's block size


class Reader:
    """A SubscribeKvEvents stream read on a thread, so a test can wait for what it expects."""

    def __init__(self, stub, start_seq: int = 0) -> None:
        self.call = stub.SubscribeKvEvents(cpb.SubscribeKvEventsRequest(start_sequence_number=start_seq))
        self.q: queue.Queue = queue.Queue()
        self.load_only: queue.Queue = queue.Queue()  # the load-only batches, apart from the events
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        try:
            for batch in self.call:
                (self.load_only if batch.load.load_only else self.q).put(batch)
        except grpc.RpcError as e:
            self.q.put(e)

    def next(self, timeout: float = 30.0):
        item = self.q.get(timeout=timeout)
        if isinstance(item, grpc.RpcError):
            raise item
        return item

    def until(self, pred, timeout: float = 30.0) -> list:
        """Batches up to the first whose events satisfy pred (given all events so far)."""
        seen, events = [], []
        while True:
            batch = self.next(timeout)
            seen.append(batch)
            events += list(batch.events)
            if pred(events):
                return seen

    def close(self) -> None:
        self.call.cancel()


def stored_blocks(events) -> list:
    return [(b, e.stored.parent_block_hash if e.stored.HasField("parent_block_hash") and i == 0 else None)
            for e in events if e.HasField("stored") for i, b in enumerate(e.stored.blocks)]


def run(stub, ids, max_tokens=2) -> vpb.GenerateComplete:
    req = vpb.GenerateRequest(tokenized=vpb.TokenizedInput(input_ids=ids),
                              sampling_params=vpb.SamplingParams(temperature=0.0, max_tokens=max_tokens))
    (msg,) = list(stub.Generate(req))
    return msg.complete


@pytest.fixture()
def srv():
    s = ServerThread(fake_engine_factory(num_blocks=16, block_size=BS, step_delay=0.002))
    s.vllm = vgrpc.VllmEngineStub(s.channel)
    yield s
    s.stop()


def test_snapshot_then_the_stored_chain_of_a_prompt(srv):
    reader = Reader(srv.vllm)
    snap = reader.next()
    assert [e.WhichOneof("data") for e in snap.events] == ["cleared"]  # nothing cached yet but the warm-up
    prompt = list(range(97, 97 + 3 * BS))  # three full blocks
    run(srv.vllm, prompt)
    seen = reader.until(lambda ev: len(stored_blocks(ev)) >= 3)
    assert [b.sequence_number for b in seen] == list(range(snap.sequence_number + 1, snap.sequence_number + 1 + len(seen)))
    blocks = [b for b, _ in stored_blocks([e for b in seen for e in b.events])]
    assert [list(b.token_ids) for b in blocks[:3]] == [prompt[:4], prompt[4:8], prompt[8:12]]
    assert all(b.block_size == BS for b in blocks)
    first_event = next(e for b in seen for e in b.events if e.HasField("stored"))
    assert not first_event.stored.HasField("parent_block_hash")  # the chain starts at this prompt
    assert len({b.block_hash for b in blocks}) == len(blocks)
    # a subscriber that comes later gets the same blocks in its snapshot, parents first
    late = Reader(srv.vllm)
    snap2 = late.next()
    hashes = [b.block_hash for e in snap2.events if e.HasField("stored") for b in e.stored.blocks]
    assert hashes[:3] == [b.block_hash for b in blocks[:3]] and snap2.sequence_number == seen[-1].sequence_number
    parents = [e.stored.parent_block_hash for e in snap2.events if e.HasField("stored")][1:3]
    assert parents == [blocks[0].block_hash, blocks[1].block_hash]
    reader.close()
    late.close()


def test_equal_prefixes_hash_equal_on_every_replica(srv):
    prompt = list(range(100, 100 + 2 * BS))
    with ServerThread(fake_engine_factory(num_blocks=16, block_size=BS)) as other:
        hashes = []
        for s in (srv, other):
            stub = vgrpc.VllmEngineStub(s.channel)
            run(stub, prompt)
            snap = Reader(stub).next()
            hashes.append([b.block_hash for e in snap.events if e.HasField("stored") for b in e.stored.blocks
                           if list(b.token_ids) in (prompt[:4], prompt[4:])])
        assert len(hashes[0]) == 2 and hashes[0] == hashes[1]


def test_eviction_is_a_removed_event_and_flush_a_cleared_one(srv):
    reader = Reader(srv.vllm)
    reader.next()
    first = list(range(60, 60 + 2 * BS))
    run(srv.vllm, first)
    seen = reader.until(lambda ev: len(stored_blocks(ev)) >= 2)
    stored = {b.block_hash for b, _ in stored_blocks([e for b in seen for e in b.events])}
    for k in range(6):  # distinct prompts fill the 16-block pool: the oldest cached blocks go
        run(srv.vllm, [120 + k] * (2 * BS + 1))
    seen = reader.until(lambda ev: any(h in stored for e in ev if e.HasField("removed") for h in e.removed.block_hashes))
    free_blocks_back(srv)
    resp = srv.vllm.FlushCache(cpb.FlushCacheRequest())
    assert resp.success, resp.message
    reader.until(lambda ev: any(e.HasField("cleared") for e in ev))
    assert run(srv.vllm, first).cached_tokens == 0  # nothing cached survives the flush
    reader.close()


def test_flush_refused_while_a_request_holds_blocks(srv):
    call = srv.vllm.Generate(vpb.GenerateRequest(tokenized=vpb.TokenizedInput(input_ids=[97] * 9), stream=True,
                                                 sampling_params=vpb.SamplingParams(max_tokens=40, ignore_eos=True)))
    assert next(call).HasField("chunk")
    resp = srv.vllm.FlushCache(cpb.FlushCacheRequest())
    assert not resp.success and "in flight" in resp.message
    list(call)
    assert srv.vllm.FlushCache(cpb.FlushCacheRequest(timeout_s=5.0)).success


@pytest.mark.parametrize("timeout_s", [-1.0, float("nan"), float("inf")])
def test_flush_timeout_must_be_finite_and_not_negative(srv, timeout_s):
    with pytest.raises(grpc.RpcError) as ei:
        srv.vllm.FlushCache(cpb.FlushCacheRequest(timeout_s=timeout_s), timeout=10)
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "timeout_s" in ei.value.details()


def test_cursor_resumes_without_snapshot_and_a_stale_one_is_out_of_range(srv):
    reader = Reader(srv.vllm)
    reader.next()
    run(srv.vllm, list(range(70, 70 + BS)))
    last = reader.until(lambda ev: len(stored_blocks(ev)) >= 1)[-1].sequence_number
    reader.close()
    run(srv.vllm, list(range(80, 80 + BS)))
    resumed = Reader(srv.vllm, start_seq=last)
    batch = resumed.next()
    assert batch.sequence_number == last + 1 and not any(e.HasField("cleared") for e in batch.events)
    resumed.close()
    with pytest.raises(grpc.RpcError) as ei:
        Reader(srv.vllm, start_seq=last + 1000).next()
    assert ei.value.code() == grpc.StatusCode.OUT_OF_RANGE


def test_streams_end_unavailable_when_the_server_drains():
    s = ServerThread(fake_engine_factory(num_blocks=16, block_size=BS))
    reader = Reader(vgrpc.VllmEngineStub(s.channel))
    reader.next()
    s.call(_drain(s.server))
    with pytest.raises(grpc.RpcError) as ei:
        reader.next()
    assert ei.value.code() == grpc.StatusCode.UNAVAILABLE
    s.stop()


async def _drain(server):
    server.begin_drain(5.0)


def test_engine_death_ends_the_stream_and_health_turns_false():
    with ServerThread(fake_engine_factory(num_blocks=64, block_size=BS, fail_after=30, step_delay=0.002)) as s:
        stub = vgrpc.VllmEngineStub(s.channel)
        reader = Reader(stub)
        reader.next()
        with pytest.raises(grpc.RpcError) as ei:
            list(stub.Generate(vpb.GenerateRequest(tokenized=vpb.TokenizedInput(input_ids=[97] * 5), stream=True,
                                                   sampling_params=vpb.SamplingParams(max_tokens=100))))
        assert ei.value.code() == grpc.StatusCode.UNAVAILABLE
        with pytest.raises(grpc.RpcError) as ei:  # the gateway's signal to route elsewhere at once
            while True:
                reader.next()
        assert ei.value.code() == grpc.StatusCode.UNAVAILABLE
        health = stub.HealthCheck(vpb.HealthCheckRequest())
        assert not health.healthy and "died" in health.message


def test_the_bench_empties_a_running_server_s_cache_before_its_runs(srv):
    """`llmsvc bench --server`: the same prompts run after run must start cold, as through the
    gateway; the bench flushes through VllmEngine/FlushCache, which needs no admin token."""
    from llmsvc.bench.server_proc import flush_server_cache

    prompt = list(range(200, 200 + 2 * BS))
    run(srv.vllm, prompt)
    assert run(srv.vllm, prompt).cached_tokens > 0
    free_blocks_back(srv)
    assert flush_server_cache(f"127.0.0.1:{srv.port}")
    assert run(srv.vllm, prompt).cached_tokens == 0
    assert not flush_server_cache("127.0.0.1:1", timeout=1.0)  # nothing listens there


async def _blocks_known_at_the_final_output(engine, prompt: list[int]) -> tuple[int, int]:
    """(stored blocks the relay held when generate() yielded the final output, after shutdown)."""
    import asyncio

    from llmsvc.engine.async_engine import AsyncEngine
    from llmsvc.engine_request import EngineRequest
    from llmsvc.sampling_params import SamplingParams
    from llmsvc.server.vllm_engine.kv_events import KVEventRelay

    def stored(relay) -> int:
        return len(stored_blocks(relay.snapshot().events))

    ae = AsyncEngine(engine)
    await ae.start()
    relay = KVEventRelay(ae.follow_kv_events, ae.wait_dead)
    try:
        await relay.start()
        at_final = None
        async for out in ae.generate(EngineRequest("r", prompt, SamplingParams(max_tokens=2, temperature=0.0))):
            if out.finished:
                at_final = stored(relay)
        await asyncio.sleep(0.2)
        return at_final, stored(relay)
    finally:
        await relay.stop()
        await ae.shutdown()


@pytest.mark.parametrize("core", ["inline", "process"])
def test_a_request_s_blocks_reach_the_relay_before_its_final_output(core, tmp_path):
    # a gateway routes a conversation's next turn, sent the moment this one ends, by what the
    # relay said this request cached: those events must not trail its last output
    import asyncio

    if core == "inline":
        engine, bs = fake_engine_factory(num_blocks=16, block_size=BS)(), BS
    else:
        from llmsvc.config import CacheConfig, EngineConfig, ModelConfig
        from llmsvc.engine.llm_engine import LLMEngine
        from tests.server_harness import make_tiny_served_model_dir

        bs = 16
        engine = LLMEngine.from_config(EngineConfig(
            model_config=ModelConfig(model=make_tiny_served_model_dir(tmp_path)), device="cpu",
            engine_core="process", cache_config=CacheConfig(kv_cache_memory_bytes=1 << 20, block_size=bs),
            log_stats_interval_s=0.0))
    prompt = list(range(97, 97 + 3 * bs))  # three full blocks
    at_final, later = asyncio.run(asyncio.wait_for(_blocks_known_at_the_final_output(engine, prompt), 120))
    assert at_final == later and at_final >= 3, (at_final, later)


def test_every_batch_carries_the_load_and_load_only_batches_keep_it_fresh(srv):
    # a gateway routes on these records instead of polling GetLoads, and reads a stream gone
    # quiet as a wedged engine: the load comes with each batch, and alone at least once a second
    reader = Reader(srv.vllm)
    snap = reader.next()
    assert snap.load.sample >= 1 and snap.load.max_running_requests == 8 and snap.load.HasField("max_total_num_tokens")
    beat = reader.load_only.get(timeout=5)  # an idle engine: a heartbeat, numbered as the last batch
    assert beat.sequence_number == snap.sequence_number and not beat.events and beat.load.sample > snap.load.sample
    assert beat.load.running_requests == 0 and beat.load.HasField("cache_hit_rate")
    prompt = list(range(97, 97 + 3 * BS))
    run(srv.vllm, prompt)
    seen = reader.until(lambda ev: len(stored_blocks(ev)) >= 3)
    assert all(b.HasField("load") and not b.load.load_only for b in seen)
    samples = [b.load.sample for b in [snap, *seen]]
    assert samples == sorted(set(samples))  # monotonic on the stream
    loads = srv.vllm.GetLoads(vpb.GetLoadsRequest()).loads[0]
    last = seen[-1].load
    assert last.max_running_requests == loads.max_running_requests and 0.0 <= last.token_usage <= 1.0
    reader.close()
