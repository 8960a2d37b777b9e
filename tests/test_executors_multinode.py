"""Multi-node tensor parallelism on one machine: two "nodes" on 127.0.0.1, one rank each.

Node 1 is always the real CLI (`llmsvc serve --nnodes 2 --node-rank 1 ...`, headless). Node 0 is
the in-test executor (greedy tokens == uniproc; its graceful shutdown ends node 1 with exit code 0)
or the real server (SIGKILLed: node 1 must exit non-zero on its own)."""
from __future__ import annotations

import contextlib
import os
import signal
import time

import pytest

from executor_driver import greedy_generate
from executor_procs import LoggedProcess, descendants, llmsvc_cmd, wait_gone, worker_pids
from executors import create_executor
from executors.base import ExecutorError
from llmsvc.bench.server_proc import free_port
from llmsvc.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig
from llmsvc.models.resolve import resolve_model_config
from test_executors import prompts_for, run
from tests.server_harness import TINY_VOCAB, make_tiny_served_model_dir


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_served_model_dir(tmp_path_factory.mktemp("tiny"))


def config(model_dir, port: int = 0, tp: int = 1, nnodes: int = 1) -> EngineConfig:
    return EngineConfig(model_config=resolve_model_config(ModelConfig(model=str(model_dir))),
                        cache_config=CacheConfig(num_kv_blocks_override=96),
                        parallel_config=ParallelConfig(executor="tp" if tp > 1 else "uniproc", tensor_parallel_size=tp,
                                                       nnodes=nnodes, node_rank=0, master_port=port),
                        device="cpu")


def headless_node(model_dir: str, port: int, *extra: str, tp: int = 2) -> LoggedProcess:
    return LoggedProcess(llmsvc_cmd("serve", model_dir, "--device", "cpu", "--tensor-parallel-size", str(tp),
                                    "--nnodes", "2", "--node-rank", "1", "--master-addr", "127.0.0.1",
                                    "--master-port", str(port), *extra))


@contextlib.contextmanager
def two_nodes(model_dir: str):
    """Node 1 headless (the CLI) and node 0 as an in-test executor, one rank each; yields
    (executor, node 1) once node 1's rank is ready; shuts both down after."""
    port = free_port()
    node1 = headless_node(model_dir, port)
    try:
        ex = create_executor(config(model_dir, port, tp=2, nnodes=2))
        try:
            node1.wait_for(r"headless node 1/2: ranks \[1\] of 2 ready")
            yield ex, node1
        finally:
            ex.shutdown()
    finally:
        node1.kill()


def test_two_nodes_match_uniproc_and_node1_exits_0_after_node0_shutdown(tiny_dir):
    prompts = prompts_for(TINY_VOCAB, lens=(6, 19, 1))
    expected = run(config(tiny_dir), prompts, max_new=8)
    with two_nodes(tiny_dir) as (ex, node1):  # node 0: rank 0 here, rank 1 on node 1
        assert ex.ranks == [0] and ex.world_size == 2
        node1_tree = descendants(node1.pid)
        ex.initialize_kv_cache(ex.determine_num_kv_blocks())
        assert greedy_generate(ex, prompts, max_new=8, chunk=5) == expected
        ex.shutdown()
        assert node1.proc.wait(30) == 0, node1.log_tail()
        assert wait_gone(node1_tree) == []
        assert "node 0 shut the group down" in "".join(node1.lines)


def test_idle_node0_notices_a_remote_rank_that_died(tiny_dir):
    # node 0 has no process sentinel for a rank on another machine: its idle health check
    # pings the group, and the broadcast to the dead rank fails
    with two_nodes(tiny_dir) as (ex, node1):
        ex.initialize_kv_cache(ex.determine_num_kv_blocks())
        ex.check_health()  # all there
        node1.proc.send_signal(signal.SIGKILL)  # the node and its worker (death pipe) go
        node1.proc.wait(10)
        deadline = time.monotonic() + 30
        with pytest.raises(ExecutorError):
            while time.monotonic() < deadline:
                ex.check_health()  # the engine core calls it about once a second while idle
                time.sleep(0.5)


