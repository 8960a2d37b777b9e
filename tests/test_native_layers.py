"""All decoder layers in one native call (kernels/cpu_ops/decoder.c) == the per-op layers.

The per-op path (each LlamaDecoderLayer through kernels.ops) is this op's reference and is
itself checked against Hugging Face in test_models.py; the one-call path must give the same
logits bit for bit, since it calls the same kernels with the same arguments."""
from __future__ import annotations

import pytest
import torch

from kernels import ops
from kernels.cpu_ops import build, decoder, linear
from model_utils import PagedRunner, load_our_model, make_tiny_model_dir
from test_models import CONFIGS


def _native_available(dtype: str) -> bool:
    lib = build.load()
    if lib is None:
        return False
    if dtype == "float32":
        return lib.llmsvc_gemm_f32_supported() == 1
    return lib.llmsvc_gemm_bf16_supported() == 1


@pytest.fixture
def count_native(monkeypatch):
    calls = {"native": 0, "per_op": 0}
    run = decoder.DecoderPlan.run

    def counted(self, *a):
        out = run(self, *a)
        calls["native" if out is not None else "per_op"] += 1
        return out
    monkeypatch.setattr(decoder.DecoderPlan, "run", counted)
    return calls


def _steps(runner: PagedRunner, seed: int) -> list[dict]:
    """A prefill batch, a chunk over a cached prefix beside decodes, then decodes; returns the
    logits of each step."""
    g = torch.Generator().manual_seed(seed)
    prompts = {i: torch.randint(3, 300, (n,), generator=g).tolist() for i, n in enumerate([37, 12, 1, 20])}
    out = [runner.step(prompts)]
    out.append(runner.step({0: [5], 1: [7, 8, 9, 10, 11], 2: [4], 3: [6]}))
    for t in range(3):
        out.append(runner.step({i: [10 + t + i] for i in range(4)}))
    return out


def _native_and_per_op(model_dir, dtype: str, steps, num_blocks: int = 48, **load) -> tuple[list[dict], list[dict]]:
    """steps(runner) -> each step's logits, run on a model that takes the one-call path and on one
    held to the per-op layers (same weights, same runner seed)."""
    out = []
    for native in (True, False):
        model = load_our_model(model_dir, dtype=dtype, **load)
        if not native:
            model.model._native_plan, model.model._native_planned = None, True
        out.append(steps(PagedRunner(model, num_blocks=num_blocks, seed=3)))
    return out[0], out[1]


# decoder.c's MLP_ROWS: an fp32 prefill step runs its MLP this many rows at a time
MLP_ROWS = 128


def _long_prefill_rows(model_dir, dtype: str) -> int:
    """Rows of a prefill step that the one-call decoder takes on this CPU (at most the plan's
    max_m: 256 for AMX bf16 tiles, 1024 elsewhere) and that is longer than an MLP_ROWS chunk,
    with a partial last chunk: 300 = 2 x 128 + 44 where it fits, else 250 under AMX's 256."""
    plan = load_our_model(model_dir, dtype=dtype).model._make_native_plan()
    assert plan is not None
    rows = min(300, plan.max_m)
    rows -= 6 if rows % MLP_ROWS == 0 else 0
    assert rows > MLP_ROWS, plan.max_m
    return rows


def _assert_same_logits(native: list[dict], per_op: list[dict]) -> None:
    assert len(native) == len(per_op)
    for native_step, per_op_step in zip(native, per_op):
        assert native_step.keys() == per_op_step.keys()
        for k in native_step:
            assert torch.equal(native_step[k], per_op_step[k]), (k, (native_step[k] - per_op_step[k]).abs().max())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", ["llama-untied", "qwen2-bias", "llama3-rope", "gqa4-hd128", "mistral-window",
                                  "phi3-partial-rope"])
