"""The CUDA path on a real GPU: our model against Hugging Face on the same GPU, CUDA-graph
decode steps against eager ones, and each single-GPU executor against the CPU.

Runs only where a CUDA GPU is present and TRITON_INTERPRET=0 (then test_kernels.py also
launches every compiled kernel on the GPU). CI has no GPU: there, test_kernels.py and
test_kernels_model.py run the same Triton kernels in the interpreter, and
test_kernels_compile.py compiles them for sm_80 and sm_90.
"""
from __future__ import annotations

import random

import pytest
import torch

from kernels.triton_ops import HAS_TRITON, INTERPRET

pytestmark = pytest.mark.skipif(
    not (HAS_TRITON and torch.cuda.is_available() and not INTERPRET),
    reason="needs a CUDA GPU and TRITON_INTERPRET=0")

from executor_driver import greedy_generate  # noqa: E402
from model_utils import PagedRunner, load_hf_model, load_our_model, make_tiny_model_dir  # noqa: E402
from test_executors import engine_config, run  # noqa: E402
from test_models import CONFIGS as CPU_CONFIGS  # noqa: E402

CONFIGS = {
    "llama-untied": dict(arch="llama", tie=False),
    "qwen2-bias-tied": dict(arch="qwen2", tie=True),
    "llama3-rope-gqa4": dict(arch="llama", num_attention_heads=8, num_key_value_heads=2,
                             rope_parameters=CPU_CONFIGS["llama3-rope"]["rope_parameters"]),
    "head-dim-128": dict(arch="llama", hidden_size=256, num_attention_heads=2,
                         num_key_value_heads=1),
}


def _prompts(vocab, lens=(5, 17, 33, 1, 70), seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lens]


@torch.no_grad()
def _hf_logits(hf, tokens):
    return hf(torch.tensor([tokens], device="cuda")).logits[0].float()  # [L, vocab]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_model_on_cuda_matches_hf_on_cuda(tmp_path, name):
    """Prefill batch, a chunk over a cached prefix, then mixed decode steps, over a shuffled
    paged cache: every logit row within 1e-3 of HF's full forward of the same tokens."""
    d = make_tiny_model_dir(tmp_path, **CONFIGS[name])
    ours = load_our_model(d, device="cuda")
    hf = load_hf_model(d).cuda()
    runner = PagedRunner(ours, num_blocks=64, block_size=16, seed=1)
    for k_cache, v_cache in runner.kv_caches:  # unwritten slots: NaN, must stay unread
        k_cache.fill_(float("nan"))
        v_cache.fill_(float("nan"))
    a, b, c = _prompts(ours.config.vocab_size, lens=(40, 7, 21))
    steps = [{"a": a[:24], "b": b}, {"a": a[24:], "b": [9], "c": c}]
    steps += [{"a": [11 + i], "b": [12 + i], "c": [13 + i]} for i in range(3)]
    seqs = {"a": [], "b": [], "c": []}
    for step in steps:
        got = runner.step(step)
        for sid, toks in step.items():
            seqs[sid] += toks
            expected = _hf_logits(hf, seqs[sid])[-len(toks):]
            assert not torch.isnan(got[sid]).any(), (name, sid)
            err = (got[sid].float() - expected).abs().max().item()
            assert err < 1e-3, f"{name} {sid}: max abs diff {err}"


def test_greedy_on_cuda_matches_hf_generate(tmp_path):
    d = make_tiny_model_dir(tmp_path, arch="llama")
    ours = load_our_model(d, device="cuda")
    hf = load_hf_model(d).cuda()
    prompts = _prompts(ours.config.vocab_size)
    got = PagedRunner(ours, num_blocks=64).greedy_generate(dict(enumerate(prompts)), 24)
    for i, p in enumerate(prompts):
        out = hf.generate(torch.tensor([p], device="cuda"), max_new_tokens=24, do_sample=False,
                          min_new_tokens=24, pad_token_id=0)
        assert got[i] == out[0, len(p):].tolist(), f"prompt {i}"


def test_bfloat16_on_cuda_close_to_fp32(tmp_path):
    d = make_tiny_model_dir(tmp_path, arch="qwen2")
    tokens = _prompts(320, lens=(50,))[0]
    logits = {}
    for dtype in ("float32", "bfloat16"):
        runner = PagedRunner(load_our_model(d, dtype=dtype, device="cuda"), num_blocks=16)
        logits[dtype] = runner.step({0: tokens})[0].float()
    err = (logits["float32"] - logits["bfloat16"]).abs().max().item()
    assert 0 < err < 0.25, err


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny"), arch="llama")


