"""Wire the model runner's decode steps into CUDAGraphRunner (CUDA only; untested on hardware).

Static buffers hold the largest decode batch (max_num_seqs sequences of one token each);
the captured forward reads its AttentionMetadata from them, with host-side hints fixed at
max_query_len=1 and max_seq_len=max_model_len so nothing syncs while captured.
"""
from __future__ import annotations

import logging

import torch

from llmsvc.models.layers.attention import AttentionMetadata
from llmsvc.worker.cuda_graph import CUDAGraphRunner

logger = logging.getLogger(__name__)


def graph_inputs(inp) -> dict[str, torch.Tensor]:
    m = inp.meta
    return {"input_ids": inp.input_ids, "positions": inp.positions, "slot_mapping": m.slot_mapping,
            "block_tables": m.block_tables, "query_start_loc": m.query_start_loc, "seq_lens": m.seq_lens}


def capture_decode_graphs(runner) -> CUDAGraphRunner:
    cfg = runner.config
    max_bs = cfg.scheduler_config.max_num_seqs
    max_len = cfg.model_config.max_model_len
    max_blocks = (max_len + runner.block_size - 1) // runner.block_size
    dev = runner.device
    buffers = {
        "input_ids": torch.zeros(max_bs, dtype=torch.int64, device=dev),
        "positions": torch.zeros(max_bs, dtype=torch.int64, device=dev),
        "slot_mapping": torch.full((max_bs,), -1, dtype=torch.int64, device=dev),
        "block_tables": torch.zeros(max_bs, max_blocks, dtype=torch.int32, device=dev),
        "query_start_loc": torch.arange(max_bs + 1, dtype=torch.int32, device=dev),
        "seq_lens": torch.zeros(max_bs, dtype=torch.int32, device=dev),
    }

    def forward(input_ids, positions, slot_mapping, block_tables, query_start_loc, seq_lens):
        meta = AttentionMetadata(slot_mapping=slot_mapping, block_tables=block_tables,
                                 query_start_loc=query_start_loc, seq_lens=seq_lens,
                                 max_query_len=1, max_seq_len=max_len)
        return runner.model(input_ids, positions, meta, runner.kv_caches)

    graph_runner = CUDAGraphRunner(forward, buffers, max_bs)
    with torch.inference_mode():
        graph_runner.capture()
    logger.info("captured CUDA graphs for decode batch sizes %s", graph_runner.sizes)
    return graph_runner
