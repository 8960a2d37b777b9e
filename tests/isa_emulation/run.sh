#!/usr/bin/env bash
# `make test-emulated`: the native kernels built for a CPU this machine is not and run under the
# Bochs emulator, on calls recorded from the kernel tests on this machine's own build (trace.py)
# and GEMM cases packed for that CPU's layouts (gemm_cases.py); replay.c compares every output.
# The replay first runs on this machine's build, which must give the trace back.
# docs/cpu-kernels.md says what each target covers and what it cannot.
#   EMU_TARGET=cascadelake (default): AVX-512 and AVX512-VNNI, Debian's Bochs 2.7, model tigerlake
#   EMU_TARGET=sapphirerapids: adds AVX512-BF16, AVX-VNNI and AMX; needs BOCHS=<the binary
#     bochs/build_bochs.sh builds>, model sapphire_rapids, the replay on one thread
#   EMU_WORK: where it builds and records (build/isa_emulation)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
HERE=$ROOT/tests/isa_emulation
PY=${PY:-$ROOT/.venv/bin/python}
W=${EMU_WORK:-$ROOT/build/isa_emulation}
TESTS="tests/test_kernels_cpu_int8.py tests/test_kernels_cpu_elementwise.py tests/test_kernels_cpu_attention.py
       tests/test_kernels_window.py"
GUEST_ENV=""
case "${EMU_TARGET:-cascadelake}" in
cascadelake) MARCH=cascadelake CPU=tigerlake ;;
sapphirerapids)
    MARCH=sapphirerapids CPU=sapphire_rapids
    if [ "${BOCHS:-bochs-bin}" = bochs-bin ]; then
        echo "isa_emulation: EMU_TARGET=sapphirerapids needs BOCHS=<tests/isa_emulation/bochs/build_bochs.sh's build>" >&2
        exit 2
    fi
    export KCLEAR=pku,fsrm,aperfmperf # this Bochs sizes XSAVES areas right: Linux keeps them (AMX needs them)
    GUEST_ENV="OMP_THREAD_LIMIT=1" ;; # the guest loses tile state across thread switches (build_bochs.sh)
*) echo "isa_emulation: EMU_TARGET is cascadelake or sapphirerapids" >&2; exit 2 ;;
esac

# replay.c links libffi statically; bochs/run.sh installs the emulator and what the guest needs
if [ ! -f /usr/lib/x86_64-linux-gnu/libffi.a ]; then
    echo "isa_emulation: installing libffi-dev (Debian package)"
    apt-get install -y -qq libffi-dev >/dev/null
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
# gemm.c's sub-panel width on the target: the whole 48-wide panel with AVX-512, 16 without; the
# bf16 entries of VNNI-tiled weights where the target has AVX512-BF16 or AMX
MACROS=$(gcc -march="$MARCH" -dM -E -x c /dev/null)
grep -q __AVX512F__ <<<"$MACROS" && SUB=48 || SUB=16
VNNI=""
grep -q __AVX512BF16__ <<<"$MACROS" && VNNI="$VNNI llmsvc_gemm_bf16_dp"
grep -q __AMX_TILE__ <<<"$MACROS" && VNNI="$VNNI llmsvc_gemm_bf16_amx"
(cd "$ROOT" && "$PY" -m tests.isa_emulation.gemm_cases "$W/guest/gemm.trace" "$SUB" $VNNI)
echo "isa_emulation: replay on this machine's build (must give the trace back)"
(cd "$W/guest" && OMP_NUM_THREADS=2 "$W/replay-native" kernels.trace)
echo "isa_emulation: replay built for $MARCH, in Bochs ($CPU)"
"$HERE/bochs/run.sh" --cpu "$CPU" --mem 2048 --timeout 2400 "$W/guest" env $GUEST_ENV ./replay kernels.trace gemm.trace