@pytest.fixture(scope="module")
def cpu_tokens(tiny_dir):
    prompts = _prompts(320, lens=(5, 17, 33, 1, 70, 9, 2, 40, 3))  # 9 decodes: graph size 16
    return prompts, run(engine_config(tiny_dir, num_blocks=256), prompts, max_new=16)


@pytest.mark.parametrize("executor,enforce_eager,chunk", [
    ("uniproc", True, None), ("uniproc", False, None), ("uniproc", False, 7),
    ("multiproc", False, None)])
def test_executor_on_cuda_matches_cpu(tiny_dir, cpu_tokens, executor, enforce_eager, chunk):
    """Eager and CUDA-graph decode steps (9 sequences padded to a captured batch of 16)."""
    prompts, expected = cpu_tokens
    got = run(engine_config(tiny_dir, executor, num_blocks=256, device="cuda",
                            enforce_eager=enforce_eager), prompts, max_new=16, chunk=chunk)
    assert got == expected


def test_uniproc_shutdown_gives_gpu_memory_back(tiny_dir):
    """An in-process engine sized by profiling (30% of the GPU) frees it all at shutdown, so a
    second engine in the same process (bench.executors, a notebook) can start."""
    from executors import create_executor

    torch.cuda.empty_cache()
    free_before = torch.cuda.mem_get_info()[0]
    allocated_before = torch.cuda.memory_allocated()
    ex = create_executor(engine_config(tiny_dir, num_blocks=None, device="cuda",
                                       gpu_memory_utilization=0.3))
    try:
        ex.initialize_kv_cache(ex.determine_num_kv_blocks())
        greedy_generate(ex, _prompts(320, lens=(5, 9)), 4)
        assert torch.cuda.mem_get_info()[0] < free_before - (8 << 30)  # the KV cache took its share
    finally:
        ex.shutdown()
    assert torch.cuda.memory_allocated() - allocated_before < 16 << 20
    assert torch.cuda.mem_get_info()[0] > free_before - (256 << 20)


def _mixed_batch(vocab):
    from llmsvc.sampling_params import SamplingParams

    params = [SamplingParams(temperature=0.0, logprobs=3),
              SamplingParams(temperature=0.0, repetition_penalty=1.7, frequency_penalty=0.3,
                             presence_penalty=0.2, logit_bias={5: 4.0}, logprobs=2,
                             allowed_token_ids=list(range(0, vocab, 3))),
              SamplingParams(temperature=0.8, top_k=5, seed=11),
              SamplingParams(temperature=1.2, top_p=0.7, min_p=0.05, seed=12, logprobs=1),
              SamplingParams(temperature=1.0, min_tokens=4, stop_token_ids=[7], seed=13),
              SamplingParams(temperature=0.0, min_tokens=4, stop_token_ids=[7], bad_words_token_ids=[[3]])]
    rng = random.Random(3)
    prompts = [[rng.randrange(vocab) for _ in range(9)] for _ in params]
    outputs = [[rng.randrange(vocab) for _ in range(2)] for _ in params]
    return params, prompts, outputs


def test_sampler_on_cuda_agrees_with_cpu():
    """Penalties, bias, min_tokens, allowed ids and bad words process logits as on the CPU;
    greedy rows and raw logprobs agree; seeded rows repeat on the GPU and truncated rows stay
    in their sets."""
    from llmsvc.worker.sampler import Sampler, apply_logits_processors
    from llmsvc.worker.sampling_metadata import SamplingMetadata

    vocab = 1000
    params, prompts, outputs = _mixed_batch(vocab)
    logits = torch.randn(len(params), vocab, generator=torch.Generator().manual_seed(0)) * 3
    logits[:, 7] = 20.0  # the stop id leads: masked by min_tokens
    md = {dev: SamplingMetadata.build(params, prompts, outputs, vocab, dev, eos_token_ids=[2])
          for dev in ("cpu", "cuda")}
    processed = {}
    for dev in md:
        processed[dev] = logits.clone().to(dev)
        apply_logits_processors(processed[dev], md[dev])
    torch.testing.assert_close(processed["cuda"].cpu(), processed["cpu"])

    out = {dev: Sampler()(logits.to(dev), md[dev]) for dev in md}
    tok = {dev: o.sampled_token_ids.cpu().tolist() for dev, o in out.items()}
    assert [tok["cuda"][i] for i in (0, 1, 5)] == [tok["cpu"][i] for i in (0, 1, 5)]
    assert tok["cuda"][5] != 7 and tok["cuda"][4] != 7
    for i, (a, b) in enumerate(zip(out["cuda"].logprobs, out["cpu"].logprobs)):
        assert (a is None) == (b is None), i
        if a is not None and i in (0, 1):  # greedy rows: the same token, the same raw logprobs
            assert a.rank == b.rank and a.top_token_ids == b.top_token_ids
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert a.top_logprobs == pytest.approx(b.top_logprobs, abs=1e-4)
    seeded = []
    for order in (list(range(len(params))), list(range(len(params)))[::-1]):
        m = SamplingMetadata.build([params[i] for i in order], [prompts[i] for i in order],
                                   [outputs[i] for i in order], vocab, "cuda", eos_token_ids=[2])
        t = Sampler()(logits[order].cuda(), m).sampled_token_ids.cpu().tolist()
        seeded.append({row: t[j] for j, row in enumerate(order)})
    assert all(seeded[0][i] == seeded[1][i] for i in (2, 3, 4))  # independent of batch order

    from llmsvc.sampling_params import SamplingParams
    n = 400
    row = torch.randn(vocab, generator=torch.Generator().manual_seed(1))  # [V], no clear winner
    m = SamplingMetadata.build([SamplingParams(temperature=1.5, top_k=5)] * n, [[]] * n, [[]] * n,
                               vocab, "cuda")
    draws = Sampler()(row.expand(n, -1).cuda(), m).sampled_token_ids.cpu().tolist()
    assert set(draws) <= set(row.topk(5).indices.tolist()) and len(set(draws)) > 2


