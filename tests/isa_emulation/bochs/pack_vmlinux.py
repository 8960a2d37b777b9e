#!/usr/bin/env python3
# Extract vmlinux from a (xz-compressed) bzImage and pack its PT_LOAD segments as
# records {u32 dest, u32 ndata, u32 nzero, data[ndata]} so that pvhstub can place
# them without decompression (runs of >=256 zero bytes are not stored).
# Header: "PVHB", u32 pvh_entry (XEN_ELFNOTE_PHYS32_ENTRY), u32 nrec.
import lzma, re, struct, sys
bz = open(sys.argv[1], 'rb').read()
elf = lzma.LZMADecompressor(format=lzma.FORMAT_XZ).decompress(bz[bz.find(b'\xfd7zXZ\x00'):])
assert elf[:4] == b'\x7fELF'
phoff, = struct.unpack_from('<Q', elf, 32); phnum, = struct.unpack_from('<H', elf, 56)
# Blank .BTF (4 MB of BPF type info): parsing it costs ~0.5 s of emulated boot; BPF is not needed.
shoff, = struct.unpack_from('<Q', elf, 40); shnum, shstr = struct.unpack_from('<HH', elf, 60)
sh = [struct.unpack_from('<IIQQQQ', elf, shoff + 64 * i) for i in range(shnum)]
elf = bytearray(elf)
for name, typ, fl, addr, off, size in sh:
    if elf[sh[shstr][4] + name:].split(b'\0', 1)[0] == b'.BTF':
        elf[off:off + size] = bytes(size)
elf = bytes(elf)
entry, recs = None, []
for i in range(phnum):
    t, fl, off, va, pa, fs, ms, al = struct.unpack_from('<IIQQQQQQ', elf, phoff + 56 * i)
    seg = elf[off:off + fs]
    if t == 4:                                   # PT_NOTE: look for Xen note 18 (PVH entry)
        p = 0
        while p < len(seg):
            nsz, dsz, typ = struct.unpack_from('<III', seg, p)
            name = seg[p + 12:p + 12 + nsz]; d = p + 12 + (nsz + 3 & ~3)
            if name.startswith(b'Xen') and typ == 18:
                entry = struct.unpack_from('<I', seg, d)[0]
            p = d + (dsz + 3 & ~3)
    if t != 1: continue
    seg += b'\0' * (ms - fs); pos = 0
    for m in list(re.finditer(rb'\0{256,}', seg)) + [None]:
        s, e = (m.start(), m.end()) if m else (len(seg), len(seg))
        recs.append(struct.pack('<III', pa + pos, s - pos, e - s) + seg[pos:s]); pos = e
assert entry, 'no PVH entry note (CONFIG_PVH=n?)'
sys.stdout.buffer.write(b'PVHB' + struct.pack('<II', entry, len(recs)) + b''.join(recs))
