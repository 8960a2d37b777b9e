"""Speculative decoding on a tiny random model: greedy tokens equal Hugging Face's on every
executor; seeded sampling with penalties, logprobs, min_tokens, stop strings and n > 1 gives the
tokens of decoding without drafts; preemption; over gRPC with the core in its own process, with
GetServerInfo and the Prometheus counters; the serve flag."""
from __future__ import annotations

import random

import pytest
import torch

from llmsvc import LLM, SamplingParams
from llmsvc.client import Client
from llmsvc.config import EngineConfig
from llmsvc.engine.llm_engine import LLMEngine
from tests.model_utils import load_hf_model
from tests.sample_compare import assert_same_samples, sample_rows
from tests.server_harness import EOS, ServerThread, make_tiny_served_model_dir

ENGINE = dict(block_size=4, num_kv_blocks_override=64, max_num_batched_tokens=64, max_num_seqs=8)
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
MAX_NEW = 28


def _prompts() -> list[list[int]]:
    """Prompts that repeat themselves (lookup finds drafts), and one that does not."""
    rng = random.Random(5)
    pat = [rng.randrange(3, EOS) for _ in range(6)]
    return [pat * 4, pat * 2 + pat[:3], [rng.randrange(3, EOS) for _ in range(9)] * 2,
            [rng.randrange(3, EOS) for _ in range(15)]]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    return build_served(tmp_path_factory.mktemp("spec"))


def build_served(root) -> tuple[str, list[list[int]]]:
    """(model dir, HF greedy tokens per prompt)."""
    model_dir = make_tiny_served_model_dir(root)
    hf = load_hf_model(model_dir)
    refs = []
    with torch.no_grad():
        for p in _prompts():
            ids = hf.generate(torch.tensor([p]), max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW, do_sample=False)
            refs.append(ids[0, len(p):].tolist())
    return model_dir, refs


GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)


def _generate(llm: LLM, prompts, params) -> list:
    outs = llm.generate(prompts, params, use_tqdm=False)
    stats = llm.llm_engine.get_stats()
    assert stats.num_free_kv_blocks == stats.num_kv_blocks, "leaked KV blocks"
    return outs


@pytest.mark.parametrize("executor,tp", [("uniproc", 1), ("multiproc", 1), ("tp", 2)])
def test_greedy_tokens_equal_hf_on_every_executor(served, executor, tp):
    check_greedy(served, executor=executor, tensor_parallel_size=tp)


def check_greedy(served, **engine) -> None:
    """HF's greedy tokens with drafts accepted (tests/test_cuda.py runs it on the GPU too)."""
    model_dir, refs = served
    llm = LLM(model=model_dir, speculative_config=SPEC, **ENGINE, **engine)
    try:
        outs = _generate(llm, _prompts(), GREEDY)
        assert [list(o.outputs[0].token_ids) for o in outs] == refs
        spec = llm.llm_engine.get_stats().spec_decode
        assert spec.num_accepted_tokens > 0 and spec.num_drafts > 0
    finally:
        llm.shutdown()


