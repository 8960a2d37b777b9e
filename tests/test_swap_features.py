"""Swap-preemption combined with the features whose resume must be exact, through the engine core
over the FakeExecutor (tests/test_feature_combinations.py's requests: structured output of every
kind beside free requests with stop tokens, min_tokens and max_tokens=1): under pool pressure, by
FCFS and by priority, with async scheduling and with speculative decoding, every request's tokens
and finish reason equal those of a roomy pool that never preempts, constraints hold, requests were
swapped, and both pools are whole at the end."""
from __future__ import annotations

import pytest

from engine_fakes import FakeExecutor, make_config
from llmsvc.core.engine_core import EngineCore
from llmsvc.structured.manager import StructuredOutputManager
from tests.server_harness import EOS, TINY_VOCAB
from tests.test_feature_combinations import SPEC, TOK, check_constrained, looping_letters, requests, run


def run_swapping(num_blocks=28, num_host_blocks=96, spec=None, async_scheduling=False, **cfg_kw):
    config = make_config(num_blocks=num_blocks, block_size=4, max_num_seqs=8, **cfg_kw)
    config.model_config.vocab_size = TINY_VOCAB
    config.model_config.eos_token_ids = [EOS]
    config.speculative_config = spec
    config.scheduler_config.async_scheduling = async_scheduling
    config.cache_config.swap_space_bytes = 1
    config.scheduler_config.preemption_mode = "swap"
    ex = FakeExecutor(config, num_blocks=num_blocks, token_fn=looping_letters, num_host_blocks=num_host_blocks)
    manager = StructuredOutputManager(TOK, TINY_VOCAB, [EOS])
    core = EngineCore(config, ex, manager)
    reqs = requests()
    got = {}
    try:
        for r in reqs:
            if r.sampling_params.structured_outputs is not None:
                manager.wait(r.sampling_params.structured_outputs)
            core.add_request(r)
        for _ in range(3000):
            if not core.has_unfinished():
                break
            for o in core.step()[0]:
                tokens, _ = got.get(o.req_id, ([], None))
                got[o.req_id] = (tokens + o.new_token_ids, o.finish_reason)
            core.scheduler.swap.check_invariants()
        assert not core.has_unfinished()
        kv, swap = core.kv_cache_manager, core.scheduler.swap
        kv.check_invariants()
        assert kv.num_free_blocks == kv.num_blocks and swap.num_free_blocks == swap.num_blocks, "leaked blocks"
    finally:
        core.shutdown()
    return got, core


@pytest.fixture(scope="module")
def roomy():
    got, _, _ = run(requests())
    return got


CASES = {
    "fcfs": dict(),
    "priority": dict(policy="priority"),
    "async": dict(async_scheduling=True),
    "async-priority": dict(async_scheduling=True, policy="priority"),
    "spec-decode": dict(spec=SPEC),
    "tight-budget": dict(max_num_batched_tokens=6),
}


@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_swapped_requests_resume_exactly_beside_grammars(roomy, case):
    got, core = run_swapping(**case)
    assert got == roomy
    check_constrained(got)
    assert core.scheduler.swap.num_swap_outs > 0, "the pool was meant to force swap-preemption"
