"""Booting insight's guest under QEMU, for the benchmarks that set insight
beside it (qemu, console, debug, papers).

The guest is the image `insight run` uses: the kernel (`vmlinux`;
`bzImage` is the same kernel with the compressed-kernel loader),
`initramfs.cpio`, plus a small cpio holding /etc/insight/command (the
guest's /init runs it, then powers off). The kernel command line is the
one insight passes; `insight.platform` gives the guest's power-off a way
out (with no power-off method, Linux only halts): the write to insight's
control port goes nowhere under QEMU, /init exits, the kernel panics,
`panic=-1` reboots at once and `-no-reboot` turns that into a clean QEMU
exit, identical in record and replay.

QEMU cannot boot an uncompressed x86-64 vmlinux without a PVH note (this
kernel has none), and on hosts whose KVM interprets guest ring 0 (nested
`kvm_pvm`) the bzImage's XZ decompressor produced no output in 8 minutes.
So QEMU boots the same vmlinux through a multiboot header and a 200-byte
loader written into the ELF file's padding (a copy, in a temporary
directory): it fills Linux's boot_params, enters long mode and jumps to
the kernel's 64-bit entry, as insight's loader does
(`direct_boot_kernel`).
"""
import os
import re
import struct
import subprocess
import tempfile
import threading
import time

from .common import GUEST_CMDLINE, die, need

QEMU = "qemu-system-x86_64"
MEMORY_MIB = 128  # insight's default
# The command line insight passes (crates/vmm/src/image.rs), quiet.
CMDLINE = GUEST_CMDLINE + " insight.platform insight.rdtsc=emulate quiet loglevel=3"
TIMEOUT = 900
# QEMU/KVM: this guest kernel needs the CPU features insight hides too
# (crates/vmm/src/cpuid.rs) where KVM interprets guest ring 0: CMPXCHG16B and
# XSAVE are beyond its emulator (insight completes XSAVE itself; without it
# the kernel uses FXSAVE). The rest is cleared on the command line.
# IA32_ARCH_CAPABILITIES: QEMU 7.2 aborts when KVM refuses to set it.
KVM_CPU = "host,-arch-capabilities,-cx16,-xsave"
# ...and where such a KVM forces XSAVE back into CPUID, `noxsave`; and the
# system-call trap for a KVM that leaves SYSCALL at CPL3 (harmless elsewhere).
KVM_CMDLINE = " noxsave insight.syscall=pf"
# Where QEMU/TCG answers insight's clock MSR with 0 instead of #GP, the
# guest would register a clock that never advances; keep jiffies.
QEMU_CMDLINE = " clocksource=jiffies"


def ensure_qemu():
    need({QEMU: "qemu-system-x86"})


def fail(what, argv, rc, err):
    tail = "\n".join(err.strip().splitlines()[-15:])
    die(f"{what} failed (exit status {rc}):\n  {' '.join(argv)}\n{tail}")


def dir_bytes(path):
    """The size of a file, or of a directory's files; an insight trace's
    boot snapshot (boot.snap) is not counted: it is the image's, a hard
    link to the cached snapshot that every trace of the image shares."""
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs
               if f != "boot.snap")


def run(what, argv, timeout=TIMEOUT, ok=(0,)):
    """Runs argv; returns (wall seconds, [(seconds since start, stdout line)], stderr).
    Stops it at the timeout, or at once when QEMU reports that KVM could not
    execute a guest instruction (QEMU then stops the VM and waits forever)."""
    with tempfile.NamedTemporaryFile() as errf:
        start = time.monotonic()
        p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=errf)

        def watch():
            while p.poll() is None:
                if time.monotonic() - start > timeout:
                    p.kill()
                with open(errf.name, "rb") as f:
                    if b"internal error" in f.read():
                        p.kill()
                time.sleep(0.5)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        lines = [(time.monotonic() - start, raw.decode(errors="replace"))
                 for raw in iter(p.stdout.readline, b"")]
        rc = p.wait()
        wall = time.monotonic() - start
        errf.seek(0)
        err = errf.read().decode(errors="replace")
    if wall >= timeout:
        fail(f"{what} (timed out after {timeout} s)", argv, rc, err + "".join(l for _, l in lines[-10:]))
    if ok is not None and rc not in ok:
        fail(what, argv, rc, err + "".join(l for _, l in lines[-10:]))
    return wall, lines, err


ANSI = re.compile(r"\x1b(\[[0-9;?]*[A-Za-z]|c)")


def console(lines):
    """The guest's console text, without terminal escapes and carriage returns."""
    return [ANSI.sub("", l).replace("\r", "").rstrip("\n") for _, l in lines]


# ---------------------------------------------------------------- the kernel

# The loader written into the vmlinux copy, entered by QEMU's multiboot
# loader in 32-bit protected mode with EBX = multiboot info. Assembled
# (GNU as --64, linked at BASE+0x1040) from:
#   cli; mov $BP,%edi                    BP = BASE+0x8000, prefilled boot_params
#   mods_count? -> ramdisk_image/size   (0x218/0x21c) from the first module
#   mmap -> e820_table (0x2d0), e820_entries (0x1e8)
#   lgdt gdtr; CR4.PAE; CR3 = PML4 (BASE+0xa000, prefilled identity map 4 GiB)
#   EFER.LME; CR0.PG|PE; ljmp $0x10,long
#   .code64 long: ds=es=ss=0x18; mov %edi,%esi; mov $ENTRY,%eax; jmp *%rax
#   gdt: null, null, code64 (0x10), data (0x18); gdtr: .word 31; .long gdt
LOADER = bytes.fromhex(
    "fabf008000008b4b1485c974168b73188b068987180200008b560429c289971c"
    "0200008b4b2c8b73308d97d002000031ed85c9742c8b460489028b4608894204"
    "8b460c8942088b461089420c8b461489421083c214458b0683c00401c629c177"
    "d089e88887e80100000f0115181100000f20e083c8200f22e0b800a000000f22"
    "d8b9800000c00f320d000100000f300f20c00d010000800f22c0eae110000010"
    "00b8180000008ed88ec08ed089feb800000001ffe00f1f000000000000000000"
    "0000000000000000ffff0000009aaf00ffff00000092cf001f00f8100000")
