"""LoRA adapters served beside the base model: greedy tokens equal Hugging Face's on the merged
weights for every adapter, whatever the mix of adapters in a step (chunked prefills and decodes
together), on every executor and over gRPC with the engine core in its own process;
the prefix cache is per adapter; bad adapters fail at start-up and unknown names per request."""
from __future__ import annotations

import argparse
import json
import os

import grpc
import pytest
import torch

from kernels import ops
from llmsvc import LLM, LoRARequest, SamplingParams
from llmsvc.client import Client
from llmsvc.client.errors import LlmsvcError
from llmsvc.config import EngineConfig, LoRAConfig
from llmsvc.core.errors import LoRAAdminError, LoRANotFoundError
from llmsvc.engine.llm_engine import LLMEngine
from llmsvc.engine.lora_registry import LoRARegistry

from llmsvc.models.lora import create_lora_manager
from llmsvc.models.lora_adapter import load_adapter
from llmsvc.server import cli
from tests.lora_utils import make_lora_adapter, merged_hf_model
from tests.model_utils import load_hf_model, load_our_model
from tests.server_harness import EOS, ServerThread, make_tiny_served_model_dir

PROMPTS = [[5 + (7 * i + j) % (EOS - 5) for i in range(10 + 3 * j)] for j in range(3)]
MAX_NEW = 10
# a 6-token budget: prompts are prefilled in chunks, beside other requests' decodes
ENGINE = dict(block_size=4, num_kv_blocks_override=128, max_num_seqs=8, max_num_batched_tokens=6)
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    return build_served(tmp_path_factory.mktemp("lora"))


def build_served(root):
    """(model dir, {adapter name: dir}, {None or name: [HF greedy tokens per prompt]})."""
    model_dir = make_tiny_served_model_dir(root)
    adapters = {
        "all": make_lora_adapter(model_dir, str(root / "all"), rank=4, alpha=8.0, seed=1),
        # another rank, a subset of modules, rsLoRA scaling and a per-module alpha
        "some": make_lora_adapter(model_dir, str(root / "some"), rank=8, alpha=4.0, seed=2,
                                  targets=("q_proj", "v_proj", "down_proj"), use_rslora=True,
                                  alpha_pattern={"v_proj": 16.0}),
    }
    refs = {None: _hf_greedy(load_hf_model(model_dir))}
    for name, path in adapters.items():
        refs[name] = _hf_greedy(merged_hf_model(model_dir, path))
    return model_dir, adapters, refs


@torch.no_grad()
def _hf_greedy(model) -> list[list[int]]:
    out = []
    for p in PROMPTS:
        ids = model.generate(torch.tensor([p]), max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW, do_sample=False)
        out.append(ids[0, len(p):].tolist())
    return out


def _mix():
    """(prompt index, adapter) pairs: every prompt under every adapter and the base model."""
    return [(i, name) for name in (None, "all", "some") for i in range(len(PROMPTS))]


def check_mixed_batch(served, **llm_kw) -> None:
    """Every prompt under both adapters and the base model in one generate call equals HF."""
    model_dir, adapters, refs = served
    llm = LLM(model=model_dir, lora_modules=adapters, max_lora_rank=8, **ENGINE, **llm_kw)
    try:
        mix = _mix()
        outs = llm.generate([PROMPTS[i] for i, _ in mix], GREEDY, use_tqdm=False, lora_request=[n for _, n in mix])
        assert [list(o.outputs[0].token_ids) for o in outs] == [refs[n][i] for i, n in mix]
    finally:
        llm.shutdown()


