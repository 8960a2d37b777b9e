"""`llmsvc serve` flags/env and LlmServer.serve() exit codes (fake engine, in process)."""
from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from llmsvc.engine_request import EngineRequest
from llmsvc.server import cli, cli_types
from llmsvc.server.app import BindError, LlmServer
from llmsvc.server.validation import ModelLimits
from tests.server_harness import fake_engine_factory

REPO = Path(__file__).resolve().parents[1]


def parse(argv, monkeypatch=None, env=None):
    for k, v in (env or {}).items():
        monkeypatch.setenv(k, v)
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    return p.parse_args(argv)


def test_parse_bytes():
    assert cli_types.parse_bytes("2GiB") == 2 << 30
    assert cli_types.parse_bytes("512MiB") == 512 << 20
    assert cli_types.parse_bytes("1.5GB") == 1_500_000_000
    assert cli_types.parse_bytes("4096") == 4096
    with pytest.raises(argparse.ArgumentTypeError):
        cli_types.parse_bytes("lots")


@pytest.mark.parametrize("size,expected", [("2G", 2 << 30), ("2GiB", 2 << 30), ("2GB", 2 * 10 ** 9),
                                           ("512M", 512 << 20), ("64K", 64 << 10)])
def test_kv_cache_memory_means_the_same_in_serve_and_llm(size, expected, monkeypatch):
    from llmsvc import llm as llm_module
    from llmsvc.engine.llm_engine import LLMEngine

    c = cli.build_config(parse(["--kv-cache-memory", size]))
    assert c.cache_config.kv_cache_memory_bytes == expected
    c = cli.build_config(parse([], monkeypatch, {"LLMSVC_KV_CACHE_MEMORY": size}))
    assert c.cache_config.kv_cache_memory_bytes == expected
    seen = []
    monkeypatch.setattr(LLMEngine, "from_config", classmethod(lambda cls, config: seen.append(config)))
    llm_module.LLM(kv_cache_memory=size)
    assert seen[0].cache_config.kv_cache_memory_bytes == expected


def test_flags_and_env(monkeypatch):
    a = parse(["m.gguf", "--port", "0", "--kv-cache-memory", "1GiB", "--no-prefix-caching", "--executor", "tp",
               "--tensor-parallel-size", "2"])
    c = cli.build_config(a)
    assert c.model_config.model == "m.gguf" and c.cache_config.kv_cache_memory_bytes == 1 << 30
    assert not c.cache_config.enable_prefix_caching and c.parallel_config.tensor_parallel_size == 2
    a = parse([], monkeypatch, {"LLMSVC_PORT": "1234", "LLMSVC_MAX_NUM_SEQS": "3", "LLMSVC_NO_PREFIX_CACHING": "1",
                                "LLMSVC_KV_CACHE_MEMORY": "256MiB", "LLMSVC_MODEL": "dir"})
    c = cli.build_config(a)
    assert a.port == 1234 and c.scheduler_config.max_num_seqs == 3 and not c.cache_config.enable_prefix_caching
    assert c.cache_config.kv_cache_memory_bytes == 256 << 20 and c.model_config.model == "dir"
    assert parse(["--port", "7"], monkeypatch, {"LLMSVC_PORT": "1234"}).port == 7  # flag wins over env
    assert c.model_config.served_model_name == "dir"  # the model argument as given
    c = cli.build_config(parse(["dir", "--served-model-name", "chat-small"]))
    assert c.model_config.served_model_name == "chat-small" and c.model_config.model == "dir"
    c = cli.build_config(parse([], monkeypatch, {"LLMSVC_SERVED_MODEL_NAME": "from-env"}))
    assert c.model_config.served_model_name == "from-env"
    c = cli.build_config(parse(["--seed", "7", "--chat-template", "t.jinja", "--gpu-memory-utilization", "0.5",
                                "--enforce-eager"]))
    mc = c.model_config
    assert (mc.seed, mc.chat_template, mc.enforce_eager) == (7, "t.jinja", True)
    assert c.cache_config.gpu_memory_utilization == 0.5
    d = cli.build_config(parse([]))
    assert (d.model_config.seed, d.model_config.enforce_eager, d.cache_config.gpu_memory_utilization) == (0, False, 0.9)
    for bad in ("0", "1.5", "nan"):
        with pytest.raises(SystemExit):
            parse(["--gpu-memory-utilization", bad])
    assert d.max_logprobs == 20
    assert (d.model_config.generation_config, d.model_config.override_generation_config) == ("auto", None)
    assert d.model_config.tokenizer is None
    assert cli.build_config(parse(["--tokenizer", "tok-dir"])).model_config.tokenizer == "tok-dir"
    c = cli.build_config(parse(["--generation-config", "vllm", "--override-generation-config", '{"top_k": 8}']))
    assert (c.model_config.generation_config, c.model_config.override_generation_config) == ("vllm", {"top_k": 8})
    for bad in ("{oops", "[1]"):
        with pytest.raises(SystemExit):
            parse(["--override-generation-config", bad])
    c = cli.build_config(parse(["--max-logprobs", "5"]))
    assert c.max_logprobs == 5 and ModelLimits.from_config(c).request_limits.max_logprobs == 5
    assert cli.build_config(parse([], monkeypatch, {"LLMSVC_MAX_LOGPROBS": "0"})).max_logprobs == 0
    with pytest.raises(SystemExit):
        parse(["--max-logprobs", "-1"])