def test_sampling_features_give_the_tokens_of_decoding_without_drafts(served):
    """Seeded sampling (the seed is keyed by output position), penalties, logprobs, min_tokens,
    bad words, stop strings (some ending inside a step's accepted drafts), n=2 and a pool small
    enough to preempt: the same outputs."""
    model_dir, refs = served
    prompts = _prompts()
    tok_text = None
    params = [SamplingParams(max_tokens=MAX_NEW, temperature=0.7, seed=3, presence_penalty=0.4,
                             repetition_penalty=1.1, logprobs=2, ignore_eos=True),
              SamplingParams(n=2, max_tokens=20, temperature=0.9, top_k=20, top_p=0.9, seed=8, ignore_eos=True),
              SamplingParams(max_tokens=MAX_NEW, temperature=0.0, min_tokens=10, frequency_penalty=0.5,
                             logprobs=0),
              GREEDY]
    results = {}
    for name, extra in (("plain", {}), ("spec", {"speculative_config": SPEC})):
        llm = LLM(model=model_dir, **{**ENGINE, "num_kv_blocks_override": 20}, **extra)
        try:
            if tok_text is None:  # stop strings the greedy output of prompt 0 holds, at several places
                text0 = llm.get_tokenizer().decode(refs[0])
                tok_text = [text0[k:k + 3] for k in range(6, 30, 4)]
            run = params + [SamplingParams(max_tokens=MAX_NEW, temperature=0.0, stop=[tok_text[0]], ignore_eos=True,
                                           bad_words=[llm.get_tokenizer().decode(refs[1][4:5])])]
            # drafts are accepted several at a time: some of these stop strings end inside a step's tokens
            run += [SamplingParams(max_tokens=MAX_NEW, temperature=0.0, stop=[t], ignore_eos=True) for t in tok_text[1:]]
            outs = _generate(llm, prompts + prompts[:1] * len(tok_text), run)
            results[name] = sample_rows(outs)
            stats = llm.llm_engine.get_stats()
            results[name + "_stats"] = stats
        finally:
            llm.shutdown()
    assert_same_samples(results["spec"], results["plain"])
    assert results["plain"][4][0][1] == "stop"
    assert results["spec_stats"].spec_decode.num_accepted_tokens > 0
    assert results["spec_stats"].num_preemptions > 0


def test_grpc_with_the_core_in_its_own_process(served):
    model_dir, refs = served
    # adaptive off: the governor's choices follow the wall clock, and on a loaded box it may stop
    # drafting before the streamed request, whose chunks of several tokens are checked below
    config = EngineConfig.from_options(model=model_dir, engine_core="process", log_stats_interval_s=0.0,
                                       speculative_config={**SPEC, "adaptive": False}, **ENGINE)
    with ServerThread(lambda: LLMEngine.from_config(config)) as srv, Client(srv.address, timeout=60) as c:
        for p, ref in zip(_prompts(), refs):
            got = c.generate(p, max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
            assert list(got.token_ids) == ref
        streamed = [m for m in c.generate_stream(_prompts()[0], max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)]
        assert [t for m in streamed for t in m.token_ids] == refs[0]
        assert any(len(m.token_ids) > 1 for m in streamed)  # accepted drafts arrive together
        info = c.server_info()
        assert (info.speculative_method, info.num_speculative_tokens) == ("ngram", 4)
        assert 0 < info.spec_decode_acceptance_rate <= 1 and info.spec_decode_mean_acceptance_length > 1
        from prometheus_client import generate_latest
        text = generate_latest(srv.server.metrics.registry).decode()
        for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
            assert f"llmsvc_spec_decode_{name}_total " in text
        assert 'llmsvc_spec_decode_num_accepted_tokens_per_pos_total{position="0"}' in text


def test_serve_flag_and_env(monkeypatch):
    from llmsvc.server import cli
    from tests.test_server_cli import parse

    c = cli.build_config(parse(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}']))
    assert (c.speculative_config.num_speculative_tokens, c.speculative_config.prompt_lookup_max) == (3, 5)
    assert cli.build_config(parse([])).speculative_config is None
    c = cli.build_config(parse([], monkeypatch, {"LLMSVC_SPECULATIVE_CONFIG": '{"num_speculative_tokens": 2}'}))
    assert c.speculative_config.num_speculative_tokens == 2
    with pytest.raises(ValueError, match="async scheduling"):
        cli.build_config(parse(["--speculative-config", '{"num_speculative_tokens": 2}', "--async-scheduling"]))
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        cli.build_config(parse(["--speculative-config", '{"method": "ngram"}']))


def test_bench_passes_the_flag_to_the_server_it_starts_and_offline():
    import argparse

    from llmsvc.bench import cli as bench_cli
    from llmsvc.server import cli
    from tests.test_server_cli import parse

    p = argparse.ArgumentParser()
    bench_cli.add_arguments(p)
    a = p.parse_args(["--speculative-config", '{"num_speculative_tokens": 3}'])
    served = cli.build_config(parse(bench_cli._serve_args(a)))
    assert served.speculative_config.num_speculative_tokens == 3
    assert bench_cli._serve_args(p.parse_args([])).count("--speculative-config") == 0

