"""What the multiproc executor's pipe costs per step, split into serialization and transport.

    python -m benchmarks.pipe_roundtrip [--reqs 16,64,256] [--steps 2000]

One decode step's SchedulerOutput (every request a running decode: one new token, no new
block) goes to a spawned process over a multiprocessing Pipe, pickled as MultiprocExecutor
pickles it (protocol 5), and its ModelRunnerOutput (one sampled token per request) comes back;
the worker computes nothing. Printed per batch size: the message size, the round trip's median
and p90, and pickle + unpickle of both messages in one process. The difference is the transport:
two process wake-ups, which shared memory alone would not remove (docs/engine-core.md).
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import pickle
import statistics
import time
import timeit
import uuid

from llmsvc.wire import CachedRequestData, ModelRunnerOutput, SchedulerOutput


def step_messages(n: int) -> tuple[SchedulerOutput, ModelRunnerOutput]:
    ids = [uuid.uuid4().hex for _ in range(n)]
    cached = CachedRequestData(req_ids=ids, new_token_ids=[[1234] for _ in ids], new_block_ids=[[] for _ in ids],
                               num_computed_tokens=[200 + i for i in range(n)])
    return (SchedulerOutput([], cached, {r: 1 for r in ids}, n, set()),
            ModelRunnerOutput(req_ids=ids, sampled_token_ids=[[4321] for _ in ids]))


def _worker(conn, n: int) -> None:
    _, reply = step_messages(n)
    while (data := conn.recv_bytes()) != b"stop":
        pickle.loads(data)
        conn.send_bytes(pickle.dumps(("ok", reply), protocol=pickle.HIGHEST_PROTOCOL))


def round_trips(n: int, steps: int) -> list[float]:
    so, _ = step_messages(n)
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_worker, args=(there, n))
    proc.start()
    try:
        out = []
        for _ in range(steps):
            t = time.perf_counter()
            here.send_bytes(pickle.dumps(("execute_model", (so,)), protocol=pickle.HIGHEST_PROTOCOL))
            pickle.loads(here.recv_bytes())
            out.append(time.perf_counter() - t)
        return out[steps // 10:]  # the first tenth warms both processes up
    finally:
        here.send_bytes(b"stop")
        proc.join()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reqs", default="16,64,256", help="comma-separated decode batch sizes")
    ap.add_argument("--steps", type=int, default=2000)
    a = ap.parse_args()
    for n in (int(v) for v in a.reqs.split(",")):
        so, mo = step_messages(n)
        size = len(pickle.dumps(("execute_model", (so,)), protocol=pickle.HIGHEST_PROTOCOL))
        codec = sum(timeit.timeit(lambda m=m: pickle.loads(pickle.dumps(m, protocol=pickle.HIGHEST_PROTOCOL)),
                                  number=a.steps) / a.steps for m in (("execute_model", (so,)), ("ok", mo)))
        ts = sorted(round_trips(n, a.steps))
        print(f"{n:4d} decodes: {size} B to the worker; round trip median {1e6 * statistics.median(ts):.0f} us, "
              f"p90 {1e6 * ts[int(0.9 * len(ts))]:.0f} us; of which pickle + unpickle {1e6 * codec:.0f} us")


if __name__ == "__main__":
    main()
