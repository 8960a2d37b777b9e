"""Run a workload offline (in-process LLMEngine) or over gRPC (streaming Generate calls)."""
from __future__ import annotations

import asyncio
import time

from tqdm import tqdm

from llmsvc.bench.metrics import RequestRecord


def run_offline(engine, prompts: list[list[int]], output_len: int, offsets: list[float],
                json_schema: str | None = None) -> tuple[list[RequestRecord], float]:
    """Drive LLMEngine.step() directly; requests are added when their arrival offset is due.
    A request that arrives during a step is added after it, but its TTFT counts from its
    arrival, as a client's would. json_schema: every request is constrained to it."""
    from llmsvc.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA,
                            structured_outputs=StructuredOutputsParams(json=json_schema) if json_schema else None)
    order = sorted(range(len(prompts)), key=lambda i: offsets[i])
    records: dict[str, RequestRecord] = {}
    bar = tqdm(total=len(prompts), desc="offline", unit="req")
    t0 = time.perf_counter()
    nxt = 0
    while nxt < len(order) or engine.has_unfinished_requests():
        now = time.perf_counter()
        while nxt < len(order) and t0 + offsets[order[nxt]] <= now:
            i = order[nxt]
            records[f"bench-{i}"] = RequestRecord(len(prompts[i]), t0 + offsets[i])
            engine.add_request(f"bench-{i}", prompts[i], params)
            nxt += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, t0 + offsets[order[nxt]] - time.perf_counter()))
            continue
        outs = engine.step()
        now = time.perf_counter()
        for o in outs:
            rec = records[o.request_id]
            rec.token_times += [now] * len(o.outputs[0].token_ids)
            rec.cached_tokens = o.num_cached_tokens
            if o.finished:
                rec.end = now
                _engine_times(rec, o.metrics)
                bar.update(1)
    bar.close()
    return [records[f"bench-{i}"] for i in range(len(prompts))], time.perf_counter() - t0


def _engine_times(rec: RequestRecord, m) -> None:
    """rec.queue / rec.prefill from a finished RequestOutput's metrics (engine clock)."""
    if m is not None and m.first_scheduled_time is not None:
        rec.queue = max(0.0, m.first_scheduled_time - m.arrival_time)
        if m.first_token_time is not None:
            rec.prefill = max(0.0, m.first_token_time - m.first_scheduled_time)


async def drive_arrivals(prompts, offsets: list[float], concurrency: int | None, desc: str,
                         send) -> tuple[list[RequestRecord], float]:
    """Start request i at offsets[i] after the first start, at most `concurrency` in flight;
    `await send(i, rec)` streams it into rec (start already stamped; it records its own error).
    Returns (records in prompt order, wall seconds). Shared by every client the bench drives, so
    each is timed the same way."""
    sem = asyncio.Semaphore(concurrency or len(prompts))
    records = [RequestRecord(len(p), 0.0) for p in prompts]
    bar = tqdm(total=len(prompts), desc=desc, unit="req")
    t0 = time.perf_counter()

    async def one(i: int) -> None:
        await asyncio.sleep(max(0.0, t0 + offsets[i] - time.perf_counter()))
        async with sem:
            records[i].start = time.perf_counter()
            await send(i, records[i])
            bar.update(1)

    await asyncio.gather(*(one(i) for i in range(len(prompts))))
    wall = time.perf_counter() - t0
    bar.close()
    return records, wall


async def _serve(target: str, prompts, output_len, offsets, concurrency: int | None, json_schema: str | None):
    import grpc

    from llmsvc.v1 import llmsvc_pb2 as pb
    from llmsvc.v1 import llmsvc_pb2_grpc as pb_grpc

    async with grpc.aio.insecure_channel(target, options=[("grpc.max_receive_message_length", 64 << 20)]) as ch:
        stub = pb_grpc.LlmServiceStub(ch)

        async def send(i: int, rec: RequestRecord) -> None:
            req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompts[i]), stream=True,
                                     sampling=pb.SamplingParams(temperature=0.0, json_schema=json_schema),
                                     stopping=pb.StoppingCriteria(max_tokens=output_len, ignore_eos=True),
                                     output=pb.OutputOptions(include_timing=True))
            try:
                async for msg in stub.Generate(req):
                    now = time.perf_counter()
                    rec.token_times += [now] * len(msg.token_ids)
                    if msg.HasField("prompt"):
                        rec.cached_tokens = msg.prompt.num_cached_tokens
                    if msg.HasField("finish"):
                        t = msg.finish.timing
                        if t.HasField("queue"):
                            rec.queue = t.queue.ToTimedelta().total_seconds()
                        if t.HasField("prefill"):
                            rec.prefill = t.prefill.ToTimedelta().total_seconds()
                rec.end = time.perf_counter()
            except grpc.aio.AioRpcError as e:
                rec.error = f"{e.code().name}: {e.details()}"

        return await drive_arrivals(prompts, offsets, concurrency, f"serve {target}", send)


def run_serving(target: str, prompts: list[list[int]], output_len: int, offsets: list[float],
                concurrency: int | None = None, json_schema: str | None = None) -> tuple[list[RequestRecord], float]:
    return asyncio.run(_serve(target, prompts, output_len, offsets, concurrency, json_schema))
