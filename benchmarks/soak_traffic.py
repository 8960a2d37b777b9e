"""The soak's client side: threads that send mixed, partly abusive requests and count the outcomes.

Each client thread draws a kind per request: streamed and unary completions, n=2, stop strings,
chat, client cancels mid-stream, Abort RPCs, short deadlines, slow readers (which read up at once
when the run ends), bad requests. Swap traffic (`swap=True`) adds "drop" (the client's connection
closes mid-stream, as a disconnect does) and draws cancel, abort and drop twice as often.

Plain traffic cancels and aborts at the second message, so the request is surely running then.
Swap traffic aims its cancels, aborts and drops at swapped requests instead: each strikes when its
stream, past its first token, falls silent (0.05 s and 4 of the streams' usual gaps) while the
server reports swapped requests (a swapped request sends nothing while the others go on), or at a
random moment of the request's life (log-uniform between 0.1 s and 15 s), whichever comes first;
its deadlines are drawn from the same range. A silent stream is only most likely the swapped one
(the server counts the requests that ended while swapped, not which action ended them). Every swap
request asks for its Timing, whose num_swaps says in the final message (a completion, or an Abort
RPC's REASON_ABORTED) how often the request was swapped out and came back; a request aborted in
its first swap reports 0 (nothing was sent for it since).
"""
from __future__ import annotations

import collections
import dataclasses
import math
import random
import threading
import time

import grpc

from llmsvc.v1 import llmsvc_pb2 as pb
from llmsvc.v1 import llmsvc_pb2_grpc as pb_grpc

ST = pb.StoppingCriteria
WORDS = ("the quick brown fox jumps over a lazy dog while servers stream tokens to many "
         "clients under load and some of them leave early").split()
KINDS = ("stream", "unary", "n2", "stop", "chat", "cancel", "abort", "deadline", "slow", "bad")
TIMED = ("cancel", "abort", "drop")  # with swap: aimed at a swapped request, or timed (see above)
SWAP_KINDS = KINDS + ("drop",) + TIMED  # an abort storm: half the draws end their request early
HIT_RANGE_S = (0.1, 15.0)  # swap traffic: when a timed action or deadline strikes (log-uniform)
STALL_S = 0.05  # ... or sooner: a stream silent this long (and 4 usual gaps) while requests are swapped
LORA_NAMES = (None, "soak", "churn", "never-loaded")
ADMIN_TOKEN = "soak-admin"


def _log_uniform(rng: random.Random, lo: float, hi: float) -> float:
    return math.exp(rng.uniform(math.log(lo), math.log(hi)))


@dataclasses.dataclass
class Stream:
    """When a stream's last message arrived, to tell a stall from the server's pace."""
    last: float = 0.0

    def message(self, now: float) -> float:
        """Record a message; the gap since the previous one (0 for the first)."""
        gap = now - self.last if self.last else 0.0
        self.last = now
        return gap

    def stalled(self, now: float, pace: float) -> bool:
        """Silent, since a first token, for STALL_S and 4 of the server's usual gaps."""
        return bool(self.last) and now - self.last > max(STALL_S, 4 * pace)


