/* pvhstub: a Multiboot (v1) kernel, loaded by syslinux mboot.c32, that boots an
 * uncompressed Linux vmlinux via its PVH entry point (no decompression: xz in an
 * emulator costs ~4e9 instructions).  Modules: [0] vmlinux packed by
 * pack_vmlinux.py, [1] initrd.  Our own command line (minus the first word, the
 * file name) becomes the kernel command line.  The big .bss below keeps mboot from
 * placing modules where the kernel goes (16..80 MiB), and mboot zero-fills it for us. */
typedef unsigned int u32; typedef unsigned long long u64; typedef unsigned char u8;
struct mb_info { u32 flags, mem_lower, mem_upper, boot_device, cmdline, mods_count, mods_addr,
                 syms[4], mmap_length, mmap_addr; };
struct mb_mod { u32 start, end, string, reserved; };
struct mb_mmap { u32 size; u64 addr, len; u32 type; } __attribute__((packed));
struct hvm_start_info { u32 magic, version, flags, nr_modules;
  u64 modlist_paddr, cmdline_paddr, rsdp_paddr, memmap_paddr; u32 memmap_entries, reserved; };
struct hvm_modlist_entry { u64 paddr, size, cmdline_paddr, reserved; };
struct hvm_memmap_entry { u64 addr, size; u32 type, reserved; };

__asm__(".section .multiboot,\"a\"\n .align 4\n .long 0x1BADB002, 3, -(0x1BADB002+3)\n"
        ".text\n .globl _start\n_start: mov $pvh_stack+16384, %esp\n push %ebx\n call stub_main\n1: hlt\n jmp 1b\n");
u8 pvh_stack[16384] __attribute__((aligned(16)));
static char reserve[0x5000000 - 0x200000] __attribute__((used, section(".bss.reserve")));
static struct hvm_start_info si; static struct hvm_modlist_entry mod; static struct hvm_memmap_entry mm[128];
static char cmdline[4096];

static void outb(unsigned short p, u8 v) { __asm__ volatile("outb %0, %1" :: "a"(v), "Nd"(p)); }
static u8 inb(unsigned short p) { u8 v; __asm__ volatile("inb %1, %0" : "=a"(v) : "Nd"(p)); return v; }
static void puts_(const char *s) { for (; *s; s++) { while (!(inb(0x3fd) & 0x20)); outb(0x3f8, *s); } }
static void die(const char *s) { puts_("pvhstub: "); puts_(s); puts_("\r\n"); for (;;) __asm__ volatile("cli; hlt"); }

void stub_main(struct mb_info *mbi) {
  outb(0x3fb, 0x80); outb(0x3f8, 1); outb(0x3f9, 0); outb(0x3fb, 3);   /* COM1: 115200 8N1 */
  puts_("pvhstub: placing kernel\r\n");
  if (!(mbi->flags & 8) || mbi->mods_count < 2) die("need 2 modules: vmlinux.pvhb initrd");
  if (!(mbi->flags & 64)) die("no memory map");
  struct mb_mod *m = (struct mb_mod *)mbi->mods_addr;
  const u8 *p = (const u8 *)m[0].start; const u32 *h = (const u32 *)p;
  if (h[0] != 0x42485650) die("module 0 is not a PVHB image");
  u32 entry = h[1], n = h[2]; p += 12;
  for (u32 i = 0; i < n; i++) {             /* place segments: copy data, zero the rest */
    const u32 *r = (const u32 *)p; u32 dst = r[0], nd = r[1], nz = r[2]; p += 12;
    if (dst < 0x1000000 || dst + nd + nz > 0x5000000) die("segment outside reserved area");
    u32 n4 = nd >> 2, n1 = nd & 3;           /* movsl: 4x fewer emulated iterations than movsb */
    __asm__ volatile("rep movsl; mov %3, %%ecx; rep movsb" : "+D"(dst), "+S"(p), "+c"(n4) : "r"(n1) : "memory");
    (void)nz;     /* no zeroing needed: mboot already zeroed our .bss.reserve, which holds the kernel */
  }
  u32 ne = 0;                                /* Multiboot mmap -> PVH memmap (same type codes) */
  for (u32 a = mbi->mmap_addr; a < mbi->mmap_addr + mbi->mmap_length && ne < 128; ) {
    struct mb_mmap *e = (struct mb_mmap *)a;
    mm[ne].addr = e->addr; mm[ne].size = e->len; mm[ne].type = e->type; mm[ne].reserved = 0; ne++;
    a += e->size + 4;
  }
  const char *c = (mbi->flags & 4) ? (const char *)mbi->cmdline : "";
  while (*c && *c != ' ') c++;               /* skip our own file name */
  while (*c == ' ') c++;
  u32 i = 0; while (c[i] && i < sizeof cmdline - 1) { cmdline[i] = c[i]; i++; } cmdline[i] = 0;
  mod.paddr = m[1].start; mod.size = m[1].end - m[1].start;
  si.magic = 0x336ec578; si.version = 1; si.nr_modules = 1;
  si.modlist_paddr = (u32)&mod; si.cmdline_paddr = (u32)cmdline;
  si.memmap_paddr = (u32)mm; si.memmap_entries = ne;
  puts_("pvhstub: kernel loaded, jumping to PVH entry\r\n");
  __asm__ volatile("jmp *%0" :: "a"(entry), "b"(&si));
}