def test_engine_core_flag_env_and_executor_auto(monkeypatch):
    c = cli.build_config(parse([]))
    assert (c.engine_core, c.parallel_config.executor) == ("process", "uniproc")  # the model in the core process
    c = cli.build_config(parse(["--engine-core", "inline"]))
    assert (c.engine_core, c.parallel_config.executor) == ("inline", "multiproc")  # off the gRPC process' GIL
    c = cli.build_config(parse([], monkeypatch, {"LLMSVC_ENGINE_CORE": "inline", "LLMSVC_EXECUTOR": "uniproc"}))
    assert (c.engine_core, c.parallel_config.executor) == ("inline", "uniproc")
    c = cli.build_config(parse(["--engine-core", "process", "--executor", "multiproc"]))
    assert (c.engine_core, c.parallel_config.executor) == ("process", "multiproc")
    with pytest.raises(SystemExit):
        parse(["--engine-core", "elsewhere"])


def test_event_loop_flag_env_and_choice(monkeypatch, caplog):
    import importlib.util

    from llmsvc.server import event_loop
    assert parse([]).event_loop == "auto"
    assert parse([], monkeypatch, {"LLMSVC_EVENT_LOOP": "asyncio"}).event_loop == "asyncio"
    with pytest.raises(SystemExit):
        parse(["--event-loop", "trio"])
    have_uvloop = importlib.util.find_spec("uvloop") is not None
    assert event_loop.resolve("auto") == ("uvloop" if have_uvloop else "asyncio")
    assert event_loop.resolve("asyncio") == "asyncio"

    async def loop_module():
        return type(asyncio.get_running_loop()).__module__

    assert event_loop.run(loop_module(), "asyncio").startswith("asyncio")
    if have_uvloop:
        assert event_loop.run(loop_module(), "uvloop").startswith("uvloop")
    monkeypatch.setitem(sys.modules, "uvloop", None)  # as if not installed: import raises ImportError
    assert event_loop.resolve("auto") == "asyncio"
    with pytest.raises(ValueError, match="not installed"):
        event_loop.resolve("uvloop")
    monkeypatch.setattr("llmsvc.server.logging_setup.setup_logging", lambda *a, **k: None)  # keep caplog's
    assert cli.main(parse(["--event-loop", "uvloop"])) == 2  # asked for by name: a clear error, no start
    assert "uvloop is not installed" in caplog.text


async def _serve_until(factory, trigger) -> tuple[int, LlmServer]:
    server = LlmServer(factory, host="127.0.0.1", port=0)
    server.shutdown_grace = 5.0
    stop = asyncio.Event()
    task = asyncio.create_task(server.serve(stop))
    while not server.state.ready:
        await asyncio.sleep(0.01)
    await trigger(server, stop)
    return await asyncio.wait_for(task, 30), server


def test_serve_exits_0_on_stop_and_1_on_engine_death():
    async def stop_now(server, stop):
        stop.set()

    code, server = asyncio.run(_serve_until(fake_engine_factory(), stop_now))
    assert code == 0 and server.state.draining

    async def kill_engine(server, stop):
        from llmsvc.sampling_params import SamplingParams
        server.async_engine.engine.fake_executor.fail_after = 0
        with pytest.raises(Exception):
            async for _ in server.async_engine.generate(EngineRequest("x", [1, 2], SamplingParams(max_tokens=5))):
                pass

    code, server = asyncio.run(_serve_until(fake_engine_factory(), kill_engine))
    assert code == 1 and server.engine_died