def test_cache_beyond_int32_offsets_on_cuda():
    if torch.cuda.mem_get_info()[0] < 10 << 30:
        pytest.skip("needs 10 GiB of free GPU memory")
    from test_kernels_int64 import check_cache_beyond_int32_offsets

    check_cache_beyond_int32_offsets("cuda")
    torch.cuda.empty_cache()


# Async scheduling on the GPU: the CPU test module's workload (chunked prefill, preemption in a
# 36-block pool, prefix hits, stop strings and tokens, n=2 seeded sampling, max_tokens=1) and its
# synchronous CPU outputs, as the `reference` fixture.
from test_async_scheduling_model import ENGINE as ASYNC_ENGINE, check_grpc_async_core_process  # noqa: E402
from test_async_scheduling_model import generate, model_dir, reference  # noqa: E402,F401 (fixtures)


@pytest.fixture(scope="module")
def cuda_sync(model_dir, reference):
    from llmsvc import LLM

    prompts, params, _, _ = reference
    llm = LLM(model=model_dir, device="cuda", **ASYNC_ENGINE)
    try:
        return generate(llm, prompts, params)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("executor,enforce_eager", [("uniproc", False), ("uniproc", True),
                                                    ("multiproc", False)])
def test_async_scheduling_on_cuda_matches_sync(model_dir, reference, cuda_sync, executor, enforce_eager):
    """CUDA-graph (and eager) decode steps under async scheduling give synchronous mode's
    outputs on the GPU, seeded samples included; the greedy requests give the CPU's tokens."""
    from llmsvc import LLM

    prompts, params, cpu_out, _ = reference
    llm = LLM(model=model_dir, device="cuda", executor=executor, enforce_eager=enforce_eager,
              async_scheduling=True, **ASYNC_ENGINE)
    try:
        assert llm.llm_engine.core.async_scheduling
        got = generate(llm, prompts, params)
        assert llm.llm_engine.get_stats().num_preemptions > 0
    finally:
        llm.shutdown()
    assert got == cuda_sync
    greedy = [i for i, p in enumerate(params) if p.temperature == 0.0]
    assert [got[i] for i in greedy] == [cpu_out[i] for i in greedy]


def test_grpc_async_core_process_on_cuda(model_dir, reference):
    check_grpc_async_core_process(model_dir, reference, device="cuda")


@pytest.mark.parametrize("enforce_eager", [False, True])
def test_lora_mixed_batch_on_cuda_matches_hf(tmp_path_factory, enforce_eager):
    """LoRA on the GPU: adapter steps eager, base-only decode steps in CUDA graphs, tokens as
    test_lora.py's HF references on merged weights."""
    from test_lora import build_served, check_mixed_batch

    check_mixed_batch(build_served(tmp_path_factory.mktemp("lora")), device="cuda", enforce_eager=enforce_eager)


@pytest.mark.parametrize("enforce_eager", [False, True])
def test_spec_decode_on_cuda_matches_hf(tmp_path_factory, enforce_eager):
    """Prompt-lookup drafts on the GPU: draft steps eager, decode steps without drafts in CUDA
    graphs, HF's greedy tokens (test_spec_decode_model.py's check, on the CPU there)."""
    from test_spec_decode_model import build_served, check_greedy

    check_greedy(build_served(tmp_path_factory.mktemp("spec")), device="cuda", enforce_eager=enforce_eager)