def test_adapters_change_the_output(served):
    _, _, refs = served
    assert refs["all"] != refs[None] and refs["some"] != refs[None] and refs["all"] != refs["some"]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_offline_mixed_batch_matches_hf_merged_weights(served, async_scheduling):
    model_dir, adapters, refs = served
    llm = LLM(model=model_dir, lora_modules=adapters, max_lora_rank=8, async_scheduling=async_scheduling, **ENGINE)
    try:
        mix = _mix()
        outs = llm.generate([PROMPTS[i] for i, _ in mix], GREEDY, use_tqdm=False,
                            lora_request=[None if n is None else LoRARequest(n, 1, adapters[n]) for _, n in mix])
        assert [list(o.outputs[0].token_ids) for o in outs] == [refs[n][i] for i, n in mix]
        assert all(o.num_cached_tokens == 0 for o in outs)
        # again: each prompt's full blocks come from the cache of its own adapter only
        again = llm.generate([PROMPTS[i] for i, _ in mix], GREEDY, use_tqdm=False,
                             lora_request=[n for _, n in mix])
        assert [list(o.outputs[0].token_ids) for o in again] == [refs[n][i] for i, n in mix]
        assert [o.num_cached_tokens for o in again] == [(len(PROMPTS[i]) - 1) // 4 * 4 for i, _ in mix]
        with pytest.raises(ValueError, match="no LoRA adapter named 'nope'; served: all, some"):
            llm.generate(PROMPTS[0], GREEDY, lora_request="nope", use_tqdm=False)
        with pytest.raises(ValueError, match="is loaded from"):
            llm.generate(PROMPTS[0], GREEDY, lora_request=LoRARequest("all", 1, "/elsewhere"), use_tqdm=False)
        assert not llm.llm_engine.has_unfinished_requests()
    finally:
        llm.shutdown()


@pytest.mark.parametrize("executor, tp", [("multiproc", 1), ("tp", 2)])
def test_worker_executors_mixed_batch_matches_hf(served, executor, tp):
    check_mixed_batch(served, tensor_parallel_size=tp, executor=executor)


def test_grpc_lora_name_and_model_info(served):
    model_dir, adapters, refs = served
    config = EngineConfig.from_options(model=model_dir, engine_core="process", log_stats_interval_s=0.0,
                                       lora_modules=adapters, max_lora_rank=8, **ENGINE)
    with ServerThread(lambda: LLMEngine.from_config(config), metrics_label_keys=("lora_name",)) as srv, \
            Client(srv.address, timeout=60) as c:
        info = c.model_info()
        assert [(a.name, a.path, a.rank) for a in info.lora_adapters] == [
            ("all", adapters["all"], 4), ("some", adapters["some"], 8)]
        for name in ("some", None, "all"):
            got = c.generate(PROMPTS[1], max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True, lora_name=name)
            assert list(got.token_ids) == refs[name][1]
        with pytest.raises(LlmsvcError) as ei:
            c.generate(PROMPTS[0], max_tokens=2, lora_name="nope")
        assert ei.value.code == grpc.StatusCode.NOT_FOUND and ei.value.reason == "LORA_NOT_FOUND"
        assert "served: all, some" in ei.value.message and ei.value.field_violations[0][0] == "lora_name"
        from prometheus_client import generate_latest
        text = generate_latest(srv.server.metrics.registry).decode()
        for name in ("some", "", "all"):  # --metrics-label-keys lora_name: series per adapter
            assert f'llmsvc_request_success_total{{finish_reason="length",lora_name="{name}"}} 1.0' in text
        info = c.server_info()
        assert info.num_free_kv_blocks == info.num_kv_blocks and info.num_running == 0


def test_preempted_requests_resume_with_their_adapter(served):
    """A KV pool too small for the batch: requests are preempted and recomputed, each with its
    own adapter again; n=2 children share the parent's adapter."""
    model_dir, adapters, refs = served
    llm = LLM(model=model_dir, lora_modules=adapters, max_lora_rank=8,
              **{**ENGINE, "num_kv_blocks_override": 12})  # 48 token slots for 9 requests of 20-26
    try:
        mix = _mix()
        outs = llm.generate([PROMPTS[i] for i, _ in mix], GREEDY, use_tqdm=False, lora_request=[n for _, n in mix])
        assert [list(o.outputs[0].token_ids) for o in outs] == [refs[n][i] for i, n in mix]
        assert sum(o.metrics.num_preemptions for o in outs) > 0
        (two,) = llm.generate(PROMPTS[1], SamplingParams(n=2, max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True),
                              use_tqdm=False, lora_request="some")
        assert [list(c.token_ids) for c in two.outputs] == [refs["some"][1]] * 2
    finally:
        llm.shutdown()


def test_offline_lora_requests_load_and_swap_adapters(served):
    """vLLM's LLM loads the adapter a LoRARequest names; with one slot, the next one swaps it out."""
    model_dir, adapters, refs = served
    llm = LLM(model=model_dir, enable_lora=True, max_loras=1, max_lora_rank=8, **ENGINE)
    try:
        for name in ("all", "some", "all"):
            outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=LoRARequest(name, 1, adapters[name]))
            assert [list(o.outputs[0].token_ids) for o in outs] == refs[name]
            assert [e.name for e in llm.llm_engine.loras.entries()] == [name]
        # a reload under the same name never reuses the earlier load's cached blocks
        assert all(o.num_cached_tokens == 0 for o in outs)
        with pytest.raises(ValueError, match="needs 2 LoRA adapters; max_loras is 1"):
            llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False,
                         lora_request=[LoRARequest(n, 1, adapters[n]) for n in ("all", "some")])
    finally:
        llm.shutdown()


