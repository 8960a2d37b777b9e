"""The engine-core process' OpenMP threads wait passively unless the user chose a wait policy:
MPClient spawns it with OMP_WAIT_POLICY=PASSIVE added to (never replacing) the environment."""
from __future__ import annotations

import os

import pytest

from llmsvc.core.mp_client import CORE_ENV_DEFAULTS, _spawn_env


@pytest.fixture
def clean_env(monkeypatch):
    for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
        monkeypatch.delenv(k, raising=False)
    return monkeypatch


def test_passive_only_while_spawning(clean_env):
    with _spawn_env(CORE_ENV_DEFAULTS):
        assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
    assert "OMP_WAIT_POLICY" not in os.environ


@pytest.mark.parametrize("knob,value", [("OMP_WAIT_POLICY", "ACTIVE"), ("GOMP_SPINCOUNT", "100000")])
def test_a_user_choice_wins(clean_env, knob, value):
    clean_env.setenv(knob, value)
    with _spawn_env(CORE_ENV_DEFAULTS):
        assert os.environ[knob] == value
        assert knob == "OMP_WAIT_POLICY" or "OMP_WAIT_POLICY" not in os.environ
    assert os.environ[knob] == value


def _report_env(q) -> None:
    q.put(os.environ.get("OMP_WAIT_POLICY"))


def test_a_spawned_child_keeps_it(clean_env):
    import multiprocessing as mp

    ctx = mp.get_context("spawn")  # as MPClient starts the core
    q = ctx.Queue()
    p = ctx.Process(target=_report_env, args=(q,))
    with _spawn_env(CORE_ENV_DEFAULTS):
        p.start()
    try:
        assert q.get(timeout=60) == "PASSIVE"
    finally:
        p.join(30)
    assert "OMP_WAIT_POLICY" not in os.environ
