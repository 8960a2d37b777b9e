"""Expert sharding for tensor parallelism: each rank keeps a slice of every expert's intermediate
dim; tp=2 over gloo gives uniproc's greedy tokens for both MoE families."""
from __future__ import annotations

import pytest
import torch

from llmsvc.models.layers.fused_moe import FusedMoE
from model_utils import make_tiny_model_dir
from test_executors import engine_config, prompts_for, run


def _sharded(rank: int, tp: int, e: int = 3, h: int = 8, i: int = 6) -> FusedMoE:
    moe = FusedMoE(e, h, i // tp)  # what a rank of a tp-way group allocates
    moe.tp_rank, moe.tp_size, moe.i_rank, moe.intermediate_size = rank, tp, i // tp, i
    return moe


def test_weight_loader_keeps_this_ranks_slice_of_every_expert():
    e, h, i, tp = 3, 8, 6, 2
    g = torch.Generator().manual_seed(0)
    gate, up = torch.randn(e, i, h, generator=g), torch.randn(e, i, h, generator=g)
    down = torch.randn(e, h, i, generator=g)
    for rank in range(tp):
        lo, hi = rank * i // tp, (rank + 1) * i // tp
        per_expert, stacked = _sharded(rank, tp), _sharded(rank, tp)
        for x in range(e):
            per_expert.weight_loader(per_expert.gate_up_proj, gate[x], (x, 0))
            per_expert.weight_loader(per_expert.gate_up_proj, up[x], (x, 1))
            per_expert.weight_loader(per_expert.down_proj, down[x], x)
        stacked.weight_loader(stacked.gate_up_proj, torch.cat([gate, up], dim=1))
        stacked.weight_loader(stacked.down_proj, down)
        expected = torch.cat([gate[:, lo:hi], up[:, lo:hi]], dim=1)  # [E, gate_r | up_r, H]
        for moe in (per_expert, stacked):
            assert torch.equal(moe.gate_up_proj, expected)
            assert torch.equal(moe.down_proj, down[:, :, lo:hi])
    bad = _sharded(0, tp)
    with pytest.raises(ValueError, match="does not fit"):
        bad.weight_loader(bad.down_proj, down[0, :5], 0)  # hidden size 5, not 8


@pytest.mark.parametrize("cfg", [dict(arch="qwen3_moe", num_hidden_layers=3, mlp_only_layers=[1],
                                      norm_topk_prob=True),
                                 dict(arch="mixtral", num_key_value_heads=1)])
def test_tp2_greedy_matches_uniproc(tmp_path, cfg):
    d = make_tiny_model_dir(tmp_path, **cfg)
    prompts = prompts_for(engine_config(d).model_config.vocab_size, lens=(9, 26, 3))
    expected = run(engine_config(d), prompts, max_new=12)
    assert run(engine_config(d, "tp", 2), prompts, max_new=12, chunk=7) == expected
