"""Samples of two runs that batch the same requests differently (drafts, preemption, swapping,
async scheduling): token ids, finish reasons and texts equal, logprobs equal to LOGPROB_ATOL.

Why not bit for bit: a row's logits may differ in their last bits with the call that computes
them. The CPU's prefill tiles sum `q . k` in another order than one-row decodes (query vectors
in lanes), AMX sends long steps through another GEMM, and a recomputed or verified row comes
in another tile than the one a plain run decoded it in; vLLM's kernels behave alike. Rounding
both sides to 4 decimals was no tolerance: two values 1e-7 apart can round to neighbours."""
from __future__ import annotations

import math

LOGPROB_ATOL = 1e-4  # fp32 differences of summation order are ~1e-6; a wrong KV row is >> 1e-2


def sample_rows(outs) -> list:
    """RequestOutputs -> per request, per sample: (token ids, finish reason, text, logprobs as
    one {token id: logprob} per position, or None)."""
    return [[(list(c.token_ids), c.finish_reason, c.text,
              None if c.logprobs is None else [{t: lp.logprob for t, lp in d.items()} for d in c.logprobs])
             for c in o.outputs] for o in outs]


def assert_logprobs_close(got: list, want: list, where: str = "", atol: float = LOGPROB_ATOL) -> None:
    """got, want: [(token id, logprob)] in order; the same ids, each logprob within atol."""
    assert [t for t, _ in got] == [t for t, _ in want], f"{where}: token ids {got} != {want}"
    for i, ((t, a), (_, b)) in enumerate(zip(got, want)):
        assert math.isclose(a, b, rel_tol=0.0, abs_tol=atol), f"{where}[{i}] token {t}: {a} != {b}"


def assert_same_samples(got: list, want: list, atol: float = LOGPROB_ATOL) -> None:
    """got, want: sample_rows() of two runs of the same requests."""
    assert len(got) == len(want), (len(got), len(want))
    for i, (g_req, w_req) in enumerate(zip(got, want)):
        assert len(g_req) == len(w_req), f"request {i}: {len(g_req)} samples != {len(w_req)}"
        for j, (g, w) in enumerate(zip(g_req, w_req)):
            assert g[:3] == w[:3], f"request {i} sample {j}: {g[:3]} != {w[:3]}"
            assert (g[3] is None) == (w[3] is None), f"request {i} sample {j}: logprobs only on one side"
            assert len(g[3] or []) == len(w[3] or []), f"request {i} sample {j}: logprobs at another count of positions"
            for k, (gd, wd) in enumerate(zip(g[3] or [], w[3] or [])):
                assert_logprobs_close(sorted(gd.items()), sorted(wd.items()), f"request {i} sample {j} position {k}",
                                      atol)
