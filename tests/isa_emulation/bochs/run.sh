#!/bin/bash
# run.sh -- run a static x86-64 Linux program inside the Bochs emulator
# (so that AVX-512 / AVX512-VNNI code can execute on a host without them).
#
# usage: run.sh [--cpu MODEL] [--smp N] [--mem MB] [--ips N] [--timeout S] [--keep] DIR CMD [ARGS...]
#   DIR      directory packed into the initramfs (static binaries + data); CMD runs in it (/work)
#   --cpu    Bochs CPU model (default tigerlake; corei7_icelake_u also has AVX512-VNNI), or
#            "generic:<cpuid: options>" for bx_generic (useless for AVX-512: Bochs 2.7 bug, leaf 7 = 0)
#   --smp    emulated CPUs (default 1; Bochs runs them all on one host thread)
#   --mem    guest RAM in MB (default 512; DIR is held in RAM, twice while unpacking)
#   --ips    emulated instructions per emulated second (default 1e8; guest TSC = this rate)
#   --keep   keep the work dir (bochsrc, serial.log, bochs.log) and print its path
# env: BOCHS_VERBOSE=1 print the whole serial log; KEXTRA="..." extra kernel args;
#      KBLACKLIST=... replace the initcall blacklist; BOCHS_CACHE=dir (default ~/.cache/llmsvc/bochs)
# Prints the program's output (serial console), then a timing line on stderr.  Exit code: the
# program's; 124 on timeout; 125 if the guest died (kernel panic/no exit marker).
set -u
# BOCHS: the emulator binary (Debian's bochs-bin, 2.7, by default; a newer build for AMX, AVX512-BF16
# and AVX-VNNI), BOCHS_BIOS its ROM (default: beside a source build's binary, else Debian's)
BOCHS=${BOCHS:-bochs-bin}
BIOS=${BOCHS_BIOS:-$(d=$(dirname "$(command -v "$BOCHS")"); [ -f "$d/bios/BIOS-bochs-latest" ] && echo "$d/bios/BIOS-bochs-latest" || echo /usr/share/bochs/BIOS-bochs-latest)}
CACHE=${BOCHS_CACHE:-$HOME/.cache/llmsvc/bochs}                # kernel, busybox, isolinux files are cached here
CPU=tigerlake SMP=1 MEM=512 TIMEOUT=1800 IPS=100000000 KEEP=0
while [ $# -gt 0 ]; do
  case "$1" in
    --cpu) CPU=$2; shift 2;;  --smp) SMP=$2; shift 2;;  --mem) MEM=$2; shift 2;;
    --ips) IPS=$2; shift 2;;  --timeout) TIMEOUT=$2; shift 2;;  --keep) KEEP=1; shift;;
    --) shift; break;;  -*) echo "run.sh: unknown option $1" >&2; exit 2;;  *) break;;
  esac
