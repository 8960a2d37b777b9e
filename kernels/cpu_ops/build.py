"""Builds and loads the native CPU kernels (`*.c` here, C + OpenMP, called through ctypes).

The C sources are compiled on first use with the system C compiler (`cc`, or $CC) for this
machine (-march=native) into <kernel cache>/<key>/, key = hash of source, flags, compiler and
CPU flags; later processes load the cached library. The kernel cache is $LLMSVC_KERNEL_CACHE,
else $LLMSVC_CACHE/kernels (default ~/.cache/llmsvc/kernels): a separate setting, so that a
process given a fresh model cache does not compile the kernels again. The build is atomic
(temp dir + rename) and holds a file lock, so processes starting together compile it once.

LLMSVC_CPU_ISA caps the x86 feature level the kernels are built for (isa.py: sse4, avx2,
avx512, avx512_vnni, avx512_bf16, amx), so a CPU with more runs the paths of one with less, as
the tests do, or a fleet whose oldest CPU lacks a feature. LLMSVC_CPU_CFLAGS adds compiler
flags after ours and the cap's (both part of the key).

If no compiler is found, or LLMSVC_CPU_KERNELS=0, `load()` returns None and
`kernels/ops.py` uses the torch reference (`kernels/reference.py`, also the ground truth
the tests compare against).
"""
from __future__ import annotations

import ctypes
import fcntl
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional

import torch

from kernels.cpu_ops import isa

logger = logging.getLogger(__name__)

_SOURCES = sorted(Path(__file__).parent.glob("*.c"))  # all linked into one library
_HEADERS = sorted(Path(__file__).parent.glob("*.h"))
# -ffast-math only at compile time: linking with it would pull in crtfastmath.o, which
# flips the whole process's FPU to flush-to-zero when the library loads.
_CFLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-ffast-math", "-fopenmp", "-fPIC", "-std=c11", "-Wall"]
_LDFLAGS = ["-shared", "-fopenmp", "-lm"]
# Skylake-family cores (Skylake-SP, Cascade Lake) under Intel's JCC-erratum microcode keep no
# jump that crosses or ends on a 32-byte boundary in the uop cache: a GEMM k-loop whose jump
# landed there ran from the legacy decoders, 25-30% slower, and which loop it hit moved with
# any edit (gemm.c's 256 x 3072 x 576 panel GEMM, one Cascade Lake core: 9.0 against 7.0 ms).
# GNU as pads branches off those boundaries; a build whose assembler refuses it goes without.
_ASFLAGS = ["-Wa,-mbranches-within-32B-boundaries"] if platform.machine().lower() in ("x86_64", "amd64") else []

# the `int dtype` argument of the entry points that take either storage type
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}


