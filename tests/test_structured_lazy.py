"""The engine core's grammar manager is built on the first constrained request
(LazyStructuredOutputManager): unconstrained serving never builds it, constrained requests get
the same masked outputs as with an eager manager, and a core process serves them."""
from __future__ import annotations

import json

import jsonschema
import pytest

from llmsvc.core.client import InprocClient
from llmsvc.core.engine_core import EngineCore
from llmsvc.engine.llm_engine import LLMEngine
from llmsvc.sampling_params import SamplingParams, StructuredOutputsParams as SO
from llmsvc.structured.build import build_structured_output_manager
from llmsvc.structured.lazy import LazyStructuredOutputManager
from tests.engine_fakes import FakeExecutor, make_config
from tests.server_harness import EOS, TINY_VOCAB, letters, make_tiny_served_model_dir, tiny_tokenizer

TOK = tiny_tokenizer()
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 5}},
          "required": ["name"], "additionalProperties": False}


def _config():
    config = make_config(num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=32)
    config.model_config.vocab_size = TINY_VOCAB
    config.model_config.eos_token_ids = [EOS]
    return config


def _engine(core_manager) -> LLMEngine:
    """A front end with its own (eager) manager over a core with `core_manager`: the process
    layout's two managers, in one process."""
    config = _config()
    ex = FakeExecutor(config, num_blocks=64, token_fn=letters)
    return LLMEngine(config, InprocClient(EngineCore(config, ex, core_manager)), TOK)


def _run(engine, requests):
    for rid, params in requests.items():
        engine.add_request(rid, TOK.encode("prompt: "), params)
    done = {}
    for _ in range(2000):
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0]
        if not engine.has_unfinished_requests():
            return done
    raise AssertionError("requests did not finish")


class _Counting:
    def __init__(self):
        self.builds, self.managers = 0, []

    def __call__(self):
        self.builds += 1
        m = build_structured_output_manager(_config(), TOK)
        self.managers.append(m)
        return m


def test_built_only_for_the_first_constrained_request_and_masks_like_an_eager_manager():
    build = _Counting()
    lazy = LazyStructuredOutputManager(build)
    engine = _engine(lazy)
    try:
        plain = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        _run(engine, {"a": plain, "b": plain})
        assert build.builds == 0 and not lazy.built
        constrained = SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=SO(json=json.dumps(SCHEMA)))
        got = _run(engine, {"c": constrained, "d": constrained, "e": plain})
        assert build.builds == 1 and lazy.built
        for rid in ("c", "d"):
            jsonschema.validate(json.loads(got[rid].text), SCHEMA)
    finally:
        engine.shutdown()
    eager = _engine(build_structured_output_manager(_config(), TOK))
    try:
        want = _run(eager, {"c": constrained})
    finally:
        eager.shutdown()
    assert (got["c"].token_ids, got["c"].text) == (want["c"].token_ids, want["c"].text)


def test_shutdown_stops_only_a_built_manager_and_a_failed_build_raises():
    lazy = LazyStructuredOutputManager(lambda: pytest.fail("built without a constrained request"))
    lazy.shutdown()
    assert not lazy.built
    none = LazyStructuredOutputManager(lambda: None)
    with pytest.raises(RuntimeError, match="not available"):
        none.new_request(SO(json=json.dumps(SCHEMA)))


def test_engine_core_process_serves_a_constrained_request(tmp_path):
    from llmsvc.llm import LLM

    model_dir = make_tiny_served_model_dir(tmp_path)
    params = SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=SO(json=json.dumps(SCHEMA)))
    with LLM(model_dir, engine_core="process", device="cpu", max_model_len=128, max_num_seqs=4) as llm:
        out = llm.generate(["hello"], params, use_tqdm=False)[0].outputs[0]
    jsonschema.validate(json.loads(out.text), SCHEMA)
