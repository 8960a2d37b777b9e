"""Edge cases the broader suites step over: each test here pins one boundary that an off-by-one
or a dropped line in the code it names would cross, with nothing else failing.

- n-gram lookup (core/spec_decode.py): a suffix whose only earlier occurrence overlaps it;
- async scheduling at the context limit (core/scheduler.py, _finishes_in_flight);
- no drafts for a request under a grammar (core/spec_decode.py, Speculator.propose);
- the GGUF block GEMM's bias on steps of more than PANEL_MAX_M rows (kernels/cpu_ops/linear.py).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine_fakes import FakeExecutor, make_config
from llmsvc.config import SpeculativeConfig
from llmsvc.core.engine_core import EngineCore
from llmsvc.core.request import Request
from llmsvc.core.spec_decode import NgramProposer
from llmsvc.sampling_params import SamplingParams, StructuredOutputsParams as SO
from test_scheduler import reference_tokens, run


def proposer(k=4, lo=1, hi=3) -> NgramProposer:
    return NgramProposer(SpeculativeConfig(num_speculative_tokens=k, prompt_lookup_min=lo, prompt_lookup_max=hi))


# ---- n-gram lookup: the search window ends one token before the suffix's last ----------------

def test_lookup_finds_a_match_that_overlaps_the_suffix_by_all_but_one_token():
    """A run of one repeated token: the suffix's only earlier occurrence starts one token before
    it and ends at the second-to-last token. It is a match (the loop continues), and it is the
    only one, so a window ending one token early proposes nothing."""
    assert proposer(lo=1).propose([1, 2, 3, 7, 7]) == [7, 7, 7, 7]
    assert proposer(lo=2, hi=2).propose([1, 2, 7, 7, 7]) == [7, 7, 7, 7]
    assert proposer(k=2, lo=3, hi=3).propose([4, 9, 9, 9, 9]) == [9, 9]
    # the suffix itself is never its own match: one copy of the pair is not enough
    assert proposer(lo=2, hi=2).propose([1, 2, 7, 7]) == []


def test_a_period_one_loop_drafts_from_its_first_repeat():
    """Through the scheduler: a model that repeats its last token drafts at the first decode step
    whose suffix recurs (lookup of 2: from three equal tokens on), and every draft is accepted."""
    spec = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=2, prompt_lookup_max=2, adaptive=False)
    cfg = make_config()
    cfg.speculative_config = spec
    ex = FakeExecutor(cfg, num_blocks=64, token_fn=lambda tokens: tokens[-1])
    core = EngineCore(cfg, ex)
    core.add_request(Request("r", [1, 2, 3, 9], SamplingParams(max_tokens=13)))
    res = run(core)
    assert res["r"]["tokens"] == [9] * 13
    # step 1: the prompt, sampling a 9; step 2: [.., 9, 9] has no earlier [9, 9] (one token);
    # step 3: [.., 9, 9, 9] finds [9, 9] one token back: 3 drafts, all accepted (4 tokens), and so
    # on until max_tokens leaves room for 2: 1 + 1 + 4 + 4 + 3 tokens
    assert [s.total for s in ex.steps] == [4, 1, 4, 4, 3]
    assert ex.num_accepted == 3 + 3 + 2


# ---- async scheduling: a request whose in-flight token reaches the context is not scheduled ---

def test_async_scheduling_stops_scheduling_at_the_context_limit():
    """max_model_len 20, a 12-token prompt, no max_tokens: 8 tokens, one step each, as in
    synchronous scheduling. The step that would compute position 20 only yields a token that is
    dropped, so it is never scheduled."""
    prompt = list(range(100, 112))
    steps = {}
    for mode in (False, True):
        cfg = make_config(max_model_len=20)
        cfg.scheduler_config.async_scheduling = mode
        ex = FakeExecutor(cfg, num_blocks=64)
        core = EngineCore(cfg, ex)
        core.add_request(Request("r", prompt, SamplingParams(max_tokens=None)))
        res = run(core)
        assert res["r"]["tokens"] == reference_tokens(prompt, 8) and res["r"]["finish"] == "context"
        steps[mode] = [s.num_scheduled for s in ex.steps]
    assert steps[True] == steps[False] == [{"r": 12}] + [{"r": 1}] * 7


def test_async_scheduling_at_the_context_limit_beside_a_longer_request():
    """The same with a second request still running: every step but the ones computing for it
    alone holds both, and the first request gets no step after its eighth token is in flight."""
    cfg = make_config(max_model_len=20)
    cfg.scheduler_config.async_scheduling = True
    ex = FakeExecutor(cfg, num_blocks=64)
    core = EngineCore(cfg, ex)
    core.add_request(Request("ctx", list(range(100, 112)), SamplingParams(max_tokens=None)))
    core.add_request(Request("long", [1, 2], SamplingParams(max_tokens=15)))
    res = run(core)
    assert len(res["ctx"]["tokens"]) == 8 and res["ctx"]["finish"] == "context"
    assert res["long"]["tokens"] == reference_tokens([1, 2], 15)
    assert sum("ctx" in s.num_scheduled for s in ex.steps) == 8
    assert len(ex.steps) == 15


# ---- speculative decoding under a grammar: no drafts ------------------------------------------

def test_no_drafts_for_a_request_under_a_grammar():
    """A regex-constrained request whose own tokens repeat (lookup finds drafts at every step) ends
    "stop" with the regex matched and never drafts; a free request beside it drafts. The grammar's
    bitmask covers one position: drafts would be verified unmasked, and the grammar then refuses
    the model's "a" where it wants the "c"."""
    from llmsvc.structured.manager import StructuredOutputManager
    from tests.server_harness import EOS, TINY_VOCAB, tiny_tokenizer

    tok = tiny_tokenizer()
    config = make_config(num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=32)
    config.model_config.vocab_size = TINY_VOCAB
    config.model_config.eos_token_ids = [EOS]
    config.speculative_config = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1,
                                                  prompt_lookup_max=2, adaptive=False)
    # a model that repeats what it said two tokens ago: "abab..." continues itself
    ex = FakeExecutor(config, num_blocks=64, token_fn=lambda tokens: tokens[-2])
    manager = StructuredOutputManager(tok, TINY_VOCAB, [EOS])
    core = EngineCore(config, ex, manager)
    drafted: list[set[str]] = []
    core.scheduler.schedule = _recording(core.scheduler.schedule, drafted)
    regex = r"(ab){4}c"
    try:
        manager.wait(SO(regex=regex))  # compiled before the request comes, as offline generate does
        core.add_request(Request("g", tok.encode("abab"), SamplingParams(
            temperature=0.0, max_tokens=30, structured_outputs=SO(regex=regex)), eos_token_ids=[EOS]))
        core.add_request(Request("free", tok.encode("abab"), SamplingParams(temperature=0.0, max_tokens=12)))
        res = run(core)
    finally:
        core.shutdown()
    assert (tok.decode(res["g"]["tokens"]), res["g"]["finish"]) == ("ababababc", "stop")
    assert res["free"]["tokens"] == tok.encode("ab" * 6)
    assert not any("g" in ids for ids in drafted)
    assert any("free" in ids for ids in drafted)


