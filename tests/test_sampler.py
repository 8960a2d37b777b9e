"""Sampler: truncation never leaks, temperature orders entropy, seeds are batch-independent,
penalties / bias / min_tokens give vLLM's exact values, logprobs match log_softmax."""
from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from llmsvc.sampling_params import SamplingParams
from llmsvc.worker.sampler import Sampler, apply_logits_processors, compute_prompt_logprobs
from llmsvc.worker.sampling_metadata import SamplingMetadata

V = 32


def build(params, prompts=None, outputs=None, vocab=V, **kw):
    n = len(params)
    prompts = prompts if prompts is not None else [[] for _ in range(n)]
    outputs = outputs if outputs is not None else [[] for _ in range(n)]
    return SamplingMetadata.build(params, prompts, outputs, vocab, "cpu", **kw)


def draw(logits_row, params, n, seed=0):
    """n independent draws from one row of logits with one SamplingParams (one batch)."""
    logits = logits_row.unsqueeze(0).expand(n, -1).contiguous()
    md = build([params] * n, vocab=logits.shape[1], generator=torch.Generator().manual_seed(seed))
    return Sampler()(logits, md).sampled_token_ids


def row_logits(seed=0, vocab=V):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(vocab, generator=g) * 2.0  # distinct values (a.s.)


# ---------------------------------------------------------------- greedy / metadata flags

def test_greedy_is_argmax_and_metadata_flags():
    logits = torch.randn(6, V, generator=torch.Generator().manual_seed(1))
    md = build([SamplingParams(temperature=0.0)] * 6)
    assert md.all_greedy and not md.all_random
    assert md.processors == [] and md.truncators == [] and md.max_num_logprobs is None
    out = Sampler()(logits, md)
    assert out.sampled_token_ids.dtype == torch.int64
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))
    assert out.logprobs == [None] * 6


def test_greedy_rows_in_mixed_batch_ignore_truncation_and_keep_argmax():
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(2))
    params = [SamplingParams(temperature=0.0, top_k=3), SamplingParams(temperature=1.0, top_k=1),
              SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, top_p=1e-6)]
    md = build(params)
    assert not md.all_greedy and not md.all_random
    out = Sampler()(logits, md).sampled_token_ids
    # top_k=1 and a tiny top_p both reduce to argmax as well
    assert torch.equal(out, logits.argmax(-1))


def test_sampler_does_not_modify_input_logits():
    logits = row_logits(3).unsqueeze(0).repeat(2, 1)
    before = logits.clone()
    params = [SamplingParams(temperature=0.8, top_k=4, top_p=0.9, min_p=0.05,
                             repetition_penalty=1.3, logit_bias={1: 5.0}, min_tokens=2,
                             stop_token_ids=[2]),
              SamplingParams(temperature=0.0, presence_penalty=1.0)]
    Sampler()(logits, build(params, prompts=[[1, 3], [4]], outputs=[[5], [6]]))
    assert torch.equal(logits, before)


# ---------------------------------------------------------------- truncation never leaks

def test_top_k_only_emits_the_k_largest():
    logits = row_logits(4)
    allowed = set(logits.topk(5).indices.tolist())
    got = set(draw(logits, SamplingParams(temperature=1.5, top_k=5), 4000).tolist())
    assert got <= allowed
    assert got == allowed  # each of the 5 has noticeable mass at T=1.5 over 4000 draws


def test_top_p_keeps_smallest_set_reaching_p():
    probs = torch.full((V,), 0.05 / (V - 3))
    probs[7], probs[3], probs[11] = 0.5, 0.3, 0.15  # cumulative 0.5, 0.8, 0.95
    logits = probs.log()
    got = set(draw(logits, SamplingParams(top_p=0.75), 4000).tolist())
    assert got == {7, 3}
    got = set(draw(logits, SamplingParams(top_p=0.9), 4000).tolist())
    assert got == {7, 3, 11}
    got = set(draw(logits, SamplingParams(top_p=0.3), 500).tolist())
    assert got == {7}


def test_min_p_drops_tokens_below_fraction_of_max():
    probs = torch.full((V,), 0.04 / (V - 4))
    probs[0], probs[5], probs[9], probs[20] = 0.5, 0.3, 0.1, 0.06
    logits = probs.log()
    # threshold 0.15 * 0.5 = 0.075: keeps 0, 5, 9; drops 20 and the tail
    got = set(draw(logits, SamplingParams(min_p=0.15), 4000).tolist())
    assert got == {0, 5, 9}