def test_grpc_load_and_unload_adapters_while_serving(served):
    model_dir, adapters, refs = served
    config = EngineConfig.from_options(model=model_dir, engine_core="process", log_stats_interval_s=0.0,
                                       enable_lora=True, max_loras=2, max_lora_rank=8, **ENGINE)
    with ServerThread(lambda: LLMEngine.from_config(config), admin_tokens=["root"]) as srv, \
            Client(srv.address, timeout=60, token="root") as c:
        def code(call, *args):
            with pytest.raises(LlmsvcError) as ei:
                call(*args)
            return ei.value.code, ei.value.reason

        assert list(c.model_info().lora_adapters) == []
        assert code(lambda: c.generate(PROMPTS[0], max_tokens=2, lora_name="all")) == (
            grpc.StatusCode.NOT_FOUND, "LORA_NOT_FOUND")
        a = c.load_lora_adapter("all", adapters["all"])
        assert (a.name, a.path, a.rank) == ("all", adapters["all"], 4)
        first = c.generate(PROMPTS[2], max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True, lora_name="all")
        assert list(first.token_ids) == refs["all"][2]
        assert code(c.load_lora_adapter, "all", adapters["some"]) == (grpc.StatusCode.ALREADY_EXISTS, "LORA_EXISTS")
        c.load_lora_adapter("some", adapters["some"])
        assert code(c.load_lora_adapter, "third", adapters["some"]) == (
            grpc.StatusCode.RESOURCE_EXHAUSTED, "LORA_SLOTS_FULL")
        c.unload_lora_adapter("some")
        assert [x.name for x in c.model_info().lora_adapters] == ["all"]
        assert code(c.unload_lora_adapter, "some") == (grpc.StatusCode.NOT_FOUND, "LORA_NOT_FOUND")
        bad = code(c.load_lora_adapter, "broken", "/no/such/adapter")
        assert bad == (grpc.StatusCode.INVALID_ARGUMENT, "LORA_LOAD_FAILED")
        garbage = make_lora_adapter(model_dir, os.path.join(os.path.dirname(adapters["all"]), "garbage"))
        with open(os.path.join(garbage, "adapter_model.safetensors"), "wb") as f:
            f.write(b"not safetensors at all")  # used to end the engine core (SafetensorError)
        assert code(c.load_lora_adapter, "garbage", garbage) == (grpc.StatusCode.INVALID_ARGUMENT, "LORA_LOAD_FAILED")
        for name in ("n" * 100_000, "two\nlines"):  # a name goes into logs, metrics and messages
            assert code(c.load_lora_adapter, name, adapters["some"])[0] == grpc.StatusCode.INVALID_ARGUMENT
        # the name "all" now means other weights: nothing cached under the old load is reused
        c.unload_lora_adapter("all")
        c.load_lora_adapter("all", adapters["some"])
        again = c.generate(PROMPTS[2], max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True, lora_name="all")
        assert list(again.token_ids) == refs["some"][2] and again.prompt.num_cached_tokens == 0
        info = c.server_info()
        assert info.num_free_kv_blocks == info.num_kv_blocks and info.num_running == 0
        assert (info.max_loras, info.max_lora_rank) == (2, 8)


def test_unload_waits_for_the_requests_using_the_adapter(served):
    """The engine core refuses to empty a slot that a request in flight still reads."""
    model_dir, adapters, refs = served
    config = EngineConfig.from_options(model=model_dir, engine_core="process", log_stats_interval_s=0.0,
                                       enable_lora=True, max_loras=1, max_lora_rank=8, **ENGINE)
    engine = LLMEngine.from_config(config)
    try:
        engine.add_lora("some", adapters["some"])
        engine.add_request("r", PROMPTS[0], SamplingParams(max_tokens=50, temperature=0.0), lora_name="some")
        engine.step()
        with pytest.raises(LoRAAdminError, match="1 request.s. in flight use it") as ei:
            engine.remove_lora("some")
        assert ei.value.reason == "LORA_IN_USE"
        engine.abort_request(["r"])
        while engine.has_unfinished_requests():
            engine.step()
        engine.remove_lora("some")
        assert engine.loras.entries() == []
        with pytest.raises(LoRANotFoundError):
            engine.add_request("r2", PROMPTS[0], GREEDY, lora_name="some")
    finally:
        engine.shutdown()


