"""Where each request's time to first token goes, as the server saw it.

    python -m benchmarks.ttft_breakdown [--workload S1] [--dtype bfloat16] [--server HOST:PORT]
                                        [--per-request] [-- extra `llmsvc serve` flags]

Streams a standard workload over gRPC (a fresh `llmsvc serve` on loopback unless --server is
given) with `OutputOptions.include_timing`, and splits every request's TTFT into the server's
queue time (arrival to its first scheduled step) and prefill time (that step to its first
token; it includes the other requests' work in the same steps), beside the TTFT the client
measured (the rest is gRPC, the front end and the client). Prints p50 / p90 / p99 / mean of each.
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import time


def _seconds(d) -> float:
    return d.seconds + d.nanos * 1e-9


async def _run(target: str, prompts, offsets, output_len: int) -> list[tuple]:
    import grpc

    from llmsvc.v1 import llmsvc_pb2 as pb
    from llmsvc.v1 import llmsvc_pb2_grpc as pb_grpc

    rows = []
    async with grpc.aio.insecure_channel(target) as ch:
        stub = pb_grpc.LlmServiceStub(ch)
        t0 = time.perf_counter()

        async def one(i: int) -> None:
            await asyncio.sleep(max(0.0, t0 + offsets[i] - time.perf_counter()))
            start, first, timing = time.perf_counter(), None, None
            req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompts[i]), stream=True,
                                     sampling=pb.SamplingParams(temperature=0.0),
                                     stopping=pb.StoppingCriteria(max_tokens=output_len, ignore_eos=True),
                                     output=pb.OutputOptions(include_timing=True))
            async for msg in stub.Generate(req):
                if first is None and msg.token_ids:
                    first = time.perf_counter()
                if msg.HasField("finish"):
                    timing = msg.finish.timing
            rows.append((i, start - t0, first - start, _seconds(timing.queue), _seconds(timing.prefill),
                         _seconds(timing.time_to_first_token)))

        await asyncio.gather(*(one(i) for i in range(len(prompts))))
    return sorted(rows)


def _pct(xs: list[float], q: float) -> float:
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="S1")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--model", default=None)
    ap.add_argument("--server", default=None, help="HOST:PORT of a running server (default: start one)")
    ap.add_argument("--per-request", action="store_true", help="print one line per request")
    ap.add_argument("serve_args", nargs="*", help="extra `llmsvc serve` flags, after --")
    a = ap.parse_args(argv)

    from transformers import AutoTokenizer

    from llmsvc.bench.server_proc import running_server, wait_serving
    from llmsvc.bench.workloads import arrival_offsets, build_prompts, get_workload, ordinary_vocab
    from llmsvc.config import ModelConfig
    from llmsvc.models.resolve import resolve_model_config

    w = get_workload(a.workload)
    mc = resolve_model_config(ModelConfig(model=a.model))
    prompts = build_prompts(w, ordinary_vocab(AutoTokenizer.from_pretrained(mc.model_dir)))
    offsets = arrival_offsets(w)
    if a.server:
        wait_serving(a.server, 900)
        rows = asyncio.run(_run(a.server, prompts, offsets, w.output_len))
    else:
        serve = [*([a.model] if a.model else []), "--dtype", a.dtype, *a.serve_args]
        with running_server(serve) as target:
            rows = asyncio.run(_run(target, prompts, offsets, w.output_len))
    if a.per_request:
        for i, start, ttft, queue, prefill, server in rows:
            print(f"{i:4d} at {start:7.2f} s: TTFT {ttft * 1e3:6.0f} ms = queue {queue * 1e3:5.0f} + prefill "
                  f"{prefill * 1e3:5.0f} + {(ttft - server) * 1e3:4.0f} outside the engine")
    print(f"{a.workload} {a.dtype}, {len(rows)} requests, ms:")
    for k, name in ((2, "client TTFT"), (3, "server queue"), (4, "server prefill"), (5, "server TTFT")):
        xs = sorted(r[k] * 1e3 for r in rows)
        print(f"  {name:15s} p50 {statistics.median(xs):7.1f}  p90 {_pct(xs, .9):7.1f}  "
              f"p99 {_pct(xs, .99):7.1f}  mean {statistics.mean(xs):7.1f}")


if __name__ == "__main__":
    main()