def test_mixed_truncation_rows_each_respect_their_own_limits():
    base = row_logits(5)
    n = 1500
    params = ([SamplingParams(top_k=3)] * n + [SamplingParams(top_p=0.5, temperature=2.0)] * n
              + [SamplingParams(top_k=10, top_p=0.6, min_p=0.01)] * n + [SamplingParams()] * n)
    logits = base.unsqueeze(0).expand(len(params), -1).contiguous()
    md = build(params, generator=torch.Generator().manual_seed(0))
    out = Sampler()(logits, md).sampled_token_ids
    order = base.argsort(descending=True).tolist()
    assert set(out[:n].tolist()) <= set(order[:3])
    # top_p at T=2: smallest prefix of the sorted T=2 distribution with mass >= 0.5
    p2 = (base / 2.0).softmax(-1)[order].cumsum(0)
    keep = order[: int((p2 < 0.5).sum()) + 1]
    assert set(out[n:2 * n].tolist()) <= set(keep)
    assert set(out[n:2 * n].tolist()) == set(keep)
    p1 = base.topk(10).values.softmax(-1).cumsum(0)
    keep = order[: int((p1 < 0.6).sum()) + 1]
    assert set(out[2 * n:3 * n].tolist()) <= set(keep)
    # the unrestricted row reaches beyond every restricted set
    assert len(set(out[3 * n:].tolist())) > len(keep)


# ---------------------------------------------------------------- distribution / temperature

def _entropy(samples: torch.Tensor, vocab: int) -> float:
    p = torch.bincount(samples, minlength=vocab).float() / samples.numel()
    p = p[p > 0]
    return float(-(p * p.log()).sum())


def test_temperature_one_matches_softmax_and_higher_temperature_has_higher_entropy():
    logits = row_logits(6, vocab=8)
    n = 20000
    s1 = draw(logits, SamplingParams(temperature=1.0), n, seed=1)
    freq = torch.bincount(s1, minlength=8).float() / n
    expect = logits.softmax(-1)
    # 5 standard errors per token: exponential race draws from softmax(logits)
    tol = 5 * (expect * (1 - expect) / n).sqrt() + 1e-3
    assert ((freq - expect).abs() <= tol).all(), (freq, expect)
    ents = [_entropy(draw(logits, SamplingParams(temperature=t), n, seed=2), 8)
            for t in (0.3, 1.0, 3.0)]
    assert ents[0] < ents[1] < ents[2], ents


# ---------------------------------------------------------------- seeds

def _seeded_run(batch_params, target_row, steps, logits_seed=7):
    """Token of `target_row` per step, its output growing by its own samples."""
    outs = [[] for _ in batch_params]
    got = []
    sampler = Sampler()
    for step in range(steps):
        g = torch.Generator().manual_seed(1000 + step)
        logits = torch.randn(len(batch_params), V, generator=g)
        # the target row's logits depend only on the step, not on its batch position
        logits[target_row] = torch.randn(V, generator=torch.Generator().manual_seed(logits_seed + step))
        md = build(batch_params, prompts=[[1, 2]] * len(batch_params), outputs=outs,
                   generator=torch.Generator().manual_seed(step * 31 + len(batch_params)))
        toks = sampler(logits, md).sampled_token_ids.tolist()
        for o, t in zip(outs, toks):
            o.append(t)
        got.append(toks[target_row])
    return got


def test_seed_reproduces_across_batch_compositions_and_orders():
    target = SamplingParams(temperature=1.3, top_p=0.95, seed=1234)
    alone = _seeded_run([target], 0, steps=12)
    others = [SamplingParams(temperature=0.0), SamplingParams(top_k=3, repetition_penalty=1.5),
              SamplingParams(seed=99, min_p=0.1), SamplingParams(top_p=0.5, logit_bias={3: 4.0})]
    mixed_a = _seeded_run(others[:2] + [target] + others[2:], 2, steps=12)
    mixed_b = _seeded_run([target] + others[::-1], 0, steps=12)
    mixed_c = _seeded_run(others + [target] * 2, 4, steps=12)
    assert alone == mixed_a == mixed_b == mixed_c
    other_seed = _seeded_run([SamplingParams(temperature=1.3, top_p=0.95, seed=1235)], 0, steps=12)
    assert other_seed != alone


