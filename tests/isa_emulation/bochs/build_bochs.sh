#!/usr/bin/env bash
# build_bochs.sh SRC: builds the emulator `make test-emulated EMU_TARGET=sapphirerapids` needs
# (AMX, AVX512-BF16 and AVX-VNNI, which Debian's Bochs 2.7 lacks) from a Bochs source tree
# (SRC holds its bochs/ folder; built and used at its commit 783b58fd6), with bochs-amx.patch:
#  - tdpbssd, tdpbsud and tdpbusd read their signed bytes as unsigned (each product is a
#    Bit32s of a Bit8u); the patch reads them as Bit8s, as the instructions define;
#  - CPUID advertises XFD, without which Linux 6.1 enables AMX's tile configuration but not its
#    tile data and faults in XSETBV at boot. Bochs does not implement the XFD MSRs (run.sh's
#    ignore_bad_msrs), so the guest never traps a first tile use: tile state is not kept across
#    its context switches, and run.sh's replay runs on one thread there.
# Prints the path of the built binary (BOCHS= for run.sh); ~3 minutes on 2 cores.
set -euo pipefail
HERE=$(dirname "$(readlink -f "$0")")
SRC=$(cd "$1" && pwd)
cd "$SRC"
patch -p1 --forward --reject-file=- < "$HERE/bochs-amx.patch" >&2 || true  # already applied: skipped
grep -q "Bit32s(Bit8s(xbyte\[0\])) \* Bit32s(Bit8s(ybyte\[0\]))" bochs/cpu/avx/amx.cc || { echo "build_bochs: the patch did not apply" >&2; exit 1; }
cd bochs
./configure --enable-x86-64 --enable-smp --enable-avx --enable-evex --enable-amx --enable-cpu-level=6 \
    --enable-all-optimizations --enable-fast-function-calls --with-term --without-x11 --without-wx \
    --without-sdl2 --disable-docbook --disable-debugger --disable-plugins >/dev/null
make -j"$(nproc)" >/dev/null
echo "$SRC/bochs/bochs"
