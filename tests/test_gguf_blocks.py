"""--quantization gguf (the default for a .gguf model in float32 on the CPU): a GGUF's Q4_0 /
Q4_1 / Q8_0 linear weights, multiplied as blocks, compute the logits of the same model
dequantized at load, bit for bit, on every executor."""
from __future__ import annotations

import functools
import os

import numpy as np
import pytest
import torch

from kernels import ops
from kernels.cpu_ops import isa, linear
from kernels.cpu_ops.build import load
from llmsvc.config import ModelConfig
from llmsvc.models.loader import build_model
from llmsvc.models.resolve import check_quantization, gguf_file, resolve_model_config, resolve_quantization
from model_utils import PagedRunner, load_hf_model, make_tiny_model_dir
from server_harness import TINY_VOCAB

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType
# every kept type, mixed inside the fused q/k/v and gate/up; layer 1's up_proj stays F32, so
# that layer's gate/up must stay on the fp32 path while the rest multiply blocks
QUANT = {"layers.1.mlp.up_proj": None, "q_proj": Q.Q4_0, "k_proj": Q.Q4_1, "v_proj": Q.Q8_0,
         "o_proj": Q.Q4_1, "gate_proj": Q.Q4_1, "up_proj": Q.Q4_0, "down_proj": Q.Q8_0,
         "embed_tokens": Q.Q8_0, "lm_head": Q.Q4_1}


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    from test_models_gguf import write_gguf

    tmp = tmp_path_factory.mktemp("gguf-blocks")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LLMSVC_CACHE", str(tmp / "cache"))
        src = make_tiny_model_dir(tmp, arch="llama", tie=False, vocab_size=TINY_VOCAB)
        path = str(tmp / "tiny.gguf")
        write_gguf(src, path, "llama", QUANT)
        yield path


@functools.cache
def _blocks_kind() -> str:
    """What a layer with GGUF blocks packs in this build: "gguf" where gemm.c is built (AVX2 or
    AVX-512) and multiplies them, else "fp32", the dequantized weight (LLMSVC_CPU_ISA=sse4, no
    compiler, LLMSVC_CPU_KERNELS=0), for which every check here holds too."""
    built = load() is not None and linear.enabled() and isa.at_least("avx2")
    probe = ops.pack_gguf_blocks(torch.zeros(48, 32, dtype=torch.int8), torch.ones(48, 1), torch.zeros(48, 1))
    assert (probe is not None) == built, "GGUF blocks packed where gemm.c is not built, or not where it is"
    return "gguf" if built else "fp32"


def _model(path, quantization):
    return build_model(resolve_model_config(ModelConfig(model=path, dtype="float32", quantization=quantization)))


def _packed_kinds(model) -> dict:
    return {name: "gguf" if m.packed_weight is not None and m.packed_weight.dtype == torch.uint8 else "fp32"
            for name, m in model.named_modules() if hasattr(m, "packed_weight")}


def test_blocks_give_the_dequantized_models_logits_bit_for_bit(tiny_gguf):
    plain, blocks = _model(tiny_gguf, "none"), _model(tiny_gguf, "gguf")
    kinds = _packed_kinds(blocks)
    assert kinds.pop("model.layers.1.mlp.gate_up_proj") == "fp32"  # its up_proj is F32 in the file
    assert set(kinds.values()) == {_blocks_kind()}, kinds  # q/k/v of three types, o, gate/up, down, LM head
    assert set(_packed_kinds(plain).values()) == {"fp32"}
    if _blocks_kind() == "gguf":
        assert blocks.model._make_native_plan() is not None  # one native call with mixed projections
    prompts = {0: list(range(3, 40)), 1: list(range(100, 107)), 2: [5]}
    runs = [PagedRunner(m, num_blocks=16, block_size=16) for m in (plain, blocks)]
    for step in (prompts, {0: [7], 1: [8], 2: [9]}, {0: [10]}):  # prefill, then decodes
        a, b = (r.step(step) for r in runs)
        for sid in step:
            assert torch.equal(a[sid], b[sid]), sid
    # and the dequantized weights are what transformers reads from the file
    from llmsvc.models.resolve import resolve_model_dir
    hf = load_hf_model(resolve_model_dir(tiny_gguf))
    ids = torch.tensor(prompts[0])
    got = PagedRunner(blocks, num_blocks=8, block_size=16).step({0: ids.tolist()})[0]
    with torch.no_grad():
        torch.testing.assert_close(got, hf(ids[None]).logits[0].float(), atol=1e-4, rtol=1e-4)