def _recording(schedule, seen: list):
    """schedule, noting the ids of the requests each step drafts for."""
    def wrapped():
        so = schedule()
        seen.append(set(so.scheduled_spec_decode_tokens))
        return so
    return wrapped


# ---- GGUF blocks: steps of more than PANEL_MAX_M rows are split, the bias kept on every part ---

@pytest.mark.parametrize("with_bias", [True, False])
def test_gguf_linear_over_panel_max_rows_keeps_the_bias_on_every_chunk(with_bias):
    """2,100 rows: three calls of at most PANEL_MAX_M (1,024) rows. Each row equals the same row
    multiplied alone in a step of up to PANEL_MAX_M rows (row sums do not depend on the other
    rows), and all of them equal F.linear on the dequantized weight with the bias."""
    from kernels import ops
    from kernels import reference as ref
    from kernels.cpu_ops import build, linear

    lib = build.load()
    if lib is None or lib.llmsvc_gemm_f32_supported() != 1:
        pytest.skip("gemm.c's panels are not built on this CPU (neither AVX-512F nor AVX2 + FMA)")
    g = torch.Generator().manual_seed(3)
    n, k = 50, 64
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int8)
    d = (torch.rand(n, k // 32, generator=g) * 0.02).half().float()
    m = (torch.randn(n, k // 32, generator=g) * 0.05).half().float()
    w = ref.dequantize_gguf_blocks(q, d, m)
    blob = ops.pack_gguf_blocks(q, d, m)
    bias = torch.randn(n, generator=g) * 3 if with_bias else None
    rows = 2 * linear.PANEL_MAX_M + 52
    x = torch.randn(rows, k, generator=g)
    got = ops.linear(x, w, bias, blob)
    assert got.shape == (rows, n)
    atol = max(1e-5, 1e-6 * float((x.abs() @ w.abs().t()).max()))
    torch.testing.assert_close(got, F.linear(x, w, bias), atol=atol, rtol=1e-4)
    for lo in range(0, rows, linear.PANEL_MAX_M):  # bit for bit: every chunk as a step of its own
        part = x[lo:lo + linear.PANEL_MAX_M]
        differ = int((got[lo:lo + len(part)] != ops.linear(part, w, bias, blob)).sum())
        assert differ == 0, f"rows {lo}..{lo + len(part)}: {differ} values differ"
    # a 3-D activation [batch, rows, K] splits the same way
    assert int((ops.linear(x.view(2, rows // 2, k), w, bias, blob).view(rows, n) != got).sum()) == 0
