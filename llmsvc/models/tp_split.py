"""Whether a model splits over a tensor-parallel group (torch-free).

Checked where the model is resolved, before any worker starts, so `--tensor-parallel-size` that
does not fit fails at once with a message naming what does not divide, rather than in every
rank's layer construction. The layers' own rules (QKVParallelLinear, kv_cache_spec): each rank
takes heads / tp query heads; KV heads are split when tp divides them, else each is replicated
on tp / kv consecutive ranks (tp a multiple of them). The MLPs' widths (intermediate_size, and a
MoE's per-expert moe_intermediate_size) are split into tp equal column / row slices.
"""
from __future__ import annotations

# the config's widths that Column/RowParallelLinear and FusedMoE divide by tp
SPLIT_WIDTHS = ("intermediate_size", "moe_intermediate_size")


def tp_problem(num_heads: int, num_kv_heads: int, tp: int, widths: dict[str, int] | None = None) -> str | None:
    """Why tp ranks cannot share these heads and widths ({config name: size}); None when they can."""
    if num_heads % tp:
        return f"its {num_heads} attention heads do not divide into {tp} equal parts"
    if num_kv_heads % tp and tp % num_kv_heads:
        return (f"its {num_kv_heads} KV heads neither divide into {tp} equal parts nor repeat "
                f"evenly over {tp} ranks")
    for name, size in (widths or {}).items():
        if size % tp:
            return f"its {name} {size} does not divide into {tp} equal parts"
    return None


def check_tensor_parallel(hf_config, tp: int) -> None:
    """Raises ValueError when tp ranks cannot share the model's attention heads and MLP widths,
    listing the sizes that can (up to 16)."""
    heads = hf_config.num_attention_heads
    kv = getattr(hf_config, "num_key_value_heads", None) or heads
    widths = {name: size for name in SPLIT_WIDTHS if isinstance(size := getattr(hf_config, name, None), int)}
    why = tp_problem(heads, kv, tp, widths)
    if why is not None:
        fits = [t for t in range(1, 17) if tp_problem(heads, kv, t, widths) is None]
        raise ValueError(f"tensor parallel size {tp} does not fit this model: {why} "
                         f"(sizes that fit: {', '.join(map(str, fits))})")