def test_second_server_on_a_busy_port_fails_naming_it():
    async def both():
        first = LlmServer(fake_engine_factory(), host="127.0.0.1", port=0)
        port = await first.start()
        try:
            second = LlmServer(fake_engine_factory(), host="127.0.0.1", port=port)
            with pytest.raises(BindError, match=f"127.0.0.1:{port}"):
                await second.start()
        finally:
            await first.shutdown(0.0)
    asyncio.run(both())


def test_serve_on_a_busy_port_exits_non_zero(tmp_path):
    from tests.server_harness import make_tiny_served_model_dir

    model_dir = make_tiny_served_model_dir(tmp_path)
    with socket.socket() as held:  # a listener with SO_REUSEPORT, as gRPC servers set it by default
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        cmd = [sys.executable, "-m", "llmsvc", "serve", model_dir, "--host", "127.0.0.1", "--port", str(port),
               "--executor", "uniproc"]
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert f"127.0.0.1:{port}" in proc.stderr and "in use" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_serve_and_llm_build_the_same_config(monkeypatch):
    from llmsvc import llm as llm_module
    from llmsvc.config import EngineConfig
    from llmsvc.engine.llm_engine import LLMEngine

    served = cli.build_config(parse(["m.gguf", "--dtype", "bfloat16", "--max-model-len", "512", "--block-size", "8",
                                     "--kv-cache-memory", "1G", "--max-num-seqs", "4", "--executor", "uniproc",
                                     "--scheduling-policy", "priority", "--device", "cpu", "--engine-core", "inline"]))
    seen = []
    monkeypatch.setattr(LLMEngine, "from_config", classmethod(lambda cls, config: seen.append(config)))
    llm_module.LLM("m.gguf", dtype="bfloat16", max_model_len=512, block_size=8, kv_cache_memory="1G",
                   max_num_seqs=4, policy="priority", device="cpu")
    offline = seen[0]
    assert offline.replace(log_stats_interval_s=served.log_stats_interval_s) == served  # LLM logs no stats
    assert EngineConfig.from_options(max_num_seqs=None) == EngineConfig()  # None: the default
    with pytest.raises(TypeError, match="no_such_option"):
        EngineConfig.from_options(no_such_option=1)
    with pytest.raises(TypeError, match="no_such_option"):
        llm_module.LLM(no_such_option=1)


def test_dtype_names_have_one_source():
    import torch

    from llmsvc.config import DTYPES
    from llmsvc.models.loader import to_torch_dtype

    assert [to_torch_dtype(name) for name in DTYPES] == [torch.float32, torch.bfloat16, torch.float16]
    for name in DTYPES:
        assert cli.build_config(parse(["--dtype", name])).model_config.dtype == name
    assert cli.build_config(parse([])).model_config.dtype == "auto"  # resolved with the model
    with pytest.raises(SystemExit):
        parse(["--dtype", "half"])
    with pytest.raises(ValueError, match="float32, bfloat16, float16"):
        to_torch_dtype("half")


def run_serve(args, env=None, timeout=120):
    import os
    e = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", "llmsvc", "serve", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout, env=e)


