"""KVSwapper: a worker's swap space (host blocks shaped as its KV cache blocks) and the block
copies of each step (SchedulerOutput.blocks_to_swap_out / blocks_to_swap_in / blocks_to_copy).

Shapes: per layer a K and a V tensor [num_host_blocks, block_size, num_kv_heads, head_dim] in
the cache's dtype; under tensor parallelism a rank's own heads only (its KV cache's shape), so
each rank copies its share of every block and nothing crosses ranks.

Order: swap-outs, then swap-ins, then copies, each list in its order (a later copy to the same
block wins), all before the step's forward pass: the scheduler relies on a device block being
read out before anything of the same step writes it, and on a host block being read in before a
later step's swap-out overwrites it (llmsvc/core/swap_space.py).

CUDA: the host blocks are pinned and the copies run on a copy stream. That stream first waits
for the compute stream (the steps before wrote the blocks it reads), and the compute stream waits
for it before the forward pass (which reads what was swapped in and overwrites what was swapped
out). The host never waits: the engine thread schedules the next step meanwhile, and a host
block is only ever touched by the copy stream, in order. CPU: plain copies on the worker's
thread, the host blocks an anonymous mapping that is faulted in as it is used.
"""
from __future__ import annotations

import logging

import torch

from llmsvc.wire import SchedulerOutput

logger = logging.getLogger(__name__)

HOST_MEMORY_SHARE = 0.9  # a swap space above this share of the machine's memory is refused at start


def _runs(pairs: list[tuple[int, int]], coalesce: bool = True) -> list[tuple[int, int, int]]:
    """(src, dst) block pairs, in order, as (src, dst, n) runs of consecutive blocks on both sides
    (one copy per layer per run). Not within one tensor (coalesce=False): a run could overlap itself."""
    runs: list[list[int]] = []
    for s, d in pairs:
        if coalesce and runs and s == runs[-1][0] + runs[-1][2] and d == runs[-1][1] + runs[-1][2]:
            runs[-1][2] += 1
        else:
            runs.append([s, d, 1])
    return [tuple(r) for r in runs]


def _host_memory_bytes() -> int | None:
    try:
        import os

        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


class KVSwapper:
    def __init__(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], nbytes: int) -> None:
        k0 = kv_caches[0][0]
        self.device = k0.device
        per_block = 2 * len(kv_caches) * k0[0].numel() * k0.element_size()
        self.num_blocks = nbytes // per_block
        flag = f"--swap-space {nbytes} bytes"
        if self.num_blocks < 1:
            raise ValueError(f"{flag} holds no KV block (one block takes {per_block} bytes on each worker)")
        total = _host_memory_bytes()
        if total is not None and nbytes > HOST_MEMORY_SHARE * total:
            raise ValueError(f"{flag} cannot be allocated: more than {HOST_MEMORY_SHARE:.0%} of this machine's "
                             f"{total / 2**30:.1f} GiB of memory")
        shape = (self.num_blocks, *k0.shape[1:])
        self._pool = None
        try:
            if self.device.type == "cuda":
                self.host = [(torch.empty(shape, dtype=k0.dtype, pin_memory=True),
                              torch.empty(shape, dtype=k0.dtype, pin_memory=True)) for _ in kv_caches]
                self.stream = torch.cuda.Stream(self.device)
            else:
                from llmsvc.worker.kv_memory import KVHostPool

                self._pool = KVHostPool(2 * len(kv_caches), shape, k0.dtype, prefault=False)
                t = self._pool.tensors
                self.host = [(t[2 * i], t[2 * i + 1]) for i in range(len(kv_caches))]
                self.stream = None
        except (RuntimeError, OSError, MemoryError, ValueError) as e:
            raise ValueError(f"{flag} cannot be allocated ({self.num_blocks} blocks of {per_block} bytes): {e}") from e
        self.kv_caches = kv_caches
        self.num_blocks_copied = 0
        logger.info("swap space: %d host blocks, %.1f MiB%s", self.num_blocks, self.num_blocks * per_block / 2**20,
                    " pinned" if self.stream is not None else "")

    def run(self, so: SchedulerOutput) -> None:
        """The step's copies, before its forward pass (see the module's docstring for the order)."""
        if not (so.blocks_to_swap_out or so.blocks_to_swap_in or so.blocks_to_copy):
            return
        if self.stream is None:
            self._copy_all(so, non_blocking=False)
            return
        compute = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(compute)
        with torch.cuda.stream(self.stream):
            self._copy_all(so, non_blocking=True)
        compute.wait_stream(self.stream)

    def _copy_all(self, so: SchedulerOutput, non_blocking: bool) -> None:
        dev, host = self.kv_caches, self.host  # per layer (K, V)
        for pairs, src, dst in ((so.blocks_to_swap_out, dev, host), (so.blocks_to_swap_in, host, dev),
                                (so.blocks_to_copy, dev, dev)):
            if not pairs:
                continue
            for s, d, n in _runs(pairs, coalesce=src is not dst):
                for src_kv, dst_kv in zip(src, dst):
                    for a, b in zip(src_kv, dst_kv):  # K, then V
                        b[d:d + n].copy_(a[s:s + n], non_blocking=non_blocking)
            self.num_blocks_copied += len(pairs)

    def close(self) -> None:
        self.host = []
        if self._pool is not None:
            self._pool.close()
            self._pool = None