def as_c_array(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t itself when it already is a contiguous `dtype` array (the hot path), else a copy:
    what an entry point taking a plain `int64_t *` / `int32_t *` / `float *` needs."""
    return t if t.dtype == dtype and t.is_contiguous() else t.to(dtype).contiguous()


def as_c_rows(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A 2-D `dtype` array whose rows may be strided but whose last dim is contiguous (the
    entry point takes the row stride): t itself when it already is one, else a copy."""
    t = t if t.dtype == dtype else t.to(dtype)
    return t if t.stride(-1) == 1 else t.contiguous()

_i, _i64, _f, _p = ctypes.c_int, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
# every exported function returns int (0 = ok, -1 = rejected arguments)
_SIGNATURES = {
    "llmsvc_paged_attention": [_i, _p, _i64, _p, _p, _p, _i64, _p, _p, _i64, _i64, _i64, _i64, _i64,
                               _f, _i64, _f, _p, _i],
    "llmsvc_rms_norm": [_i, _p, _i64, _p, _p, _i64, _i64, _f, _i],
    "llmsvc_fused_add_rms_norm": [_i, _p, _i64, _p, _i64, _p, _p, _p, _i64, _i64, _f, _i],
    "llmsvc_silu_and_mul": [_i, _p, _i64, _p, _i64, _i64, _i],
    "llmsvc_store_kv": [_p, _i64, _p, _i64, _p, _p, _p, _i64, _i64, _i64, _i64],
    "llmsvc_argmax_rows": [_p, _i64, _p, _i64, _i64, _i],
    "llmsvc_gemm_f32_supported": [],
    "llmsvc_gemm_f32_subpanel": [],
    "llmsvc_gemm_f32": [_p, _i64, _p, _p, _p, _i64, _i64, _i64, _i64, _i],
    "llmsvc_gemm_q8": [_p, _i64, _p, _p, _p, _i64, _i64, _i64, _i64, _i],
    "llmsvc_gemm_i8_supported": [_i],
    "llmsvc_gemm_i8_qmax": [_i],
    "llmsvc_gemm_i8": [_i, _p, _i64, _i, _p, _p, _p, _i64, _i64, _i64, _i64, _i],
    "llmsvc_gemm_bf16_supported": [],
    "llmsvc_gemm_bf16_layout": [],
    "llmsvc_gemm_bf16_widen_supported": [],
    "llmsvc_gemm_bf16_widen": [_p, _i64, _p, _p, _p, _i64, _i64, _i64, _i64, _i],
    "llmsvc_gemm_bf16": [_p, _i64, _p, _p, _p, _i64, _i64, _i64, _i64, _i],
    "llmsvc_gemm_bf16_amx_supported": [],
    "llmsvc_gemm_bf16_amx": [_p, _i64, _p, _p, _p, _i64, _i64, _i64, _i64, _i],
    "llmsvc_gemm_bf16_dp_supported": [],
    "llmsvc_gemm_bf16_dp": [_p, _i64, _p, _p, _p, _i64, _i64, _i64, _i64, _i],
    "llmsvc_llama_layers": [_i, _i64, _p, _p, _p, _p, _p, _p, _p, _p, _p, _p, _i64, _i64, _p, _i64, _p,
                            _i64, _p, _p, _i64, _i64, _i64, _i64, _i64, _i64, _i64, _i64, _f, _f, _i64, _i, _p, _p],
    "llmsvc_rotary_neox": [_i, _p, _p, _i64, _i64, _p, _i64, _i64, _i64, _p, _i64, _i64, _i64, _i],
}

_lock = threading.Lock()
_lib: Optional[ctypes.CDLL] = None
_tried = False


def enabled_by_env() -> bool:
    return os.environ.get("LLMSVC_CPU_KERNELS", "1") not in ("", "0")


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def _compiler() -> Optional[str]:
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")


def cache_dir() -> Path:
    """Where compiled libraries are kept (module docstring)."""
    if os.environ.get("LLMSVC_KERNEL_CACHE"):
        return Path(os.path.expanduser(os.environ["LLMSVC_KERNEL_CACHE"]))
    root = os.environ.get("LLMSVC_CACHE") or os.path.join("~", ".cache", "llmsvc")
    return Path(os.path.expanduser(root)) / "kernels"


def _known_flags(cc: str, flags: list[str], tmp: str) -> list[str]:
    """The flags of an ISA cap this compiler knows: one that does not know an extension's
    -mno- flag cannot enable that extension either."""
    return [f for f in flags if _compiles(cc, [f], tmp)]


def _compiles(cc: str, cflags: list[str], tmp: str) -> bool:
    """Whether cc with cflags compiles an empty function (the assembler takes every -Wa flag)."""
    src = os.path.join(tmp, "probe.c")
    Path(src).write_text("int llmsvc_probe(int x) { return x ? 1 : 2; }\n")
    return subprocess.run([cc, *cflags, "-c", src, "-o", src + ".o"], capture_output=True).returncode == 0


def _run_or_raise(cmd: list[str]) -> list[str]:
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{r.stderr}")
    return cmd


def build(force: bool = False) -> Path:
    """Compile (or find in the cache) the shared library; returns its path. Raises on failure."""
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler (cc / gcc / $CC) found")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout.splitlines()[:1]
    cap_flags = isa.cap_cflags(isa.cap())
    cflags = _CFLAGS + _ASFLAGS + cap_flags + os.environ.get("LLMSVC_CPU_CFLAGS", "").split()
    key = hashlib.sha256("\0".join([*(p.read_text() for p in _SOURCES + _HEADERS), *cflags, *_LDFLAGS, *version, _cpu_flags(),
                                    platform.machine()]).encode()).hexdigest()[:16]
    out = cache_dir() / key / "libllmsvc_cpu.so"
    if out.exists() and not force:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # one compile per library at a time: processes starting together on an empty cache (a
    # server's TP workers, parallel test workers) wait for the first build instead of each
    # compiling it again on the same cores; the lock goes with its process if it is killed
    with open(out.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if out.exists() and not force:
            return out
        _compile(cc, cflags, cap_flags, out)
    logger.info("built CPU kernels %s", out)
    return out


def _compile(cc: str, cflags: list[str], cap_flags: list[str], out: Path) -> None:
    """Compile the sources with cflags into `out`, through a temporary file renamed into place."""
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        objs = [os.path.join(tmp, p.stem + ".o") for p in _SOURCES]
        so = os.path.join(tmp, "k.so")
        if _ASFLAGS and not _compiles(cc, cflags, tmp):
            cflags = [f for f in cflags if f not in _ASFLAGS]
        unknown = set(cap_flags) - set(_known_flags(cc, cap_flags, tmp))
        cflags = [f for f in cflags if f not in unknown]
        cmds = [[cc, *cflags, "-c", str(p), "-o", o] for p, o in zip(_SOURCES, objs)]
        # the sources compile independently: one compiler per core (a test run builds one library
        # per LLMSVC_CPU_ISA level below the CPU's own)
        with ThreadPoolExecutor(max(1, min(len(cmds), os.cpu_count() or 1))) as pool:
            list(pool.map(_run_or_raise, cmds))  # re-raises the first failure
        _run_or_raise([cc, *objs, *_LDFLAGS, "-o", so])
        os.replace(so, out)


def load() -> Optional[ctypes.CDLL]:
    """The library with its argtypes set, built on first call; None if unavailable (logged once)."""
    global _lib, _tried
    if _tried:  # hot path (every op call): no lock once decided
        return _lib
    with _lock:
        if _tried:
            return _lib
        if not enabled_by_env():
            _tried = True
            return None
        isa.cap()  # an unknown LLMSVC_CPU_ISA is a configuration error, not a silent fallback
        _tried = True
        try:
            lib = ctypes.CDLL(str(build()))
        except Exception as e:  # no compiler, read-only cache, ...: the reference still works
            logger.warning("CPU kernels unavailable, using the torch reference: %s", e)
            return None
        logger.info("CPU kernels: native library %s (x86 level %s%s)", lib._name, isa.level(),
                    f", capped by {isa.ENV}" if isa.cap() else "")
        for name, argtypes in _SIGNATURES.items():
            f = getattr(lib, name)
            f.argtypes, f.restype = argtypes, ctypes.c_int
        _lib = lib
        return lib