@pytest.mark.parametrize("args,env,says", [
    (["--port", "70000"], None, "argument --port: must be a port in [0, 65535], got 70000"),  # the OS wraps it
    (["--port", "-1"], None, "argument --port: must be a port in [0, 65535]"),
    ([], {"LLMSVC_PORT": "abc"}, "LLMSVC_PORT='abc'"),
    (["--max-num-seqs", "0"], None, "argument --max-num-seqs: must be >= 1"),  # warm-up waited forever
    ([], {"LLMSVC_MAX_NUM_BATCHED_TOKENS": "0"}, "LLMSVC_MAX_NUM_BATCHED_TOKENS='0': must be >= 1"),
    (["--tensor-parallel-size", "0"], None, "argument --tensor-parallel-size: must be >= 1"),  # ZeroDivisionError
    (["--nnodes", "0"], None, "argument --nnodes: must be >= 1"),  # served as if 1
    (["--block-size", "0"], None, "argument --block-size: must be >= 1"),
    (["--shutdown-grace", "nan"], None, "argument --shutdown-grace: must be a finite number >= 0"),
    (["--log-level", "bogus"], None, "argument --log-level: must be one of DEBUG"),  # fell back to INFO
    ([], {"LLMSVC_LOG_FORMAT": "xml"}, "LLMSVC_LOG_FORMAT='xml': must be one of text, json"),  # choices skipped
    ([], {"LLMSVC_ENABLE_LORA": "maybe"}, "LLMSVC_ENABLE_LORA='maybe': must be one of 1, true"),  # meant false
    ([], {"LLMSVC_MAX_LORAS": "0"}, "LLMSVC_MAX_LORAS='0': must be >= 1"),  # a traceback at parser construction
    ([], {"LLMSVC_NUM_THREADS": "0"}, "LLMSVC_NUM_THREADS='0': must be a whole number of threads"),  # 3 tracebacks
    ([], {"LLMSVC_NUM_THREADS": "abc"}, "LLMSVC_NUM_THREADS='abc': must be"),  # int()'s words, no name
    (["--auth-token-file", "/nope"], None, "--auth-token-file: cannot read '/nope'"),  # "[Errno 2] ...: '/nope'"
])
def test_bad_flag_or_env_value_is_a_usage_error(args, env, says):
    proc = run_serve(args, env)
    assert proc.returncode == 2 and says in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("args,says", [
    (["--tensor-parallel-size", "2"], "bad configuration: tensor parallel size 2 does not fit this model"),
    (["--tokenizer", "/nonexistent"], "bad configuration: tokenizer '/nonexistent' is not a directory"),
    (["--override-generation-config", '{"temperature": -1}'], "bad configuration: override generation config"),
    (["--device", "cuda"], "bad configuration: device cuda: torch sees no CUDA GPU here"),
])
def test_configuration_that_does_not_fit_is_one_line_and_exit_2(tmp_path, args, says):
    # found once the model is resolved, in this process and in the engine core's: no traceback
    import torch
    if "cuda" in args and torch.cuda.is_available():
        pytest.skip("a GPU is visible: --device cuda is a valid configuration here")
    from tests.server_harness import make_tiny_served_model_dir
    model_dir = make_tiny_served_model_dir(tmp_path, num_attention_heads=3, num_key_value_heads=3, hidden_size=48)
    proc = run_serve([model_dir, "--port", "0", *args])
    assert proc.returncode == 2 and says in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


def _drop_tokenizer(d):
    for f in os.listdir(d):
        if f.startswith(("tokenizer", "vocab", "merges", "special_tokens")):
            os.remove(os.path.join(d, f))


def _tear_weights(d):
    with open(os.path.join(d, "model.safetensors"), "r+b") as f:
        f.truncate(100)


@pytest.mark.parametrize("spoil,says", [
    (_drop_tokenizer, "bad configuration: no tokenizer in "),  # transformers' 5 lines after the model load
    (_tear_weights, "bad configuration: cannot read the weights file "),  # 99 lines of two tracebacks
    (lambda d: shutil.rmtree(d), "bad configuration: model "),  # a FileNotFoundError traceback
])
def test_model_files_that_do_not_load_are_one_line_and_exit_2(tmp_path, spoil, says):
    from tests.server_harness import make_tiny_served_model_dir
    model_dir = make_tiny_served_model_dir(tmp_path)
    spoil(model_dir)
    proc = run_serve([model_dir, "--port", "0"])
    assert proc.returncode == 2 and says in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


def test_a_torn_gguf_file_is_one_line_and_exit_2(tmp_path):
    from llmsvc.models.resolve import default_model_path
    torn = tmp_path / "torn.gguf"
    with open(default_model_path(), "rb") as f:
        torn.write_bytes(f.read(100))  # the header cut short
    proc = run_serve([str(torn), "--port", "0"], env={"LLMSVC_CACHE": str(tmp_path / "cache")})
    assert proc.returncode == 2 and "torn.gguf cannot be converted (truncated" in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


def test_busy_metrics_port_is_one_line(tmp_path):
    from tests.server_harness import make_tiny_served_model_dir
    model_dir = make_tiny_served_model_dir(tmp_path)
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        proc = run_serve([model_dir, "--port", "0", "--metrics-port", str(port)])
    assert proc.returncode == 1 and f"cannot listen for metrics on 127.0.0.1:{port}" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_engine_config_refuses_sizes_that_cannot_work():
    from llmsvc.config import EngineConfig
    for bad in ({"max_num_seqs": 0}, {"max_num_batched_tokens": -1}, {"block_size": 0}, {"tensor_parallel_size": 0},
                {"grammar_compile_timeout_s": float("nan")}, {"max_model_len": 0}, {"master_port": 70000}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            EngineConfig.from_options(**bad)
