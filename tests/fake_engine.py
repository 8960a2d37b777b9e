"""A tiny stand-in for LLMEngine (same public interface) for AsyncEngine/server unit tests.

Each step emits one token per running request: token k of request r is
(last prompt token + 1 + k + 7 * index) % vocab_size, with text f"<{token}>". Requests hold
ceil(num_tokens / block_size) blocks of a fixed pool, so tests can check blocks come back.
"""
from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field

from llmsvc.core.errors import InvalidRequestError
from llmsvc.engine.admission import AdmittedRequest
from llmsvc.engine_request import EngineRequest
from llmsvc.config import EngineConfig, ModelConfig, SchedulerConfig
from llmsvc.outputs import ABORT, CONTEXT, LENGTH, CompletionOutput, EngineStats, RequestOutput
from llmsvc.sampling_params import RequestOutputKind


class FakeEngineError(RuntimeError):
    pass


@dataclass
class _Req:
    rid: str
    prompt: list[int]
    params: object
    prompt_text: str | None
    outs: dict = field(default_factory=dict)  # index -> list[int]
    finished: bool = False


class FakeEngine:
    def __init__(self, *, vocab_size: int = 1000, max_model_len: int = 64, num_blocks: int = 64,
                 block_size: int = 4, step_delay: float = 0.0, max_running: int = 8) -> None:
        self.config = EngineConfig(model_config=ModelConfig(max_model_len=max_model_len, vocab_size=vocab_size,
                                                            eos_token_ids=[0], architecture="Fake"),
                                   scheduler_config=SchedulerConfig(max_num_seqs=max_running))
        self.tokenizer = None
        self.num_blocks, self.block_size = num_blocks, block_size
        self.step_delay = step_delay
        self.max_running = max_running
        self.gate = threading.Event()  # clear it to make step() block (a long step)
        self.gate.set()
        self.fail_next_step: Exception | None = None
        self.reqs: dict[str, _Req] = {}
        self.aborted: list[str] = []
        self.admitted: list[str] = []  # ids in the order admit() passed them
        self.threads: set[int] = set()
        self.steps = 0
        self.is_shutdown = False
        self._to_abort: list[str] = []

    def _touch(self) -> None:
        self.threads.add(threading.get_ident())

    def admit(self, request: EngineRequest) -> AdmittedRequest:
        """LLMEngine.admit's contract, with one rule: the prompt must not be empty."""
        if not request.prompt_token_ids:
            raise InvalidRequestError("prompt", "must not be empty")
        self.admitted.append(request.request_id)
        return AdmittedRequest(request)

    def add_admitted(self, admitted: AdmittedRequest):
        self._touch()
        r = admitted.request
        if r.request_id in self.reqs:
            raise ValueError(f"duplicate {r.request_id}")
        self.reqs[r.request_id] = _Req(r.request_id, list(r.prompt_token_ids), r.sampling_params, r.prompt,
                                       {i: [] for i in range(r.sampling_params.n)})

    def add_request(self, request_id, prompt_token_ids, params, *, prompt=None, priority=0, arrival_time=None,
                    cache_salt=None, lora_name=None):
        self.add_admitted(self.admit(EngineRequest(request_id, prompt_token_ids, params, prompt=prompt)))

    def abort_request(self, ids):
        self._touch()
        self._to_abort.extend(ids)

    def has_unfinished_requests(self) -> bool:
        self._touch()
        return any(not r.finished for r in self.reqs.values()) or bool(self._to_abort)

    def _running(self) -> list[_Req]:
        return [r for r in self.reqs.values() if not r.finished][: self.max_running]

    def _blocks(self, r: _Req) -> int:
        n = len(r.prompt) + max(len(v) for v in r.outs.values())
        return math.ceil(n / self.block_size)

    def step(self) -> list[RequestOutput]:
        self._touch()
        self.gate.wait()
        if self.fail_next_step is not None:
            e, self.fail_next_step = self.fail_next_step, None
            raise e
        if self.step_delay:
            time.sleep(self.step_delay)
        self.steps += 1
        outputs = []
        for rid in self._to_abort:
            r = self.reqs.get(rid)
            if r is None or r.finished:
                continue
            r.finished = True
            self.aborted.append(rid)
            outputs.append(self._output(r, {i: [] for i in r.outs}, ABORT))
        self._to_abort.clear()
        for r in self._running():
            new = {}
            for i, toks in r.outs.items():
                t = (r.prompt[-1] + 1 + len(toks) + 7 * i) % self.config.model_config.vocab_size
                toks.append(t)
                new[i] = [t]
            n = len(r.outs[0])
            reason = None
            if r.params.max_tokens is not None and n >= r.params.max_tokens:
                reason = LENGTH
            elif len(r.prompt) + n >= self.config.model_config.max_model_len:
                reason = CONTEXT
            if reason:
                r.finished = True
            outputs.append(self._output(r, new, reason))
        for rid in [k for k, r in self.reqs.items() if r.finished]:
            del self.reqs[rid]
        return outputs

    def _output(self, r: _Req, new: dict, reason) -> RequestOutput:
        delta = r.params.output_kind == RequestOutputKind.DELTA
        comps = []
        for i, toks in r.outs.items():
            ids = new[i] if delta else list(toks)
            comps.append(CompletionOutput(index=i, text="".join(f"<{t}>" for t in ids), token_ids=list(ids),
                                          finish_reason=reason, num_output_tokens=len(toks)))
        return RequestOutput(r.rid, r.prompt_text, r.prompt, comps, finished=reason is not None,
                             seed=r.params.seed)

    def get_stats(self) -> EngineStats:
        running = self._running()
        used = sum(self._blocks(r) for r in running)
        return EngineStats(num_running=len(running),
                           num_waiting=len([r for r in self.reqs.values() if not r.finished]) - len(running),
                           num_kv_blocks=self.num_blocks, num_free_kv_blocks=self.num_blocks - used,
                           kv_cache_usage=used / self.num_blocks)

    def shutdown(self) -> None:
        self._touch()
        self.is_shutdown = True
