"""CUDA-graph capture of decode steps for a fixed set of batch sizes (CUDA only).

The model runner owns static input buffers whose leading dim is max_batch_size (or
max_batch_size + 1, e.g. query_start_loc). `CUDAGraphRunner.capture()` records
`forward(**buffers[:bs])` once per size in `capture_sizes()`; `run(inputs)` copies a decode
batch of n <= max size into the buffers, pads rows n..bs-1 (slot -1, seq_len 0, ...), replays
the graph of the smallest captured bs >= n and returns the first n output rows. The forward
must not sync with the host while captured (pass max_query_len / max_seq_len hints to
`kernels.ops.paged_attention`). Untested on hardware: only the bucketing and padding logic
below runs in CI (it is plain torch and works on CPU tensors).
"""
from __future__ import annotations

import bisect
from typing import Callable, Mapping, Sequence, Union

import torch

PadValue = Union[int, float, Callable[[torch.Tensor, torch.Tensor], None]]


def capture_sizes(max_batch_size: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16 up to max_batch_size (always ending at it)."""
    assert max_batch_size >= 1
    sizes = [s for s in (1, 2, 4, 8) if s <= max_batch_size]
    sizes += list(range(16, max_batch_size + 1, 16))
    if sizes[-1] != max_batch_size:
        sizes.append(max_batch_size)
    return sizes


def padded_batch_size(n: int, sizes: Sequence[int]) -> int | None:
    """Smallest captured size >= n (sizes sorted ascending), or None: run eagerly."""
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if n >= 1 and i < len(sizes) else None


def continue_arange(pad: torch.Tensor, prev: torch.Tensor) -> None:
    """Pads query_start_loc-like rows so each padded sequence owns one token."""
    # pad: [k] rows to fill; prev: [1] the last real entry
    pad.copy_(prev + torch.arange(1, pad.shape[0] + 1, device=pad.device, dtype=pad.dtype))


DEFAULT_PAD: dict[str, PadValue] = {
    "slot_mapping": -1,  # skipped by store_kv
    "seq_lens": 0,  # attention over an empty context writes zeros
    "query_start_loc": continue_arange,
}


def stage_inputs(buffers: Mapping[str, torch.Tensor], inputs: Mapping[str, torch.Tensor],
                 n: int, bs: int, max_batch_size: int,
                 pad_values: Mapping[str, PadValue]) -> dict[str, torch.Tensor]:
    """Copies n real rows into each buffer, pads up to bs, returns the [:bs (+extra)] views.

    A buffer with max_batch_size + e leading rows takes n + e input rows and yields bs + e.
    """
    assert 1 <= n <= bs <= max_batch_size, f"n={n} bs={bs} max_batch_size={max_batch_size}"
    views = {}
    for name, buf in buffers.items():
        extra = buf.shape[0] - max_batch_size
        src = inputs[name]
        rows = n + extra
        assert src.dim() == buf.dim() and src.shape[0] == rows and all(
            s <= b for s, b in zip(src.shape[1:], buf.shape[1:])), \
            f"{name}: input {tuple(src.shape)} does not fit buffer {tuple(buf.shape)} for n={n}"
        if src.shape[1:] != buf.shape[1:]:  # e.g. a narrower block table: zero the tail columns
            buf[:rows].zero_()
            buf[(slice(0, rows),) + tuple(slice(0, s) for s in src.shape[1:])].copy_(src)
        else:
            buf[:rows].copy_(src)
        pad = buf[rows:bs + extra]
        if pad.shape[0]:
            fill = pad_values.get(name, 0)
            if callable(fill):
                fill(pad, buf[rows - 1:rows])
            else:
                pad.fill_(fill)
        views[name] = buf[:bs + extra]
    return views


class CUDAGraphRunner:
    """Replays captured decode forwards; `forward(**inputs) -> Tensor [bs, ...]`."""

    def __init__(self, forward: Callable[..., torch.Tensor], buffers: Mapping[str, torch.Tensor],
                 max_batch_size: int, pad_values: Mapping[str, PadValue] | None = None,
                 sizes: Sequence[int] | None = None):
        self.forward = forward
        self.buffers = dict(buffers)
        self.max_batch_size = max_batch_size
        self.pad_values = {**DEFAULT_PAD, **(pad_values or {})}
        self.sizes = sorted(sizes) if sizes else capture_sizes(max_batch_size)
        assert self.sizes[-1] <= max_batch_size
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    @staticmethod
    def available(device: torch.device) -> bool:
        return device.type == "cuda" and torch.cuda.is_available()

    def capture(self) -> None:
        """Captures the largest size first so smaller graphs reuse its memory pool."""
        dev = next(iter(self.buffers.values())).device
        if not self.available(dev):
            raise RuntimeError("CUDA graphs need CUDA tensors and a CUDA device")
        pool = None
        for bs in reversed(self.sizes):
            views = {k: b[:bs + b.shape[0] - self.max_batch_size] for k, b in self.buffers.items()}
            self.forward(**views)  # warm up: compile kernels, allocate outside the graph
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[bs] = self.forward(**views)
            pool = graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize()

    def can_run(self, n: int) -> bool:
        bs = padded_batch_size(n, self.sizes)
        return bs is not None and bs in self.graphs

    def run(self, inputs: Mapping[str, torch.Tensor], n: int) -> torch.Tensor:
        """n real decode rows; returns the first n rows of the captured output (a view)."""
        bs = padded_batch_size(n, self.sizes)
        assert bs is not None and bs in self.graphs, f"no graph for batch size {n}"
        stage_inputs(self.buffers, inputs, n, bs, self.max_batch_size, self.pad_values)
        self.graphs[bs].replay()
        return self.outputs[bs][:n]
