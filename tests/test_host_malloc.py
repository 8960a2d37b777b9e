"""The CPU worker's malloc settings (llmsvc/worker/host_malloc.py), in fresh processes so
this one's allocator is left alone."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

_PROBE = """
import resource, sys, torch
from llmsvc.worker import host_malloc
applied = host_malloc.keep_activations_mapped() if sys.argv[1] == "1" else None
def step():  # a 1024-token prefill layer's activations, alive together, then freed; the
    for _ in range(3):  # MLP block (42 MB, as in a model with intermediate size 5120) is above
        h = torch.empty(1024, 576).fill_(1.0)  # glibc's largest dynamic mmap threshold (32 MB)
        gate_up = torch.empty(1024, 10240).fill_(1.0)
        act = torch.empty(1024, 5120).fill_(1.0)
        del h, gate_up, act
step()
f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    step()
print(applied, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
"""


def _probe(apply: bool, **env) -> tuple[str, int]:
    r = subprocess.run([sys.executable, "-c", _PROBE, "1" if apply else "0"], capture_output=True,
                       text=True, timeout=120, env={**os.environ, **env})
    assert r.returncode == 0, r.stderr
    applied, faults = r.stdout.split()
    return applied, int(faults)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc settings")
def test_freed_activations_stay_mapped():
    applied, faults = _probe(True)
    assert applied == "True"
    # the 42 MB block is 10,240 pages: by default every use maps and faults it in again
    _, faults_default = _probe(False)
    assert faults_default > 5 * 3 * 10_000
    # kept mapped: a few re-faults remain where glibc's aligned blocks fragment the heap top
    # (20,480 of 163,854 here); the engine's real steps go to ~0 after the first
    assert faults < faults_default / 4


def test_operator_malloc_env_wins():
    applied, _ = _probe(True, MALLOC_MMAP_THRESHOLD_="131072")
    assert applied == "False"
