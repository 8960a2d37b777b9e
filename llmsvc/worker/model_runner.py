"""ModelRunner: one step = fold the diff in, flatten the batch, run the model, sample."""
from __future__ import annotations

import logging
import time

import torch

from kernels.triton_ops import DEFAULT_DECODE_SPLIT
from llmsvc.config import EngineConfig
from llmsvc.models.loader import build_model, kv_cache_spec, to_torch_dtype
from llmsvc.models.lora import create_lora_manager
from llmsvc.models.parallel import get_tp_rank, get_tp_world_size
from llmsvc.wire import ModelRunnerOutput, NewRequestData, SchedulerOutput
from llmsvc.worker.graphs import capture_decode_graphs, graph_inputs
from llmsvc.worker.input_batch import build_inputs
from llmsvc.worker.kv_memory import KVHostPool
from llmsvc.worker.request_state import RequestStates
from llmsvc.worker.sampler import Sampler, compute_prompt_logprobs
from llmsvc.worker.sampling_metadata import SamplingMetadata
from llmsvc.worker.spec_decode import accept, expand_rows

logger = logging.getLogger(__name__)



class ModelRunner:
    """Owns the model, the KV cache tensors and the per-request states of one rank."""

    def __init__(self, config: EngineConfig, device: torch.device) -> None:
        self.config = config
        self.device = device
        self.dtype = to_torch_dtype(config.model_config.dtype)
        self.block_size = config.cache_config.block_size
        self.states = RequestStates()
        self.sampler = Sampler(config.logprobs_mode)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.kv_pool: KVHostPool | None = None  # CPU: the mapping kv_caches view
        self.model: torch.nn.Module | None = None
        self.graph_runner = None  # CUDA only: replays captured decode steps
        self.lora = None  # llmsvc.models.lora.LoRAManager when the config serves adapters

    def load_model(self) -> None:
        t0 = time.perf_counter()
        mc = self.config.model_config
        self.model = build_model(mc, self.device, self.dtype)
        self.lora = create_lora_manager(self.model, self.config.lora_config)
        n_params = sum(p.numel() for p in self.model.parameters())
        logger.info("loaded %s (%s, %.1fM params on this rank, %s, tp rank %d/%d) in %.1fs",
                    mc.served_model_name, mc.architecture, n_params / 1e6, mc.dtype,
                    get_tp_rank(), get_tp_world_size(), time.perf_counter() - t0)

    def kv_cache_bytes_per_block(self) -> int:
        num_layers, num_kv_heads, head_dim = kv_cache_spec(self.config.model_config.hf_config,
                                                           get_tp_world_size())
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * num_layers * self.block_size * num_kv_heads * head_dim * elem

    def initialize_kv_cache(self, num_blocks: int) -> None:
        num_layers, num_kv_heads, head_dim = kv_cache_spec(self.config.model_config.hf_config,
                                                           get_tp_world_size())
        shape = (num_blocks, self.block_size, num_kv_heads, head_dim)
        self.release_kv_cache()
        if self.device.type == "cpu":  # zero pages from the kernel, faulted in off the start-up path
            self.kv_pool = KVHostPool(2 * num_layers, shape, self.dtype)
            t = self.kv_pool.tensors
            self.kv_caches = [(t[2 * i], t[2 * i + 1]) for i in range(num_layers)]
        else:
            self.kv_caches = [(torch.zeros(shape, dtype=self.dtype, device=self.device),
                               torch.zeros(shape, dtype=self.dtype, device=self.device))
                              for _ in range(num_layers)]
        self.num_blocks = num_blocks

    def release_kv_cache(self) -> None:
        """Drop the KV cache tensors (and stop a CPU pool's prefault thread)."""
        self.kv_caches = []
        if self.kv_pool is not None:
            self.kv_pool.close()
            self.kv_pool = None

    def warmup(self) -> None:
        """A tiny prefill and decode through every op (the first blocks; nothing is cached yet). On
        CUDA also a 512-token prefill, a decode past the 512-key split-K threshold and a mixed
        step, so every Triton kernel variant compiles here and not in a user's first request."""
        n = min(self.block_size, 8)
        steps = [{"w0": (0, n)}, {"w0": (n, 1)}]  # req -> (num_computed, num_new), per step
        short_blocks = -(-(n + 1) // self.block_size)  # the decode at position n needs block 1 when n == block_size
        split = DEFAULT_DECODE_SPLIT
        long_len = split + 2
        long_blocks = -(-long_len // self.block_size)
        if (self.device.type == "cuda" and self.num_blocks >= short_blocks + long_blocks
                and (self.config.model_config.max_model_len or 0) >= long_len):
            steps += [{"w1": (0, split)}, {"w1": (split, 1)}, {"w1": (split + 1, 1), "w0": (0, n)}]
        tables = {"w0": list(range(short_blocks)), "w1": list(range(short_blocks, short_blocks + long_blocks))}
        prompt_len = {"w0": n + 1, "w1": long_len}
        for step in steps:
            self._warmup_step(step, tables, prompt_len)
            self.states.clear()
        if self.kv_pool is not None:  # the whole pool resident before the first request (kv_memory.py)
            self.kv_pool.wait_resident()
        if self.device.type == "cuda" and not self.config.model_config.enforce_eager:
            self.graph_runner = capture_decode_graphs(self)

    def _warmup_step(self, step: dict, tables: dict, prompt_len: dict) -> None:
        from llmsvc.sampling_params import SamplingParams

        so = SchedulerOutput.make_empty()
        for req, (num_computed, num_new) in step.items():
            so.scheduled_new_reqs.append(NewRequestData(
                f"__warmup_{req}__", [0] * prompt_len[req], [], SamplingParams(temperature=0.0),
                tables[req], num_computed))
            so.num_scheduled_tokens[f"__warmup_{req}__"] = num_new
        so.total_num_scheduled_tokens = sum(so.num_scheduled_tokens.values())
        self.execute_model(so)

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput | None:
        """Run one step. Returns the sampled tokens on TP rank 0, None on other ranks."""
        self.states.apply(so)
        if not so.num_scheduled_tokens:
            return ModelRunnerOutput.make_empty() if get_tp_rank() == 0 else None
        inp = build_inputs(self.states, so.num_scheduled_tokens, self.block_size, self.device,
                           so.scheduled_spec_decode_tokens)
        n = len(inp.req_ids)
        if self.lora is not None:
            self.lora.set_mapping(inp.token_lora_slots, self.device)
        # graphs were captured without adapters: a step with one runs eagerly
        if (self.graph_runner is not None and inp.meta.max_query_len == 1 and inp.token_lora_slots is None
                and self.graph_runner.can_run(n)):
            hidden = self.graph_runner.run(graph_inputs(inp), n)  # [n, hidden]
        else:
            hidden = self.model(inp.input_ids, inp.positions, inp.meta, self.kv_caches)  # [T, hidden]
        logits = self.model.compute_logits(hidden[inp.logits_indices])  # [S, vocab] fp32
        prompt_logprobs = self._prompt_logprobs(hidden, inp) if inp.prompt_logprob_rows else {}
        if get_tp_rank() != 0:
            return None
        if not inp.sampling_req_ids:
            self.states.prev_sampled = {}
            return ModelRunnerOutput([], [], None, prompt_logprobs)
        states = [self.states[r] for r in inp.sampling_req_ids]
        if inp.num_sample_rows is None:  # one row per request
            params, prompts, outputs = ([s.sampling_params for s in states],
                                        [s.token_ids[:s.prompt_len] for s in states],
                                        [s.output_token_ids for s in states])
            row_req_ids = inp.sampling_req_ids
        else:  # speculative decoding: a row per draft position (spec_decode.py)
            params, prompts, outputs, row_req_ids = expand_rows(states, inp.num_sample_rows,
                                                                so.scheduled_spec_decode_tokens)
        md = SamplingMetadata.build(params, prompts, outputs, vocab_size=logits.shape[-1],
                                    device=self.device, eos_token_ids=self.config.model_config.eos_token_ids)
        if so.grammar_bitmask is not None:
            md.set_grammar_bitmask(row_req_ids, so.structured_output_req_ids, so.grammar_bitmask)
        out = self.sampler.forward(logits, md)
        flat = out.sampled_token_ids.tolist()
        if inp.num_sample_rows is None:
            sampled, logprobs = [[t] for t in flat], [None if lp is None else [lp] for lp in out.logprobs]
        else:
            sampled, logprobs = accept(flat, out.logprobs, inp.sampling_req_ids, inp.num_sample_rows,
                                       so.scheduled_spec_decode_tokens)
        self.states.prev_sampled = {r: t[-1] for r, t in zip(inp.sampling_req_ids, sampled)}
        logprobs = logprobs if any(lp is not None for lp in logprobs) else None
        no_token = first_token_from_an_empty_row(out.no_token_rows, inp.sampling_req_ids, sampled, inp.num_sample_rows)
        return ModelRunnerOutput(inp.sampling_req_ids, sampled, logprobs, prompt_logprobs, no_token)

    def _prompt_logprobs(self, hidden: torch.Tensor, inp) -> dict:
        result = {}
        for req_id, (row, count, first_target) in inp.prompt_logprob_rows.items():
            st = self.states[req_id]
            entries = [None] if first_target == 1 else []  # the first prompt token has no logprob
            if count > 0:
                logits = self.model.compute_logits(hidden[row:row + count])
                targets = torch.tensor(st.token_ids[first_target:first_target + count], device=self.device)
                entries += compute_prompt_logprobs(logits, targets, st.sampling_params.prompt_logprobs)
            result[req_id] = entries
        return result


def first_token_from_an_empty_row(rows: list[int], req_ids: list[str], sampled: list[list[int]],
                                  num_sample_rows: list[int] | None) -> dict[str, int]:
    """req_id -> index of its first sampled token that came from a row with nothing to sample
    (`rows`, the sampler's). A request's k-th token comes from its k-th row: one row each, or
    with drafts its positions in order (spec_decode.accept keeps a prefix of them)."""
    if not rows:
        return {}
    dead, found, start = set(rows), {}, 0
    for i, rid in enumerate(req_ids):
        n = 1 if num_sample_rows is None else num_sample_rows[i]
        k = next((k for k in range(len(sampled[i])) if start + k in dead), None)
        if k is not None:
            found[rid] = k
        start += n
    return found
