"""Structured output on the real default model (SmolLM2-135M-Instruct), sampled at temperature 1
over several seeds: every output parses and validates against its JSON Schema, fully matches its
regex / grammar, or is one of its choices, and ends "stop". Unconstrained greedy requests batched
with constrained ones give the same tokens as alone."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest

from llmsvc import LLM, SamplingParams, StructuredOutputsParams as SO

pytestmark = pytest.mark.e2e

SEEDS = range(4)
TOOL_CALL = {
    "type": "object",
    "properties": {
        "name": {"enum": ["get_weather", "get_time"]},
        "arguments": {"type": "object",
                      "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 10},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 14}},
                      "required": ["city", "days"], "additionalProperties": False},
    },
    "required": ["name", "arguments"], "additionalProperties": False,
}
CASES = {
    "json": (SO(json=TOOL_CALL), lambda t: jsonschema.validate(json.loads(t), TOOL_CALL) is None),
    "regex": (SO(regex=r"[A-Z][a-z]{2,6} [0-9]{1,3}"), lambda t: re.fullmatch(r"[A-Z][a-z]{2,6} [0-9]{1,3}", t)),
    "choice": (SO(choice=["sunny", "rainy", "cloudy"]), lambda t: t in ("sunny", "rainy", "cloudy")),
    "grammar": (SO(grammar='root ::= "It is " ("hot" | "cold" | "mild") "."'),
                lambda t: re.fullmatch(r"It is (hot|cold|mild)\.", t)),
    "json_object": (SO(json={"type": "object", "properties": {"ok": {"type": "boolean"}},
                             "required": ["ok"], "additionalProperties": False}),
                    lambda t: isinstance(json.loads(t)["ok"], bool)),
}


@pytest.fixture(scope="module")
def llm():
    engine = LLM(max_num_seqs=32, max_num_batched_tokens=512)
    yield engine
    engine.shutdown()


def chat(llm, text: str) -> list[int]:
    ids = llm.get_tokenizer().apply_chat_template([{"role": "user", "content": text}], tokenize=True,
                                                  add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_sampled_outputs_always_conform(llm):
    prompt = chat(llm, "Call a tool to get the weather in Paris for three days. Reply in JSON.")
    prompts, params, names = [], [], []
    for name, (so, _) in CASES.items():
        for seed in SEEDS:
            prompts.append(prompt)
            params.append(SamplingParams(temperature=1.0, seed=seed, max_tokens=64, structured_outputs=so))
            names.append(name)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for name, out in zip(names, outs):
        o = out.outputs[0]
        assert o.finish_reason == "stop", (name, o.text, o.finish_reason)
        assert CASES[name][1](o.text), (name, o.text)
        assert llm.get_tokenizer().eos_token_id not in o.token_ids


def test_unconstrained_greedy_bystanders_unchanged(llm):
    free = [chat(llm, "Name three rivers."), chat(llm, "Count to five.")]
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in llm.generate(free, greedy, use_tqdm=False)]
    constrained = [SamplingParams(temperature=1.0, seed=s, max_tokens=24, structured_outputs=CASES[k][0])
                   for s, k in enumerate(["json", "regex", "grammar"])]
    mixed = llm.generate([free[0], chat(llm, "weather?"), free[1], chat(llm, "x"), chat(llm, "y")],
                         [greedy, constrained[0], greedy, constrained[1], constrained[2]], use_tqdm=False)
    assert [mixed[0].outputs[0].token_ids, mixed[2].outputs[0].token_ids] == alone


def test_logprobs_and_n_under_a_choice(llm):
    out = llm.generate([chat(llm, "Is the sky blue?")],
                       SamplingParams(temperature=1.0, seed=3, n=3, max_tokens=8, logprobs=2,
                                      structured_outputs=SO(choice=["yes", "no"])), use_tqdm=False)[0]
    assert len(out.outputs) == 3
    for o in out.outputs:
        assert o.text in ("yes", "no") and o.finish_reason == "stop"
        first = o.logprobs[0]  # taken after the mask: both alternatives start a choice
        assert len(first) == 2 and all(lp.logprob > float("-inf") for lp in first.values())
        assert all("yes".startswith(lp.decoded_token) or "no".startswith(lp.decoded_token)
                   for lp in first.values())


def test_bad_constraint_raises_before_anything_runs(llm):
    with pytest.raises(ValueError, match="structured_outputs.regex"):
        llm.generate(["hi"], SamplingParams(structured_outputs=SO(regex="(")), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_constraint_the_other_token_rules_leave_nothing_of_aborts_with_the_reason(llm, temperature):
    # the regex allows digits only, allowed_token_ids only "yes": no token is left to sample
    yes = llm.get_tokenizer().encode("yes")[0]
    out = llm.generate([chat(llm, "Pick a number.")],
                       SamplingParams(temperature=temperature, seed=1, max_tokens=8, allowed_token_ids=[yes],
                                      structured_outputs=SO(regex="[0-9]{3}")), use_tqdm=False)[0]
    o = out.outputs[0]
    assert (o.finish_reason, o.token_ids, o.text) == ("abort", [], "")  # the refused token is not emitted
    assert "left no token to sample" in out.abort_reason and o.stop_reason is None
    assert not llm.llm_engine.has_unfinished_requests()
