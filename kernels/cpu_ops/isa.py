"""x86 feature levels of the native CPU kernels, and LLMSVC_CPU_ISA, the cap on them.

The kernels are built with -march=native (build.py), so each C source compiles the branch of
the best level this CPU has and no other. LLMSVC_CPU_ISA=<level> builds them as a CPU of that
level would, on a CPU that has more: the paths an older or other vendor's CPU runs are then
exercised here (tests/test_cpu_isa_levels.py runs the kernel tests under each level below the
box's own). The levels, each one the one before plus:

  sse4         x86-64-v2: no AVX; gemm.c is not built (fp32 goes to MKL / oneDNN, bf16 to oneDNN)
  avx2         AVX2 + FMA (Zen 3, Haswell to Comet Lake): fp32 panels, bf16 widened to fp32
  avx512       AVX-512 F/BW/DQ/VL (Skylake-SP): 512-bit panels, attention in zmm
  avx512_vnni  AVX512-VNNI (Cascade Lake): int8 dot products
  avx512_bf16  AVX512-BF16 (Cooper Lake, Zen 4, Zen 5): bf16 dot products (gemm_bf16dp.c)
  amx          AMX tiles, bf16 and int8 (Sapphire, Emerald, Granite Rapids): gemm_amx.c

A cap at or above the CPU's own level changes nothing (no flag can add a feature the CPU
lacks). The cap is read once per process, before the library is built; it is part of the
build's cache key through the compiler flags it adds. Everything that asks which path runs
(`linear.bf16_layout`, `linear.has_amx`, the ceiling's arithmetic dtype) asks the library, so
it follows the cap; tests that need the CPU's level ask `level()` here, not /proc/cpuinfo.
torch's own GEMMs (oneDNN) are not capped by it: ONEDNN_MAX_CPU_ISA does that.
"""
from __future__ import annotations

import functools
import os
import platform
from pathlib import Path
from typing import Optional

ENV = "LLMSVC_CPU_ISA"
LEVELS = ("sse4", "avx2", "avx512", "avx512_vnni", "avx512_bf16", "amx")
# /proc/cpuinfo flags a CPU needs for each level (on top of the previous level's)
_NEEDS = {
    "sse4": ("sse4_2",),
    "avx2": ("avx", "avx2", "fma"),
    "avx512": ("avx512f", "avx512bw", "avx512dq", "avx512vl"),
    "avx512_vnni": ("avx512_vnni",),
    "avx512_bf16": ("avx512_bf16",),
    "amx": ("amx_tile", "amx_bf16"),
}
# GCC / Clang flags that take away what each level adds over the previous one; a cap at level
# L applies those of every level above L. -mno-avx512f drops every AVX-512 extension and
# -mno-avx AVX2 and FMA with it; AMX and AVX-VNNI do not depend on them and are named.
_REMOVES = {
    "avx2": ("-mno-avx", "-mno-avx2", "-mno-fma"),
    "avx512": ("-mno-avx512f", "-mno-avxvnni", "-mno-avxvnniint8"),
    "avx512_vnni": ("-mno-avx512vnni",),
    "avx512_bf16": ("-mno-avx512bf16", "-mno-avx512fp16"),
    "amx": ("-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8", "-mno-amx-fp16"),
}


def cpu_flags() -> set[str]:
    """The CPU's feature flags as /proc/cpuinfo names them (empty where it cannot be read)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[-1].split())
    except OSError:
        pass
    return set()


def cpu_level(flags: Optional[set[str]] = None) -> Optional[str]:
    """The highest level whose features this CPU (or `flags`) has; None off x86-64."""
    if flags is None:
        if platform.machine().lower() not in ("x86_64", "amd64"):
            return None
        flags = cpu_flags()
    best = None
    for lvl in LEVELS:
        if not set(_NEEDS[lvl]) <= flags:
            break
        best = lvl
    return best


def parse(value: str) -> Optional[str]:
    """A LLMSVC_CPU_ISA value -> the level (None: unset, no cap); raises on an unknown name."""
    value = value.strip().lower()
    if value in ("", "native"):
        return None
    if value not in LEVELS:
        raise ValueError(f"{ENV}={value!r}: expected one of {', '.join(LEVELS)} (or native)")
    return value


@functools.cache
def cap() -> Optional[str]:
    """LLMSVC_CPU_ISA, read once per process (the library is built once)."""
    return parse(os.environ.get(ENV, ""))


def level() -> Optional[str]:
    """The level the kernels are built for here: the CPU's own, lowered to the cap."""
    own = cpu_level()
    if own is None or cap() is None:
        return own
    return min(own, cap(), key=LEVELS.index)


def at_least(lvl: str) -> bool:
    """Whether the kernels here are built for `lvl` or a level above it."""
    here = level()
    return here is not None and LEVELS.index(here) >= LEVELS.index(lvl)


def cap_cflags(lvl: Optional[str]) -> list[str]:
    """Compiler flags that build for `lvl` (none for None: -march=native as it is). The define
    LLMSVC_CPU_ISA_LEVEL (the index in LEVELS) is for code that picks its ISA at run time
    (target attributes, cpuid) and must not pick one above the cap."""
    if lvl is None:
        return []
    removes = [f for above in LEVELS[LEVELS.index(lvl) + 1:] for f in _REMOVES[above]]
    return removes + [f"-DLLMSVC_CPU_ISA_LEVEL={LEVELS.index(lvl)}"]