def test_seeded_token_depends_only_on_seed_and_output_length():
    """Preemption: the worker rebuilds the request with the same output -> same next token."""
    logits = row_logits(8).unsqueeze(0)
    p = SamplingParams(temperature=2.0, seed=5)
    first = [Sampler()(logits, build([p], outputs=[[0] * k])).sampled_token_ids.item()
             for k in range(16)]
    again = [Sampler()(logits, build([p], outputs=[[9] * k])).sampled_token_ids.item()
             for k in range(16)]
    assert first == again
    assert len(set(first)) > 1  # the step index feeds the seed


def test_seed_reproduces_in_another_process():
    code = (
        "import torch\n"
        "from llmsvc.sampling_params import SamplingParams\n"
        "from llmsvc.worker.sampler import Sampler\n"
        "from llmsvc.worker.sampling_metadata import SamplingMetadata\n"
        "logits = torch.linspace(-3, 3, 32).unsqueeze(0)\n"
        "p = SamplingParams(temperature=3.0, seed=77)\n"
        "print([Sampler()(logits, SamplingMetadata.build([p], [[1]], [[0] * k], 32, 'cpu'))"
        ".sampled_token_ids.item() for k in range(10)])\n"
    )
    here = [Sampler()(torch.linspace(-3, 3, 32).unsqueeze(0),
                      build([SamplingParams(temperature=3.0, seed=77)], prompts=[[1]],
                            outputs=[[0] * k])).sampled_token_ids.item() for k in range(10)]
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=root, env=env)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == str(here)


# ---------------------------------------------------------------- penalties / bias / min_tokens

def test_penalties_match_vllm_definition_exactly():
    logits = torch.tensor([[2.0, -1.0, 3.0, -2.0, 0.5, 1.0],
                           [2.0, -1.0, 3.0, -2.0, 0.5, 1.0]])
    prompt, output = [0, 1], [1, 2, 2, 4]
    params = [SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25),
              SamplingParams()]
    md = build(params, prompts=[prompt, prompt], outputs=[output, output], vocab=6)
    assert md.stage("penalties").flat_index.tolist() == [0, 1, 2, 4]  # row 0 only: seen tokens
    got = logits.clone()
    apply_logits_processors(got, md)
    expect = []
    for tok, x in enumerate(logits[0].tolist()):
        if tok in prompt or tok in output:  # repetition: prompt OR output
            x = x / 2.0 if x > 0 else x * 2.0
        x -= 0.25 * output.count(tok)  # frequency: output only
        x -= 0.5 * (tok in output)  # presence: output only
        expect.append(x)
    assert got[0].tolist() == pytest.approx(expect, abs=1e-6)
    assert torch.equal(got[1], logits[1])  # neutral row untouched
    # token 2 was the argmax; penalties push greedy to token 0
    out = Sampler()(logits[:1], build([SamplingParams(temperature=0.0, repetition_penalty=2.0,
                                                      frequency_penalty=0.25, presence_penalty=0.5)],
                                      prompts=[prompt], outputs=[output], vocab=6))
    assert out.sampled_token_ids.tolist() == [0]


def test_negative_presence_and_frequency_penalties_reward_output_tokens():
    logits = torch.zeros(1, 5)
    md = build([SamplingParams(presence_penalty=-1.0, frequency_penalty=-0.5)],
               prompts=[[0]], outputs=[[3, 3, 3]], vocab=5)
    apply_logits_processors(logits, md)
    assert logits[0].tolist() == pytest.approx([0.0, 0.0, 0.0, 2.5, 0.0])


def test_logit_bias_added_before_sampling():
    logits = torch.zeros(2, V)
    logits[:, 4] = 5.0
    params = [SamplingParams(temperature=0.0, logit_bias={9: 6.0, 4: -1.5}), SamplingParams()]
    md = build(params)
    got = logits.clone()
    apply_logits_processors(got, md)
    assert got[0, 9].item() == 6.0 and got[0, 4].item() == 3.5
    assert torch.equal(got[1], logits[1])
    assert Sampler()(logits, md).sampled_token_ids[0].item() == 9
    # a -100 bias removes a token from random sampling in practice
    s = draw(torch.zeros(V), SamplingParams(logit_bias={t: -100.0 for t in range(V - 2)}), 500)
    assert set(s.tolist()) == {V - 2, V - 1}


