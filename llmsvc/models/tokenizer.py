"""The model's tokenizer, as `AutoTokenizer.from_pretrained(model_dir)` gives it, started fast.

AutoTokenizer picks the class from tokenizer_config.json, config.json (through AutoConfig, so
through transformers' config machinery, which imports torch and sympy: ~3.5 s before any
tokenizer loads) and tokenizer.json. Its last step is `cls.from_pretrained(model_dir,
_from_auto=True)`. The class it picked is remembered per (those three files, their
directory, transformers version) under the llmsvc cache; later loads call that last step
directly, which imports neither torch nor the config classes: the front end of `llmsvc serve` then starts in ~1.5 s
instead of ~5. Classes from outside transformers (remote code) are never remembered.
"""
from __future__ import annotations

import importlib
import os

from llmsvc.models import json_cache

_DECISION_FILES = ("tokenizer_config.json", "config.json", "tokenizer.json")


def load_tokenizer(model_dir: str, cache_dir: str | None, chat_template: str | None = None):
    """The tokenizer of model_dir (a transformers tokenizer). cache_dir None: no cache.
    chat_template: Jinja text (read_chat_template's) that replaces the model's own, or None."""
    tokenizer = _load(model_dir, cache_dir)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer


def read_chat_template(value: str) -> str:
    """The Jinja text of a --chat-template value: a file's contents when `value` names a file,
    else `value` itself when it holds Jinja tags. ValueError when it is neither, or does not
    parse (checked at start-up, not at the first chat request)."""
    path = os.path.expanduser(value)
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            text = f.read()
    elif "{{" in value or "{%" in value:
        text = value
    else:
        raise ValueError(f"chat template {value!r} is neither a file nor Jinja text")
    import jinja2

    try:
        _jinja_environment().parse(text)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"chat template {value!r} does not parse: line {e.lineno}: {e.message}") from None
    return text


def _jinja_environment():
    """A Jinja environment with the extensions transformers renders chat templates with (loop
    controls, the `{% generation %}` tag), so a template it renders is not refused here."""
    import jinja2
    from jinja2.ext import Extension, loopcontrols

    class GenerationTag(Extension):  # parses {% generation %}...{% endgeneration %}; rendering is HF's
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body, lineno=lineno)

    return jinja2.Environment(extensions=[GenerationTag, loopcontrols])


def _load(model_dir: str, cache_dir: str | None):
    path = None
    if cache_dir is not None:
        path = json_cache.entry_path(cache_dir, "tokenizer", [os.path.join(model_dir, f) for f in _DECISION_FILES],
                                     os.path.realpath(model_dir))
        cls = _class_of(json_cache.read(path))
        if cls is not None:
            return cls.from_pretrained(model_dir, _from_auto=True)
    from transformers import AutoTokenizer

    if os.path.isdir(model_dir) and not any(os.path.exists(os.path.join(model_dir, f)) for f in _TOKENIZER_FILES):
        raise ValueError(f"no tokenizer in {model_dir} (none of {', '.join(_TOKENIZER_FILES)}); "
                         "give one with --tokenizer")
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError) as e:  # transformers' messages run over several lines
        raise ValueError(f"cannot load the tokenizer in {model_dir}: {' '.join(str(e).split())[:400]}") from None
    module, name = type(tokenizer).__module__, type(tokenizer).__qualname__
    if path is not None and module.startswith("transformers."):
        json_cache.write(path, {"module": module, "class": name})
    return tokenizer


def tokenizer_eos_id(tokenizer_dir: str) -> int | None:
    """The tokenizer's EOS id, read from its files without loading it (the engine-core process
    resolves the model before any tokenizer loads): tokenizer_config.json names the token, its
    added_tokens_decoder or tokenizer.json's added tokens or vocabulary give the id. None where
    they do not say (a sentencepiece-only tokenizer)."""
    import json

    def read(name: str) -> dict:
        try:
            with open(os.path.join(tokenizer_dir, name), encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}
    config = read("tokenizer_config.json")
    eos = config.get("eos_token")
    if isinstance(eos, dict):
        eos = eos.get("content")
    if not isinstance(eos, str):
        return None
    for tid, entry in (config.get("added_tokens_decoder") or {}).items():
        if isinstance(entry, dict) and entry.get("content") == eos and str(tid).isdigit():
            return int(tid)
    data = read("tokenizer.json")
    for entry in data.get("added_tokens") or ():
        if isinstance(entry, dict) and entry.get("content") == eos and isinstance(entry.get("id"), int):
            return entry["id"]
    vocab = (data.get("model") or {}).get("vocab")
    tid = vocab.get(eos) if isinstance(vocab, dict) else None
    return tid if isinstance(tid, int) else None


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model",
                    "tokenizer_config.json")


def _class_of(entry: dict | None):
    if not entry or not str(entry.get("module", "")).startswith("transformers."):
        return None
    try:
        return getattr(importlib.import_module(entry["module"]), entry["class"])
    except (ImportError, AttributeError, KeyError, TypeError):
        return None  # renamed or moved: ask AutoTokenizer again
