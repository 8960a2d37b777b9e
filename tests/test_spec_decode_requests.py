"""Speculative decoding counted per request: the draft tokens verified for a request and how many
were accepted travel from the scheduler (Speculator.observe, the one place both these and the
engine-wide counters are fed) through EngineCoreOutput and the output processor into
RequestMetrics (summed over the n samples), and out over llmsvc.v1's Timing and vLLM's
GenerateComplete (spec_draft_tokens / spec_accepted_tokens). Real LLMEngine on the FakeExecutor."""
from __future__ import annotations

import pytest

from llmsvc.config import SpeculativeConfig
from llmsvc.sampling_params import SamplingParams
from llmsvc.server.vllm_engine.proto import vllm_engine_pb2 as vpb
from llmsvc.server.vllm_engine.proto import vllm_engine_pb2_grpc as vgrpc
from llmsvc.v1 import llmsvc_pb2 as pb
from tests.server_harness import ServerThread, fake_engine_factory, letters

# adaptive off: the governor's choices follow the wall clock, these counts must not
SPEC = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=2, adaptive=False)
PROMPT = list(b"abcdabcdab")


def looping(tokens: list[int]) -> int:
    """Repeats what it said 4 tokens ago (lookup drafts are right), but at every 7th position
    and while it has fewer than 4 (a letter of its own there: drafts get rejected too)."""
    return tokens[-4] if len(tokens) >= 4 and len(tokens) % 7 else letters(tokens)


def counts(metrics) -> tuple[int, int]:
    return metrics.num_draft_tokens, metrics.num_accepted_tokens


def run_engine(spec, requests):
    engine = fake_engine_factory(speculative_config=spec, token_fn=looping)()
    try:
        for rid, params in requests:
            engine.add_request(rid, PROMPT, params)
        finals = {}
        for _ in range(1000):
            if not engine.has_unfinished_requests():
                break
            finals.update((o.request_id, o) for o in engine.step() if o.finished)
        return finals, engine.get_stats().spec_decode
    finally:
        engine.shutdown()


REQUESTS = [("one", SamplingParams(max_tokens=30, temperature=0.0)),
            ("three", SamplingParams(max_tokens=20, n=3, temperature=1.0, seed=7)),
            ("single", SamplingParams(max_tokens=1))]  # one token: never decodes, never drafts


def test_request_counts_sum_to_the_engine_counters():
    finals, spec = run_engine(SPEC, REQUESTS)
    assert set(finals) == {"one", "three", "single"}
    for rid in ("one", "three"):
        drafts, accepted = counts(finals[rid].metrics)
        assert drafts >= accepted > 0, rid
    assert counts(finals["single"].metrics) == (0, 0)
    # one observation feeds both: every sample of every request adds up to the engine's numbers
    # (an n=3 request that kept one sample's counts only would fall short here)
    assert sum(counts(o.metrics)[0] for o in finals.values()) == spec.num_draft_tokens > 0
    assert sum(counts(o.metrics)[1] for o in finals.values()) == spec.num_accepted_tokens > 0


def test_without_speculative_decoding_both_counts_are_zero():
    finals, spec = run_engine(None, REQUESTS[:2])
    assert spec is None
    assert [counts(o.metrics) for o in finals.values()] == [(0, 0), (0, 0)]


def _spec_totals(s: ServerThread) -> tuple[int, int]:
    st = s.server.async_engine.get_stats().spec_decode
    return (0, 0) if st is None else (st.num_draft_tokens, st.num_accepted_tokens)


def _v1(s: ServerThread, n: int) -> list[pb.Timing]:
    req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=PROMPT), sampling=pb.SamplingParams(temperature=0.0, n=n),
                             stopping=pb.StoppingCriteria(max_tokens=24), output=pb.OutputOptions(include_timing=True))
    return [m.finish.timing for m in s.stub.Generate(req) if m.HasField("finish")]


def _vllm(s: ServerThread, n: int, stream: bool) -> list[vpb.GenerateComplete]:
    req = vpb.GenerateRequest(tokenized=vpb.TokenizedInput(input_ids=PROMPT), stream=stream,
                              sampling_params=vpb.SamplingParams(max_tokens=24, n=n, temperature=0.0))
    return [m.complete for m in vgrpc.VllmEngineStub(s.channel).Generate(req) if m.HasField("complete")]


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_timing_and_generate_complete_carry_the_counts(stream):
    s = ServerThread(fake_engine_factory(speculative_config=SPEC, token_fn=looping))
    try:
        before = _spec_totals(s)
        timings = _v1(s, n=2)
        after = _spec_totals(s)
        assert len(timings) == 2
        got = {(t.num_draft_tokens, t.num_accepted_tokens) for t in timings}
        assert len(got) == 1  # each index's finish carries the request's (summed) counts
        ((drafts, accepted),) = got
        assert drafts >= accepted > 0
        assert (drafts, accepted) == (after[0] - before[0], after[1] - before[1])

        completes = _vllm(s, n=2, stream=stream)
        done = _spec_totals(s)
        assert sorted(c.index for c in completes) == [0, 1]
        # each index's complete carries that index's own counts (as vLLM's worker reports each
        # completion's), so they sum to the request's
        per_index = [(c.spec_draft_tokens, c.spec_accepted_tokens) for c in completes]
        assert all(d >= a > 0 for d, a in per_index), per_index
        assert (sum(d for d, _ in per_index), sum(a for _, a in per_index)) == (done[0] - after[0], done[1] - after[1])
    finally:
        s.stop()


def test_both_doors_report_zero_without_speculative_decoding():
    s = ServerThread(fake_engine_factory(token_fn=looping))
    try:
        assert [(t.num_draft_tokens, t.num_accepted_tokens) for t in _v1(s, n=1)] == [(0, 0)]
        completes = _vllm(s, n=1, stream=True)
        assert [(c.spec_draft_tokens, c.spec_accepted_tokens) for c in completes] == [(0, 0)]
    finally:
        s.stop()
