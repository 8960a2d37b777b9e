"""EngineCore: schedule -> execute the model -> update from its output, one step at a time.

Single-threaded: every method is called from the engine loop's thread. Imports only the
Executor interface; the executor object is injected (torch stays out of this process' engine).

Async scheduling (SchedulerConfig.async_scheduling): a batch queue of depth 2. Each step()
takes the step in flight (N), schedules and submits N+1 without waiting, then waits for N and
updates from its output, so the executor finds the next step queued when it finishes one. A step
that must see step N's tokens before the next is scheduled (see _may_schedule_ahead) leaves the
queue empty: the next step() schedules after the update, as the synchronous core does.
"""
from __future__ import annotations

import logging
import time
from concurrent.futures import FIRST_COMPLETED, wait

from executors.base import Executor
from llmsvc.config import EngineConfig
from llmsvc.core.async_scheduler import AsyncScheduler
from llmsvc.core.core_output import EngineCoreOutput
from llmsvc.core.kv_cache_manager import KVCacheManager
from llmsvc.core.kv_events import KVEventPage
from llmsvc.core.request import Request
from llmsvc.core.scheduler import Scheduler
from llmsvc.core.swap_space import SwapSpace
from llmsvc.models.loader_names import kv_release_window
from llmsvc.outputs import ABORT, EngineStats
from llmsvc.wire import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)

_UNBOUNDED_LEN = 1 << 31
_FSM_POLL_S = 0.005  # an idle step waits this long at most for a grammar compile
_COST_MIN_TOKENS = 256  # steps this large feed seconds_per_token (smaller ones are mostly fixed cost)


