"""The native CPU kernel library itself: it builds here, it falls back to the torch reference
without a compiler or when disabled, it stays unloaded for other devices, and its sources build
for every x86-64 feature level (AVX2 run for real in a fresh process)."""
from __future__ import annotations

import os
import platform
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from kernels.cpu_ops import attention, build
from kernel_utils import needs_native, run_avx2_build_probe


@needs_native
def test_native_kernels_build_here():
    # CI machines have a C compiler: the fast path must really be exercised, not skipped
    assert attention.available(), "kernels/cpu_ops failed to build (see the warning logged)"
    assert build.build() == build.build()  # second call: the cached library


def test_the_kernel_cache_is_its_own_setting_else_under_the_model_cache(monkeypatch, tmp_path):
    monkeypatch.delenv("LLMSVC_KERNEL_CACHE", raising=False)
    monkeypatch.delenv("LLMSVC_CACHE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert build.cache_dir() == tmp_path / "home" / ".cache" / "llmsvc" / "kernels"
    monkeypatch.setenv("LLMSVC_CACHE", str(tmp_path / "models"))
    assert build.cache_dir() == tmp_path / "models" / "kernels"
    monkeypatch.setenv("LLMSVC_KERNEL_CACHE", str(tmp_path / "k"))
    assert build.cache_dir() == tmp_path / "k"


def test_builds_started_together_compile_once(monkeypatch, tmp_path):
    """Two builders of one library on an empty cache (a server's TP workers, parallel test
    workers): the second waits on the first's lock and loads its library."""
    calls = []

    def slow_compile(cc, cflags, cap_flags, out):
        calls.append(out)
        time.sleep(0.5)  # long enough for the other thread to reach the lock
        out.write_bytes(b"lib")

    monkeypatch.setenv("LLMSVC_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setattr(build, "_compiler", lambda: sys.executable)  # `--version` is all it is asked
    monkeypatch.setattr(build, "_compile", slow_compile)
    with ThreadPoolExecutor(2) as pool:
        paths = list(pool.map(lambda _: build.build(), range(2)))
    assert len(calls) == 1 and paths == [calls[0]] * 2


def test_build_pads_branches_where_the_assembler_takes_it(tmp_path):
    # x86: GNU as keeps jumps off 32-byte boundaries (the JCC-erratum slowdown, build.py); an
    # assembler that refuses a -Wa flag makes the build go without it, not fail
    cc = build._compiler()
    if cc is None:
        pytest.skip("no C compiler")
    if platform.machine().lower() in ("x86_64", "amd64"):
        assert build._ASFLAGS == ["-Wa,-mbranches-within-32B-boundaries"]
        assert build._compiles(cc, build._CFLAGS + build._ASFLAGS, str(tmp_path))
    assert build._compiles(cc, build._CFLAGS, str(tmp_path))
    assert not build._compiles(cc, build._CFLAGS + ["-Wa,--no-such-assembler-flag"], str(tmp_path))


def _run_python(code: str, **env) -> subprocess.CompletedProcess:
    full = {**os.environ, **env}
    return subprocess.run([sys.executable, "-c", code], env=full, capture_output=True, text=True,
                          timeout=120)


def test_disabled_by_env_uses_the_reference():
    r = _run_python("from kernels.cpu_ops import attention, linear; import torch;"
                    "print(attention.available(), linear.pack(torch.ones(4, 4)) is None)",
                    LLMSVC_CPU_KERNELS="0")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["False", "True"]


def test_no_compiler_falls_back_with_a_warning(tmp_path):
    r = _run_python("import logging; logging.basicConfig();"
                    "from kernels.cpu_ops import attention; print(attention.available())",
                    CC=str(tmp_path / "no-such-cc"), PATH=str(tmp_path), LLMSVC_KERNEL_CACHE=str(tmp_path),
                    LLMSVC_CPU_KERNELS="1")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False"
    assert "CPU kernels unavailable" in r.stderr


def test_ops_on_other_devices_never_load_the_cpu_library(tmp_path):
    """A GPU's ops (greedy argmax on fp32 logits, norms, the attention and packing checks) must
    not build or load the native library; 'meta' tensors stand in for CUDA ones."""
    r = _run_python("import torch; from kernels import ops; from kernels.cpu_ops import attention, build, "
                    "elementwise, linear; x = torch.empty(4, 64, device='meta');"
                    "ops.argmax_rows(x); ops.rms_norm(x, torch.empty(64, device='meta'), 1e-6);"
                    "print(elementwise.supports(x), attention.supports(x, x), linear.pack(x), build._tried)",
                    LLMSVC_KERNEL_CACHE=str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["False", "False", "None", "False"]


_AVX2_PROBE = """
import torch, torch.nn.functional as F
from kernels import reference as ref
from kernels.cpu_ops import attention, build, linear
lib = build.load()
assert lib.llmsvc_gemm_f32_supported() == 1
g = torch.Generator().manual_seed(0)
for n, k in ((48, 64), (50, 35), (100, 576), (1000, 1536)):
    w, b = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    packed = linear.pack_panels(w)  # held: the call gets only its address
    for m in (1, 5, 6, 7, 64, 300):
        x = torch.randn(m, k, generator=g)
        for nt in (1, 2, 3):
            out = torch.full((m, n), float("nan"))
            assert lib.llmsvc_gemm_f32(x.data_ptr(), k, packed.data_ptr(), b.data_ptr(),
                                       out.data_ptr(), n, m, n, k, nt) == 0
            torch.testing.assert_close(out, F.linear(x, w, b), atol=1e-3, rtol=1e-4)
for dtype, tol in ((torch.float32, 2e-5), (torch.bfloat16, 2e-2)):
    for hq, hkv, d, lens in ((9, 3, 64, [(1, 37), (1, 200), (1, 5)]), (4, 2, 128, [(19, 19), (3, 40)]),
                             (2, 1, 32, [(40, 70), (1, 16)])):
        bs, nb = 16, 64
        kc, vc = (torch.randn(nb, bs, hkv, d, generator=g).to(dtype) for _ in range(2))
        qlens = [q for q, _ in lens]
        q = torch.randn(sum(qlens), hq, d, generator=g).to(dtype)
        perm = torch.randperm(nb, generator=g)
        bt = torch.stack([perm[i * 14:(i + 1) * 14] for i in range(len(lens))]).to(torch.int32)  # 224 keys each
        qsl = torch.tensor([0] + qlens).cumsum(0).to(torch.int32)
        sl = torch.tensor([c for _, c in lens], dtype=torch.int32)
        for window in (0, 24):
            got = attention.paged_attention(q, kc, vc, bt, qsl, sl, d ** -0.5, window)
            want = ref.paged_attention(q, kc, vc, bt, qsl, sl, d ** -0.5, window)
            torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
print("ok")
"""


@needs_native
def test_gemm_and_attention_built_for_avx2():
    """The panel GEMM and paged attention as an AVX2 CPU without AVX-512 runs them (built with
    LLMSVC_CPU_ISA=avx2, in a fresh process), against F.linear and
    the reference: ragged panels, 6-row blocks and their remainders, GQA decodes and prefill
    tiles, sliding windows, fp32 and bf16."""
    run_avx2_build_probe(_AVX2_PROBE)


# x86-64 feature levels the C sources branch on: SSE4.2 only, AVX2 + FMA, AVX-512F,
# AVX512-BF16, AMX. Each machine builds only its own (-march=native), so a change that breaks
# another level's branch would pass here and fail on that CPU.
_MARCHES = ["x86-64-v2", "x86-64-v3", "skylake-avx512", "cooperlake", "sapphirerapids"]


@pytest.mark.parametrize("march", _MARCHES)
def test_c_sources_compile_for_every_x86_feature_level(march):
    import platform

    cc = build._compiler()
    if cc is None or platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("needs a C compiler targeting x86-64")
    flags = [f if f != "-march=native" else f"-march={march}" for f in build._CFLAGS]
    for src in build._SOURCES:
        r = subprocess.run([cc, *flags, "-Werror=incompatible-pointer-types", "-fsyntax-only", str(src)],
                           capture_output=True, text=True)
        if r.returncode and "bad value" in r.stderr:
            pytest.skip(f"{cc} does not know -march={march}")
        assert r.returncode == 0, f"{src.name} for {march}:\n{r.stderr[-2000:]}"
