"""A GGUF's block-quantized weights kept as blocks for the CPU GEMM (`--quantization gguf`).

The model loads as always from the GGUF's derived fp32 checkpoint (resolve.py). This module
then reads the same file's blocks of every linear weight (gguf-py's reader and its tensor-name
map), checks that their dequantization equals that fp32 weight bit for bit, and hands each
layer its share through the layer's own weight loader, so tensor parallelism slices the blocks
as it slices the weight. The layers then multiply the blocks (kernels/cpu_ops/gemm.c,
`llmsvc_gemm_q8`): the same products and sums as the fp32 path, from ~1/3 of the bytes.

Kept: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 (a scale, and an offset where the type has one, per 32
weights), Q4_K and Q5_K (per 32-weight sub-block: the super-block's scale times the 6-bit
sub-scale, and minus its min times the 6-bit sub-min) and Q6_K (per 16 weights). Left on the
fp32 path, and counted in the load's log line: other types (F16, BF16, Q2_K, Q3_K, the IQ
types, ...), weights whose blocks do not dequantize to the checkpoint's tensor, and layers
whose shard of the inputs does not fall on whole blocks.
"""
from __future__ import annotations

import collections
import json
import logging
import os
import time

import numpy as np
import torch
import torch.nn as nn

from kernels.reference import dequantize_gguf_blocks
from llmsvc.models.weights import checkpoint_files, checkpoint_targets

logger = logging.getLogger(__name__)

