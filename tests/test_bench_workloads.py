"""The benchmark's workloads: the packaged standard set, refusals of bad workload flags before the
model loads, deterministic prompts with shared prefixes, ordinary tokens, arrival times."""
from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from llmsvc.bench import cli as bench_cli
from llmsvc.bench import executors as bench_executors
from llmsvc.bench.workloads import (Workload, arrival_offsets, build_prompts, get_workload, load_workloads,
                                   ordinary_vocab)

ROOT = Path(__file__).resolve().parents[1]


def test_standard_workloads_load():
    ws = load_workloads()
    assert {"W1", "W2", "S1", "P1"} <= set(ws)
    assert (ws["W1"].num_requests, ws["W1"].input_len, ws["W1"].output_len) == (64, 128, 128)
    assert ws["S1"].arrival == "poisson" and ws["S1"].rate == 2.0
    assert ws["P1"].shared_prefix_len == 448


def test_unknown_workload_is_refused_before_the_model_loads():
    """A typo in --workload must not quietly run some default shape: both bench entry points
    name the known workloads and exit 2; "custom" stays the base of the custom-workload flags."""
    assert get_workload("custom").num_requests == 16
    assert get_workload("W1") == load_workloads()["W1"]
    for argv in (["bench", "/nonexistent", "--workload", "W9"],
                 ["bench", "/nonexistent", "--executors", "uniproc", "--workload", "W9"]):
        r = subprocess.run([sys.executable, "-m", "llmsvc", *argv], cwd=ROOT, capture_output=True,
                           text=True, timeout=120)
        assert r.returncode == 2, r.stderr
        assert "unknown workload 'W9'" in r.stderr and "W1" in r.stderr


@pytest.mark.parametrize("argv, message", [
    (["--num-requests", "0"], "error: argument --num-requests: must be >= 1, got 0"),
    (["--num-requests", "-3"], "error: argument --num-requests: must be >= 1, got -3"),
    (["--input-len", "0"], "error: argument --input-len: must be >= 1, got 0"),
    (["--output-len", "-1"], "error: argument --output-len: must be >= 1, got -1"),
    (["--rate", "-1"], "error: argument --rate: must be a finite number > 0, got -1"),
    (["--concurrency", "0"], "error: argument --concurrency: must be >= 1, got 0"),
    (["--shared-prefix-len", "-1"], "error: argument --shared-prefix-len: must be >= 0, got -1"),
    (["--json-schema", "/nonexistent/schema.json"],
     "error: argument --json-schema: cannot read /nonexistent/schema.json: No such file or directory"),
    (["--sweep-rate", "a,b"], "error: argument --sweep-rate: invalid number: 'a'"),
    (["--sweep-rate", "1,0"], "error: argument --sweep-rate: must be a finite number > 0, got 0"),
    (["--sweep-concurrency", "2,x"], "error: argument --sweep-concurrency: invalid integer: 'x'"),
])
def test_bad_workload_flags_are_refused_before_the_model_loads(capsys, argv, message):
    from llmsvc.__main__ import main as llmsvc_main

    with pytest.raises(SystemExit) as exc:
        llmsvc_main(["bench", "/nonexistent", *argv])
    assert exc.value.code == 2 and capsys.readouterr().err.splitlines()[-1] == f"llmsvc bench: {message}"


def test_a_shared_prefix_longer_than_the_prompts_is_refused(capsys):
    from llmsvc.__main__ import main as llmsvc_main

    assert llmsvc_main(["bench", "/nonexistent", "--workload", "P1", "--input-len", "100"]) == 2
    assert capsys.readouterr().err == ("llmsvc bench: P1: the shared prefix (448 tokens) is longer than the "
                                       "prompts (100 tokens)\n")


def test_workloads_are_read_only_from_the_package(tmp_path, monkeypatch):
    # A decoy where an environment variable, the working directory or a folder beside the
    # checkout could have pointed: none of them may change what a standard workload means.
    decoy = tmp_path / "shared" / "bench" / "workloads.json"
    decoy.parent.mkdir(parents=True)
    decoy.write_text(json.dumps({"workloads": [{"name": "W1", "num_requests": 1, "input_len": 2,
                                                "output_len": 3}]}))
    monkeypatch.setenv("LLMSVC_WORKLOADS", str(decoy))
    monkeypatch.chdir(tmp_path)
    shipped = json.loads((ROOT / "llmsvc" / "bench" / "workloads.json").read_text())["workloads"]
    assert {n: (w.num_requests, w.input_len, w.output_len) for n, w in load_workloads().items()} == {
        w["name"]: (w["num_requests"], w["input_len"], w["output_len"]) for w in shipped}
    for module in (bench_cli, bench_executors):
        p = argparse.ArgumentParser()
        module.add_arguments(p)
        with pytest.raises(SystemExit):  # no flag names a workloads file either
            p.parse_args(["--workloads-file", str(decoy)])
    p = argparse.ArgumentParser()
    bench_cli.add_arguments(p)
    (w1,) = bench_cli._workloads(p.parse_args(["--workload", "W1"]))
    assert (w1.num_requests, w1.input_len, w1.output_len) == (64, 128, 128)


def test_prompts_are_deterministic_exact_length_and_ordinary_tokens():
    vocab = list(range(5, 1000))
    w = load_workloads()["P1"]
    a, b = build_prompts(w, vocab), build_prompts(w, vocab)
    assert a == b and len(a) == w.num_requests
    assert all(len(p) == w.input_len and set(p) <= set(vocab) for p in a)
    assert all(p[:448] == a[0][:448] for p in a)  # the shared prefix
    assert len({tuple(p[448:]) for p in a}) == w.num_requests  # own suffixes differ
    w2 = Workload("x", 3, 16, 4, seed=7)
    assert build_prompts(w2, vocab)[1] != build_prompts(w2, vocab)[2]


def test_several_prefixes_take_turns_and_the_first_is_the_single_prefix():
    vocab = list(range(5, 1000))
    p1 = load_workloads()["P1"]
    one = build_prompts(p1, vocab)
    four = build_prompts(dataclasses.replace(p1, num_prefixes=4), vocab)
    assert [p[448:] for p in four] == [p[448:] for p in one]  # own suffixes unchanged
    assert all(four[i][:448] == four[i % 4][:448] for i in range(len(four)))
    assert len({tuple(p[:448]) for p in four}) == 4
    assert four[0][:448] == one[0][:448]  # prefix 0 is P1's own
    p = argparse.ArgumentParser()
    bench_cli.add_arguments(p)
    (w,) = bench_cli._workloads(p.parse_args(["--workload", "P1", "--num-prefixes", "4"]))
    assert (w.name, w.num_prefixes, w.shared_prefix_len) == ("P1", 4, 448)


def test_ordinary_vocab_excludes_special_tokens():
    from server_harness import tiny_tokenizer

    tok = tiny_tokenizer()
    vocab = ordinary_vocab(tok)
    assert vocab and not set(vocab) & set(tok.all_special_ids)


def test_poisson_arrivals_have_the_configured_rate():
    w = Workload("p", 2000, 8, 8, seed=1, arrival="poisson", rate=4.0)
    offs = arrival_offsets(w)
    assert offs == sorted(offs) and offs[0] == 0.0
    assert abs((len(offs) - 1) / offs[-1] - 4.0) < 0.4
    assert arrival_offsets(Workload("a", 3, 8, 8)) == [0.0, 0.0, 0.0]
