"""CUDA-graph bucketing and input staging (the parts that run without a GPU)."""
from __future__ import annotations

import pytest
import torch

from llmsvc.worker.cuda_graph import (CUDAGraphRunner, capture_sizes, padded_batch_size,
                                      stage_inputs, DEFAULT_PAD)


def test_capture_sizes():
    assert capture_sizes(1) == [1]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert capture_sizes(40) == [1, 2, 4, 8, 16, 32, 40]


def test_padded_batch_size():
    sizes = capture_sizes(64)
    got = {n: padded_batch_size(n, sizes) for n in (1, 3, 8, 9, 17, 63, 64, 65, 0)}
    assert got == {1: 1, 3: 4, 8: 8, 9: 16, 17: 32, 63: 64, 64: 64, 65: None, 0: None}


def test_stage_inputs_pads_decode_batch():
    max_bs = 8
    bufs = {"input_ids": torch.full((max_bs,), 7, dtype=torch.int64),
            "slot_mapping": torch.full((max_bs,), 99, dtype=torch.int64),
            "seq_lens": torch.full((max_bs,), 99, dtype=torch.int32),
            "query_start_loc": torch.zeros(max_bs + 1, dtype=torch.int32),
            "block_tables": torch.full((max_bs, 4), 55, dtype=torch.int32)}
    n, bs = 3, padded_batch_size(3, capture_sizes(max_bs))
    inputs = {"input_ids": torch.tensor([5, 6, 7]), "slot_mapping": torch.tensor([10, 20, 30]),
              "seq_lens": torch.tensor([4, 9, 2], dtype=torch.int32),
              "query_start_loc": torch.tensor([0, 1, 2, 3], dtype=torch.int32),
              "block_tables": torch.tensor([[1], [2], [3]], dtype=torch.int32)}
    views = stage_inputs(bufs, inputs, n, bs, max_bs, DEFAULT_PAD)
    assert bs == 4
    assert views["input_ids"].tolist() == [5, 6, 7, 0]
    assert views["slot_mapping"].tolist() == [10, 20, 30, -1]  # padded token writes nothing
    assert views["seq_lens"].tolist() == [4, 9, 2, 0]
    assert views["query_start_loc"].tolist() == [0, 1, 2, 3, 4]
    assert views["block_tables"].tolist() == [[1, 0, 0, 0], [2, 0, 0, 0], [3, 0, 0, 0], [0, 0, 0, 0]]
    assert views["slot_mapping"].data_ptr() == bufs["slot_mapping"].data_ptr()  # views, no copies
    assert bufs["slot_mapping"][4:].tolist() == [99] * 4  # rows past bs untouched


def test_stage_inputs_rejects_oversized_input():
    bufs = {"input_ids": torch.zeros(4, dtype=torch.int64)}
    with pytest.raises(AssertionError):
        stage_inputs(bufs, {"input_ids": torch.zeros(5, dtype=torch.int64)}, 5, 4, 4, {})


def test_runner_refuses_cpu_capture():
    runner = CUDAGraphRunner(lambda **kw: kw["x"] * 2, {"x": torch.zeros(8)}, max_batch_size=8)
    assert runner.sizes == [1, 2, 4, 8]
    assert not CUDAGraphRunner.available(torch.device("cpu"))
    with pytest.raises(RuntimeError):
        runner.capture()
    assert not runner.can_run(3)