class EngineCore:
    def __init__(self, config: EngineConfig, executor: Executor, structured_output_manager=None) -> None:
        self.config = config
        self.executor = executor
        # llmsvc.structured.StructuredOutputManager (None: no constraints served); fills the
        # grammar bitmask of each step
        self.structured_output_manager = structured_output_manager
        cache = config.cache_config
        num_blocks = executor.determine_num_kv_blocks()
        if cache.num_kv_blocks_override is not None:
            num_blocks = min(num_blocks, cache.num_kv_blocks_override)
        if num_blocks < 1:
            raise RuntimeError("no memory for KV cache blocks; raise kv_cache_memory")
        executor.initialize_kv_cache(num_blocks)
        logger.info("KV cache: %d blocks of %d tokens (%d tokens)", num_blocks, cache.block_size,
                    num_blocks * cache.block_size)
        self.kv_cache_manager = KVCacheManager(num_blocks, cache.block_size, cache.enable_prefix_caching,
                                               kv_release_window(config.model_config.hf_config))
        max_model_len = config.model_config.max_model_len or _UNBOUNDED_LEN
        self.async_scheduling = config.scheduler_config.async_scheduling
        spec = config.speculative_config
        if self.async_scheduling and spec is not None:
            raise ValueError("speculative decoding cannot run with async scheduling")
        if spec is not None:
            logger.info("speculative decoding: %s, up to %d draft tokens, lookup of %d-%d tokens%s", spec.method,
                        spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max,
                        "" if spec.disable_by_batch_size is None
                        else f", off above {spec.disable_by_batch_size} running requests")
        scheduler_cls = AsyncScheduler if self.async_scheduling else Scheduler
        self.scheduler = scheduler_cls(config.scheduler_config, cache, self.kv_cache_manager, max_model_len, spec)
        if cache.swap_space_bytes:
            self._init_swap_space(cache.swap_space_bytes)
        pool_len = self.scheduler.pool_max_len
        if config.model_config.max_model_len and pool_len is not None and pool_len < config.model_config.max_model_len:
            logger.warning("the KV cache holds %d tokens, fewer than max_model_len (%d): a request longer than "
                           "the cache is refused (PROMPT_TOO_LONG); raise the KV cache memory or lower "
                           "max_model_len", pool_len, config.model_config.max_model_len)
        self.num_steps = 0
        # model seconds per scheduled token of recent prefill-sized steps (None: none yet); what a
        # step of n prompt tokens will take, for the core loop's burst wait (proc.py)
        self.seconds_per_token: float | None = None
        # async scheduling: the step submitted and not yet updated from, with its output's future
        # and when it was submitted; when the last step's output came in
        self._in_flight = None
        self._last_result_at = 0.0

    def _init_swap_space(self, nbytes: int) -> None:
        """Every worker allocates the host blocks (raising, with the flag's name, when it cannot);
        the scheduler swaps into as many."""
        num_host = self.executor.initialize_swap_space(nbytes)
        mode = self.config.scheduler_config.preemption_mode
        self.scheduler.attach_swap_space(SwapSpace(num_host, self.config.cache_config.enable_prefix_caching), mode)
        logger.info("swap space: %d host blocks (%d tokens); preemption by %s%s", num_host,
                    num_host * self.config.cache_config.block_size,
                    "swap" if self.scheduler.swap_preemption else "recompute",
                    ", host tier of the prefix cache" if self.kv_cache_manager.enable_caching else "")

    @property
    def max_len(self) -> int:
        """Most tokens (prompt + output) one request can hold: context and KV pool permitting."""
        return self.scheduler.max_len

    def add_request(self, request: Request) -> None:
        """Queue a request. Raises PromptTooLongError (nothing queued then). The waiting-queue cap is
        the serving front end's (AsyncEngine): offline generate queues any number of prompts."""
        constraint = request.sampling_params.structured_outputs
        if constraint is not None and self.structured_output_manager is not None and request.structured is None:
            # one grammar state per child request (n > 1); the compile is shared through the cache
            request.structured = self.structured_output_manager.new_request(constraint)
        self.scheduler.add_request(request)

    def add_lora(self, lora_id: int, name: str, path: str) -> str | None:
        """Load an adapter into every worker's slot lora_id - 1. Returns None, or why not."""
        return self.executor.collective_rpc("add_lora", lora_id - 1, name, path)

    def remove_lora(self, lora_id: int) -> str | None:
        """Empty slot lora_id - 1 unless a request still runs with it (then returns why not)."""
        users = sum(r.lora_id == lora_id for r in self.scheduler.requests.values())
        if users:
            return f"{users} request(s) in flight use it"
        self.executor.collective_rpc("remove_lora", lora_id - 1)
        return None

    def take_kv_events(self, after_seq: int) -> KVEventPage:
        """The prefix cache's events numbered after `after_seq` (llmsvc.core.kv_events); the
        first call turns their recording on."""
        return self.kv_cache_manager.events.take(after_seq)

    def drain_kv_events(self) -> list[tuple]:
        """The events recorded since the last drain, for the output batch of a core process
        (none until take_kv_events turned recording on)."""
        return self.kv_cache_manager.events.drain()

    def abort_requests(self, request_ids, reason: str = ABORT) -> list[str]:
        """Finish these requests now (blocks freed, workers told next step); unknown ids ignored."""
        return [r.request_id for r in self.scheduler.finish_requests(request_ids, reason)]

    def step(self) -> tuple[list[EngineCoreOutput], bool]:
        """One step. Returns the per-request outputs and whether the model ran.

        Raises executors.base.ExecutorError when the executor fails."""
        if self.async_scheduling:
            return self._step_async()
        if not self.scheduler.has_unfinished_requests():
            return [], False
        so = self._schedule()
        executed = so.total_num_scheduled_tokens > 0
        t0 = time.perf_counter()
        runner_output = self.executor.execute_model(so) if executed else ModelRunnerOutput.make_empty()
        seconds = time.perf_counter() - t0
        self._note_cost(so, seconds)
        self.num_steps += executed
        outputs = self.scheduler.update_from_output(so, runner_output)
        if self.scheduler.speculator is not None and executed:
            self.scheduler.speculator.step_done(sum(len(o.new_token_ids) for o in outputs), seconds)
        return outputs, executed

    def _schedule(self, idle_wait: bool = True) -> SchedulerOutput:
        so = self.scheduler.schedule()
        executed = so.total_num_scheduled_tokens > 0
        if executed and self.structured_output_manager is not None:
            self._attach_grammar_bitmask(so)
        elif not executed and idle_wait and self.scheduler.waiting_for_fsm:
            # nothing runnable until a grammar compiles: sleep on the compiles, not a busy loop
            wait(self.scheduler.compiling_grammars(), timeout=_FSM_POLL_S, return_when=FIRST_COMPLETED)
        if executed:
            self.scheduler.after_schedule(so)
        return so

    def _step_async(self) -> tuple[list[EngineCoreOutput], bool]:
        batch, self._in_flight = self._in_flight, None
        if batch is None:
            if not self.scheduler.has_unfinished_requests():
                return [], False
            so = self._schedule()
            if so.total_num_scheduled_tokens == 0:
                return self.scheduler.update_from_output(so, ModelRunnerOutput.make_empty()), False
            batch = (so, self.executor.execute_model(so, non_block=True), time.perf_counter())
        so, future, submitted = batch
        if self._may_schedule_ahead(so):
            ahead = self._schedule(idle_wait=False)
            if ahead.total_num_scheduled_tokens > 0:  # else its finished ids stay for the next step
                self._in_flight = (ahead, self.executor.execute_model(ahead, non_block=True), time.perf_counter())
        runner_output = future.result()
        now = time.perf_counter()  # the model ran from its submission or the step before's end
        self._note_cost(so, now - max(submitted, self._last_result_at))
        self._last_result_at = now
        self.num_steps += 1
        return self.scheduler.update_from_output(so, runner_output), True

    def _note_cost(self, so: SchedulerOutput, seconds: float) -> None:
        """Fold a prefill-sized step's seconds per token into seconds_per_token (smaller steps'
        time is mostly fixed cost, and says little about a prompt's)."""
        if so.total_num_scheduled_tokens >= _COST_MIN_TOKENS:
            cost, prev = seconds / so.total_num_scheduled_tokens, self.seconds_per_token
            self.seconds_per_token = cost if prev is None else 0.5 * (prev + cost)

    def _may_schedule_ahead(self, so: SchedulerOutput) -> bool:
        """Whether step N+1 may be scheduled before step N's output is in. Not when N samples
        under a grammar (N+1's bitmask needs N's token), nor when N computes prompt positions of a
        request asking for prompt logprobs (their bookkeeping needs num_computed_tokens as of N)."""
        if not self.scheduler.has_unfinished_requests() or so.structured_output_req_ids:
            return False
        reqs = self.scheduler.requests
        for rid, n in so.num_scheduled_tokens.items():
            req = reqs.get(rid)
            if (req is not None and req.sampling_params.prompt_logprobs is not None
                    and req.num_computed_tokens - n < req.num_prompt_tokens):
                return False
        return True

    def _attach_grammar_bitmask(self, so) -> None:
        """Fill the bitmask rows of the constrained requests that sample in this step (a request
        samples iff this step computes up to its last token)."""
        reqs = self.scheduler.requests
        ids, states = [], []
        for rid, n in so.num_scheduled_tokens.items():
            req = reqs[rid]
            if req.structured is not None and req.num_computed_tokens + n == req.num_tokens:
                req.structured.sync(req.output_token_ids)
                ids.append(rid)
                states.append(req.structured)
        if ids:
            so.structured_output_req_ids = ids
            so.grammar_bitmask = self.structured_output_manager.fill_bitmask(states)

    def has_unfinished(self) -> bool:
        """Requests unfinished, or a step in flight whose output is still to be taken."""
        return self.scheduler.has_unfinished_requests() or self._in_flight is not None

    @property
    def stats(self) -> EngineStats:
        kv, s = self.kv_cache_manager, self.scheduler
        return EngineStats(
            num_running=s.num_running,
            num_waiting=s.num_waiting,
            num_kv_blocks=kv.num_blocks,
            num_free_kv_blocks=kv.num_free_blocks,
            kv_cache_usage=kv.usage(),
            prefix_cache_hit_rate=kv.hit_rate(),
            num_preemptions=s.num_preemptions,
            prompt_tokens_total=s.prompt_tokens_total,
            generation_tokens_total=s.generation_tokens_total,
            extra={"num_steps": self.num_steps, "prefix_cache_queries": kv.prefix_queries,
                   "prefix_cache_hits": kv.prefix_hits, **self._swap_stats()},
            spec_decode=None if s.speculator is None else s.speculator.stats(),
        )

    def _swap_stats(self) -> dict:
        swap = self.scheduler.swap
        if swap is None:
            return {}
        return {"preemption_mode": "swap" if self.scheduler.swap_preemption else "recompute",
                "num_swapped": self.scheduler.num_swapped, "num_swap_blocks": swap.num_blocks,
                "num_free_swap_blocks": swap.num_free_blocks, "swap_outs": swap.num_swap_outs,
                "swap_ins": swap.num_swap_ins, "blocks_swapped_out": swap.num_blocks_swapped_out,
                "blocks_swapped_in": swap.num_blocks_swapped_in, "host_tier_hits": swap.num_host_hits,
                "host_tier_stores": swap.num_host_stores}

    def shutdown(self) -> None:
        self.executor.shutdown()
        if self.structured_output_manager is not None:
            self.structured_output_manager.shutdown()