def test_one_native_call_equals_the_per_op_layers(tmp_path, count_native, dtype, name):
    if not _native_available(dtype):
        pytest.skip(f"no native {dtype} GEMM on this CPU: every step takes the per-op path")
    cfg = CONFIGS.get(name) or dict(arch="llama", tie=False, hidden_size=256, num_attention_heads=8,
                                    num_key_value_heads=2, head_dim=128, intermediate_size=160)
    d = make_tiny_model_dir(tmp_path, **cfg)
    native, per_op = _native_and_per_op(d, dtype, lambda runner: _steps(runner, seed=7))
    assert count_native == {"native": 5, "per_op": 0}  # every step of the first model ran natively
    _assert_same_logits(native, per_op)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_prefill_longer_than_an_mlp_chunk_equals_the_per_op_layers(tmp_path, count_native, dtype):
    # ~300 rows: the native call runs the fp32 MLP in chunks of decoder.c's MLP_ROWS (128), the
    # last one partial; the per-op path runs it whole
    if not _native_available(dtype):
        pytest.skip(f"no native {dtype} GEMM on this CPU")
    d = make_tiny_model_dir(tmp_path, "llama")
    rows = _long_prefill_rows(d, dtype)
    g = torch.Generator().manual_seed(11)
    sizes = [rows // 2, rows - rows // 2 - 10, 10]  # 150, 140, 10 at 300 rows
    prompts = {i: torch.randint(3, 300, (n,), generator=g).tolist() for i, n in enumerate(sizes)}
    native, per_op = _native_and_per_op(
        d, dtype, lambda runner: [runner.step(prompts), runner.step({i: [20 + i] for i in range(3)})])
    assert count_native == {"native": 2, "per_op": 0}
    _assert_same_logits(native, per_op)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", ["llama-untied", "qwen2-bias"])
def test_int8_weights_in_the_native_call_equal_the_per_op_layers(tmp_path, count_native, caplog, dtype, name):
    """`--quantization int8`: the call multiplies through llmsvc_gemm_i8 on the ISA the per-op
    layers use, and takes steps of any size (no float panel limit): here a prefill one row past
    the fp32 panels' limit, whose MLP runs in fp32's row chunks."""
    from kernels.cpu_ops import int8

    if not _native_available(dtype) or int8.isa() == "ref":
        pytest.skip(f"no native {dtype} or int8 GEMM on this CPU")
    d = make_tiny_model_dir(tmp_path, **CONFIGS[name], max_position_embeddings=2048)
    long_prompt = {9: [3 + i % 300 for i in range(linear.PANEL_MAX_M + 1)]}  # a fifth sequence

    def steps(runner):
        return _steps(runner, seed=7) + [runner.step(long_prompt, last_only=True)]
    with caplog.at_level("INFO", logger="kernels.cpu_ops.decoder"):
        native, per_op = _native_and_per_op(d, dtype, steps, num_blocks=96, quantization="int8")
    assert count_native == {"native": 6, "per_op": 0}
    assert f"steps of any size ({dtype}, int8 {int8.isa()} GEMM)" in caplog.text
    _assert_same_logits(native, per_op)


def test_int8_weights_on_the_torch_reference_take_the_per_op_path(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMSVC_INT8_ISA", "ref")
    model = load_our_model(make_tiny_model_dir(tmp_path, "llama"), quantization="int8")
    assert model.model._make_native_plan() is None


def test_steps_beyond_the_native_gemm_rows_take_the_per_op_path(tmp_path, count_native, caplog):
    if not _native_available("float32"):
        pytest.skip("no native fp32 GEMM")
    d = make_tiny_model_dir(tmp_path, "llama", max_position_embeddings=2048)
    model = load_our_model(d)
    runner = PagedRunner(model, num_blocks=2 + (linear.PANEL_MAX_M + 1) // 16 + 1)
    with caplog.at_level("INFO", logger="kernels.cpu_ops.decoder"):
        runner.step({0: [3]})  # the first forward makes the plan and says so, once
        runner.free(0)
    assert [r.getMessage() for r in caplog.records] == [
        f"CPU decoder layers: 2 layers in one native call for steps of up to {linear.PANEL_MAX_M} "
        "tokens (float32, panel GEMM); larger steps run layer by layer"]
    big = {0: [3 + i % 300 for i in range(linear.PANEL_MAX_M + 1)]}  # a row past the panel GEMM's limit
    runner.step(big)
    runner.step({0: [5]})
    assert count_native == {"native": 2, "per_op": 1}


def test_no_plan_where_the_per_op_path_must_run(tmp_path, monkeypatch):
    d = make_tiny_model_dir(tmp_path, "llama", attention_bias=True)  # o_proj has a bias
    model = load_our_model(d)
    assert model.model._make_native_plan() is None
    monkeypatch.setenv("LLMSVC_NATIVE_LAYERS", "0")
    plain = load_our_model(make_tiny_model_dir(tmp_path, "qwen2"))
    assert plain.model._make_native_plan() is None
    monkeypatch.delenv("LLMSVC_NATIVE_LAYERS")
    # per-head q/k norms, or windows that differ between layers: no plan
    for name in ("qwen3", "qwen2-window"):
        model = load_our_model(make_tiny_model_dir(tmp_path, **CONFIGS[name]))
        assert model.model._make_native_plan() is None, name
    monkeypatch.setenv("LLMSVC_NATIVE_LAYERS", "0")
    # profiling forward without a cache: the plan declines the step
    monkeypatch.delenv("LLMSVC_NATIVE_LAYERS")
    if _native_available("float32"):
        plan = plain.model._make_native_plan()
        assert plan is not None
        assert ops.decoder_layers(plan, torch.zeros(3, 64), torch.arange(3), None, None) is None


def test_bad_position_is_an_error_not_a_wild_read(tmp_path):
    if not _native_available("float32"):
        pytest.skip("no native fp32 GEMM")
    d = make_tiny_model_dir(tmp_path, "llama")
    model = load_our_model(d)  # max_position_embeddings 256
    runner = PagedRunner(model, num_blocks=48)
    runner.step({0: [3, 4, 5]})
    meta_positions = torch.tensor([300])  # past the rope table
    kv = runner.kv_caches
    from llmsvc.models.layers.attention import AttentionMetadata
    meta = AttentionMetadata(torch.tensor([3]), torch.tensor([runner.block_tables[0]], dtype=torch.int32),
                             torch.tensor([0, 1], dtype=torch.int32), torch.tensor([4], dtype=torch.int32), 1, 4)
    with pytest.raises(ValueError, match="rejected"):
        model(torch.tensor([7]), meta_positions, meta, kv)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_profile_times_every_kind_of_call_and_changes_no_logit(tmp_path, dtype):
    if not _native_available(dtype):
        pytest.skip(f"no native {dtype} GEMM on this CPU")
    d = make_tiny_model_dir(tmp_path, "llama")
    logits, profile = [], None
    for profiled in (False, True):
        model = load_our_model(d, dtype=dtype)
        if profiled:
            model.model._native_plan, model.model._native_planned = model.model._make_native_plan(), True
            profile = model.model._native_plan.enable_profile()
        logits.append(_steps(PagedRunner(model, num_blocks=48, seed=3), seed=7))
    for plain_step, profiled_step in zip(*logits):
        for k in plain_step:
            assert torch.equal(plain_step[k], profiled_step[k])
    wall, cpu = profile
    assert profile.shape == (2, len(decoder.PROFILE_KINDS))
    assert (wall > 0).all(), dict(zip(decoder.PROFILE_KINDS, wall.tolist()))  # every kind ran and was timed
    assert cpu.sum() > 0 and (cpu <= wall + 1e-3).all()  # the calling thread's share of each


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_lora_adapters_in_the_native_call_equal_the_per_op_layers(tmp_path, count_native, dtype):
    """Two adapters (all projections at rank 4; q/v/down at rank 8) and base-model rows mixed in
    every step, a ~300-row prefill among them (the fp32 MLP's row chunks split the groups)."""
    import numpy as np

    from llmsvc.config import LoRAConfig
    from llmsvc.models.lora import create_lora_manager
    from tests.lora_utils import make_lora_adapter

    if not _native_available(dtype):
        pytest.skip(f"no native {dtype} GEMM on this CPU")
    d = make_tiny_model_dir(tmp_path, "llama")
    config = LoRAConfig({"a": make_lora_adapter(d, str(tmp_path / "a"), seed=1),
                         "b": make_lora_adapter(d, str(tmp_path / "b"), rank=8, seed=2,
                                                targets=("q_proj", "v_proj", "down_proj"))}, max_lora_rank=8)
    slot_of = {0: 0, 1: 1, 2: -1, 3: 0}  # sequence -> adapter slot (-1: the base model)
    rows = _long_prefill_rows(d, dtype)
    sizes = [rows // 2, 12, rows - rows // 2 - 17, 5]  # 150, 12, 133, 5 at 300 rows

    def steps(runner):
        manager = create_lora_manager(runner.model, config)
        g = torch.Generator().manual_seed(5)
        batches = [{i: torch.randint(3, 300, (n,), generator=g).tolist() for i, n in enumerate(sizes)},
                   {0: [5], 1: [7, 8, 9], 2: [4], 3: [6]}, {i: [10 + i] for i in range(4)}]
        out = []
        for batch in batches:
            manager.set_mapping(np.repeat([slot_of[i] for i in batch], [len(t) for t in batch.values()]),
                                torch.device("cpu"))
            out.append(runner.step(batch))
        return out

    native, per_op = _native_and_per_op(d, dtype, steps)
    assert count_native == {"native": 3, "per_op": 0}
    _assert_same_logits(native, per_op)
