"""The executor registry is the one list of executors: `llmsvc serve --help` and --executor,
GetServerInfo, the bench and the docs follow it, and the offline LLM takes an Executor class."""
from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from executors import create_executor, registry
from executors.uniproc import UniprocExecutor
from llmsvc.config import EngineConfig, ParallelConfig
from llmsvc.v1 import llmsvc_pb2 as pb
from tests.engine_fakes import FakeExecutor
from tests.server_harness import ServerThread, fake_engine_factory, make_tiny_served_model_dir

DOCS = Path(__file__).resolve().parents[1] / "docs"


class CountingExecutor(UniprocExecutor):
    """uniproc that counts its steps: shows that LLM built this class and stepped through it."""
    name = "counting"
    instances: list["CountingExecutor"] = []

    def __init__(self, config) -> None:
        super().__init__(config)
        self.steps = 0
        CountingExecutor.instances.append(self)

    def execute_model(self, scheduler_output, non_block=False):
        self.steps += 1
        return super().execute_model(scheduler_output, non_block)


class RecordingFakeExecutor(FakeExecutor):
    """A FakeExecutor registered under a name of its own (no model: a server starts in ms)."""


@pytest.fixture
def extra_executor(monkeypatch):
    """A registry with one more executor, registered as an out-of-tree one would be."""
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    return registry.register_executor("recording", f"{__name__}:RecordingFakeExecutor",
                                      "a fake model in this process, for tests", wire_name="recording_fake")


def serve_help(capsys) -> str:
    from llmsvc.__main__ import main

    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    return " ".join(capsys.readouterr().out.split())  # argparse wraps the help at any space


def test_builtin_executors_are_registered_under_their_class_names():
    assert registry.executor_names()[:3] == ("uniproc", "multiproc", "tp")
    for entry in registry.registered():
        assert entry.load().name == entry.name  # the name the executor logs and errors with


def test_every_registered_executor_is_in_serve_help_and_accepted(capsys, extra_executor):
    from llmsvc.server import cli

    text = serve_help(capsys)
    choices = re.search(r"--executor \{([^}]*)\}", text).group(1).split(",")
    assert choices == ["auto", *registry.executor_names()]
    for entry in registry.registered():
        assert f"{entry.name} ({entry.description})" in text
        p = argparse.ArgumentParser()
        cli.add_arguments(p)
        assert cli.build_config(p.parse_args(["--executor", entry.name])).parallel_config.executor == entry.name


@pytest.mark.parametrize("name,tp", [("uniproc", 1), ("multiproc", 1), ("tp", 2), ("multiproc", 2),
                                     ("recording", 1)])
def test_server_info_reports_the_registry_wire_name(extra_executor, name, tp):
    def make():
        engine = fake_engine_factory()()
        engine.config = engine.config.replace(parallel_config=ParallelConfig(executor=name, tensor_parallel_size=tp))
        return engine

    with ServerThread(make) as s:
        info = s.stub.GetServerInfo(pb.GetServerInfoRequest())
    kind = "tp" if tp > 1 else name  # more than one rank is always the tensor-parallel executor
    assert info.executor == registry.get_entry(kind).wire_name
    assert info.executor == {"uniproc": "uniproc", "multiproc": "multiproc", "tp": "tensor_parallel",
                             "recording": "recording_fake"}[kind]  # the API's values do not move


def test_create_executor_builds_a_registered_name_and_refuses_others(extra_executor):
    from tests.engine_fakes import make_config

    config = make_config(num_blocks=8)
    built = create_executor(config.replace(parallel_config=ParallelConfig(executor="recording")))
    assert type(built) is RecordingFakeExecutor
    with pytest.raises(ValueError, match="unknown executor 'nope'; choose one of uniproc, multiproc, tp, recording"):
        create_executor(config.replace(parallel_config=ParallelConfig(executor="nope")))
    with pytest.raises(TypeError, match="not a subclass of executors.base.Executor"):
        create_executor(config.replace(parallel_config=ParallelConfig(executor=dict)))


def test_a_class_reports_its_registered_entry_or_its_name(extra_executor):
    assert registry.wire_name(ParallelConfig(executor=RecordingFakeExecutor)) == "recording_fake"
    assert registry.wire_name(ParallelConfig(executor=CountingExecutor)) == "counting"
    assert registry.wire_name(ParallelConfig(executor=UniprocExecutor, tensor_parallel_size=2)) == "uniproc"


def test_llm_accepts_an_executor_class(tmp_path):
    from llmsvc import LLM, SamplingParams

    model = make_tiny_served_model_dir(tmp_path)
    engine = dict(model=model, dtype="float32", device="cpu", kv_cache_memory="16MiB", max_num_seqs=4)
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    CountingExecutor.instances.clear()
    llm = LLM(executor=CountingExecutor, **engine)
    try:
        by_class = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    finally:
        llm.shutdown()
    assert len(CountingExecutor.instances) == 1 and CountingExecutor.instances[0].steps >= 6
    llm = LLM(executor="uniproc", **engine)
    try:
        by_name = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    finally:
        llm.shutdown()
    assert by_class == by_name and all(len(t) == 6 for t in by_class)


def test_docs_list_every_registered_executor():
    design = (DOCS / "design.md").read_text()
    semantics = (DOCS / "request-semantics.md").read_text()
    flags = (DOCS / "engine-core.md").read_text()
    for entry in registry.registered():
        assert f"| `{entry.name}` |" in design, f"docs/design.md's executor table lacks {entry.name}"
        assert f'"{entry.wire_name}"' in semantics, f"docs/request-semantics.md lacks {entry.wire_name}"
    assert "--executor auto\\|" + "\\|".join(registry.executor_names()) + "`" in flags


def test_engine_config_carries_a_class_through_from_options():
    config = EngineConfig.from_options(executor=CountingExecutor, tensor_parallel_size=1)
    assert registry.executor_class(config.parallel_config) is CountingExecutor