def test_allowed_token_ids_restrict_greedy_and_random_rows_only():
    logits = row_logits(3).unsqueeze(0).repeat(3, 1)  # [3, V]
    allowed = [5, 11, 30]
    best_allowed = max(allowed, key=lambda t: logits[0, t].item())
    params = [SamplingParams(temperature=0.0, allowed_token_ids=allowed),
              SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.0, allowed_token_ids=(2,), logprobs=2)]
    md = build(params)
    out = Sampler()(logits, md)
    assert out.sampled_token_ids.tolist() == [best_allowed, logits[1].argmax().item(), 2]
    # raw logprobs: the model's distribution, not the masked one
    assert out.logprobs[2].logprob == pytest.approx(torch.log_softmax(logits[2], -1)[2].item(), abs=1e-5)
    s = draw(torch.zeros(V), SamplingParams(allowed_token_ids=allowed, temperature=1.5, top_p=0.9,
                                            repetition_penalty=1.3), 600)
    assert set(s.tolist()) == set(allowed)
    for bad in ([], [-1]):
        with pytest.raises(ValueError, match="allowed_token_ids"):
            SamplingParams(allowed_token_ids=bad)


def test_bad_words_mask_a_sequences_last_token_after_the_rest():
    logits = torch.zeros(1, V)
    logits[0, 9], logits[0, 4], logits[0, 3] = 10.0, 9.0, 1.0
    p = SamplingParams(temperature=0.0, bad_words_token_ids=[[9], [5, 6, 4]])

    def greedy(out):
        return Sampler()(logits, build([p], outputs=[out])).sampled_token_ids.item()

    assert greedy([]) == 4  # 9 is a one-token bad word: always masked
    assert greedy([1, 5, 6]) == 3  # the output ends with 5 6: 4 would complete [5, 6, 4]
    assert greedy([5, 6, 1]) == 4 and greedy([6]) == 4
    s = draw(torch.zeros(V), SamplingParams(bad_words_token_ids=[[t] for t in range(V - 3)]), 300)
    assert set(s.tolist()) == {V - 3, V - 2, V - 1}


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    eos, stop = 7, 8
    logits = torch.zeros(1, V)
    logits[0, eos], logits[0, stop], logits[0, 3] = 10.0, 9.0, 1.0
    p = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[stop])

    def greedy(out_len, params=p):
        md = build([params], outputs=[[0] * out_len], eos_token_ids=[eos])
        return Sampler()(logits, md).sampled_token_ids.item()

    assert greedy(0) == 3 and greedy(2) == 3  # both masked while len(output) < min_tokens
    assert greedy(3) == eos
    ig = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[stop], ignore_eos=True)
    assert greedy(1, ig) == eos  # ignore_eos: EOS is not a stop token, so not masked
    ig_logits = logits.clone()
    ig_logits[0, eos] = 0.0
    md = build([ig], outputs=[[0]], eos_token_ids=[eos])
    assert Sampler()(ig_logits, md).sampled_token_ids.item() == 3  # stop id still masked
    # random sampling never emits a masked id
    s = draw(torch.zeros(V), SamplingParams(min_tokens=1, stop_token_ids=[1, 2]), 3000)
    assert not ({1, 2} & set(s.tolist()))


# ---------------------------------------------------------------- logprobs

def test_logprobs_are_raw_log_softmax_with_rank_and_top_k():
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(9)) * 3
    params = [SamplingParams(temperature=0.5, top_k=4, logprobs=3, repetition_penalty=1.7),
              SamplingParams(logprobs=None),
              SamplingParams(temperature=0.0, logprobs=0, logit_bias={0: 50.0}),
              SamplingParams(temperature=2.0, logprobs=5)]
    md = build(params, prompts=[[1, 2, 3]] * 4, outputs=[[4]] * 4,
               generator=torch.Generator().manual_seed(3))
    out = Sampler()(logits, md)
    lp = torch.log_softmax(logits, -1)
    assert out.logprobs[1] is None
    assert out.sampled_token_ids[2].item() == 0  # biased greedy row
    for i, k in ((0, 3), (2, 0), (3, 5)):
        e, tok = out.logprobs[i], out.sampled_token_ids[i].item()
        assert e.logprob == pytest.approx(lp[i, tok].item(), abs=1e-5)
        assert e.rank == int((lp[i] >= lp[i, tok]).sum())
        top = lp[i].topk(k)
        assert e.top_token_ids == top.indices.tolist()
        assert e.top_logprobs == pytest.approx(top.values.tolist(), abs=1e-5)
    assert out.logprobs[2].top_token_ids == [] and out.logprobs[2].top_logprobs == []


