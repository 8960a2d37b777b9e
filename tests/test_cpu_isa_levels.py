"""LLMSVC_CPU_ISA (kernels/cpu_ops/isa.py): the cap on the x86 level the native kernels are built
for, and the kernel tests under every level below this CPU's own.

Each machine builds only its own level (-march=native), so without the cap an AMX box never runs
the AVX512-BF16, AVX-512, AVX2 or no-AVX paths its users' CPUs take. The last test runs the
kernels' key tests in a fresh process per lower level; the rest of the suite is this CPU's level.
`make test-isa` runs the whole kernel test files under every level instead."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kernels.cpu_ops import build, isa, linear
from kernel_utils import needs_native

ZEN3 = {"sse4_2", "avx", "avx2", "fma"}
SKYLAKE_SP = ZEN3 | {"avx512f", "avx512bw", "avx512dq", "avx512vl"}
CASCADE_LAKE = SKYLAKE_SP | {"avx512_vnni"}
ZEN4 = CASCADE_LAKE | {"avx512_bf16"}
SAPPHIRE_RAPIDS = ZEN4 | {"amx_tile", "amx_bf16", "amx_int8", "avx512_fp16"}


def test_each_cpu_we_meet_has_its_level():
    assert isa.cpu_level({"sse2"}) is None
    assert isa.cpu_level({"sse4_2", "avx"}) == "sse4"  # AVX without AVX2 + FMA (Sandy Bridge)
    assert isa.cpu_level(ZEN3) == "avx2"
    assert isa.cpu_level(SKYLAKE_SP) == "avx512"
    assert isa.cpu_level(CASCADE_LAKE) == "avx512_vnni"
    assert isa.cpu_level(ZEN4) == "avx512_bf16"
    assert isa.cpu_level(SAPPHIRE_RAPIDS) == "amx"
    assert isa.cpu_level(ZEN3 | {"avx512_bf16", "amx_tile", "amx_bf16"}) == "avx2"  # levels are cumulative


def test_a_cap_is_a_known_level_or_nothing():
    assert isa.parse("") is None and isa.parse("native") is None
    assert isa.parse(" AVX512_BF16 ") == "avx512_bf16"
    with pytest.raises(ValueError, match="LLMSVC_CPU_ISA='avx3'.*sse4, avx2, avx512"):
        isa.parse("avx3")


def test_a_cap_removes_every_level_above_it_and_none_below():
    assert isa.cap_cflags(None) == []
    assert isa.cap_cflags("amx") == ["-DLLMSVC_CPU_ISA_LEVEL=5"]  # the top: nothing to remove
    bf16 = isa.cap_cflags("avx512_bf16")
    assert "-mno-amx-tile" in bf16 and "-mno-avx512bf16" not in bf16
    avx2 = isa.cap_cflags("avx2")
    assert {"-mno-avx512f", "-mno-avx512bf16", "-mno-amx-tile", "-mno-amx-bf16", "-mno-avxvnni"} <= set(avx2)
    assert "-mno-avx2" not in avx2 and "-mno-fma" not in avx2
    assert {"-mno-avx", "-mno-avx2", "-mno-fma"} <= set(isa.cap_cflags("sse4"))


def test_an_unknown_cap_is_refused_when_the_kernels_load():
    r = subprocess.run([sys.executable, "-c", "from kernels.cpu_ops import build; build.load()"],
                       env={**os.environ, isa.ENV: "avx3", "LLMSVC_CPU_KERNELS": "1"}, capture_output=True, text=True, timeout=120,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert r.returncode != 0 and "ValueError: LLMSVC_CPU_ISA='avx3'" in r.stderr


# what the library built for each level says it runs: (fp32 panels, their sub-panel width,
# bf16 layout 1 = VNNI tiles / 2 = widened panels / 0 = none, AVX512-BF16 dot products)
_EXPECTED = {
    "sse4": (0, None, 0, 0),
    "avx2": (1, 16, 2, 0),
    "avx512": (1, 48, 2, 0),
    "avx512_vnni": (1, 48, 2, 0),
    "avx512_bf16": (1, 48, 1, 1),
    "amx": (1, 48, 1, 1),
}


def test_the_library_is_built_for_the_level_here():
    """In the suite: this CPU's level. Under LLMSVC_CPU_ISA (the subprocesses below, or a whole
    suite run so): the capped level, not the CPU's."""
    if build._compiler() is None or isa.level() is None or not build.enabled_by_env():
        pytest.skip("no C compiler, not x86-64, or the native kernels disabled")
    lib = build.load()
    assert lib is not None
    f32, sub, layout, dp = _EXPECTED[isa.level()]
    assert lib.llmsvc_gemm_f32_supported() == f32
    if sub is not None:
        assert lib.llmsvc_gemm_f32_subpanel() == sub
    assert lib.llmsvc_gemm_bf16_layout() == layout
    assert lib.llmsvc_gemm_bf16_dp_supported() == dp
    if isa.level() != "amx":
        assert lib.llmsvc_gemm_bf16_amx_supported() == 0 and not linear.has_amx()
    if isa.level() == "sse4":  # no panels: the library GEMMs, as on a CPU without AVX2
        assert linear.bf16_layout() == "" and linear.FP32_LIBRARY in ("mkl", "onednn", None)


# the key kernel tests, run under each lower level (kept small: each level also builds the
# library once): the library check above, the packed linear layers, paged attention, the
# norms and SiLU against the torch reference, and the one-call decoder against the per-op layers
# in fp32 and bf16 (every kernel of a step)
_SUBSET = [
    "tests/test_cpu_isa_levels.py::test_the_library_is_built_for_the_level_here",
    "tests/test_kernels_cpu_attention.py", "tests/test_kernels_cpu_linear.py", "tests/test_kernels_cpu_elementwise.py",
    "tests/test_native_layers.py",
    "-k", "test_cpu_isa_levels or (test_kernels_cpu and (packed_linear_matches or test_decode or rms_norm"
          " or test_silu_and_mul)) or (test_native_layers and (llama-untied or prefill_longer))",
]


def _lower_levels() -> list[str]:
    here = isa.level()
    return list(isa.LEVELS[:isa.LEVELS.index(here)]) if here else []


@needs_native
@pytest.mark.parametrize("level", isa.LEVELS[:-1])
def test_the_kernel_tests_pass_built_for_each_lower_level(level):
    """The avx512_vnni level builds the same bf16 / fp32 kernels as avx512 and is left to
    `make test-isa`."""
    if build._compiler() is None or level not in _lower_levels():
        pytest.skip(f"{level} is not below this CPU's level ({isa.level()}), or no C compiler")
    if level == "avx512_vnni":
        pytest.skip("same fp32 / bf16 kernels as avx512: make test-isa runs it")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *_SUBSET],
                       env={**os.environ, isa.ENV: level}, capture_output=True, text=True, timeout=900, cwd=root)
    tail = r.stdout[-3000:] + r.stderr[-2000:]
    assert r.returncode == 0, tail
    assert " passed" in r.stdout.splitlines()[-1] and "failed" not in r.stdout.splitlines()[-1], tail
