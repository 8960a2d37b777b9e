"""Speculative decoding by prompt lookup, engine side: the proposer, the config, and the
scheduler against the fake worker (drafts verified, rolled back, capped by budget, max_tokens
and context; several tokens per step; the same tokens as decoding without drafts)."""
from __future__ import annotations

import pytest

from engine_fakes import FakeExecutor, make_config, next_token
from llmsvc.config import EngineConfig, SpeculativeConfig
from llmsvc.core.engine_core import EngineCore
from llmsvc.core.request import Request
from llmsvc.core.spec_decode import NgramProposer
from llmsvc.engine.stats import StatsLogger
from llmsvc.sampling_params import SamplingParams


def proposer(k=4, lo=1, hi=3) -> NgramProposer:
    return NgramProposer(SpeculativeConfig(num_speculative_tokens=k, prompt_lookup_min=lo, prompt_lookup_max=hi))


def test_proposer_takes_the_longest_suffix_and_its_latest_occurrence():
    # suffix [2, 3] occurs at 1 and at 6; [1, 2, 3] only at 0: the longest match wins
    assert proposer().propose([1, 2, 3, 9, 9, 7, 2, 3, 8, 5, 1, 2, 3]) == [9, 9, 7, 2]
    # with lookups of at most 2 tokens, the latest occurrence of [2, 3] wins
    assert proposer(hi=2).propose([1, 2, 3, 9, 9, 7, 2, 3, 8, 5, 1, 2, 3]) == [8, 5, 1, 2]
    assert proposer(k=2).propose([5, 6, 7, 8, 5, 6]) == [7, 8]
    assert proposer().propose([5, 6, 7, 8, 5, 6], max_drafts=1) == [7]
    assert proposer().propose([5, 6, 7, 8, 5, 6], max_drafts=0) == []


def test_proposer_needs_a_suffix_of_min_tokens_seen_before():
    assert proposer().propose([1, 2, 3, 4]) == []
    assert proposer(lo=2).propose([1, 2, 3, 9, 3]) == []  # only a 1-token suffix recurs
    assert proposer(lo=1).propose([1, 2, 3, 9, 3]) == [9, 3, 9, 3]
    assert proposer().propose([7]) == [] and proposer().propose([]) == []


def test_proposer_continues_a_loop_shorter_than_the_draft():
    assert proposer(k=5).propose([4, 1, 2, 1, 2]) == [1, 2, 1, 2, 1]
    assert proposer(k=3).propose([0, 0, 0]) == [0, 0, 0]


def test_proposer_matches_whole_tokens_only():
    # 256 then 0 packs as bytes 00 01 00 00 | 00 00 00 00: token 1's bytes (01 00 00 00) occur
    # inside them, one byte off a token boundary, which is no occurrence of token 1
    assert proposer().propose([256, 0, 7, 1]) == []
    assert proposer().propose([256, 0, 1, 7, 1]) == [7, 1, 7, 1]


def test_config_defaults_and_errors():
    c = SpeculativeConfig.from_dict('{"method": "ngram", "num_speculative_tokens": 3}')
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (5, 5)  # vLLM's defaults
    assert SpeculativeConfig(num_speculative_tokens=2, prompt_lookup_max=4).prompt_lookup_min == 4
    assert SpeculativeConfig(num_speculative_tokens=2, prompt_lookup_min=2).prompt_lookup_max == 2
    for bad, match in ((dict(num_speculative_tokens=0), "num_speculative_tokens"),
                       (dict(num_speculative_tokens=2, method="eagle"), "method"),
                       (dict(num_speculative_tokens=2, prompt_lookup_min=4, prompt_lookup_max=2), "prompt_lookup_min"),
                       (dict(num_speculative_tokens=2, disable_by_batch_size=0), "disable_by_batch_size"),
                       (dict(num_speculative_tokens=2, draft_model="x"), "unknown speculative config key")):
        with pytest.raises(ValueError, match=match):
            SpeculativeConfig.from_dict(bad)
    with pytest.raises(ValueError, match="not valid JSON"):
        SpeculativeConfig.from_dict("{num_speculative_tokens: 2}")
    with pytest.raises(ValueError, match="async scheduling"):
        EngineConfig.from_options(speculative_config={"num_speculative_tokens": 2}, async_scheduling=True)
    cfg = EngineConfig.from_options(speculative_config={"num_speculative_tokens": 2, "prompt_lookup_max": 3})
    assert cfg.speculative_config == SpeculativeConfig(num_speculative_tokens=2, prompt_lookup_max=3, prompt_lookup_min=3)


def looping(tokens: list[int]) -> int:
    """A 'model' that repeats what it said 4 tokens ago (drafts from lookup are right), but for
    every 7th position (wrong there)."""
    return tokens[-4] if len(tokens) % 7 else next_token(tokens)