def test_processed_logprobs_mode_reports_the_sampled_distribution():
    logits = row_logits(10).unsqueeze(0)
    md = build([SamplingParams(temperature=0.5, top_k=2, logprobs=4)])
    out = Sampler(logprobs_mode="processed_logprobs")(logits, md)
    e = out.logprobs[0]
    top2 = logits[0].topk(2)
    expect = torch.log_softmax(top2.values / 0.5, -1)
    assert e.top_token_ids[:2] == top2.indices.tolist()
    assert e.top_logprobs[:2] == pytest.approx(expect.tolist(), abs=1e-5)
    assert all(math.isinf(x) for x in e.top_logprobs[2:])
    assert out.sampled_token_ids.item() in top2.indices.tolist()
    with pytest.raises(ValueError):
        Sampler(logprobs_mode="bogus")


def test_compute_prompt_logprobs():
    logits = torch.randn(5, V, generator=torch.Generator().manual_seed(11))
    targets = torch.tensor([3, 0, 31, 3, 7])
    res = compute_prompt_logprobs(logits, targets, k=2)
    lp = torch.log_softmax(logits, -1)
    assert len(res) == 5
    for i, e in enumerate(res):
        t = targets[i].item()
        assert e.logprob == pytest.approx(lp[i, t].item(), abs=1e-5)
        assert e.rank == int((lp[i] >= lp[i, t]).sum())
        assert e.top_token_ids == lp[i].topk(2).indices.tolist()
    assert compute_prompt_logprobs(logits[:0], targets[:0], 2) == []


def test_top_p_mask_matches_full_sort_reference_with_deep_cuts():
    """Rows whose cut lies beyond the partial top-k candidates fall back to a full sort."""
    vocab = 12000
    g = torch.Generator().manual_seed(12)
    logits = torch.cat([torch.randn(2, vocab, generator=g) * 0.05,  # flat: cut ~ p * vocab
                        torch.randn(3, vocab, generator=g) * 4.0])  # peaked: cut within 1024
    top_p = [0.5, 0.97, 0.9, 0.3, 0.8]  # cuts: second tier, full sort, first tier x3
    params = [SamplingParams(top_p=p) for p in top_p]
    params[4] = SamplingParams(top_p=0.8, top_k=5)  # top_k is not applied by the top_p stage
    md = build(params, vocab=vocab)
    got = logits.clone()
    md.stage("top_p").apply(got)
    for r, p in enumerate(top_p):
        probs = logits[r].softmax(-1)
        vals, idx = probs.sort(descending=True)
        before = vals.cumsum(0) - vals  # mass strictly more likely than each token
        expect = set(idx[before < p].tolist())
        kept = set(torch.isfinite(got[r]).nonzero().squeeze(1).tolist())
        assert kept == expect, (r, len(kept), len(expect))
        assert torch.equal(got[r][torch.isfinite(got[r])], logits[r][torch.isfinite(got[r])])
    kept = [int(torch.isfinite(got[r]).sum()) for r in range(5)]
    assert 1024 < kept[0] <= 8192 and kept[1] > 8192 and max(kept[2:]) <= 1024, kept


def test_empty_batch_and_top_k_beyond_vocab():
    out = Sampler()(torch.zeros(0, V), build([]))
    assert out.sampled_token_ids.shape == (0,) and out.logprobs == []
    md = build([SamplingParams(top_k=V), SamplingParams(top_k=V + 5), SamplingParams(top_k=-1)])
    assert md.stage("top_k") is None  # k >= V keeps everything: no top-k pass
    s = draw(torch.zeros(V), SamplingParams(top_k=V + 5), 2000)
    assert len(set(s.tolist())) > V // 2
