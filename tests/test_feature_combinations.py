"""Features combined the way users combine them, through the engine core and its scheduler over the
FakeExecutor (no model; tests/engine_fakes.py): speculative decoding beside structured output,
under recompute preemption by pool pressure and by priority, a tight step budget and unchunked
prefill; async scheduling beside structured output under priority preemption. Each run gives the
tokens and finish reasons of the run without the extra feature, and every block comes back.
tests/test_feature_combinations_model.py adds LoRA on a real tiny model."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest

from engine_fakes import FakeExecutor, make_config
from llmsvc.config import SpeculativeConfig
from llmsvc.core.engine_core import EngineCore
from llmsvc.core.request import Request
from llmsvc.core.scheduler import Scheduler
from llmsvc.sampling_params import SamplingParams, StructuredOutputsParams as SO
from llmsvc.structured.manager import StructuredOutputManager
from tests.server_harness import EOS, TINY_VOCAB, letters, tiny_tokenizer

TOK = tiny_tokenizer()
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "n"], "additionalProperties": False}
REGEX = r"[a-c]{2}-[0-9]{3}"
SPEC = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3, adaptive=False)


def looping_letters(tokens: list[int]) -> int:
    """A 'model' of lowercase letters that repeats what it said 3 tokens ago (lookup drafts are
    right there), but for every 5th position (a letter from the hash: drafts are wrong there)."""
    return tokens[-3] if len(tokens) % 5 and len(tokens) >= 3 and 97 <= tokens[-3] <= 122 else letters(tokens)


def requests() -> list[Request]:
    """Constrained requests of every kind beside free ones (with stop tokens, min_tokens and a
    max_tokens of 1); priorities and arrivals spread so that the priority policy preempts."""
    out = []
    kinds = [SO(json=SCHEMA), SO(regex=REGEX), SO(choice=["alpha", "beta", "gamma"]),
             SO(grammar='root ::= "x" [a-z] [a-z]? "."'), None, None, None, None]
    for i, so in enumerate(kinds * 2):
        prompt = TOK.encode(f"abc abc {i} " * (1 + i % 3))
        if so is not None:
            params = SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=so)
        else:
            kw = {"stop_token_ids": [ord("q")]} if i % 4 == 1 else {"min_tokens": 4} if i % 4 == 2 else {}
            params = SamplingParams(temperature=0.0, max_tokens=1 if i == 7 else 30, **kw)
        out.append(Request(f"r{i}", prompt, params, eos_token_ids=[EOS], priority=i % 3, arrival_time=float(i)))
    return out


def run(requests: list[Request], spec: SpeculativeConfig | None = None, async_scheduling: bool = False,
        num_blocks: int = 256, later: dict[int, list[Request]] | None = None, **cfg_kw):
    """Run every request to its end through an EngineCore with a grammar manager (those of
    later[k] added before step k); returns ({id: (tokens, finish reason)}, core, executor)."""
    config = make_config(num_blocks=num_blocks, block_size=4, max_num_seqs=8, **cfg_kw)
    config.model_config.vocab_size = TINY_VOCAB
    config.model_config.eos_token_ids = [EOS]
    config.speculative_config = spec
    config.scheduler_config.async_scheduling = async_scheduling
    ex = FakeExecutor(config, num_blocks=num_blocks, token_fn=looping_letters)
    manager = StructuredOutputManager(TOK, TINY_VOCAB, [EOS])
    core = EngineCore(config, ex, manager)
    got: dict[str, tuple[list[int], str | None]] = {}
    try:
        # every grammar compiled before its request comes (as offline generate does): no request
        # waits for a compile, so the steps do not depend on the compile threads' timing
        for r in requests + [r for rs in (later or {}).values() for r in rs]:
            if r.sampling_params.structured_outputs is not None:
                manager.wait(r.sampling_params.structured_outputs)
        for r in requests:
            core.add_request(r)
        for k in range(3000):
            for r in (later or {}).get(k, []):
                core.add_request(r)
            if not core.has_unfinished() and k > max(later or [0]):
                break
            for o in core.step()[0]:
                tokens, _ = got.get(o.req_id, ([], None))
                got[o.req_id] = (tokens + o.new_token_ids, o.finish_reason)
        assert not core.has_unfinished()
        core.kv_cache_manager.check_invariants()
        assert core.kv_cache_manager.num_free_blocks == core.kv_cache_manager.num_blocks, "leaked blocks"
    finally:
        core.shutdown()
    return got, core, ex


def check_constrained(got: dict) -> None:
    """Every constrained request ended "stop" with its constraint met."""
    texts = {rid: TOK.decode(tokens) for rid, (tokens, _) in got.items()}
    for i in range(0, 16, 8):
        assert all(got[f"r{i + j}"][1] == "stop" for j in range(4)), got
        jsonschema.validate(json.loads(texts[f"r{i}"]), SCHEMA)
        assert re.fullmatch(REGEX, texts[f"r{i + 1}"])
        assert texts[f"r{i + 2}"] in ("alpha", "beta", "gamma")
        assert re.fullmatch(r"x[a-z]{1,2}\.", texts[f"r{i + 3}"])


CONFIGS = {
    "roomy": dict(),
    "tight-budget": dict(max_num_batched_tokens=6),
    "preempting": dict(num_blocks=28),
    "priority-preempting": dict(num_blocks=28, policy="priority"),
    "unchunked": dict(chunked=False, max_num_batched_tokens=128),
}


@pytest.mark.parametrize("cfg", list(CONFIGS.values()), ids=list(CONFIGS))
def test_spec_decode_beside_structured_output_gives_the_tokens_of_no_drafts(cfg):
    """Drafts for the free requests, none for the constrained ones: every request's tokens and
    finish reason equal those of decoding one token at a time, constraints met, drafts accepted."""
    base, _, base_ex = run(requests(), **cfg)
    got, core, ex = run(requests(), spec=SPEC, **cfg)
    assert got == base
    check_constrained(got)
    assert core.stats.spec_decode.num_accepted_tokens == ex.num_accepted > 0
    if not cfg:  # (with a 6-token budget, rejected drafts take budget that prefill chunks had)
        assert len(ex.steps) < len(base_ex.steps)
    if "num_blocks" in cfg:
        assert core.scheduler.num_preemptions > 0


def test_drafts_of_a_request_taken_back_out_of_its_step_by_priority_preemption():
    """Under the priority policy, a request scheduled earlier in the step with its drafts is taken
    back out of it (drafts and all) when a higher-ranked request after it needs its blocks: a
    low-priority request running first, a high-priority one admitted beside it later, a pool too
    small for both to finish. The tokens of decoding without drafts."""
    def reqs():
        low = Request("low", TOK.encode("xyz" * 3), SamplingParams(temperature=0.0, max_tokens=24), priority=5)
        high = Request("high", TOK.encode("uvw" * 3), SamplingParams(temperature=0.0, max_tokens=24), priority=0)
        return [low], {2: [high]}

    first, later = reqs()
    base, _, _ = run(first, later=later, num_blocks=11, policy="priority")
    first, later = reqs()
    taken_back = []  # whether each request taken back out of its step had drafts in it
    orig = Scheduler._unschedule

    def spy(req, *step):  # step: the step's maps under construction, its drafts among them
        taken_back.append(any(isinstance(m, dict) and isinstance(m.get(req.request_id), list) for m in step))
        return orig(req, *step)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Scheduler, "_unschedule", staticmethod(spy))
        got, core, ex = run(first, spec=SPEC, later=later, num_blocks=11, policy="priority")
    assert got == base and all(len(t) == 24 and f == "length" for t, f in got.values())
    assert True in taken_back and ex.num_accepted > 0


@pytest.mark.parametrize("num_blocks", [256, 28])
def test_async_scheduling_beside_structured_output_under_priority(num_blocks):
    """Async scheduling (steps under a grammar are not overlapped) with constrained and free
    requests, the priority policy and, with 28 blocks, preemption: the synchronous outputs."""
    base, _, _ = run(requests(), num_blocks=num_blocks, policy="priority")
    got, core, ex = run(requests(), async_scheduling=True, num_blocks=num_blocks, policy="priority")
    assert got == base
    check_constrained(got)
    assert ex.num_placeholders > 0
    if num_blocks == 28:
        assert core.scheduler.num_preemptions > 0