def run(spec: SpeculativeConfig | None, requests, token_fn=looping, **cfg_kw):
    cfg = make_config(**cfg_kw)
    cfg.speculative_config = spec
    ex = FakeExecutor(cfg, num_blocks=cfg.cache_config.num_kv_blocks_override, token_fn=token_fn)
    core = EngineCore(cfg, ex)
    for rid, prompt, params in requests:
        core.add_request(Request(rid, prompt, params, eos_token_ids=[999]))
    outs: dict[str, list[int]] = {rid: [] for rid, _, _ in requests}
    finish: dict[str, str] = {}
    for _ in range(500):
        if not core.has_unfinished():
            break
        for o in core.step()[0]:
            outs[o.req_id] += o.new_token_ids
            if o.finished:
                finish[o.req_id] = o.finish_reason
    core.kv_cache_manager.check_invariants()
    assert core.kv_cache_manager.num_free_blocks == core.kv_cache_manager.num_blocks
    return outs, finish, core, ex


REQUESTS = [("a", [5, 6, 7, 8, 5, 6, 7, 8, 5], SamplingParams(max_tokens=30)),
            ("b", [11, 12, 13, 14, 15, 16], SamplingParams(max_tokens=23)),
            ("c", list(range(40, 60)) + [40, 41], SamplingParams(max_tokens=1)),
            ("d", [3, 4, 3, 4, 3], SamplingParams(max_tokens=17, stop_token_ids=[4], min_tokens=5))]
# adaptive off: these tests count steps, and the governor's choices follow the wall clock
SPEC = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=2, adaptive=False)


@pytest.mark.parametrize("cfg", [dict(), dict(max_num_batched_tokens=6), dict(num_blocks=12),
                                 dict(chunked=False, max_num_batched_tokens=48)],
                         ids=["roomy", "tight-budget", "preempting", "unchunked"])
def test_drafts_give_the_tokens_of_decoding_one_at_a_time(cfg):
    base, base_finish, base_core, _ = run(None, REQUESTS, **cfg)
    got, finish, core, ex = run(SPEC, REQUESTS, **cfg)
    assert got == base and finish == base_finish
    assert [len(got[r]) for r in "abc"] == [30, 23, 1] and finish["d"] == "stop"
    spec = core.stats.spec_decode
    assert spec.num_accepted_tokens == ex.num_accepted > 0 and spec.num_draft_tokens > spec.num_accepted_tokens
    assert spec.accepted_per_pos[0] >= spec.accepted_per_pos[1] >= spec.accepted_per_pos[2] > 0
    assert core.num_steps < base_core.num_steps
    budget = core.config.scheduler_config.max_num_batched_tokens
    assert all(s.total <= budget for s in ex.steps)
    if "num_blocks" in cfg:
        assert core.scheduler.num_preemptions > 0


def test_no_drafts_past_max_tokens_or_the_context():
    # every draft is right: the request may still not run past max_tokens or max_model_len
    reqs = [("m", [1, 2, 3, 4] * 3, SamplingParams(max_tokens=9)), ("ctx", [1, 2, 3, 4] * 3, SamplingParams())]
    got, finish, core, ex = run(SPEC, reqs, max_model_len=21)
    assert len(got["m"]) == 9 and finish["m"] == "length"
    assert len(got["ctx"]) == 21 - 12 and finish["ctx"] in ("length", "context")
    assert core.stats.spec_decode.num_accepted_tokens > 0  # (the fake fails a position past the context)


def test_a_stop_token_inside_accepted_drafts_ends_the_request_there():
    period4 = lambda tokens: tokens[-4]  # noqa: E731
    reqs = [("s", [5, 6, 7, 8, 5], SamplingParams(max_tokens=40, stop_token_ids=[8]))]
    base, _, _, _ = run(None, reqs, token_fn=period4)
    got, finish, _, ex = run(SPEC, reqs, token_fn=period4)
    # the second step verifies drafts [7, 8, 5]: all right, and the request ends at the 8
    assert got == base == {"s": [6, 7, 8]} and finish["s"] == "stop"
    assert ex.num_accepted == 3 and len(ex.steps) == 2


def test_disable_by_batch_size_turns_drafting_off_for_large_batches():
    spec = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=2,
                             disable_by_batch_size=2, adaptive=False)
    _, _, core, ex = run(spec, REQUESTS[:2])
    assert core.stats.spec_decode.num_drafts > 0
    _, _, core, ex = run(spec, [(f"{r}{i}", p, sp) for i in range(2) for r, p, sp in REQUESTS[:2]])
    spec_steps = [s for s in ex.steps if len(s.num_scheduled) > 2 and max(s.num_scheduled.values()) > 1
                  and not s.new_req_ids]
    assert not spec_steps  # with 4 running, every decode step is one token each


def test_stats_line_reports_acceptance():
    _, _, core, _ = run(SPEC, REQUESTS)
    log = StatsLogger(1.0, log=type("L", (), {"info": staticmethod(lambda *a: None)})())
    empty = core.stats
    empty.spec_decode = type(empty.spec_decode)()
    log.maybe_log(empty, now=0.0)
    line = log.maybe_log(core.stats, now=2.0)
    s = core.stats.spec_decode
    assert f"Draft acceptance rate: {100 * s.num_accepted_tokens / s.num_draft_tokens:.1f}%" in line
    assert f"Mean acceptance length: {1 + s.num_accepted_tokens / s.num_drafts:.2f}" in line
