"""Hypothesis state machine over add / abort / step / finish: no leaked or double-freed block,
reference counts consistent, and the worker-side diff always applies (FakeExecutor checks)."""
from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from engine_fakes import FakeExecutor, make_config, next_token
from llmsvc.config import SpeculativeConfig
from llmsvc.core.engine_core import EngineCore
from llmsvc.core.errors import PromptTooLongError
from llmsvc.core.request import Request, RequestStatus
from llmsvc.sampling_params import SamplingParams

# prompts drawn from a few shared prefixes so the prefix cache is exercised
PREFIXES = [list(range(10, 18)), list(range(10, 14)) + [99, 98, 97, 96], []]


def loopy_token(tokens: list[int]) -> int:
    """A 'model' that mostly repeats what it said 3 tokens ago, so prompt-lookup drafts are often
    right and sometimes wrong."""
    return tokens[-3] if len(tokens) % 5 and len(tokens) >= 3 else next_token(tokens)


class EngineMachine(RuleBasedStateMachine):
    async_scheduling = False
    speculative_config = None
    token_fn = staticmethod(next_token)
    @initialize(num_blocks=st.integers(4, 24), block_size=st.sampled_from([2, 4]),
                budget=st.integers(1, 40), max_seqs=st.integers(1, 6),
                policy=st.sampled_from(["fcfs", "priority"]), caching=st.booleans(),
                chunked=st.booleans())
    def setup(self, num_blocks, block_size, budget, max_seqs, policy, caching, chunked):
        cfg = make_config(num_blocks=num_blocks, block_size=block_size, max_num_batched_tokens=budget,
                          max_num_seqs=max_seqs, policy=policy, enable_prefix_caching=caching,
                          chunked=chunked, max_model_len=64)
        cfg.scheduler_config.async_scheduling = self.async_scheduling
        cfg.speculative_config = self.speculative_config
        self.ex = FakeExecutor(cfg, num_blocks=num_blocks, token_fn=self.token_fn)
        self.core = EngineCore(cfg, self.ex)
        self.kv = self.core.kv_cache_manager
        self.next_id = 0
        self.live: set[str] = set()
        self.room: dict[str, int] = {}  # output tokens each live request may still get

    @rule(prefix=st.sampled_from(PREFIXES), tail=st.lists(st.integers(0, 999), max_size=12),
          max_tokens=st.integers(1, 20), priority=st.integers(-2, 2), eos=st.booleans())
    def add(self, prefix, tail, max_tokens, priority, eos):
        prompt = prefix + tail
        if not prompt:
            return
        rid = f"r{self.next_id}"
        self.next_id += 1
        r = Request(rid, prompt, SamplingParams(max_tokens=max_tokens), priority=priority,
                    eos_token_ids=[7] if eos else [])
        try:
            self.core.add_request(r)
        except PromptTooLongError:
            assert len(prompt) >= self.core.max_len
            return
        self.live.add(rid)
        self.room[rid] = max_tokens

    @precondition(lambda self: self.live)
    @rule(data=st.data(), reason=st.sampled_from(["abort", "stop"]))
    def finish(self, data, reason):
        rid = data.draw(st.sampled_from(sorted(self.live)))
        assert self.core.abort_requests([rid, "unknown"], reason) == [rid]
        self.live.discard(rid)
        assert self.core.abort_requests([rid], reason) == []  # twice: no double free

    @rule(n=st.integers(1, 4))
    def step(self, n):
        for _ in range(n):
            outs, _ = self.core.step()
            for o in outs:
                assert o.req_id in self.live
                self.room[o.req_id] -= len(o.new_token_ids)
                assert self.room[o.req_id] >= 0, f"{o.req_id}: more tokens than max_tokens"
                if o.finished:
                    self.live.discard(o.req_id)

    @invariant()
    def blocks_consistent(self):
        if not hasattr(self, "core"):
            return
        self.kv.check_invariants()
        s = self.core.scheduler
        assert set(s.requests) == self.live
        running = {r.request_id for r in s.running}
        waiting = {r.request_id for r in s.waiting}
        assert not running & waiting and running | waiting == self.live
        assert len(running) <= s.config.max_num_seqs
        for r in s.running:
            assert r.status == RequestStatus.RUNNING
            assert len(self.kv.get_block_ids(r.request_id)) * self.kv.block_size >= r.num_computed_tokens
        for r in s.waiting:
            assert not self.kv.get_block_ids(r.request_id)
        held = {b for blocks in self.kv.req_to_blocks.values() for b in blocks}
        assert self.kv.num_free_blocks + len(held) == self.kv.num_blocks

    def teardown(self):
        if not hasattr(self, "core"):
            return
        for _ in range(2000):
            if not self.core.has_unfinished():
                break
            self.core.step()
        assert not self.core.has_unfinished(), "requests never finish"
        self.kv.check_invariants()
        assert self.kv.num_free_blocks == self.kv.num_blocks


EngineMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=30, deadline=None)
TestEngineMachine = EngineMachine.TestCase


class AsyncEngineMachine(EngineMachine):
    """The same, with async scheduling: placeholders in flight, work scheduled for requests that
    finish or are aborted or preempted meanwhile."""

    async_scheduling = True


AsyncEngineMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=30, deadline=None)
TestAsyncEngineMachine = AsyncEngineMachine.TestCase


class SpecEngineMachine(EngineMachine):
    """The same, with prompt-lookup drafts verified in the steps: lookahead slots, rolled-back
    num_computed_tokens, several tokens per step, max_tokens and stop tokens inside a draft."""

    # adaptive off: the governor's choices follow the wall clock, and hypothesis replays examples
    speculative_config = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=3, prompt_lookup_min=1,
                                           adaptive=False)
    token_fn = staticmethod(loopy_token)


SpecEngineMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=30, deadline=None)
TestSpecEngineMachine = SpecEngineMachine.TestCase


def test_priority_preempts_a_running_request_passed_over_this_step():
    """Found by the machine above: under async scheduling r1's last token is in flight, so the
    step passes r1 over; the higher-ranked r2 then needs its blocks, and taking r1 "back out of
    the step" failed, as it had never been scheduled in it."""
    m = AsyncEngineMachine()
    m.setup(num_blocks=11, block_size=4, budget=2, max_seqs=2, policy="priority", caching=False, chunked=True)
    prefix = [10, 11, 12, 13, 14, 15, 16, 17]
    m.add(eos=False, max_tokens=1, prefix=prefix, priority=0, tail=[])
    m.add(eos=False, max_tokens=14, prefix=prefix, priority=0, tail=[0] * 8)
    for _ in range(10):
        m.step(n=1)
        m.blocks_consistent()
    m.step(n=2)
    m.add(eos=False, max_tokens=2, prefix=prefix, priority=-1, tail=[0] * 4)
    m.blocks_consistent()
    m.teardown()
