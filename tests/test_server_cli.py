"""`llmsvc serve` flags/env and LlmServer.serve() exit codes (fake engine, in process)."""
from __future__ import annotations

import argparse
import asyncio

import pytest

from llmsvc.server import cli
from llmsvc.server.app import LlmServer
from tests.server_harness import fake_engine_factory


def parse(argv, monkeypatch=None, env=None):
    for k, v in (env or {}).items():
        monkeypatch.setenv(k, v)
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    return p.parse_args(argv)


def test_parse_bytes():
    assert cli.parse_bytes("2GiB") == 2 << 30
    assert cli.parse_bytes("512MiB") == 512 << 20
    assert cli.parse_bytes("1.5GB") == 1_500_000_000
    assert cli.parse_bytes("4096") == 4096
    with pytest.raises(argparse.ArgumentTypeError):
        cli.parse_bytes("lots")


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
            async for _ in server.async_engine.generate("x", [1, 2], SamplingParams(max_tokens=5)):
                pass

    code, server = asyncio.run(_serve_until(fake_engine_factory(), kill_engine))
    assert code == 1 and server.engine_died