LOADER_RELOCS = (2, 108, 122, 155, 218)  # 32-bit fields holding BASE-relative addresses
LOADER_ENTRY = 175  # 32-bit field: the kernel's entry point


def direct_boot_kernel(vmlinux, bzimage, cmdline, path):
    """A copy of vmlinux that QEMU boots as a multiboot kernel; returns path."""
    with open(vmlinux, "rb") as f:
        data = bytearray(f.read())
    with open(bzimage, "rb") as f:
        setup = f.read(4096)
    if data[:4] != b"\x7fELF" or data[4] != 2 or setup[0x202:0x206] != b"HdrS":
        die("unexpected vmlinux or bzImage format")
    entry, phoff = struct.unpack_from("<QQ", data, 0x18)
    phentsize, phnum = struct.unpack_from("<HH", data, 0x36)
    loads = []
    for i in range(phnum):
        ptype, _, off, _, paddr, filesz, memsz = struct.unpack_from("<IIQQQQQ", data, phoff + i * phentsize)
        if ptype == 1:
            loads.append((off, paddr, filesz, memsz))
    base = loads[0][1] - loads[0][0]
    if (any(p - o != base for o, p, _, _ in loads) or base < 0x100000 or loads[0][0] < 0x10000
            or any(data[0x1000:0x10000]) or entry >= 1 << 32):
        die("vmlinux layout unsuited to the direct-boot loader "
            "(segments not at a constant file/physical offset, or no padding); use --bzimage")
    load_end = max(p + fs for _, p, fs, _ in loads)
    bss_end = max(p + ms for _, p, _, ms in loads)
    magic, flags = 0x1BADB002, 0x00010000
    struct.pack_into("<8I", data, 0x1000, magic, flags, (-(magic + flags)) & 0xffffffff,
                     base + 0x1000, base, load_end, bss_end, base + 0x1040)
    loader = bytearray(LOADER)
    for o in LOADER_RELOCS:
        struct.pack_into("<I", loader, o, struct.unpack_from("<I", loader, o)[0] + base)
    struct.pack_into("<I", loader, LOADER_ENTRY, entry)
    data[0x1040:0x1040 + len(loader)] = loader
    # boot_params: the bzImage's setup header, a loader type, the command line.
    hdr_end = 0x202 + setup[0x201]
    data[0x8000 + 0x1f1:0x8000 + hdr_end] = setup[0x1f1:hdr_end]
    data[0x8000 + 0x210] = 0xff
    struct.pack_into("<I", data, 0x8000 + 0x228, base + 0x9000)
    c = cmdline.encode() + b"\0"
    data[0x9000:0x9000 + len(c)] = c
    # Page tables: identity map of the first 4 GiB in 2 MiB pages.
    struct.pack_into("<Q", data, 0xa000, base + 0xb000 + 3)
    for i in range(4):
        struct.pack_into("<Q", data, 0xb000 + 8 * i, base + 0xc000 + 0x1000 * i + 3)
    for i in range(2048):
        struct.pack_into("<Q", data, 0xc000 + 8 * i, (i << 21) | 0x83)
    with open(path, "wb") as f:
        f.write(data)
    return path


def guest_kernel(guest, cmdline, path):
    """direct_boot_kernel of the guest image in `guest`."""
    return direct_boot_kernel(os.path.join(guest, "vmlinux"), os.path.join(guest, "bzImage"),
                              cmdline, path)


def qemu_argv(kernel, initrd, cmdline, accel):
    """QEMU booting kernel and initrd, its serial port on standard output;
    accel: "kvm", "tcg", or TCG with that -icount."""
    argv = [QEMU, "-m", str(MEMORY_MIB), "-display", "none", "-serial", "stdio", "-monitor", "none",
            "-net", "none", "-no-reboot", "-kernel", kernel, "-initrd", initrd, "-append", cmdline]
    if accel == "kvm":
        return argv + ["-accel", "kvm", "-cpu", KVM_CPU]
    return argv + ["-accel", "tcg", "-cpu", "max"] + (["-icount", accel] if accel != "tcg" else [])


def kvm_refusal(err):
    """What KVM could not execute, from QEMU's report of an internal error."""
    if "internal error" not in err:
        return None
    m = re.search(r"Code=.*?<([0-9a-f]{2})> ((?:[0-9a-f]{2} ){0,3})", err)
    code = (m.group(1) + " " + m.group(2)).strip() if m else "?"
    known = {"cc": "int3 in kernel mode", "0f ae": "xsave/xrstor", "0f c7": "cmpxchg16b/xrstors"}
    name = next((v for k, v in known.items() if code.replace("48 ", "", 1).startswith(k)), "instruction")
    return f"KVM internal error: the guest kernel's {name} (bytes {code}) could not be emulated"


