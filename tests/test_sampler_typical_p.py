"""typical_p, the worked example of docs/design.md ("A sampling parameter, declared once"):
its stage keeps exactly the tokens transformers' TypicalLogitsWarper keeps, and sampling draws
only from them; greedy rows and typical_p=1 rows are untouched."""
from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import TypicalLogitsWarper

from llmsvc.sampling_params import SamplingParams
from llmsvc.worker.sampler import Sampler
from llmsvc.worker.sampling_metadata import SamplingMetadata

V = 300


def _md(params):
    n = len(params)
    return SamplingMetadata.build(params, [[1]] * n, [[2]] * n, V)


@pytest.mark.parametrize("mass", [0.2, 0.5, 0.9, 0.99])
def test_kept_tokens_equal_transformers_typical_warper(mass):
    g = torch.Generator().manual_seed(int(mass * 100))
    logits = torch.randn(4, V, generator=g) * torch.tensor([[0.5], [2.0], [4.0], [8.0]])
    md = _md([SamplingParams(temperature=1.0, typical_p=mass)] * 4)
    got = logits.clone()
    md.stage("typical_p").apply(got)
    want = TypicalLogitsWarper(mass=mass)(None, logits.clone())
    assert torch.equal(torch.isfinite(got), torch.isfinite(want))
    assert torch.equal(got[torch.isfinite(got)], logits[torch.isfinite(got)])  # survivors unchanged


def test_draws_stay_in_the_typical_set_and_other_rows_are_untouched():
    g = torch.Generator().manual_seed(3)
    row = torch.randn(V, generator=g) * 3
    params = [SamplingParams(temperature=1.0, typical_p=0.3, seed=s) for s in range(64)]
    params += [SamplingParams(temperature=0.0, typical_p=0.3), SamplingParams(temperature=1.0, seed=1)]
    md = _md(params)
    assert md.stage("typical_p").rows.tolist() == list(range(64))  # neither greedy nor neutral rows
    out = Sampler()(row.expand(len(params), -1).contiguous(), md).sampled_token_ids.tolist()
    allowed = torch.isfinite(TypicalLogitsWarper(mass=0.3)(None, row.unsqueeze(0).clone()))[0]
    assert all(allowed[t] for t in out[:64]) and len(set(out[:64])) > 1
    assert out[64] == int(row.argmax())
    assert _md([SamplingParams(temperature=1.0)]).stage("typical_p") is None
