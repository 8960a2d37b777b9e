"""Qwen3-MoE and Mixtral == Hugging Face transformers on the same tiny random weights (fp32):
prefill logits, chunked prefill and decode over the paged cache, greedy tokens through the engine
with chunked prefill, on the CPU path and the Triton path (interpreter); checkpoint names, the
per-op fallback of the one-call CPU decoder, expert sharding and tensor parallelism."""
from __future__ import annotations

import contextlib
import functools

import pytest
import torch

from kernels import ops
from kernels.triton_ops import HAS_TRITON, INTERPRET
from model_utils import PagedRunner, load_hf_model, load_our_model, make_tiny_model_dir
from server_harness import EOS, IM_START, TINY_VOCAB, tiny_tokenizer
from test_models import _close, _hf_logits  # fp32 logits within 1e-4 of transformers'
from test_models import _seqs as _draw

CONFIGS = {
    "qwen3moe": dict(arch="qwen3_moe", norm_topk_prob=True),
    # layer 0 dense (off the sparse step), 1 sparse, 2 dense (step), 3 dense (mlp_only_layers)
    "qwen3moe-dense-layers": dict(arch="qwen3_moe", norm_topk_prob=False, num_hidden_layers=4,
                                  decoder_sparse_step=2, mlp_only_layers=[3]),
    "mixtral": dict(arch="mixtral"),
}
needs_interpreter = pytest.mark.skipif(not (HAS_TRITON and INTERPRET),
                                       reason="CPU tensors take the Triton path only in the interpreter")
PATHS = ["cpu", pytest.param("triton", marks=needs_interpreter)]


def _path(name):
    return ops.force_triton() if name == "triton" else contextlib.nullcontext()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    @functools.cache
    def get(name):  # -> (model dir, our model, HF model), built once
        d = make_tiny_model_dir(tmp_path_factory.mktemp(name), **CONFIGS[name])
        return d, load_our_model(d), load_hf_model(d)
    return get


def _seqs(lens, seed, vocab=320):
    return _draw(len(lens), lens, vocab, seed)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_prefill_batch_matches_hf(models, name, path):
    _, ours, hf = models(name)
    seqs = _seqs([29, 5, 40], seed=1)
    runner = PagedRunner(ours, num_blocks=32, block_size=16, seed=2)
    with _path(path):
        out = runner.step(dict(enumerate(seqs)))  # one flattened batch
    for i, s in enumerate(seqs):
        _close(out[i], _hf_logits(hf, s))
    assert out[0].abs().max() > 0.5


def test_dense_and_sparse_layers_follow_the_config(models):
    from llmsvc.models.layers.fused_moe import FusedMoE
    _, ours, hf = models("qwen3moe-dense-layers")
    sparse = [isinstance(getattr(layer.mlp, "experts", None), FusedMoE) for layer in ours.model.layers]
    assert sparse == [False, True, False, False]
    assert sparse == [hasattr(layer.mlp, "experts") for layer in hf.model.layers]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_chunked_prefill_then_decode_matches_hf(models, name):
    _, ours, hf = models(name)
    a, b = _seqs([50, 21], seed=3)
    runner = PagedRunner(ours, num_blocks=40, block_size=4, seed=4)
    ref_a, ref_b = _hf_logits(hf, a), _hf_logits(hf, b)
    got = runner.step({"a": a[:17]})["a"]
    out = runner.step({"a": a[17:44], "b": b[:-3]})  # a chunk over a cached prefix beside a prompt
    _close(torch.cat([got, out["a"]]), ref_a[:44])
    _close(out["b"], ref_b[:-3])
    for j in range(3):  # decodes of b beside the rest of a's prefill / a's decodes
        batch = {"b": [b[len(b) - 3 + j]], "a": a[44:47] if j == 0 else [a[46 + j]]}
        out = runner.step(batch, last_only=True)
        _close(out["b"], ref_b[len(b) - 3 + j])
        _close(out["a"], ref_a[46 + j])


