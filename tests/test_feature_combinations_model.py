"""Features combined on a tiny random Llama through the offline LLM API: LoRA adapters with
speculative decoding (greedy tokens equal Hugging Face's on the merged weights, drafts accepted),
in a pool small enough to preempt; structured output with drafts for the free requests and
adapters on both kinds; async scheduling with adapters, grammars and preemption; and everything
at once under the priority policy. Each gives the greedy tokens of the run without the extra
feature. tests/test_feature_combinations.py has the engine-level combinations (no model)."""
from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest
import torch

from llmsvc import LLM, SamplingParams, StructuredOutputsParams as SO
from tests.lora_utils import make_lora_adapter, merged_hf_model
from tests.model_utils import load_hf_model
from tests.sample_compare import assert_same_samples, sample_rows
from tests.server_harness import EOS, make_tiny_served_model_dir

ENGINE = dict(block_size=4, num_kv_blocks_override=64, max_num_batched_tokens=64, max_num_seqs=8)
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
MAX_NEW = 24
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
ADAPTERS = (None, "all", "some")
SCHEMA = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                           "tag": {"enum": ["red", "green", "blue"]}},
          "required": ["id", "tag"], "additionalProperties": False}
REGEX = r"[a-f]{2,5}-[0-9]{2}"
CONSTRAINTS = [(SO(json=SCHEMA), lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
               (SO(regex=REGEX), lambda t: re.fullmatch(REGEX, t)),
               (SO(choice=["north", "south", "east"]), lambda t: t in ("north", "south", "east"))]


def _prompts() -> list[list[int]]:
    """Prompts that repeat themselves (lookup finds drafts), and one that does not."""
    rng = random.Random(5)
    pat = [rng.randrange(3, EOS) for _ in range(6)]
    return [pat * 4, pat * 2 + pat[:3], [rng.randrange(3, EOS) for _ in range(15)]]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(model dir, {adapter: dir}, {None or adapter: HF greedy tokens per prompt, merged weights})."""
    root = tmp_path_factory.mktemp("combo")
    model_dir = make_tiny_served_model_dir(root)
    adapters = {"all": make_lora_adapter(model_dir, str(root / "all"), rank=4, alpha=8.0, seed=1),
                "some": make_lora_adapter(model_dir, str(root / "some"), rank=8, alpha=4.0, seed=2,
                                          targets=("q_proj", "v_proj", "down_proj"), use_rslora=True)}
    refs = {}
    with torch.no_grad():
        for name in ADAPTERS:
            hf = load_hf_model(model_dir) if name is None else merged_hf_model(model_dir, adapters[name])
            refs[name] = [hf.generate(torch.tensor([p]), max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW,
                                      do_sample=False)[0, len(p):].tolist() for p in _prompts()]
    return model_dir, adapters, refs


def generate(served, prompts, params, loras, priority=None, detail=False, **engine):
    """[(token ids, finish reason, text) per prompt], engine stats; every KV block free after."""
    model_dir, adapters, _ = served
    llm = LLM(model=model_dir, lora_modules=adapters, max_lora_rank=8, **{**ENGINE, **engine})
    try:
        outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras, priority=priority)
        stats = llm.llm_engine.get_stats()
        assert stats.num_free_kv_blocks == stats.num_kv_blocks, "leaked KV blocks"
        assert not llm.llm_engine.has_unfinished_requests()
    finally:
        llm.shutdown()
    if detail:  # every sample of each prompt, with its logprobs (compare with assert_same_samples)
        return sample_rows(outs), stats
    return [(list(o.outputs[0].token_ids), o.outputs[0].finish_reason, o.outputs[0].text) for o in outs], stats


def _lora_mix():
    """Every prompt under each adapter and the base model, in one call."""
    return [(p, name) for name in ADAPTERS for p in range(len(_prompts()))]


@pytest.mark.parametrize("num_blocks", [64, 20], ids=["roomy", "preempting"])
def test_spec_decode_with_lora_adapters_gives_hf_greedy_tokens(served, num_blocks):
    """Draft positions run through the adapter of their request: greedy tokens equal HF's on each
    adapter's merged weights, drafts are accepted, and with 20 blocks requests are preempted and
    recomputed under their adapter."""
    _, _, refs = served
    mix = _lora_mix()
    got, stats = generate(served, [_prompts()[p] for p, _ in mix], GREEDY, [n for _, n in mix],
                          speculative_config=SPEC, num_kv_blocks_override=num_blocks)
    assert [t for t, _, _ in got] == [refs[n][p] for p, n in mix]
    assert stats.spec_decode.num_accepted_tokens > 0
    if num_blocks == 20:
        assert stats.num_preemptions > 0


def test_seeded_sampling_with_adapters_gives_the_same_samples_with_drafts_and_async_scheduling(served):
    """Seeded sampling (n=2, top-p, penalties, logprobs) under every adapter: drafts, and async
    scheduling, each in a pool that preempts, give the samples and logprobs of the plain run."""
    mix = _lora_mix()
    params = [SamplingParams(n=2, max_tokens=MAX_NEW, temperature=0.8, top_p=0.9, seed=i, presence_penalty=0.3,
                             logprobs=2, ignore_eos=True) for i in range(len(mix))]
    args = ([_prompts()[p] for p, _ in mix], params, [n for _, n in mix])
    base, _ = generate(served, *args, detail=True)
    spec, spec_stats = generate(served, *args, detail=True, speculative_config=SPEC, num_kv_blocks_override=20)
    asyn, async_stats = generate(served, *args, detail=True, async_scheduling=True, num_kv_blocks_override=20)
    assert_same_samples(spec, base)
    assert_same_samples(asyn, base)
    assert spec_stats.num_preemptions > 0 and async_stats.num_preemptions > 0
    assert spec_stats.spec_decode.num_draft_tokens > 0


def _structured_mix():
    """Each constraint under each adapter and the base model, beside free greedy requests."""
    prompts, params, loras, checks = [], [], [], []
    for j, name in enumerate(ADAPTERS):
        for k, (so, check) in enumerate(CONSTRAINTS):
            prompts.append(_prompts()[(j + k) % 3])
            params.append(SamplingParams(max_tokens=40, temperature=0.0, structured_outputs=so))
            loras.append(name)
            checks.append(check)
        prompts.append(_prompts()[j])
        params.append(GREEDY)
        loras.append(name)
        checks.append(None)
    return prompts, params, loras, checks


def _check_constraints(got, checks) -> None:
    for (tokens, finish, text), check in zip(got, checks):
        if check is not None:
            assert finish == "stop" and check(text), (text, finish)
        else:
            assert len(tokens) == MAX_NEW and finish == "length"


def test_spec_decode_with_structured_output_and_adapters_gives_the_tokens_of_no_drafts(served):
    """Constrained requests (JSON schema, regex, choice) under every adapter beside free ones: with
    drafts on, the free requests draft and the constrained ones do not, and every output equals
    the run without drafts, constraints met."""
    prompts, params, loras, checks = _structured_mix()
    base, _ = generate(served, prompts, params, loras)
    got, stats = generate(served, prompts, params, loras, speculative_config=SPEC)
    assert got == base
    _check_constraints(got, checks)
    assert stats.spec_decode.num_accepted_tokens > 0


@pytest.mark.parametrize("num_blocks", [64, 24], ids=["roomy", "preempting"])
def test_async_scheduling_with_adapters_grammars_and_preemption_gives_the_sync_tokens(served, num_blocks):
    """Async scheduling overlaps the steps that sample no grammar; adapters on constrained and
    free requests, and with 24 blocks preemption: the tokens of synchronous scheduling."""
    prompts, params, loras, checks = _structured_mix()
    base, _ = generate(served, prompts, params, loras, num_kv_blocks_override=num_blocks)
    got, stats = generate(served, prompts, params, loras, num_kv_blocks_override=num_blocks, async_scheduling=True)
    assert got == base
    _check_constraints(got, checks)
    if num_blocks == 24:
        assert stats.num_preemptions > 0


def test_everything_at_once_under_the_priority_policy(served):
    """Drafts, adapters, grammars, a pool that preempts, a 6-token step budget (chunked prefills
    beside decodes) and the priority policy together: the greedy tokens of a roomy, first-come
    run without drafts, and HF's for the free requests."""
    _, _, refs = served
    prompts, params, loras, checks = _structured_mix()
    priority = [i % 3 for i in range(len(prompts))]
    base, _ = generate(served, prompts, params, loras)
    got, stats = generate(served, prompts, params, loras, priority=priority, speculative_config=SPEC,
                          num_kv_blocks_override=24, max_num_batched_tokens=6, policy="priority")
    assert got == base
    _check_constraints(got, checks)
    free = [(t, name, p) for (t, _, _), c, name, p in zip(got, checks, loras, prompts) if c is None]
    assert [t for t, _, _ in free] == [refs[name][_prompts().index(p)] for _, name, p in free]
    assert stats.num_preemptions > 0 and stats.spec_decode.num_accepted_tokens > 0


def test_prefix_cache_hits_per_adapter_with_drafts(served):
    """The same mix again in one engine with drafts on: each prompt's full blocks come from the
    cache of its own adapter (the K/V of an adapted model differ), and the tokens stay HF's."""
    model_dir, adapters, refs = served
    mix = _lora_mix()
    # a pool that holds every block of both rounds: nothing is evicted
    llm = LLM(model=model_dir, lora_modules=adapters, max_lora_rank=8, speculative_config=SPEC,
              **{**ENGINE, "num_kv_blocks_override": 256})
    try:
        for rnd in range(2):
            outs = llm.generate([_prompts()[p] for p, _ in mix], GREEDY, use_tqdm=False, lora_request=[n for _, n in mix])
            assert [list(o.outputs[0].token_ids) for o in outs] == [refs[n][p] for p, n in mix]
            cached = [o.num_cached_tokens for o in outs]
            if rnd == 0:  # prompt 1 starts with prompt 0's first 12 tokens: a hit under the same adapter only
                assert cached == [12 if p == 1 else 0 for p, _ in mix] or cached == [0] * len(mix)
            else:
                assert cached == [(len(_prompts()[p]) - 1) // 4 * 4 for p, _ in mix]
        assert llm.llm_engine.get_stats().spec_decode.num_accepted_tokens > 0
    finally:
        llm.shutdown()


def test_everything_at_once_on_tensor_parallel_workers(served):
    """Drafts, adapters (sharded per rank), grammars (the bitmask crosses to the worker
    processes), a pool that preempts and the priority policy on TP=2: the single-process tokens."""
    prompts, params, loras, checks = _structured_mix()
    priority = [i % 3 for i in range(len(prompts))]
    base, _ = generate(served, prompts, params, loras)
    got, stats = generate(served, prompts, params, loras, priority=priority, speculative_config=SPEC,
                          num_kv_blocks_override=24, policy="priority", executor="tp", tensor_parallel_size=2)
    assert got == base
    _check_constraints(got, checks)
    assert stats.num_preemptions > 0 and stats.spec_decode.num_accepted_tokens > 0
