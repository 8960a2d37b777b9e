#!/usr/bin/env bash
# `make test-emulated`: the native kernels built for a CPU this machine is not (by default
# Cascade Lake's -march: AVX-512 and AVX512-VNNI) and run under the Bochs emulator, on calls
# recorded from the kernel tests on this machine's own build (trace.py) and GEMM cases packed
# for that CPU's layout (gemm_cases.py); replay.c compares every output. The replay first runs
# on this machine's build, which must give the trace back. docs/cpu-kernels.md says what it
# covers and what it cannot (AVX512-BF16, AMX and AVX-VNNI are not in Bochs 2.7).
#   EMU_MARCH (cascadelake), EMU_CPU (the Bochs model, tigerlake), EMU_WORK (build/isa_emulation)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
HERE=$ROOT/tests/isa_emulation
PY=${PY:-$ROOT/.venv/bin/python}
MARCH=${EMU_MARCH:-cascadelake}
W=${EMU_WORK:-$ROOT/build/isa_emulation}
TESTS="tests/test_kernels_cpu_int8.py tests/test_kernels_cpu_elementwise.py tests/test_kernels_cpu_attention.py
       tests/test_kernels_window.py"

missing=""
command -v bochs-bin >/dev/null || missing="$missing bochs bochsbios vgabios"
[ -f /usr/lib/x86_64-linux-gnu/libffi.a ] || missing="$missing libffi-dev"
if [ -n "$missing" ]; then
    echo "isa_emulation: installing$missing (Debian packages)"
    apt-get install -y -qq $missing >/dev/null
fi

# the library's own compile flags (build.py), -march=native swapped for the target's
CFLAGS=$(cd "$ROOT" && "$PY" -c "from kernels.cpu_ops import build; print(*[f for f in build._CFLAGS + build._ASFLAGS if f != '-march=native'])")
build() { # build MARCH OUT: every kernel source and replay.c, linked statically (the guest has no libc)
    local obj=$W/obj-$1
    rm -rf "$obj" && mkdir -p "$obj"
    # warnings are the library build's business (-w); an error stops the run
    for c in "$ROOT"/kernels/cpu_ops/*.c; do
        gcc $CFLAGS -w -march="$1" -c "$c" -o "$obj/$(basename "$c" .c).o"
    done
    gcc -O2 -std=c11 -Wall -march="$1" -c "$HERE/replay.c" -o "$obj/replay.o"
    gcc -static -fopenmp -o "$2" "$obj"/*.o -lffi -lm 2>"$obj/link.log" || { cat "$obj/link.log"; exit 1; }
}

rm -rf "$W/guest" && mkdir -p "$W/guest"
echo "isa_emulation: building for -march=native and -march=$MARCH"
build native "$W/replay-native"
build "$MARCH" "$W/guest/replay"
echo "isa_emulation: recording the kernel tests' calls"
(cd "$ROOT" && EMU_TRACE=$W/guest/kernels.trace "$PY" -m pytest -q -p tests.isa_emulation.trace -p no:cacheprovider $TESTS | tail -n 2)
# gemm.c's sub-panel width on the target: the whole 48-wide panel with AVX-512, 16 without
gcc -march="$MARCH" -dM -E -x c /dev/null | grep -q __AVX512F__ && SUB=48 || SUB=16
(cd "$ROOT" && "$PY" -m tests.isa_emulation.gemm_cases "$W/guest/gemm.trace" "$SUB")
echo "isa_emulation: replay on this machine's build (must give the trace back)"
(cd "$W/guest" && OMP_NUM_THREADS=2 "$W/replay-native" kernels.trace)
echo "isa_emulation: replay built for $MARCH, in Bochs (${EMU_CPU:-tigerlake})"
"$HERE/bochs/run.sh" --cpu "${EMU_CPU:-tigerlake}" --mem 2048 --timeout 2400 "$W/guest" ./replay kernels.trace gemm.trace