def test_blocks_are_read_from_the_file_once(tiny_gguf, monkeypatch):
    from llmsvc.models import gguf_blocks
    from llmsvc.models.resolve import resolve_model_dir

    _model(tiny_gguf, "gguf")
    kept = os.path.join(resolve_model_dir(tiny_gguf), "gguf_blocks", "blocks.safetensors")
    assert os.path.isfile(kept)

    def no_reread(*a):
        raise AssertionError("the GGUF was parsed again")
    monkeypatch.setattr(gguf_blocks, "_read_gguf", no_reread)
    model = _model(tiny_gguf, "gguf")
    assert list(_packed_kinds(model).values()).count("gguf") == (2 * 4 - 1 + 1 if _blocks_kind() == "gguf" else 0)


def test_decode_blocks_matches_gguf_py():
    from llmsvc.models.gguf_blocks import decode_blocks
    from kernels.reference import dequantize_gguf_blocks

    g = torch.Generator().manual_seed(0)
    w = (torch.randn(6, 96, generator=g) * 0.1).numpy()
    for qt in (Q.Q4_0, Q.Q4_1, Q.Q8_0):
        raw = gguf.quants.quantize(w, qt)
        q, d, m = decode_blocks(qt.name, raw, 6, 96)
        assert q.dtype == torch.int8 and d.shape == m.shape == (6, 3)
        want = torch.from_numpy(gguf.quants.dequantize(raw, qt))
        assert torch.equal(dequantize_gguf_blocks(q, d, m), want), qt.name
    assert decode_blocks("Q6_K", raw, 6, 96) is None


def test_executors_give_uniprocs_tokens(tiny_gguf):
    from test_executors import engine_config, prompts_for, run

    def config(executor="uniproc", tp=1, quantization="gguf"):
        c = engine_config(tiny_gguf, executor, tp)
        c.model_config.quantization = quantization
        return c
    prompts = prompts_for(TINY_VOCAB)
    expected = run(config(quantization="none"), prompts)  # dequantized at load
    assert run(config("uniproc", 1), prompts, chunk=7) == expected
    assert run(config("tp", 2), prompts) == expected


def test_quantization_is_checked_at_start(tiny_gguf, tmp_path):
    check_quantization("none", str(tmp_path), "bfloat16", "cuda")  # nothing to check
    check_quantization("gguf", tiny_gguf, "float32", "cpu")
    check_quantization("gguf", os.path.dirname(tiny_gguf), "float32", "auto")  # a directory holding one .gguf
    assert gguf_file(os.path.dirname(tiny_gguf)) == tiny_gguf
    for args, match in (((tiny_gguf, "bfloat16", "cpu"), "float32"), ((tiny_gguf, "float32", "cuda"), "CPU"),
                        ((make_tiny_model_dir(tmp_path), "float32", "cpu"), "needs a .gguf")):
        with pytest.raises(ValueError, match=match):
            check_quantization("gguf", *args)
    with pytest.raises(ValueError, match="unsupported quantization 'awq'"):
        check_quantization("awq", tiny_gguf, "float32", "cpu")
    with pytest.raises(ValueError, match="computes in float32"):
        resolve_model_config(ModelConfig(model=tiny_gguf, dtype="bfloat16", quantization="gguf"))


def test_quantization_auto_takes_the_blocks_where_they_apply(tiny_gguf, tmp_path):
    """The default, "auto": GGUF blocks for a .gguf model computed in float32 off CUDA (as vLLM
    runs a GGUF quantized), the dequantized weights anywhere else; an explicit choice stands."""
    assert resolve_quantization("auto", tiny_gguf, "float32", "cpu") == "gguf"
    assert resolve_quantization("auto", tiny_gguf, "float32", "auto") == "gguf"
    assert resolve_quantization("auto", os.path.dirname(tiny_gguf), "float32", "cpu") == "gguf"
    assert resolve_quantization("auto", tiny_gguf, "bfloat16", "cpu") == "none"
    assert resolve_quantization("auto", tiny_gguf, "float32", "cuda") == "none"
    assert resolve_quantization("auto", make_tiny_model_dir(tmp_path), "float32", "cpu") == "none"
    assert resolve_quantization("none", tiny_gguf, "float32", "cpu") == "none"
    assert resolve_quantization("int8", tiny_gguf, "float32", "cpu") == "int8"
    assert ModelConfig().quantization == "auto"
    assert resolve_model_config(ModelConfig(model=tiny_gguf, dtype="float32")).quantization == "gguf"
    assert resolve_model_config(ModelConfig(model=tiny_gguf, dtype="bfloat16")).quantization == "none"
    assert resolve_model_config(ModelConfig(model=tiny_gguf, quantization="none")).quantization == "none"
    with pytest.raises(ValueError, match="computes in float32"):
        resolve_quantization("gguf", tiny_gguf, "bfloat16", "cpu")  # an explicit choice is still checked