done
[ $# -ge 2 ] && [ -d "$1" ] || { sed -n '5,16p' "$0" >&2; exit 2; }
DIR=$(cd "$1" && pwd); shift

# ---- one-time setup: tools + Debian kernel (extracted, never installed) ----
need() { command -v "$1" >/dev/null || NEED="${NEED:-} $2"; }
need xorriso xorriso; need cpio cpio; need bochs-bin bochs; need bc bc
[ -f /bin/busybox ] && file -L /bin/busybox | grep -q static || NEED="${NEED:-} busybox-static"
[ -f /usr/lib/ISOLINUX/isolinux.bin ] || NEED="${NEED:-} isolinux syslinux-common"
[ -n "${NEED:-}" ] && { apt-get install -y -qq $NEED >/dev/null || exit 3; }
mkdir -p "$CACHE"; H=$(dirname "$(readlink -f "$0")")     # pvhstub.c, pvhstub.ld, pack_vmlinux.py beside this script
if [ ! -f "$CACHE/vmlinux.pvhb" ]; then
  KPKG=$(apt-cache depends linux-image-amd64 | awk '/Depends: linux-image-[0-9]/{print $2; exit}')
  ( cd "$CACHE" && rm -rf kdeb && mkdir kdeb && cd kdeb && apt-get download "$KPKG" >/dev/null 2>&1 &&
    dpkg-deb -x ./*.deb x && cp x/boot/vmlinuz-* ../vmlinuz && cd .. && rm -rf kdeb &&
    python3 "$H/pack_vmlinux.py" vmlinuz > vmlinux.tmp && mv vmlinux.tmp vmlinux.pvhb ) ||
    { echo "run.sh: kernel download/unpack failed" >&2; exit 3; }
fi
[ -f "$CACHE/pvhstub.elf" ] || gcc -m32 -O2 -ffreestanding -fno-pic -fno-pie -fno-stack-protector \
  -fno-asynchronous-unwind-tables -nostdlib -static -Wl,-T,"$H/pvhstub.ld" -Wl,--build-id=none \
  -z noexecstack -o "$CACHE/pvhstub.elf" "$H/pvhstub.c" || exit 3

W=$(mktemp -d "${TMPDIR:-/tmp}/bochs.XXXXXX")
BOCHS_PID=
cleanup() { [ -n "$BOCHS_PID" ] && kill -9 "$BOCHS_PID" 2>/dev/null; [ $KEEP = 1 ] || rm -rf "$W"; }
trap cleanup EXIT; trap 'exit 130' INT TERM

# ---- initramfs: busybox + /init + DIR as /work ----
R=$W/root; mkdir -p "$R"/{bin,dev,proc,sys,tmp,work} "$W/iso"
cp /bin/busybox "$R/bin/busybox"
for a in $(/bin/busybox --list); do [ -e "$R/bin/$a" ] || ln -s busybox "$R/bin/$a"; done  # applets
cp -a "$DIR/." "$R/work/"
CMDQ=$(printf '%q ' "$@")                 # CMD quoted for the guest shell (busybox ash)
cat > "$R/init" <<EOF
#!/bin/busybox sh
export PATH=/work:/bin HOME=/work TERM=dumb
mount -t proc proc /proc; mount -t sysfs sys /sys; mount -t devtmpfs dev /dev 2>/dev/null
cd /work
echo "@@START \$(cut -d' ' -f1 /proc/uptime)"
$CMDQ
rc=\$?
echo "@@EXIT \$rc \$(cut -d' ' -f1 /proc/uptime)"
sleep 2                                  # let the UART drain (guest idles: cheap in Bochs)
poweroff -f
EOF
chmod +x "$R/init"
( cd "$R" && find . | cpio -o -H newc --quiet ) > "$W/iso/initrd"

# ---- bootable ISO: isolinux -> mboot.c32 -> pvhstub -> vmlinux (PVH entry) + initrd ----
cp "$CACHE/vmlinux.pvhb" "$CACHE/pvhstub.elf" /usr/lib/ISOLINUX/isolinux.bin "$W/iso/"
for m in ldlinux libcom32 libutil mboot; do cp /usr/lib/syslinux/modules/bios/$m.c32 "$W/iso/"; done
# clearcpuid: Bochs 2.7 bugs -- CPUID 0xD reports wrong XSAVES/XSAVEC compacted size and a 0-byte
# PKRU area (kernel WARNs, xstate mess); IA32_MISC_ENABLE lacks fast-strings so Linux drops ERMS
# but keeps FSRM, which leaves memmove() broken for <32 bytes (boot dies in printk).  TSC ticks
# once per emulated instruction (= ips per emulated second), not at the 2.4 GHz CPUID claims.
# initcall_blacklist: slow initcalls that are useless here (tracing, TCP cubic/BTF, certs, PS/2...).
BL=trace_eval_init,cubictcp_register,init_kprobe_trace,load_system_certificate_list,init_evm,init_ima
BL=$BL,i8042_init,amd_pstate_init,intel_pstate_init,cmos_init,inet6_init,blake2s_mod_init,hugetlb_init
BL=$BL,crypto_kdf108_init,dev_map_init,init_trace_printk_function_export,init_graph_tracefs,bsg_init
BL=$BL,ftrace_check_for_weak_functions,tracer_init_tracefs   # ftrace check: 0.8 s (kallsyms x 40k)
# rodata=off skips the W+X page-table walk (CONFIG_DEBUG_WX, ~1.2 s); notests skips crypto self-tests
KARGS="console=ttyS0,115200 quiet loglevel=3 mitigations=off nokaslr rdinit=/init cryptomgr.notests rodata=off \
 clearcpuid=${KCLEAR-xsaves,xsavec,pku,fsrm,aperfmperf} tsc_early_khz=$((IPS/1000)) \
 initcall_blacklist=${KBLACKLIST-$BL} ${KEXTRA:-}"
printf 'DEFAULT l\nPROMPT 0\nTIMEOUT 0\nLABEL l\n KERNEL mboot.c32\n APPEND %s\n' \
  "pvhstub.elf $KARGS --- vmlinux.pvhb --- initrd" > "$W/iso/isolinux.cfg"
xorriso -as mkisofs -quiet -o "$W/boot.iso" -b isolinux.bin -c boot.cat -no-emul-boot \
  -boot-load-size 4 -boot-info-table "$W/iso" 2>/dev/null || { echo "run.sh: xorriso failed" >&2; exit 3; }

# ---- bochsrc ----
if [ "${CPU#generic:}" != "$CPU" ]; then
  CPULINE="cpu: model=bx_generic, count=$SMP, ips=$IPS, reset_on_triple_fault=0, ignore_bad_msrs=1
cpuid: x86_64=1, level=6, family=6, model=0x55, stepping=3, mmx=1, apic=x2apic, sep=1, aes=1, movbe=1, xsave=1, xsaveopt=1, 1g_pages=1, pcid=1, fsgsbase=1, smep=1, ${CPU#generic:}"
else
  CPULINE="cpu: model=$CPU, count=$SMP, ips=$IPS, reset_on_triple_fault=0, ignore_bad_msrs=1"
fi
cat > "$W/bochsrc" <<EOF
config_interface: textconfig
display_library: term
memory: guest=$MEM, host=$MEM
romimage: file=$BIOS
vgaromimage: file=/usr/share/vgabios/vgabios.bin
$CPULINE
ata0-master: type=cdrom, path=$W/boot.iso, status=inserted
boot: cdrom
clock: sync=none, time0=local
com1: enabled=1, mode=file, dev=$W/serial.log
log: $W/bochs.log
panic: action=fatal
error: action=report
info: action=ignore
debug: action=ignore
EOF
printf 'c\nquit\n' > "$W/dbgcmds"          # Debian's bochs has the debugger built in: just continue
RC_ARGS=(-rc "$W/dbgcmds"); [ "$BOCHS" = bochs-bin ] || RC_ARGS=()   # a build without it takes no -rc

# ---- run (one Bochs, killed on timeout) ----
T0=$(date +%s.%N)
TERM=vt100 "$BOCHS" -q -f "$W/bochsrc" "${RC_ARGS[@]}" </dev/null >"$W/bochs.out" 2>&1 &
BOCHS_PID=$!
END=$(( $(date +%s) + TIMEOUT )); RC= TS= TK= TI=
seen() { grep -aq "$1" "$W/tail" && date +%s.%N; }
while kill -0 "$BOCHS_PID" 2>/dev/null; do        # poll the serial log, note host times of boot phases
  tail -c 65536 "$W/serial.log" > "$W/tail" 2>/dev/null   # (only the tail: output may be huge)
  [ -z "$TS" ] && TS=$(seen 'pvhstub: placing')    # BIOS + isolinux + mboot loaded everything
  [ -z "$TK" ] && TK=$(seen 'pvhstub: kernel')     # stub placed the kernel, jumps to it
  [ -z "$TI" ] && TI=$(seen '^@@START')             # /init runs the command
  if grep -aq '^@@EXIT' "$W/tail"; then sleep 1; break; fi   # (1 s: let the rest of that line in)
  grep -aq 'end Kernel panic' "$W/tail" && { RC=125; break; }
  [ "$(date +%s)" -ge $END ] && { RC=124; break; }
  sleep 0.2
done
kill -9 "$BOCHS_PID" 2>/dev/null; wait "$BOCHS_PID" 2>/dev/null; BOCHS_PID=  # SIGTERM is not enough
T1=$(date +%s.%N)
LOG=$(tr -d '\r\0' < "$W/serial.log" 2>/dev/null)
if [ "${BOCHS_VERBOSE:-0}" = 1 ]; then printf '%s\n' "$LOG"
else printf '%s\n' "$LOG" | sed -n '/^@@START/,/^@@EXIT/{/^@@/d;p}'; fi
EXITLINE=$(printf '%s\n' "$LOG" | grep '^@@EXIT' | tail -1)
STARTLINE=$(printf '%s\n' "$LOG" | grep '^@@START' | tail -1)
[ -z "$RC" ] && RC=$(echo "$EXITLINE" | awk '{print $2}')
[ -z "$EXITLINE" ] && { echo "run.sh: no exit marker (timeout/panic/crash); serial log tail:" >&2
  printf '%s\n' "$LOG" | tail -25 >&2; RC=${RC:-125}; }
d() { [ -n "$1" ] && printf '%.1fs' "$(echo "$1 - $T0" | bc)" || echo '?'; }
echo "run.sh: rc=$RC host: loaded=$(d "$TS") kernel=$(d "$TK") init=$(d "$TI") total=$(d "$T1");" \
     "guest uptime: init=${STARTLINE#@@START } exit=$(echo "$EXITLINE" | awk '{print $3}')" >&2
[ $KEEP = 1 ] && echo "run.sh: workdir $W" >&2
exit "$RC"
