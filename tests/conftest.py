import os
import sys

# Triton reads TRITON_INTERPRET when @triton.jit runs, i.e. when `kernels` is imported:
# set it before anything imports the project. Real CUDA tensors never occur here.
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# libgomp threads sleep instead of spinning when they wait: many test processes share 2 cores
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# `llmsvc bench` in a test times nothing: no idle check before its runs (llmsvc/bench/fairness.py)
os.environ.setdefault("LLMSVC_BENCH_IDLE_WAIT", "-1")
# and an engine's start does not wait for its KV pool to fault in (2 GiB by default: ~0.8 s a
# start here): the wait keeps a server's first steps at full speed (llmsvc/worker/kv_memory.py)
os.environ.setdefault("LLMSVC_KV_PREFAULT", "background")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# the compiled kernels stay where they are when a test gives the model cache a fresh directory
# (a build is ~16 s on 2 cores, and every spawned worker of such a test would pay it)
from kernels.cpu_ops.build import cache_dir as _kernel_cache_dir  # noqa: E402

os.environ.setdefault("LLMSVC_KERNEL_CACHE", str(_kernel_cache_dir()))


def _worker_port_range() -> None:
    """Parallel test workers (`make test` runs pytest-xdist's -n) draw server ports from disjoint
    slices of free_port's range: a port one worker found free, before its server binds it, is
    never another worker's pick. Spawned processes (`llmsvc bench` in a test) inherit it."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER", ""), os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    if not (worker.startswith("gw") and count.isdigit()) or "LLMSVC_BENCH_PORTS" in os.environ:
        return
    from llmsvc.bench.server_proc import port_range

    lo, hi = port_range()
    if hi:
        span = (hi - lo) // int(count)
        first = lo + int(worker[2:]) * span
        os.environ["LLMSVC_BENCH_PORTS"] = f"{first}-{first + span}"


_worker_port_range()

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def default_model_dir() -> str:
    """The default SmolLM2-135M-Instruct, converted once from its GGUF into $LLMSVC_CACHE."""
    from llmsvc.models.resolve import resolve_model_dir

    return resolve_model_dir(None)