class Traffic:
    def __init__(self, target: str, seed: int, max_tokens: int, lora_names: tuple = (), swap: bool = False) -> None:
        self.target = target
        self.channel = grpc.insecure_channel(target)
        self.stub = pb_grpc.LlmServiceStub(self.channel)
        self.seed, self.max_tokens = seed, max_tokens
        self.lora_names = lora_names  # adapters requests may name (None: the base model)
        self.swap = swap
        self.kinds = SWAP_KINDS if swap else KINDS
        self.codes: collections.Counter = collections.Counter()  # "KIND:CODE"
        self.by_code: collections.Counter = collections.Counter()
        # requests whose final message said they had been swapped out, "KIND:FINISH_REASON"
        self.swapped_seen: collections.Counter = collections.Counter()
        self.num_swapped_now = 0  # the server's swapped requests, by watch_swapped
        self.pace = 0.0  # moving average of the gap between two messages of a stream (slow readers aside)
        self.strikes: collections.Counter = collections.Counter()  # swap traffic: "aimed" or "timed"
        self.tokens = 0
        self.lock = threading.Lock()
        self.stop = threading.Event()

    def _count(self, kind: str, code: str, tokens: int = 0) -> None:
        with self.lock:
            self.codes[f"{kind}:{code}"] += 1
            self.by_code[code] += 1
            self.tokens += tokens

    def _request(self, rng: random.Random, rid: str, kind: str) -> pb.GenerateRequest:
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 60)))
        r = pb.GenerateRequest(request_id=rid, text=text, stream=kind != "unary",
                               sampling=pb.SamplingParams(temperature=rng.choice([0.0, 0.7, 1.0]),
                                                          top_p=rng.choice([1.0, 0.9]), seed=rng.randrange(1 << 30)),
                               stopping=ST(max_tokens=rng.randint(1, self.max_tokens), ignore_eos=rng.random() < 0.5))
        if self.swap:
            r.output.include_timing = True  # Timing.num_swaps: was it swapped out?
        if self.lora_names:
            name = rng.choice(self.lora_names)
            if name is not None:
                r.lora_name = name
        if kind == "n2":
            r.sampling.n = 2
        elif kind == "stop":
            r.stopping.stop.extend(rng.sample(WORDS, 3) + ["."])
        elif kind == "chat":
            r.ClearField("text")
            r.chat.messages.add(role="user", content=text)
        elif kind == "bad":
            bad = rng.randrange(4)
            if bad == 0:
                r.sampling.top_p = 0.0
            elif bad == 1:
                r.stopping.max_tokens = 10 ** 7
            elif bad == 2:
                r.stopping.stop.append("")
            else:
                r.ClearField("text")
        return r

    def _abort(self, rid: str) -> None:
        try:  # an unknown id beside it: it must be reported, not fail the call
            self.stub.Abort(pb.AbortRequest(request_ids=[rid, f"unknown-{rid}"]), timeout=30)
        except grpc.RpcError as e:
            self._count("abort-rpc", e.code().name)

    def _strike(self, kind: str, call, rid: str, channel: grpc.Channel | None) -> None:
        """Swap traffic's timed action (a request that already finished shrugs it off)."""
        if kind == "cancel":
            call.cancel()
        elif kind == "abort":
            self._abort(rid)
        elif channel is not None:  # drop: the connection goes, and the call with it
            channel.close()

    def _aim(self, at: float, seen: Stream, done: threading.Event, strike) -> None:
        """Strike at monotonic time `at`, or sooner when the stream stalls while the server holds
        swapped requests: a swapped request is the one stream that falls silent while the others
        go on, so this one is then most likely swapped out (the server's ended_while_swapped says
        how often such a strike, or any other, found its request swapped)."""
        while not done.wait(0.02):
            now = time.monotonic()
            aimed = seen.stalled(now, self.pace) and self.num_swapped_now > 0
            if aimed or now >= at:
                strike()
                with self.lock:
                    self.strikes["aimed" if aimed else "timed"] += 1
                return

    def _start_aim(self, rng: random.Random, kind: str, call, rid: str, channel,
                   seen: Stream) -> threading.Event | None:
        """Swap traffic's cancels, aborts and drops: a thread that strikes (see _aim); set the
        event returned once the call is over. None: plain traffic, or another kind."""
        if not self.swap or kind not in TIMED:
            return None
        done = threading.Event()
        at = time.monotonic() + _log_uniform(rng, *HIT_RANGE_S)
        threading.Thread(target=self._aim, args=(at, seen, done, lambda: self._strike(kind, call, rid, channel)),
                         daemon=True).start()
        return done

    def watch_swapped(self) -> None:
        """Swap traffic: keep num_swapped_now (GetServerInfo) fresh for the aimed strikes."""
        while not self.stop.wait(0.05):
            try:
                self.num_swapped_now = self.stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10).num_swapped
            except grpc.RpcError:
                pass

    def one(self, rng: random.Random, i: int, worker: int) -> None:
        kind = rng.choice(self.kinds)
        rid = f"soak-{worker}-{i}"
        req = self._request(rng, rid, kind)
        # a drop gets a connection of its own, so closing it ends no other client's call
        channel = grpc.insecure_channel(self.target) if kind == "drop" else None
        stub = pb_grpc.LlmServiceStub(channel) if channel is not None else self.stub
        n_tok, swapped, finish, aimed, seen = 0, False, "", None, Stream()
        try:
            if kind == "deadline":
                timeout = _log_uniform(rng, *HIT_RANGE_S) if self.swap else rng.uniform(0.05, 1.5)
            else:
                timeout = 300
            call = stub.Generate(req, timeout=timeout)
            aimed = self._start_aim(rng, kind, call, rid, channel, seen)
            for k, m in enumerate(call):
                gap = seen.message(time.monotonic())
                if gap and kind != "slow":
                    self.pace += 0.05 * (gap - self.pace)
                n_tok += len(m.token_ids)
                if m.HasField("finish"):
                    swapped = swapped or m.finish.timing.num_swaps > 0
                    finish = pb.FinishInfo.Reason.Name(m.finish.reason)
                if kind == "cancel" and k == 1 and aimed is None:
                    call.cancel()
                    break
                if kind == "abort" and k == 1 and aimed is None:
                    self._abort(rid)
                if kind == "slow" and not self.stop.is_set():  # once the run ends, read up at once
                    time.sleep(0.2)
            self._count(kind, "CANCELLED" if kind == "cancel" and aimed is None else "OK", n_tok)
        except grpc.RpcError as e:
            self._count(kind, e.code().name, n_tok)
        finally:
            if aimed is not None:
                aimed.set()
            if channel is not None:
                channel.close()
        if swapped:
            with self.lock:
                self.swapped_seen[f"{kind}:{finish}"] += 1

    def worker(self, w: int) -> None:
        rng = random.Random(self.seed * 1000 + w)
        i = 0
        while not self.stop.is_set():
            self.one(rng, i, w)
            i += 1


def lora_churn(traffic: Traffic, path: str) -> None:
    """Load and unload the adapter "churn" every ~2 s (a refused unload: it is in use)."""
    admin = pb_grpc.AdminServiceStub(traffic.channel)
    md = (("authorization", f"Bearer {ADMIN_TOKEN}"),)
    loaded = False
    while not traffic.stop.wait(2.0):
        try:
            if loaded:
                admin.UnloadLoraAdapter(pb.UnloadLoraAdapterRequest(lora_name="churn"), metadata=md, timeout=60)
            else:
                admin.LoadLoraAdapter(pb.LoadLoraAdapterRequest(lora_name="churn", lora_path=path), metadata=md,
                                      timeout=60)
            loaded = not loaded
            traffic._count("unload" if not loaded else "load", "OK")
        except grpc.RpcError as e:
            traffic._count("unload" if loaded else "load", e.code().name)
