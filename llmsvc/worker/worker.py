"""Worker: owns one device, its share of the model and its KV cache (one per TP rank)."""
from __future__ import annotations

import logging
import time
from collections import deque

import torch

from llmsvc.config import EngineConfig, num_threads_env
from llmsvc.sampling_params import SamplingParams
from llmsvc.wire import ModelRunnerOutput, NewRequestData, SchedulerOutput
from llmsvc.worker import host_malloc
from llmsvc.worker.device import resolve_device_type
from llmsvc.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    name = resolve_device_type(name)
    if name == "cuda":
        return torch.device("cuda", local_rank)
    return torch.device(name)


class Worker:
    """Lifecycle: init_device() -> load_model() -> determine_num_kv_blocks() ->
    initialize_kv_cache(n) -> execute_model(so)* -> shutdown()."""

    def __init__(self, config: EngineConfig, rank: int = 0, world_size: int = 1,
                 distributed_init_method: str | None = None, local_rank: int = 0) -> None:
        self.config = config
        self.rank, self.world_size, self.local_rank = rank, world_size, local_rank
        self.distributed_init_method = distributed_init_method
        self.device = resolve_device(config.device, local_rank)
        self.runner: ModelRunner | None = None
        self.swapper = None  # llmsvc.worker.kv_swap.KVSwapper once a swap space is allocated
        self.cpu_group = None
        self.num_steps = 0  # execute_model calls, and the seconds spent inside them (IPC excluded)
        self.execute_time_s = 0.0
        # host gap: seconds from the end of one execute_model to the start of the next, i.e. how
        # long the device waits for the next SchedulerOutput (idle periods included: see median)
        self.host_gap_s = 0.0
        self._recent_gaps: deque[float] = deque(maxlen=4096)
        self._last_end: float | None = None

    def init_device(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        threads = num_threads_env()
        if threads is not None:
            torch.set_num_threads(threads)
        torch.manual_seed(self.config.model_config.seed)
        if self.world_size > 1:
            import torch.distributed as dist

            backend = "nccl" if self.device.type == "cuda" else "gloo"
            if self.config.parallel_config.nnodes > 1:  # ranks from other command lines: check them first
                from llmsvc.worker.rendezvous import join_store
                store = join_store(self.distributed_init_method, self.rank, self.world_size, self.config,
                                   timeout_s=900.0)
                dist.init_process_group(backend, store=store, rank=self.rank, world_size=self.world_size)
            else:
                dist.init_process_group(backend, init_method=self.distributed_init_method,
                                        rank=self.rank, world_size=self.world_size)
            # control messages (SchedulerOutput broadcast, block-count agreement) go over gloo
            self.cpu_group = dist.new_group(backend="gloo") if backend != "gloo" else dist.group.WORLD
            logger.info("rank %d/%d joined %s process group", self.rank, self.world_size, backend)

    def load_model(self) -> None:
        self.runner = ModelRunner(self.config, self.device)
        self.runner.load_model()

    def determine_num_kv_blocks(self) -> int:
        n = self._local_num_kv_blocks()
        if self.world_size > 1:  # every rank must hold the same pool: take the minimum
            import torch.distributed as dist

            t = torch.tensor([n], dtype=torch.int64)
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
            n = int(t.item())
        return n

    def _local_num_kv_blocks(self) -> int:
        cc = self.config.cache_config
        per_block = self.runner.kv_cache_bytes_per_block()
        if cc.num_kv_blocks_override is not None:
            return cc.num_kv_blocks_override
        if self.device.type != "cuda":
            return max(cc.kv_cache_memory_bytes // per_block, 1)
        return self._profile_cuda_blocks(per_block)

    def _profile_cuda_blocks(self, per_block: int) -> int:
        """Free memory after the weights and one max-size forward's activations, times utilization."""
        sc, bs = self.config.scheduler_config, self.config.cache_config.block_size
        n_tok = sc.max_num_batched_tokens
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        self.runner.initialize_kv_cache(n_tok // bs + 1)
        so = SchedulerOutput.make_empty()
        so.scheduled_new_reqs = [NewRequestData("__profile__", [0] * n_tok, [], SamplingParams(temperature=0.0),
                                                list(range(n_tok // bs + 1)), 0)]
        so.num_scheduled_tokens = {"__profile__": n_tok}
        so.total_num_scheduled_tokens = n_tok
        self.runner.execute_model(so)
        self.runner.states.clear()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        self.runner.release_kv_cache()
        torch.cuda.empty_cache()
        total = torch.cuda.get_device_properties(self.device).total_memory
        budget = int(total * self.config.cache_config.gpu_memory_utilization) - peak
        return max(budget // per_block, 1)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.runner.initialize_kv_cache(num_blocks)
        if self.device.type == "cpu":  # weights and cache are in place: step activations from here on
            host_malloc.keep_activations_mapped()
        self.runner.warmup()

    def initialize_swap_space(self, nbytes: int) -> int:
        """Host blocks of the KV cache's shape, `nbytes` in all (after initialize_kv_cache); returns
        how many. Raises ValueError naming --swap-space when the memory cannot be had."""
        from llmsvc.worker.kv_swap import KVSwapper

        self.swapper = KVSwapper(self.runner.kv_caches, nbytes)
        return self.swapper.num_blocks

    def init_thread(self) -> None:
        """Bind the calling thread (the uniproc executor's model thread) to this worker's device."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)

    def fill_placeholders(self, so: SchedulerOutput) -> None:
        """Rank 0, before it broadcasts a step: put in the tokens async placeholders stand for
        (only rank 0 samples, so only it knows them)."""
        self.runner.states.fill_placeholders(so)

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput | None:
        t0 = time.perf_counter()
        if self._last_end is not None:
            gap = t0 - self._last_end
            self.host_gap_s += gap
            self._recent_gaps.append(gap)
        if self.swapper is not None:  # the step's block copies go before its forward pass
            self.swapper.run(so)
        out = self.runner.execute_model(so)
        self._last_end = time.perf_counter()
        self.execute_time_s += self._last_end - t0
        self.num_steps += 1
        return out

    def add_lora(self, slot: int, name: str, path: str) -> str | None:
        """Load a LoRA adapter into `slot`. Returns None, or why it could not (a bad or missing
        adapter is the caller's error, never a worker failure: a TP group would die of it)."""
        from llmsvc.models.lora_adapter import load_adapter

        lora = self.runner.lora
        if lora is None:
            return "LoRA is not enabled (start with --enable-lora or --lora-modules)"
        try:
            lora.load(slot, load_adapter(name, path, lora.max_rank))
        except Exception as e:  # noqa: BLE001 - whatever the caller's files do, the worker goes on
            return str(e) if isinstance(e, (OSError, ValueError)) else f"{type(e).__name__}: {e}"
        return None

    def remove_lora(self, slot: int) -> None:
        self.runner.lora.clear(slot)

    def ping(self) -> None:
        """Nothing: the call's broadcast is node 0's check that every rank is still there."""

    def execute_stats(self) -> dict:
        """Since start: {"num_steps", "execute_time_s"} (the worker's own share of each step),
        "host_gap_s" (summed waits between consecutive steps) and "host_gap_median_s" (median of
        the last 4096 waits: the per-step gap of a busy stretch, idle periods aside)."""
        gaps = sorted(self._recent_gaps)
        return {"num_steps": self.num_steps, "execute_time_s": self.execute_time_s,
                "host_gap_s": self.host_gap_s, "host_gap_median_s": gaps[len(gaps) // 2] if gaps else 0.0}

    def shutdown(self) -> None:
        """Drops the model, the KV cache and the CUDA graphs: an engine in a process that goes
        on (offline `LLM`, uniproc) gives its GPU memory back."""
        if self.swapper is not None:
            self.swapper.close()
            self.swapper = None
        if self.runner is not None:
            self.runner.release_kv_cache()
            self.runner = None
            if self.device.type == "cuda":
                import gc

                gc.collect()  # the captured graphs and their runner refer to each other
                torch.cuda.empty_cache()
        if self.world_size > 1:
            import torch.distributed as dist

            if dist.is_initialized():
                try:  # every rank done with the group before any closes its pairs: a peer's gloo
                    dist.barrier()  # reader thread otherwise can abort its process (SIGABRT)
                except Exception:  # noqa: BLE001 - a peer already gone: tear down all the same
                    pass
                dist.destroy_process_group()