@pytest.fixture(scope="module")
def served_dirs(tmp_path_factory):
    """Each family with tiny_tokenizer()'s vocabulary and the tokenizer saved beside it."""
    dirs = {}
    for name in ("qwen3moe", "mixtral"):
        d = make_tiny_model_dir(tmp_path_factory.mktemp(name), **CONFIGS[name], vocab_size=TINY_VOCAB,
                                eos_token_id=EOS, bos_token_id=IM_START, pad_token_id=0)
        tiny_tokenizer().save_pretrained(d)
        dirs[name] = d
    return dirs


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("name", ["qwen3moe", "mixtral"])
def test_engine_greedy_matches_hf_generate(served_dirs, name, path, monkeypatch):
    """24 greedy tokens of 3 concurrent requests through LLM (scheduler, chunked prefill with a
    16-token budget, paged cache) == HF generate of each prompt alone. The Triton path (in the
    interpreter, ~1 s a step) runs 8 of them: its chunked prefills and decodes beside them."""
    from llmsvc import LLM, SamplingParams
    d, new = served_dirs[name], 8 if path == "triton" else 24
    prompts = _seqs([37, 6, 19], seed=5, vocab=TINY_VOCAB - 3)
    hf = load_hf_model(d)
    with torch.no_grad():
        expected = [hf.generate(torch.tensor([p]), do_sample=False, max_new_tokens=new, min_new_tokens=new,
                                pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    triton_calls = []
    if HAS_TRITON:
        real = ops._tri.fused_moe
        monkeypatch.setattr(ops._tri, "fused_moe", lambda *a: triton_calls.append(1) or real(*a))
    llm = LLM(d, max_num_batched_tokens=16, max_num_seqs=4, max_model_len=128)
    try:
        with _path(path):
            outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True),
                                use_tqdm=False)
        stats = llm.llm_engine.get_stats()
    finally:
        llm.shutdown()
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert stats.num_free_kv_blocks == stats.num_kv_blocks
    assert bool(triton_calls) == (path == "triton")


# (family, checkpoint tensor under model.layers.1.) -> (our parameter under model.layers.1., shard id)
NAME_MAP = [
    ("qwen3_moe", "mlp.experts.7.gate_proj.weight", "mlp.experts.gate_up_proj", (7, 0)),
    ("qwen3_moe", "mlp.experts.3.up_proj.weight", "mlp.experts.gate_up_proj", (3, 1)),
    ("qwen3_moe", "mlp.experts.0.down_proj.weight", "mlp.experts.down_proj", 0),
    ("qwen3_moe", "mlp.gate.weight", "mlp.gate.weight", None),
    ("qwen3_moe", "mlp.gate_proj.weight", "mlp.gate_up_proj.weight", 0),  # a dense layer
    ("qwen3_moe", "self_attn.k_proj.weight", "self_attn.qkv_proj.weight", "k"),
    ("qwen3_moe", "self_attn.q_norm.weight", "self_attn.q_norm.weight", None),
    ("mixtral", "block_sparse_moe.experts.5.w1.weight", "mlp.experts.gate_up_proj", (5, 0)),
    ("mixtral", "block_sparse_moe.experts.5.w3.weight", "mlp.experts.gate_up_proj", (5, 1)),
    ("mixtral", "block_sparse_moe.experts.6.w2.weight", "mlp.experts.down_proj", 6),
    ("mixtral", "block_sparse_moe.gate.weight", "mlp.gate.weight", None),
]


def test_checkpoint_names_map_to_stacked_experts():
    from llmsvc.models.moe import MixtralForCausalLM, Qwen3MoeForCausalLM
    from model_utils import tiny_hf_config
    models = {"qwen3_moe": Qwen3MoeForCausalLM(tiny_hf_config("qwen3_moe")),
              "mixtral": MixtralForCausalLM(tiny_hf_config("mixtral"))}
    for arch, name, target, shard in NAME_MAP:
        model = models[arch]
        assert model.checkpoint_target(f"model.layers.1.{name}") == (f"model.layers.1.{target}", shard), name
        if arch == "qwen3_moe" and target.startswith("mlp.experts"):
            assert f"model.layers.1.{target}" in dict(model.named_parameters())
    qwen, experts = models["qwen3_moe"], "model.layers.1.mlp.experts"
    assert dict(qwen.named_parameters())[f"{experts}.gate_up_proj"].shape == (8, 2 * 32, 64)  # [E, 2I, H]
    assert len(qwen.shard_ids(f"{experts}.gate_up_proj")) == 16
    assert qwen.shard_ids(f"{experts}.down_proj") == tuple(range(8))


@pytest.mark.parametrize("name", ["qwen3moe", "mixtral"])
def test_per_expert_tensors_are_stacked_at_load(models, name):
    from safetensors import safe_open
    d, ours, _ = models(name)
    moe = ours.model.layers[1].mlp.experts
    w1, w3, w2 = ("w1", "w3", "w2") if name == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    prefix = "model.layers.1.block_sparse_moe" if name == "mixtral" else "model.layers.1.mlp"
    with safe_open(f"{d}/model.safetensors", framework="pt") as f:
        for e in range(moe.num_experts):
            gate, up, down = (f.get_tensor(f"{prefix}.experts.{e}.{p}.weight") for p in (w1, w3, w2))
            assert torch.equal(moe.gate_up_proj[e], torch.cat([gate, up]))
            assert torch.equal(moe.down_proj[e], down)
        assert torch.equal(ours.model.layers[1].mlp.gate.weight, f.get_tensor(f"{prefix}.gate.weight"))