def test_node1_exits_1_when_node0_shuts_down_after_a_failed_call(tiny_dir):
    # node 0's engine failed (here a call outlasting its timeout, as with a hung rank): the
    # group ends as a failure on every node, so node 1's supervisor restarts it
    with two_nodes(tiny_dir) as (ex, node1):
        ex.call_timeout_s = 1e-6
        with pytest.raises(ExecutorError, match="timed out"):
            ex.determine_num_kv_blocks()
        ex.shutdown()
        assert node1.proc.wait(30) == 1, node1.log_tail()
        assert "node 0 abandoned the group" in "".join(node1.lines)


def test_a_headless_node_whose_rank_is_stuck_exits_1_when_node0_dies(tiny_dir):
    # a rank frozen (a stalled VM) while node 0 died can wait, once resumed, in a gloo collective
    # that never returns; node 1 watches node 0's store and exits 1 when it stops answering.
    # Here the rank stays stopped: neither its exit nor its collective's error can tell node 1
    with two_nodes(tiny_dir) as (ex, node1):
        (w1,) = worker_pids(node1.pid)
        os.kill(w1, signal.SIGSTOP)
        os.kill(ex.procs[0].pid, signal.SIGKILL)  # node 0's rank 0 (and the store it hosts) die
        ex.procs[0].join(10)
        ex.shutdown()
        assert node1.proc.wait(60) == 1, node1.log_tail()
        assert "stopped answering" in "".join(node1.lines)
        assert wait_gone([w1]) == []


@pytest.mark.parametrize("extra,tp,field", [(("--dtype", "bfloat16"), 2, "dtype"),
                                           ((), 4, "tensor_parallel_size")])
def test_a_node_started_with_other_options_fails_both_nodes_naming_them(tiny_dir, extra, tp, field):
    # a different TP size would otherwise hang the rendezvous, a different dtype fail inside a
    # collective with gloo's words (or compute something else): each rank's configuration is
    # checked against rank 0's before the process group forms
    port = free_port()
    node1 = headless_node(tiny_dir, port, *extra, tp=tp)
    try:
        with pytest.raises(ExecutorError, match=f"differs from node 0's.*{field}: rank 0 has"):
            create_executor(config(tiny_dir, port, tp=2, nnodes=2))
        assert node1.proc.wait(60) != 0
        assert f"{field}: rank 0 has" in "".join(node1.lines), node1.log_tail()
    finally:
        node1.kill()


def test_headless_node_exits_nonzero_when_node0_dies(tiny_dir):
    port = free_port()
    node1 = headless_node(tiny_dir, port)
    node0 = LoggedProcess(llmsvc_cmd("serve", tiny_dir, "--host", "127.0.0.1", "--port", "0", "--device", "cpu",
                                     "--kv-cache-memory", "4MiB", "--tensor-parallel-size", "2", "--nnodes", "2",
                                     "--node-rank", "0", "--master-addr", "127.0.0.1", "--master-port", str(port)))
    try:
        node0.wait_for(r"ready: serving", timeout=120)
        node1.wait_for(r"ready, driven by node 0")
        assert len(worker_pids(node0.pid)) == 1 and len(worker_pids(node1.pid)) == 1
        node1_tree = descendants(node1.pid)
        node0_tree = descendants(node0.pid)
        node0.proc.send_signal(signal.SIGKILL)  # node 0 crashes: its worker follows (death pipe)
        node0.proc.wait(10)
        assert node1.proc.wait(30) != 0, node1.log_tail()
        assert wait_gone(node1_tree + node0_tree) == []
        assert "lost the process group" in "".join(node1.lines)
    finally:
        node0.kill()
        node1.kill()