def test_served_over_grpc_by_default(tiny_gguf):
    """`llmsvc serve model.gguf` with no flag multiplies the blocks: GetModelInfo says so, and a
    greedy stream gives the tokens of the model dequantized at load."""
    import grpc

    from executor_procs import LoggedProcess, llmsvc_cmd
    from llmsvc import LLM, SamplingParams
    from llmsvc.v1 import llmsvc_pb2 as pb
    from llmsvc.v1 import llmsvc_pb2_grpc as pb_grpc

    prompt = list(range(10, 30))
    want = LLM(tiny_gguf, dtype="float32", quantization="none", kv_cache_memory="8MiB").generate(
        [{"prompt_token_ids": prompt}], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    srv = LoggedProcess(llmsvc_cmd("serve", tiny_gguf, "--host", "127.0.0.1", "--port", "0",
                                   "--device", "cpu", "--kv-cache-memory", "8MiB", "--shutdown-grace", "0"))
    try:
        port = int(srv.wait_for(r"listening on 127\.0\.0\.1:(\d+)").group(1))
        srv.wait_for(r"ready: serving", timeout=180)
        assert any("GGUF blocks: 8 of 9 layers" in line for line in srv.lines)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.LlmServiceStub(channel)
            info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
            assert (info.quantization, info.dtype) == ("gguf", "float32")
            got = [t for r in stub.Generate(pb.GenerateRequest(
                token_ids=pb.TokenIds(ids=prompt), stream=True, sampling=pb.SamplingParams(temperature=0.0),
                stopping=pb.StoppingCriteria(max_tokens=12, ignore_eos=True)), timeout=60) for t in r.token_ids]
        assert got == list(want[0].outputs[0].token_ids)
    finally:
        srv.kill()


def _random_blocks(kind, seed):
    """f(array) -> (random blocks of `kind` shaped like the array, kind): any bytes are valid
    blocks once the fp16 scales are finite; scales ~1e-3 keep the weights O(0.1-1)."""
    def make(data):
        rng = np.random.default_rng(seed)
        n, k = data.shape
        per, size = gguf.GGML_QUANT_SIZES[kind]
        raw = rng.integers(0, 256, (n, k // per, size), dtype=np.uint8)
        fields = {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,), Q.Q5_0: (0,), Q.Q5_1: (0, 2)}[kind]
        for at in fields:
            raw[..., at:at + 2] = (rng.standard_normal((n, k // per, 1)) * 1e-3).astype(np.float16).view(np.uint8)
        return raw.reshape(n, -1), kind
    return make


@pytest.fixture(scope="module")
def tiny_k_quants(tmp_path_factory):
    """A model whose linear weights are K-quants (256-weight super-blocks, so hidden 256), the
    fused q/k/v mixing Q4_K, Q5_K and Q6_K (16-weight blocks), plus Q5_0 and Q5_1."""
    from test_models_gguf import write_gguf

    tmp = tmp_path_factory.mktemp("gguf-k-quants")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LLMSVC_CACHE", str(tmp / "cache"))
        src = make_tiny_model_dir(tmp, arch="llama", tie=False, vocab_size=TINY_VOCAB, hidden_size=256,
                                  intermediate_size=512)
        kinds = {"q_proj": Q.Q4_K, "k_proj": Q.Q5_K, "v_proj": Q.Q6_K, "o_proj": Q.Q5_0, "gate_proj": Q.Q5_1,
                 "up_proj": Q.Q4_K, "down_proj": Q.Q6_K, "lm_head": Q.Q5_K}
        path = str(tmp / "k.gguf")
        write_gguf(src, path, "llama", {key: _random_blocks(kind, i) for i, (key, kind) in enumerate(kinds.items())})
        yield path


def test_k_quants_and_mixed_block_sizes(tiny_k_quants):
    from test_executors import engine_config, prompts_for, run

    plain, blocks = _model(tiny_k_quants, "none"), _model(tiny_k_quants, "gguf")
    assert set(_packed_kinds(blocks).values()) == {_blocks_kind()}, _packed_kinds(blocks)
    if _blocks_kind() == "gguf":
        qkv = blocks.model.layers[0].self_attn.qkv_proj.packed_weight
        assert int(qkv[:4].view(torch.int32)) == 16  # Q6_K's v: the fused weight takes 16-weight blocks
    prompts = {0: list(range(3, 40)), 1: [5, 6]}
    runs = [PagedRunner(m, num_blocks=16, block_size=16) for m in (plain, blocks)]
    for step in (prompts, {0: [7], 1: [8]}):
        a, b = (r.step(step) for r in runs)
        for sid in step:
            assert torch.isfinite(a[sid]).all() and torch.equal(a[sid], b[sid]), sid
    config, plain_config = engine_config(tiny_k_quants, "tp", 2), engine_config(tiny_k_quants)
    config.model_config.quantization, plain_config.model_config.quantization = "gguf", "none"
    ids = prompts_for(TINY_VOCAB, lens=(9, 20))
    assert run(config, ids) == run(plain_config, ids)


def test_fp32_copies_go_and_lora_still_applies(tiny_gguf, tmp_path):
    """Layers multiplying blocks drop their fp32 weight (meta: shape and dtype only), a tied or
    fp32 one keeps it; LoRA adapters on such layers give the tokens they give over `none`; steps
    past the native GEMM's 1024 rows go through it in chunks."""
    from llmsvc import LLM, LoRARequest, SamplingParams
    from llmsvc.models.resolve import resolve_model_dir
    from tests.lora_utils import make_lora_adapter

    model = _model(tiny_gguf, "gguf")
    metas = {name for name, p in model.named_parameters() if p.is_meta}
    if _blocks_kind() == "gguf":
        assert "model.layers.0.self_attn.qkv_proj.weight" in metas and "lm_head.weight" in metas
    else:  # nothing multiplies blocks: every fp32 weight stays
        assert not metas
    assert "model.layers.1.mlp.gate_up_proj.weight" not in metas  # an F32 part: fp32 path
    assert not any("embed_tokens" in n or "norm" in n for n in metas)
    x = torch.randn(1300, 64)
    layer = model.model.layers[0].self_attn.qkv_proj
    plain = _model(tiny_gguf, "none").model.layers[0].self_attn.qkv_proj
    torch.testing.assert_close(layer(x), plain(x), atol=1e-5, rtol=1e-5)  # 1024 + 276 rows
    assert layer(x[:0]).shape == (0, plain.weight.shape[0])

    adapter = make_lora_adapter(resolve_model_dir(tiny_gguf), str(tmp_path / "lora"), rank=4)
    prompts = [[3, 4, 5, 6, 7], list(range(20, 40))]
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    got = {}
    for q in ("none", "gguf"):
        llm = LLM(tiny_gguf, dtype="float32", quantization=q, kv_cache_memory="8MiB", lora_modules={"a": adapter},
                  max_lora_rank=8)
        try:
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False,
                                lora_request=[LoRARequest("a", 1, adapter), None])
            got[q] = [list(o.outputs[0].token_ids) for o in outs]
        finally:
            llm.shutdown()
    assert got["gguf"] == got["none"]


def test_tied_lm_head_multiplies_blocks_and_keeps_the_embedding(tmp_path, monkeypatch):
    from test_models_gguf import write_gguf

    monkeypatch.setenv("LLMSVC_CACHE", str(tmp_path / "cache"))
    src = make_tiny_model_dir(tmp_path, arch="llama", tie=True, vocab_size=TINY_VOCAB)
    path = str(tmp_path / "tied.gguf")
    write_gguf(src, path, "llama", {"embed_tokens": Q.Q8_0, "proj": Q.Q4_1})
    plain, blocks = _model(path, "none"), _model(path, "gguf")
    head, embed = blocks.lm_head, blocks.model.embed_tokens
    assert head.weight is embed.weight and not embed.weight.is_meta
    assert (head.packed_weight is not None and head.packed_weight.dtype == torch.uint8) == (_blocks_kind() == "gguf")
    ids = list(range(3, 30))
    a, b = (PagedRunner(m, num_blocks=8, block_size=16).step({0: ids})[0] for m in (plain, blocks))
    assert torch.equal(a, b)