def test_stacked_checkpoint_loads_the_same_and_missing_experts_are_reported(models, tmp_path):
    """A checkpoint holding transformers v5's stacked tensors loads into the same weights; one
    expert's tensor missing from a per-expert checkpoint is an error naming the parameter."""
    import shutil

    from safetensors.torch import load_file, save_file
    d, ours, _ = models("qwen3moe")
    sd = load_file(f"{d}/model.safetensors")
    stacked = dict(sd)
    for layer in range(2):
        p = f"model.layers.{layer}.mlp.experts"
        gate_up = [torch.cat([stacked.pop(f"{p}.{e}.gate_proj.weight"), stacked.pop(f"{p}.{e}.up_proj.weight")])
                   for e in range(8)]
        stacked[f"{p}.gate_up_proj"] = torch.stack(gate_up)
        stacked[f"{p}.down_proj"] = torch.stack([stacked.pop(f"{p}.{e}.down_proj.weight") for e in range(8)])
    for variant, tensors in (("stacked", stacked), ("missing", sd)):
        out = tmp_path / variant
        shutil.copytree(d, out)
        if variant == "missing":
            del tensors["model.layers.0.mlp.experts.5.up_proj.weight"]
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        if variant == "missing":
            with pytest.raises(ValueError, match=r"layers\.0\.mlp\.experts\.gate_up_proj:\(5, 1\)"):
                load_our_model(str(out))
        else:
            again = load_our_model(str(out))
            for (n, a), (_, b) in zip(ours.named_parameters(), again.named_parameters()):
                assert torch.equal(a, b), n


def test_moe_models_run_op_by_op_not_through_the_native_decoder(models, monkeypatch, tmp_path):
    """The one-call CPU decoder has no MoE block: an MoE model must never plan or run it, while
    a dense model of the same size does ask for a plan (so the counter is live)."""
    planned = []
    real = ops.decoder_layers_plan
    monkeypatch.setattr(ops, "decoder_layers_plan", lambda *a, **k: planned.append(1) or real(*a, **k))
    for name in ("qwen3moe-dense-layers", "mixtral"):
        _, ours, hf = models(name)
        (seq,) = _seqs([12], seed=8)
        _close(PagedRunner(ours, num_blocks=8, block_size=16).step({0: seq})[0], _hf_logits(hf, seq))
    assert planned == []
    dense = load_our_model(make_tiny_model_dir(tmp_path, "llama"))
    PagedRunner(dense, num_blocks=8, block_size=16).step({0: seq})
    assert planned == [1]


def test_unknown_architecture_keeps_its_clear_error(tmp_path):
    import json

    from llmsvc.config import ModelConfig
    from llmsvc.models.loader import get_model_class
    from llmsvc.models.resolve import resolve_model_config
    d = make_tiny_model_dir(tmp_path, "qwen3_moe")
    cfg = json.load(open(f"{d}/config.json"))
    assert resolve_model_config(ModelConfig(model=d)).architecture == "Qwen3MoeForCausalLM"
    cfg.update(architectures=["Qwen2MoeForCausalLM"], model_type="qwen2_moe")
    json.dump(cfg, open(f"{d}/config.json", "w"))
    with pytest.raises(ValueError, match="unsupported architecture 'Qwen2MoeForCausalLM'.*MixtralForCausalLM"):
        resolve_model_config(ModelConfig(model=d))
    with pytest.raises(ValueError, match="unsupported architecture 'DeepseekV3ForCausalLM'"):
        get_model_class("DeepseekV3ForCausalLM")
    assert get_model_class("MixtralForCausalLM").__name__ == "MixtralForCausalLM"


@pytest.mark.parametrize("name", ["qwen3moe", "mixtral"])
def test_bfloat16_runs_close_to_fp32(models, name):
    d, ours, _ = models(name)
    seqs = _seqs([30, 12], seed=12)
    ref = PagedRunner(ours).step(dict(enumerate(seqs)))
    bf = load_our_model(d, dtype="bfloat16")
    assert bf.model.layers[0].mlp.experts.gate_up_proj.dtype == torch.bfloat16
    out = PagedRunner(bf).step(dict(enumerate(seqs)))
    for i in range(2):
        assert out[i].dtype == torch.float32 and not torch.isnan(out[i]).any()
        # bf16 keeps ~3 significant digits (and may flip a near-tie in the routing): argmax mostly agrees
        agree = (out[i].argmax(-1) == ref[i].argmax(-1)).float().mean().item()
        assert agree > 0.8, agree