BLOCKS = {"Q4_0": 32, "Q4_1": 32, "Q5_0": 32, "Q5_1": 32, "Q8_0": 32, "Q4_K": 32, "Q5_K": 32, "Q6_K": 16}
SUPER = {"Q4_K": 256, "Q5_K": 256, "Q6_K": 256}  # weights per stored block where not BLOCKS'
FORMAT = 2  # of the kept blocks file: a file of another format (fewer types) is rebuilt
PARTS = ("q", "scale", "offset")  # a kept tensor's entries, "<checkpoint name>:<part>"


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The fp16 field at byte `start` of every block, as fp32: [..., num_blocks, 1]."""
    return np.ascontiguousarray(blocks[..., start:start + 2]).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes of 4-bit values -> [..., 32]: the low nibbles are weights 0-15, the high 16-31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _bits(qh: np.ndarray, count: int) -> np.ndarray:
    """[..., 4] bytes read as a little-endian uint32 -> its low `count` bits, [..., count] (0 / 1)."""
    word = np.ascontiguousarray(qh).view("<u4")
    return ((word >> np.arange(count, dtype=np.uint32)) & 1).astype(np.uint8)


def _k_quant(blocks: np.ndarray, high_bits: bool):
    """Q4_K / Q5_K super-blocks [..., 144 or 176] -> (q [..., 8, 32], scale, offset [..., 8, 1]):
    eight 32-weight sub-blocks, each W = d * sc * q - dmin * mn (6-bit sc and mn, gguf-py's
    own unpacking)."""
    import gguf

    d, dmin = _f16(blocks, 0), _f16(blocks, 2)
    lead = blocks.shape[:-1]
    sc, mn = gguf.quants.Q4_K.get_scale_min(np.ascontiguousarray(blocks[..., 4:16]).reshape(-1, 12))
    sc, mn = sc.reshape(*lead, 8, 1).astype(np.float32), mn.reshape(*lead, 8, 1).astype(np.float32)
    qs = blocks[..., 48:176] if high_bits else blocks[..., 16:144]
    q = np.stack([qs.reshape(*lead, 4, 32) & 0x0F, qs.reshape(*lead, 4, 32) >> 4], axis=-2).reshape(*lead, 8, 32)
    if high_bits:  # bit i of byte j of qh is weight j's fifth bit in sub-block i
        qh = blocks[..., 16:48]
        q = q | (((qh[..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1) << 4)
    return q, d[..., None] * sc, -(dmin[..., None] * mn)


def _q6_k(blocks: np.ndarray):
    """Q6_K super-blocks [..., 210] -> (q [..., 16, 16], scale [..., 16, 1], None): sixteen
    16-weight sub-blocks, W = d * sc * q with an int8 sc and q in -32 .. 31."""
    lead = blocks.shape[:-1]
    ql = blocks[..., 0:128].reshape(*lead, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8)[:, None]
    qh = blocks[..., 128:192].reshape(*lead, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]
    q = ((ql & 0x0F).reshape(*lead, 8, 32) | ((qh & 0x03).reshape(*lead, 8, 32) << 4)).astype(np.int16) - 32
    sc = np.ascontiguousarray(blocks[..., 192:208]).view(np.int8).astype(np.float32)
    return q.reshape(*lead, 16, 16), (_f16(blocks, 208) * sc)[..., None], None


def decode_blocks(type_name: str, data: np.ndarray, n: int, k: int):
    """One GGUF tensor's raw blocks ([n, bytes per row] uint8) -> (q [n, k] int8, scale and
    offset [n, k / bs] fp32, bs = BLOCKS[type]) with W = scale * q + offset per bs weights, or
    None for a type not in BLOCKS (or k not whole blocks)."""
    bs = BLOCKS.get(type_name)
    if bs is None or k % SUPER.get(type_name, bs):
        return None
    blocks = np.asarray(data, dtype=np.uint8).reshape(n, k // SUPER.get(type_name, bs), -1)
    m = None
    if type_name == "Q8_0":  # fp16 d, 32 x int8
        q, d = blocks[..., 2:34].view(np.int8), _f16(blocks, 0)
    elif type_name == "Q4_0":  # fp16 d, 16 bytes of nibbles, stored + 8
        q, d = _nibbles(blocks[..., 2:18]).astype(np.int16) - 8, _f16(blocks, 0)
    elif type_name == "Q4_1":  # fp16 d, fp16 m, 16 bytes of nibbles
        q, d, m = _nibbles(blocks[..., 4:20]), _f16(blocks, 0), _f16(blocks, 2)
    elif type_name == "Q5_0":  # fp16 d, 32 fifth bits, 16 bytes of nibbles, stored + 16
        q, d = (_nibbles(blocks[..., 6:22]) | (_bits(blocks[..., 2:6], 32) << 4)).astype(np.int16) - 16, _f16(blocks, 0)
    elif type_name == "Q5_1":  # fp16 d, fp16 m, 32 fifth bits, 16 bytes of nibbles
        q, d, m = _nibbles(blocks[..., 8:24]) | (_bits(blocks[..., 4:8], 32) << 4), _f16(blocks, 0), _f16(blocks, 2)
    elif type_name in ("Q4_K", "Q5_K"):
        q, d, m = _k_quant(blocks, type_name == "Q5_K")
    else:
        q, d, m = _q6_k(blocks)
    scale = torch.from_numpy(np.ascontiguousarray(d, dtype=np.float32).reshape(n, k // bs))
    offset = torch.zeros_like(scale) if m is None else torch.from_numpy(
        np.array(np.broadcast_to(m, d.shape), dtype=np.float32).reshape(n, k // bs))
    return torch.from_numpy(np.ascontiguousarray(q).astype(np.int8).reshape(n, k)), scale, offset


def _unpermute(t: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp stores a llama q / k projection's rows with each head's two RoPE halves
    interleaved; this restores HF's order (the rows of q, scale and offset alike)."""
    return t.reshape(n_head, t.shape[0] // n_head // 2, 2, *t.shape[1:]).swapaxes(1, 2).reshape(t.shape)


def _matching_blocks(blocks: tuple, weight: torch.Tensor, head_dim: int):
    """blocks in the row order whose dequantization is `weight` bit for bit, else None."""
    if dequantize_gguf_blocks(*blocks).equal(weight):
        return blocks
    n = weight.shape[0]
    if head_dim and head_dim % 2 == 0 and n % head_dim == 0:
        moved = tuple(_unpermute(t, n // head_dim) for t in blocks)
        if dequantize_gguf_blocks(*moved).equal(weight):
            return moved
    return None


def _holders(model: nn.Module) -> dict[int, list[nn.Module]]:
    """id(weight parameter) -> the layers that multiply it and can keep GGUF blocks (a tied
    embedding's parameter belongs to the LM head too)."""
    out: dict[int, list[nn.Module]] = collections.defaultdict(list)
    for mod in model.modules():
        if hasattr(mod, "load_gguf_blocks") and isinstance(getattr(mod, "weight", None), torch.Tensor):
            out[id(mod.weight)].append(mod)
    return out


def _read_gguf(gguf_path: str, model_dir: str, head_dim: int) -> tuple[dict, dict]:
    """({checkpoint tensor name: (q, scale, offset)}, {what: count}) for every 2-D tensor of the
    derived checkpoint whose GGUF blocks are a kept type and dequantize to it bit for bit."""
    import gguf
    from safetensors import safe_open

    reader = gguf.GGUFReader(gguf_path)  # parses every field, the vocabulary too: seconds
    arch_name = str(bytes(reader.fields["general.architecture"].parts[-1]), "utf-8")
    arch = next((a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == arch_name), None)
    if arch is None:
        raise ValueError(f"{os.path.basename(gguf_path)}: GGUF architecture {arch_name!r} unknown to gguf-py")
    names = gguf.get_tensor_name_map(arch, int(reader.fields[f"{arch_name}.block_count"].parts[-1][0]))
    tensors = {t.name: t for t in reader.tensors}
    blocks, counts = {}, collections.Counter()
    for path in checkpoint_files(model_dir):
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                shape = f.get_slice(name).get_shape()
                if len(shape) != 2 or not name.endswith(".weight"):
                    continue
                t = tensors.get(names.get_name(name, try_suffixes=(".weight",)) or "")
                if t is None:
                    counts["absent (fp32)"] += 1
                    continue
                kind = t.tensor_type.name
                decoded = decode_blocks(kind, t.data, *shape)
                why = "" if kind in BLOCKS else "type not kept"
                if decoded is not None:
                    decoded = _matching_blocks(decoded, f.get_tensor(name).float(), head_dim)
                    why = "" if decoded is not None else "blocks differ from the checkpoint"
                elif not why:
                    why = "shape splits its blocks"
                if decoded is not None:
                    blocks[name] = decoded
                counts[kind if decoded is not None else f"{kind} (fp32: {why})"] += 1
    return blocks, dict(counts)


def _read_kept(path: str) -> tuple[dict, dict] | None:
    """A kept blocks file's (blocks, counts), or None where it is absent, unreadable or of
    another FORMAT (then it is rebuilt)."""
    from safetensors import safe_open

    try:
        with safe_open(path, framework="pt", device="cpu") as f:
            meta = f.metadata() or {}
            if int(meta.get("format", 0)) != FORMAT:
                return None
            blocks: dict = {}
            for key in f.keys():
                name, _, part = key.rpartition(":")
                blocks.setdefault(name, [None] * 3)[PARTS.index(part)] = f.get_tensor(key)
            return {k: tuple(v) for k, v in blocks.items()}, json.loads(meta["counts"])
    except Exception:  # noqa: BLE001 - absent, torn or foreign: rebuilt
        return None


def gguf_block_tensors(gguf_path: str, model_dir: str, head_dim: int) -> tuple[dict, dict]:
    """_read_gguf's result, kept beside the derived checkpoint (model_dir/gguf_blocks/, written
    once: gguf-py's reader takes seconds over a vocabulary, safetensors maps the blocks at once)."""
    from safetensors.torch import save_file

    path = os.path.join(model_dir, "gguf_blocks", "blocks.safetensors")
    if (kept := _read_kept(path)) is not None:
        return kept
    blocks, counts = _read_gguf(gguf_path, model_dir, head_dim)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        save_file({f"{name}:{part}": t.contiguous() for name, b in blocks.items() for part, t in zip(PARTS, b)},
                  tmp, metadata={"counts": json.dumps(counts), "format": str(FORMAT)})
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # as the converted files: other users of a shared cache read it
        os.replace(tmp, path)
    except Exception as e:  # noqa: BLE001 - a read-only or foreign cache (SafetensorError too): read the GGUF again next time
        logger.warning("could not keep the GGUF blocks in %s: %s", path, e)
    return blocks, counts


def _target(model: nn.Module, name: str, splits: dict) -> str:
    """Our parameter a checkpoint tensor loads into (a fused checkpoint tensor keeps its name)."""
    return name if any(f".{hf}." in name for hf in splits) else model.checkpoint_target(name)[0]


def load_gguf_blocks(model: nn.Module, gguf_path: str, model_dir: str, head_dim: int) -> dict:
    """Give every layer of `model` (loaded from `model_dir`, the derived checkpoint of
    `gguf_path`) whose weight is of a kept type (BLOCKS) in the file its blocks. Returns (and
    logs) {"tensors": {type or reason: count}, "layers": layers with blocks, "of": candidates}."""
    start = time.perf_counter()
    blocks, counts = gguf_block_tensors(gguf_path, model_dir, head_dim)
    params = dict(model.named_parameters(remove_duplicate=False))
    holders, splits = _holders(model), model.checkpoint_splits()
    shards: dict[nn.Module, set] = collections.defaultdict(set)
    expected: dict[nn.Module, set] = {}
    # a fused weight whose parts have different block sizes (Q6_K's 16 beside Q4_K's 32) takes
    # the finest: a 32-weight block is two 16-weight blocks of the same scale and offset
    finest: dict[str, int] = {}
    for name, (q, d, _) in blocks.items():
        target = _target(model, name, splits)
        finest[target] = min(finest.get(target, 32), q.shape[1] // d.shape[1])
    for name, decoded in blocks.items():
        q, d, m = decoded
        if (r := q.shape[1] // d.shape[1] // finest[_target(model, name, splits)]) > 1:
            decoded = (q, d.repeat_interleave(r, 1), m.repeat_interleave(r, 1))
        pieces = zip(*(checkpoint_targets(model, name, x, splits) for x in decoded))
        for (target, sid, q), (_, _, d), (_, _, m) in pieces:
            for mod in holders.get(id(params.get(target)), []) if target in params else []:
                expected.setdefault(mod, set(model.shard_ids(target)))
                try:
                    mod.load_gguf_blocks(sid, q, d, m)
                    shards[mod].add(sid)
                except ValueError:  # this rank's inputs split a block
                    expected[mod] = {"never"}
    for mod, want in expected.items():
        if not want <= shards[mod]:  # a part of a fused weight is not in blocks
            mod.gguf_blocks = None
    layers = {mod for mods in holders.values() for mod in mods}
    kept = sum(m.gguf_blocks is not None for m in layers)
    logger.info("GGUF blocks: %d of %d layers multiply them (checkpoint tensors by GGUF type: %s), in %.1f s",
                kept, len(layers), ", ".join(f"{k} {v}" for k, v in sorted(counts.items())),
                time.perf_counter() - start)
    return {"tensors": counts, "layers": kept, "of": len(layers)}
