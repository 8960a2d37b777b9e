"""The bench's fairness mechanics (llmsvc/bench/fairness.py): the peer's process group frozen while
ours runs and resumed for its own run, the idle check on a fake /proc/stat, the warm-up prompts,
and the KV pool resident before the first request. No timing thresholds: waits below are bounds
on how long a state change may take to show, never a measurement."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from llmsvc.bench import fairness
from llmsvc.bench.repeat import System, alternate
from llmsvc.bench.vllm_peer import stop_group


def _stat(busy: int, idle: int) -> str:
    # user nice system idle iowait irq softirq steal guest guest_nice
    return (f"cpu  {busy} 0 0 {idle} 0 0 0 0 7 0\n"
            f"cpu0 {busy} 0 0 {idle} 0 0 0 0 7 0\nintr 1 2 3\n")


def test_cpu_times_count_all_but_idle_and_iowait():
    text = "cpu  100 5 20 800 50 3 2 10 40 0\ncpu0 1 1 1 1 1 1 1 1 1 1\n"
    busy, total = fairness.cpu_times(text)
    assert total == 100 + 5 + 20 + 800 + 50 + 3 + 2 + 10  # guest is inside user already
    assert busy == total - 800 - 50
    with pytest.raises(ValueError):
        fairness.cpu_times("cpu0 1 2 3 4\n")


def _fake_box(samples: list[tuple[int, int]]):
    """A reader returning successive /proc/stat texts, a sleep that advances a fake clock."""
    texts = iter(_stat(b, i) for b, i in samples)
    now = [0.0]

    def sleep(s):
        now[0] += s
    return (lambda: next(texts)), sleep, (lambda: now[0])


def test_busy_fraction_is_the_busy_share_of_the_interval():
    read, sleep, _ = _fake_box([(100, 900), (160, 940)])  # +60 busy, +40 idle
    assert fairness.sample_busy(read, sleep) == pytest.approx(0.6)
    read, sleep, _ = _fake_box([(100, 900), (100, 900)])  # no time passed
    assert fairness.sample_busy(read, sleep) == 0.0


def test_the_idle_check_waits_for_an_idle_sample():
    # busy 90%, then 50%, then 5%: three samples, idle on the third
    read, sleep, clock = _fake_box([(0, 0), (90, 10), (90, 10), (140, 60), (140, 60), (145, 155)])
    check = fairness.wait_idle(threshold=0.15, timeout=30, read=read, sleep=sleep, clock=clock)
    assert check.idle and check.busy == pytest.approx(0.05) and check.waited_s == pytest.approx(3.0)
    assert "box idle: CPU 5% busy" in check.line() and "after 3s" in check.line()


def test_the_idle_check_gives_up_after_its_bound_and_says_so():
    samples = [(0, 0), (80, 20)] * 100  # each sample 80% busy
    read, sleep, clock = _fake_box(samples)
    check = fairness.wait_idle(threshold=0.15, timeout=5, read=read, sleep=sleep, clock=clock)
    assert not check.idle and check.waited_s == pytest.approx(5.0) and check.busy == pytest.approx(0.8)
    assert "NOT idle after waiting 5s, measured anyway" in check.line()


def test_a_negative_wait_turns_the_check_off():
    def never(*a):
        raise AssertionError("sampled")
    check = fairness.wait_idle(timeout=-1, read=never, sleep=never)
    assert not check.checked and check.line() == "idle check off"


def test_memory_available_is_read_from_meminfo():
    text = "MemTotal:       24000000 kB\nMemFree: 1 kB\nMemAvailable:    5505024 kB\n"
    assert fairness.mem_available_gib(lambda: text) == pytest.approx(5.25)
    assert fairness.mem_available_gib(lambda: "MemTotal: 1 kB\n") is None
    if os.path.exists("/proc/meminfo"):
        assert fairness.mem_available_gib() > 0


def test_the_idle_check_reads_the_real_proc_stat():
    if not os.path.exists("/proc/stat"):
        pytest.skip("no /proc/stat")
    busy = fairness.sample_busy(interval=0.05)
    assert 0.0 <= busy <= 1.0


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]  # R, S, T (stopped), ...


def _await_state(pids: list[int], stopped: bool, bound: float = 20.0) -> None:
    deadline = time.monotonic() + bound
    while time.monotonic() < deadline:
        if all((_state(p) == "T") == stopped for p in pids):
            return
        time.sleep(0.02)
    raise AssertionError({p: _state(p) for p in pids})


@pytest.fixture
def group():
    """A child in a session of its own (as the peer's children are) with a grandchild in its
    group; yields (child, [child pid, grandchild pid])."""
    if not os.path.exists("/proc/self/stat"):
        pytest.skip("needs /proc")
    proc = subprocess.Popen(["sh", "-c", "sleep 300 & echo $!; wait"], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    grandchild = int(proc.stdout.readline())
    yield proc, [proc.pid, grandchild]
    fairness.signal_group(proc.pid, signal.SIGCONT)
    fairness.signal_group(proc.pid, signal.SIGKILL)
    proc.wait()


def test_freeze_stops_the_whole_group_and_resume_continues_it(group):
    proc, pids = group
    assert fairness.peer_pgids([proc, None]) == [proc.pid]
    with fairness.frozen(fairness.peer_pgids([proc])) as stopped:
        assert stopped == [proc.pid]
        _await_state(pids, stopped=True)  # the grandchild too: the signal goes to the group
    _await_state(pids, stopped=False)


def test_a_gone_group_is_neither_frozen_nor_an_error(group):
    proc, _ = group
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert fairness.peer_pgids([proc]) == []
    deadline = time.monotonic() + 20  # the killed grandchild lingers until init reaps it
    while fairness.signal_group(proc.pid, 0) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert fairness.freeze([proc.pid]) == []


def test_turns_freeze_the_peer_for_ours_and_resume_it_for_its_own_run(group):
    proc, pids = group
    lines = []
    check = fairness.IdleCheck(0.02, 0.0, True)
    turns = fairness.Turns(lambda: fairness.peer_pgids([proc]), {"vllm"}, idle=lambda: check, out=lines.append,
                           memory=lambda: 5.25)
    seen = []
    systems = [System("offline", "llmsvc offline", lambda: seen.append(("offline", _state(pids[1]))) or {}),
               System("vllm", "vLLM LLM.generate", lambda: seen.append(("vllm", _state(pids[1]))) or {})]

    def before(s):
        turns.before(s.key, s.label)
        _await_state(pids, stopped=s.key != "vllm")
    alternate(systems, 2, lambda *a: None, before=before)
    turns.resume()
    assert [(k, st == "T") for k, st in seen] == [("offline", True), ("vllm", False)] * 2
    assert lines[0] == ("  [llmsvc offline] box idle: CPU 2% busy over 1s (threshold 15%); 5.2 GiB memory available;"
                        " peer frozen (1 process group)")
    assert lines[1] == "  [vLLM LLM.generate] box idle: CPU 2% busy over 1s (threshold 15%); 5.2 GiB memory available"
    _await_state(pids, stopped=False)


@pytest.fixture
def two_groups(group):
    """A second group beside `group`'s, each as an external server started under setsid would be."""
    proc = subprocess.Popen(["sh", "-c", "sleep 300 & echo $!; wait"], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    grandchild = int(proc.stdout.readline())
    yield group, (proc, [proc.pid, grandchild])
    fairness.signal_group(proc.pid, signal.SIGCONT)
    fairness.signal_group(proc.pid, signal.SIGKILL)
    proc.wait()


def test_held_groups_run_only_for_the_systems_they_name(two_groups):
    """--freeze llmsvc,smg-llmsvc=PID and --freeze smg-vllm=PID: during each run the other
    system's group is stopped (child and grandchild), its own runs."""
    (ours, ours_pids), (theirs, their_pids) = two_groups
    held = [fairness.parse_held(f"llmsvc,smg-llmsvc={ours.pid}"), fairness.parse_held(f"smg-vllm={theirs.pid}")]
    assert held[0] == fairness.HeldGroup(frozenset({"llmsvc", "smg-llmsvc"}), ours.pid)
    turns = fairness.Turns(list, set(), idle=lambda: fairness.IdleCheck(0.0, 0.0, True), out=lambda _: None,
                           held=held)
    seen = []

    def run(key):
        return lambda: seen.append((key, _state(ours_pids[1]) == "T", _state(their_pids[1]) == "T")) or {}
    keys = ["serve", "openai:smg-llmsvc", "openai:smg-vllm"]
    systems = [System(k, k, run(k)) for k in keys]

    def before(s):
        turns.before(s.key, s.label)
        _await_state(ours_pids, stopped=s.key == "openai:smg-vllm")
        _await_state(their_pids, stopped=s.key != "openai:smg-vllm")
    alternate(systems, 2, lambda *a: None, before=before)
    turns.resume()
    assert seen == [("serve", False, True), ("openai:smg-llmsvc", False, True), ("openai:smg-vllm", True, False)] * 2
    _await_state(ours_pids + their_pids, stopped=False)


def test_freeze_refuses_the_bench_s_own_group_a_dead_pid_and_unknown_names():
    import argparse

    for bad in (f"llmsvc={os.getpid()}", "llmsvc", "=123", "llmsvc=abc"):
        with pytest.raises(argparse.ArgumentTypeError):
            fairness.parse_held(bad)
    dead = subprocess.Popen(["true"], start_new_session=True)
    dead.wait()
    with pytest.raises(argparse.ArgumentTypeError, match="no process"):
        fairness.parse_held(f"llmsvc={dead.pid}")
    held = [fairness.HeldGroup(frozenset({"llmsvc", "smg"}), 1)]
    assert fairness.check_held(held, ["smg"]) is None
    assert "'smg'" in fairness.check_held(held, ["other"])


def test_a_frozen_peer_still_shuts_down_on_sigterm():
    """vLLM handles SIGTERM to shut down cleanly; a stopped process cannot run its handler, so
    stop_group resumes the group first (else it would wait out the grace, then SIGKILL)."""
    code = ("import signal, sys, time\n"
            "signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))\n"
            "print('up', flush=True)\n"
            "time.sleep(300)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert proc.stdout.readline().strip() == "up"
        fairness.freeze([proc.pid])
        _await_state([proc.pid], stopped=True)
        stop_group(proc, grace=60.0)
        assert proc.returncode == 0  # its handler ran: not -SIGKILL
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_warmup_prompts_have_the_workload_shape_and_none_of_its_prefixes():
    prompts = [[i * 100 + j for j in range(16)] for i in range(20)]
    warm = fairness.warmup_prompts(prompts)
    assert len(warm) == 8 and [len(p) for p in warm] == [16] * 8
    assert all(w == p[::-1] for w, p in zip(warm, prompts))
    assert not any(w[0] == p[0] for w in warm for p in prompts)
    assert fairness.warmup_prompts(prompts[:3]) == [p[::-1] for p in prompts[:3]]


def test_the_kv_pool_is_resident_when_the_wait_returns(monkeypatch):
    import torch

    from llmsvc.worker.kv_memory import KVHostPool

    monkeypatch.delenv("LLMSVC_KV_PREFAULT", raising=False)
    pool = KVHostPool(2, (64, 1024), torch.float32)
    try:
        assert pool.wait_resident() and pool.prefaulter.done.is_set()
    finally:
        pool.close()


def test_background_prefault_does_not_wait(monkeypatch):
    import torch

    from llmsvc.worker.kv_memory import KVHostPool

    pool = KVHostPool(2, (64, 1024), torch.float32, prefault=False)

    class NeverDone:
        def is_set(self):
            return False

        def wait(self, timeout=None):
            raise AssertionError("waited for the prefaulter")
    pool.prefaulter = type("P", (), {"done": NeverDone()})()
    monkeypatch.setenv("LLMSVC_KV_PREFAULT", "background")
    assert pool.wait_resident() is False
    monkeypatch.setenv("LLMSVC_KV_PREFAULT", "wait")
    with pytest.raises(AssertionError, match="waited"):
        pool.wait_resident()


def test_a_cpu_worker_reports_ready_with_its_kv_pool_resident(tmp_path, monkeypatch):
    """initialize_kv_cache (allocation, then the warm-up) returns only once the prefaulter is
    done: the first request does not share the CPU with it or fault the pool in itself."""
    from executors import create_executor
    from model_utils import make_tiny_model_dir
    from test_executors import engine_config

    from llmsvc.worker.kv_memory import KVHostPool

    monkeypatch.delenv("LLMSVC_KV_PREFAULT", raising=False)
    waits = []
    real = KVHostPool.wait_resident
    monkeypatch.setattr(KVHostPool, "wait_resident", lambda self, *a: waits.append(real(self, *a)) or waits[-1])
    ex = create_executor(engine_config(make_tiny_model_dir(tmp_path, "llama"), num_blocks=512))
    try:
        ex.initialize_kv_cache(ex.determine_num_kv_blocks())
        pool = ex.worker.runner.kv_pool
        assert waits == [True] and pool is not None and pool.prefaulter.done.is_set()
    finally:
        ex.shutdown()
