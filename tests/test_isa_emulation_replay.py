"""The harness behind `make test-emulated` (tests/isa_emulation): calls recorded by trace.py and
GEMM cases from gemm_cases.py replay on this machine's own build with no difference, the int8
GEMM's on every int8 ISA here, and a trace that does not fit the build is caught. The emulated
run itself (Bochs, minutes) is `make test-emulated`'s, not this suite's."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from kernel_utils import PagedBatch, needs_native
from kernels import ops
from kernels.cpu_ops import attention, build, int8, linear
from tests.isa_emulation import gemm_cases
from tests.isa_emulation.trace import recording

HERE = Path(__file__).parent / "isa_emulation"
pytestmark = needs_native


@pytest.fixture(scope="module")
def replay(tmp_path_factory) -> Path:
    """replay.c linked against the library this process loaded."""
    lib = build.build()
    exe = tmp_path_factory.mktemp("replay") / "replay"
    r = subprocess.run(["gcc", "-O1", "-std=c11", "-Wall", str(HERE / "replay.c"), "-o", str(exe), str(lib),
                        f"-Wl,-rpath,{lib.parent}", "-lffi", "-lm"], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.fail(f"replay.c did not build (it needs gcc and libffi's headers, Debian's libffi-dev):\n{r.stderr}")
    return exe


def _run(exe: Path, *traces: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(exe), *map(str, traces)], capture_output=True, text=True, timeout=120)


def test_recorded_calls_replay_to_the_same_bytes(replay, tmp_path):
    trace = tmp_path / "calls.trace"
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 576, generator=g)
    w = torch.randn(576, generator=g)
    # weights every int8 path here multiplies, so that each replays every call
    packed = int8.pack(torch.randn(100, 576, generator=g), qmax=min(map(int8.weight_qmax, int8.available_isas())))
    with recording(str(trace)) as counts:
        ops.rms_norm(x, w, 1e-6)
        ops.silu_and_mul(torch.randn(7, 256, generator=g).to(torch.bfloat16))
        attention.paged_attention(*PagedBatch([(17, 1), (40, 9), (100, 1)], 9, 3, 64, seed=1).args())
        for isa in int8.available_isas()[1:]:
            int8.linear(x, packed, path=isa)
    assert counts["llmsvc_rms_norm"] == 1 and counts["llmsvc_silu_and_mul"] == 1
    assert counts["llmsvc_paged_attention"] == 1
    assert counts.get("llmsvc_gemm_i8", 0) == len(int8.available_isas()) - 1
    r = _run(replay, trace)
    assert r.returncode == 0, r.stdout + r.stderr
    n_int8 = len(int8.available_isas()) - 1  # calls, each replayed on every int8 ISA here
    assert f"replayed {3 + n_int8} calls ({3 + n_int8 * n_int8} runs): 0 differ, 0 storages" in r.stdout, r.stdout


def test_a_trace_that_does_not_fit_the_build_is_caught(replay, tmp_path):
    """GEMM cases packed for this build's panels replay within rounding of torch; packed for
    the other width (AVX-512's 48 here, AVX2's 16 on AVX-512), every output differs."""
    here = build.load().llmsvc_gemm_f32_subpanel()
    if not linear.enabled() or here not in (16, 48):
        pytest.skip("gemm.c is not built at this x86 level (LLMSVC_CPU_ISA=sse4): no panels to pack")
    ok, wrong = tmp_path / "ok.trace", tmp_path / "wrong.trace"
    gemm_cases.main(str(ok), here)
    gemm_cases.main(str(wrong), 64 - here)
    r = _run(replay, ok)
    assert r.returncode == 0 and " 0 differ" in r.stdout, r.stdout
    r = _run(replay, wrong)
    n = 2 * len(gemm_cases.SHAPES)
    assert r.returncode == 1 and f"replayed {n} calls ({n} runs): {n} differ" in r.stdout, r.stdout