def test_load_lora_needs_enable_lora():
    from tests.server_harness import fake_engine_factory

    with ServerThread(fake_engine_factory(), admin_tokens=["root"]) as srv, \
            Client(srv.address, timeout=30, token="root") as c:
        with pytest.raises(LlmsvcError) as ei:
            c.load_lora_adapter("a", "/x")
        assert ei.value.code == grpc.StatusCode.FAILED_PRECONDITION and ei.value.reason == "LORA_DISABLED"


def test_lora_name_without_adapters_is_unknown():
    registry = LoRARegistry(None)
    with pytest.raises(LoRANotFoundError, match="served: none"):
        registry.lookup("x")
    assert registry.lookup(None) is None


@pytest.mark.parametrize("change, message", [
    ({"use_dora": True}, "use_dora not supported"),
    ({"bias": "all"}, "bias not supported"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save not supported"),
])
def test_unsupported_adapter_kinds_fail_at_load(served, tmp_path, change, message):
    model_dir = served[0]
    bad = make_lora_adapter(model_dir, str(tmp_path / "bad"), **change)
    with pytest.raises(ValueError, match=message):
        create_lora_manager(load_our_model(model_dir), LoRAConfig({"bad": bad}))


def test_adapter_errors_name_the_problem(served, tmp_path):
    model_dir = served[0]
    model = load_our_model(model_dir)
    big = make_lora_adapter(model_dir, str(tmp_path / "big"), rank=32)
    with pytest.raises(ValueError, match="rank 32, above --max-lora-rank 16"):
        create_lora_manager(model, LoRAConfig({"big": big}))
    head = make_lora_adapter(model_dir, str(tmp_path / "head"), targets=("lm_head",))
    with pytest.raises(ValueError, match="'lm_head' is not a linear layer of this model"):
        create_lora_manager(model, LoRAConfig({"head": head}))
    # shapes that do not fit, found after earlier modules were written: the slot is emptied again
    from safetensors.torch import load_file, save_file
    odd = make_lora_adapter(model_dir, str(tmp_path / "odd"))
    tensors = load_file(f"{odd}/adapter_model.safetensors")
    key = "base_model.model.model.layers.1.mlp.down_proj.lora_A.weight"
    tensors[key] = tensors[key][:, :7].contiguous()
    save_file(tensors, f"{odd}/adapter_model.safetensors")
    manager = create_lora_manager(model, LoRAConfig({}, max_loras=1))
    with pytest.raises(ValueError, match=r"down_proj \(A \(4, 7\).* do not fit the layer \(128 inputs"):
        manager.load(0, load_adapter("odd", odd, 16))
    assert all(not layer.lora.loaded[0] and not layer.lora.lora_a[0].any() and not layer.lora.lora_b[0].any()
               for layer in manager.layers.values())
    with pytest.raises(FileNotFoundError, match="no adapter_config.json"):
        create_lora_manager(model, LoRAConfig({"none": str(tmp_path)}))
    # a start-up with a bad adapter fails with that message, before serving anything
    with pytest.raises(ValueError, match="above --max-lora-rank"):
        LLM(model=model_dir, lora_modules={"big": big}, **ENGINE)


def _corrupt_config(path, **change):
    with open(f"{path}/adapter_config.json") as f:
        cfg = json.load(f)
    cfg.update(change)
    with open(f"{path}/adapter_config.json", "w") as f:
        json.dump(cfg, f)


def _corrupt_tensor(path, key, make):
    from safetensors.torch import load_file, save_file
    tensors = load_file(f"{path}/adapter_model.safetensors")
    tensors[key] = make(tensors[key]).contiguous()
    save_file(tensors, f"{path}/adapter_model.safetensors")


K_B = "base_model.model.model.layers.0.self_attn.k_proj.lora_B.weight"
Q_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
Q_B = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"


@pytest.mark.parametrize("corrupt, message", [
    (lambda p: open(f"{p}/adapter_model.safetensors", "wb").write(b"\x08junk"), "weights cannot be read"),
    (lambda p: open(f"{p}/adapter_config.json", "w").write("[1, 2]"), "holds list, not an object"),
    (lambda p: _corrupt_config(p, lora_alpha=None), "lora_alpha is None, not a number"),
    (lambda p: _corrupt_config(p, alpha_pattern={"q_proj(": 4}), "alpha_pattern key 'q_proj\\(' is not a regex"),
    (lambda p: _corrupt_config(p, alpha_pattern=[1]), "alpha_pattern is not an object"),
    (lambda p: (_corrupt_tensor(p, Q_A, lambda t: t[:0]), _corrupt_tensor(p, Q_B, lambda t: t[:, :0])),
     r"q_proj has A \(0, 64\)"),
    # more rows than the layer has outputs: the loader's narrow would drop them silently
    (lambda p: _corrupt_tensor(p, K_B, lambda t: torch.cat([t, t[:8]])),
     r"qkv_proj \(part 'k'\) \(A \(4, 64\), B \(40, 4\)\) do not fit the layer \(64 inputs, 32 outputs\)"),
])
def test_malformed_adapters_are_the_callers_error(served, tmp_path, corrupt, message):
    model_dir = served[0]
    path = make_lora_adapter(model_dir, str(tmp_path / "bad"))
    corrupt(path)
    manager = create_lora_manager(load_our_model(model_dir), LoRAConfig({}, max_loras=1))
    with pytest.raises(ValueError, match=message):
        manager.load(0, load_adapter("bad", path, 16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("packed", [False, True])
def test_lora_add_matches_dense_update(dtype, packed):
    """Mixed slots (and base tokens), one slot for every token; the CPU packed-GEMM path and the
    torch reference alike."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(7, 64, generator=g).to(dtype), torch.randn(7, 96, generator=g).to(dtype)
    a = (torch.randn(3, 16, 64, generator=g) / 8).to(dtype)  # an O(1) update, as a trained adapter gives
    b = (torch.randn(3, 96, 16, generator=g) / 4).to(dtype)
    packs = [(ops.pack_linear_weight(a[s]), ops.pack_linear_weight(b[s])) for s in range(3)] if packed else None
    xf, yf, af, bf = x.float(), y.float(), a.float(), b.float()
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=0.05, rtol=0.02)
    slots = [2, -1, 0, 2, 0, -1, 2]
    expect = yf.clone()
    for t, s in enumerate(slots):
        if s >= 0:
            expect[t] += bf[s] @ (af[s] @ xf[t])
    got = y.clone()
    ops.lora_add_(got, x, a, b, [(0, torch.tensor([2, 4])), (2, torch.tensor([0, 3, 6]))], packs)
    torch.testing.assert_close(got.float(), expect, **tol)
    got = y.clone()
    ops.lora_add_(got, x, a, b, [(1, None)], packs)
    torch.testing.assert_close(got.float(), yf + xf @ (bf[1] @ af[1]).T, **tol)


def test_cli_lora_flags(monkeypatch, tmp_path):
    def parse(argv):
        p = argparse.ArgumentParser()
        cli.add_arguments(p)
        return p.parse_args(argv)

    args = parse(["m", "--enable-lora", "--lora-modules", "a=/x", json.dumps({"name": "b", "path": "/y"}),
                  "--max-lora-rank", "32"])
    config = cli.build_config(args)
    assert config.lora_config == LoRAConfig({"a": "/x", "b": "/y"}, 32)
    registry = LoRARegistry(config.lora_config)
    assert registry.lookup("b").lora_id == 2
    with pytest.raises(LoRANotFoundError):
        registry.lookup("c")
    assert cli.build_config(parse(["m"])).lora_config is None
    monkeypatch.setenv("LLMSVC_LORA_MODULES", "a=/x, b=/y")
    assert cli.build_config(parse(["m"])).lora_config.modules == {"a": "/x", "b": "/y"}
    with pytest.raises(SystemExit):
        parse(["m", "--lora-modules", "nameonly"])
    with pytest.raises(ValueError, match="once"):
        cli.build_config(parse(["m", "--lora-modules", "a=/x", "a=/y"]))
