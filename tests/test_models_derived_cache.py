"""What transformers derives from a model's files (the config, the tokenizer class), resolved
once and then read back as plain data: same values as transformers gives, and a warm process
imports neither torch nor transformers' config classes for them."""
from __future__ import annotations

import copy
import json
import os
import pickle
import shutil
import subprocess
import sys

import pytest

from llmsvc.config import ModelConfig
from llmsvc.models import json_cache
from llmsvc.models.hf_config import HFConfig, load_hf_config
from llmsvc.models.resolve import resolve_model_config
from llmsvc.models.tokenizer import load_tokenizer
from model_utils import FAMILIES, make_tiny_model_dir, tiny_hf_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("arch", sorted(FAMILIES))
def test_plain_config_reads_as_the_transformers_config(arch):
    real = tiny_hf_config(arch)
    plain = HFConfig.from_transformers(real)
    names = {n for n in real.__dict__ if not n.startswith("_")} | set(type(real).attribute_map)
    for name in sorted(names - {"id2label", "transformers_version"}):  # JSON keys are strings
        assert getattr(plain, name) == getattr(real, name), name
    assert plain.num_hidden_layers == real.num_hidden_layers
    assert getattr(plain, "no_such_field", "absent") == "absent"
    with pytest.raises(AttributeError, match="no attribute 'no_such_field'"):
        plain.no_such_field  # noqa: B018
    assert HFConfig.from_transformers(plain.to_transformers()) == plain
    assert type(plain.to_transformers()) is type(real)


def test_plain_config_aliases_pickles_and_is_read_only():
    plain = HFConfig.from_transformers(tiny_hf_config("mixtral"))
    assert plain.num_experts == plain.num_local_experts == 8  # MixtralConfig.attribute_map
    assert pickle.loads(pickle.dumps(plain)) == plain
    assert copy.deepcopy(plain) == plain
    with pytest.raises(AttributeError, match="read-only"):
        plain.num_hidden_layers = 3
    d = plain.to_dict()
    d["num_hidden_layers"] = 99
    assert plain.num_hidden_layers == 2  # to_dict is a copy


def test_config_cached_per_file_content(tmp_path):
    model_dir = make_tiny_model_dir(tmp_path, "qwen3")
    cache = str(tmp_path / "cache")
    first = load_hf_config(model_dir, cache)
    entries = os.listdir(cache)
    assert len(entries) == 1 and entries[0].endswith(".config.json")
    assert load_hf_config(model_dir, cache) == first  # read back
    assert os.listdir(cache) == entries
    copy_dir = shutil.copytree(model_dir, str(tmp_path / "copy"))  # same bytes, another directory
    assert load_hf_config(copy_dir, cache)._name_or_path == copy_dir != first._name_or_path
    assert len(os.listdir(cache)) == 2
    os.unlink(os.path.join(cache, sorted(set(os.listdir(cache)) - set(entries))[0]))

    path = os.path.join(model_dir, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg["rms_norm_eps"] = 1e-3
    with open(path, "w") as f:
        json.dump(cfg, f)
    edited = load_hf_config(model_dir, cache)
    assert edited.rms_norm_eps == 1e-3 and first.rms_norm_eps == 1e-5  # a new entry, not the old one
    assert len(os.listdir(cache)) == 2

    entry = json_cache.entry_path(cache, "config", [path], os.path.realpath(model_dir))
    with open(entry, "w") as f:
        f.write("{not json")
    assert load_hf_config(model_dir, cache) == edited  # a damaged entry is derived again and rewritten
    assert json_cache.read(entry)["values"]["rms_norm_eps"] == 1e-3


def test_unwritable_cache_only_means_no_cache(tmp_path):
    model_dir = make_tiny_model_dir(tmp_path)
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert load_hf_config(model_dir, str(blocker / "cache")).model_type == "llama"
    assert load_hf_config(model_dir, None).model_type == "llama"


def _fresh_process(code: str, env: dict) -> list[str]:
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         env={**os.environ, **env}, timeout=300)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def test_warm_resolution_imports_neither_torch_nor_transformers(tmp_path, monkeypatch):
    model_dir = make_tiny_model_dir(tmp_path, "gemma3")
    env = {"LLMSVC_CACHE": str(tmp_path / "cache")}
    code = ("import sys; from llmsvc.config import ModelConfig; from llmsvc.models.resolve import "
            f"resolve_model_config; mc = resolve_model_config(ModelConfig(model={model_dir!r})); "
            "print(mc.architecture, mc.hf_config.sliding_window, 'torch' in sys.modules, "
            "'transformers' in sys.modules)")
    assert _fresh_process(code, env) == ["Gemma3ForCausalLM", "16", "True", "True"]  # cold: transformers
    assert _fresh_process(code, env) == ["Gemma3ForCausalLM", "16", "False", "False"]  # warm: neither
    monkeypatch.setenv("LLMSVC_CACHE", env["LLMSVC_CACHE"])
    mc = resolve_model_config(ModelConfig(model=model_dir))
    from transformers import AutoConfig

    assert isinstance(mc.hf_config, HFConfig)
    assert mc.hf_config == HFConfig.from_transformers(AutoConfig.from_pretrained(model_dir))


@pytest.mark.e2e
def test_tokenizer_remembered_loads_as_autotokenizer(default_model_dir, tmp_path):
    from transformers import AutoTokenizer

    cache = str(tmp_path / "cache")
    ref = AutoTokenizer.from_pretrained(default_model_dir)
    cold = load_tokenizer(default_model_dir, cache)
    warm = load_tokenizer(default_model_dir, cache)
    [entry] = os.listdir(cache)
    assert json_cache.read(os.path.join(cache, entry))["class"] == type(ref).__qualname__
    text = "Hello <|im_start|> wörld  \n\n\t 12345 🙂"
    messages = [{"role": "user", "content": "hi"}]
    for tok in (cold, warm):
        assert type(tok) is type(ref)
        assert tok.encode(text) == ref.encode(text)
        assert tok.decode(ref.encode(text)) == ref.decode(ref.encode(text))
        assert tok.all_special_ids == ref.all_special_ids and tok.init_kwargs == ref.init_kwargs
        assert tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
            ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    code = ("import sys; from llmsvc.models.tokenizer import load_tokenizer; "
            f"t = load_tokenizer({default_model_dir!r}, {cache!r}); "
            "t.apply_chat_template([{'role': 'user', 'content': 'hi'}], tokenize=False); "
            "print(len(t), 'torch' in sys.modules, 'transformers.configuration_utils' in sys.modules)")
    assert _fresh_process(code, {}) == [str(len(ref)), "False", "False"]


def test_tokenizer_entry_outside_transformers_is_ignored():
    from llmsvc.models import tokenizer as tokmod

    assert tokmod._class_of({"module": "os", "class": "system"}) is None
    assert tokmod._class_of({"module": "transformers.no_such_module", "class": "X"}) is None
    assert tokmod._class_of(None) is None
    cls = tokmod._class_of({"module": "transformers.tokenization_utils_tokenizers", "class": "TokenizersBackend"})
    assert cls is not None and cls.__name__ == "TokenizersBackend"
