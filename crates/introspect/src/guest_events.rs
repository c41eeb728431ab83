//! Reading a raised event's buffer out of guest memory (docs/events.md).
//!
//! The buffer address comes from the guest: it is translated through the
//! guest's page tables without touching them (replay must not change
//! guest memory that recording did not), and an event may not cross the
//! page it starts in.

use events::abi::{declared_size, HEADER_LEN, PAGE};
use events::capture::BufferError;
use kvm_bindings::kvm_regs;
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

use crate::gva;

/// User addresses end here on x86-64 with 4-level paging.
const USER_END: u64 = 0x0000_8000_0000_0000;
/// And the kernel's start here.
pub const KERNEL_START: u64 = 0xffff_8000_0000_0000;
/// Where a user `syscall` lands on hosts that leave it in user mode
/// (`insight.syscall=pf`, the guest's `INSIGHT_SYSCALL_TRAP_ADDR`): an
/// unmapped page, whose instruction-fetch fault the guest kernel turns
/// into the system call. RCX holds the return address meanwhile.
pub const SYSCALL_TRAP_RIP: u64 = 0x1000;

/// The bytes of the event at `gva` (page tables at `cr3`): its declared
/// size, or as much as the page holds when the size is out of bounds (the
/// parser then reports it).
pub fn read_buffer(
    mem: &GuestMemoryMmap,
    cr3: u64,
    gva: u64,
    from_probe: bool,
) -> Result<Vec<u8>, BufferError> {
    if from_probe && gva >= USER_END {
        return Err(BufferError::NotUser(gva));
    }
    let room = PAGE - (gva as usize & (PAGE - 1));
    let pa = gva::translate(mem, cr3, gva).map_err(|_| BufferError::Unmapped(gva))?;
    let mut head = vec![0u8; room.min(HEADER_LEN)];
    mem.read_slice(&mut head, GuestAddress(pa))
        .map_err(|_| BufferError::Unmapped(gva))?;
    let size = declared_size(&head).map(|s| s as usize);
    let len = match size {
        Some(s) if s > room && s <= PAGE => {
            return Err(BufferError::CrossesPage {
                gva,
                size: s as u64,
            })
        }
        None if room < HEADER_LEN => {
            return Err(BufferError::CrossesPage {
                gva,
                size: HEADER_LEN as u64,
            })
        }
        Some(s) if s >= HEADER_LEN && s <= room => s,
        _ => room,
    };
    let mut buf = vec![0u8; len];
    mem.read_slice(&mut buf, GuestAddress(pa))
        .map_err(|_| BufferError::Unmapped(gva))?;
    Ok(buf)
}

/// The return addresses of a user stack, innermost first, by following
/// frame pointers from `rbp`: at most `max`, stopping at the first frame
/// that is unmapped, misaligned, not above the previous one, or outside
/// user memory. Reads only, like [`read_buffer`].
pub fn frame_chain(mem: &GuestMemoryMmap, cr3: u64, rbp: u64, max: usize) -> Vec<u64> {
    let read = |va: u64| -> Option<u64> {
        let pa = gva::translate(mem, cr3, va).ok()?;
        mem.read_obj(GuestAddress(pa)).ok()
    };
    let mut frames = Vec::new();
    let mut fp = rbp;
    while frames.len() < max {
        if fp == 0 || !fp.is_multiple_of(8) || fp >= USER_END - 16 {
            break;
        }
        let (Some(next), Some(ret)) = (read(fp), read(fp + 8)) else {
            break;
        };
        if ret == 0 {
            break;
        }
        frames.push(ret);
        if next <= fp {
            break;
        }
        fp = next;
    }
    frames
}

/// A user stack in guest memory, read through the guest's page tables
/// (for `unwind`); nothing at or above the user half is read.
pub struct UserMemory<'a> {
    pub mem: &'a GuestMemoryMmap,
    pub cr3: u64,
}

impl unwind::ProcessMemory for UserMemory<'_> {
    fn read_u64(&mut self, addr: u64) -> Option<u64> {
        if addr >= USER_END - 8 {
            return None;
        }
        let mut word = [0u8; 8];
        gva::read_virt(self.mem, self.cr3, addr, &mut word).ok()?;
        Some(u64::from_le_bytes(word))
    }
}

/// `struct pt_regs` of x86-64 Linux: where a task entering the kernel
/// from user mode leaves its registers, at the top of its kernel stack.
const PT_REGS_SIZE: u64 = 21 * 8;
const PT_REGS_RBP: usize = 4;
const PT_REGS_R11: usize = 6;
const PT_REGS_RIP: usize = 16;
const PT_REGS_CS: usize = 17;
const PT_REGS_FLAGS: usize = 18;
const PT_REGS_RSP: usize = 19;

/// Where the current task's kernel entry saved its user registers
/// (`pt_regs`, below the top of its kernel stack; `top_of_stack` is the
/// guest virtual address of the kernel variable holding that top,
/// `cpu_current_top_of_stack` of a uniprocessor kernel), and their bytes.
/// `None` unless they look like user mode's (a kernel thread, a task
/// between switches, or another kernel).
fn saved_user_frame(
    mem: &GuestMemoryMmap,
    cr3: u64,
    top_of_stack: u64,
) -> Option<(u64, [u8; PT_REGS_SIZE as usize])> {
    let mut word = [0u8; 8];
    gva::read_virt(mem, cr3, top_of_stack, &mut word).ok()?;
    let top = u64::from_le_bytes(word);
    if top < USER_END || !top.is_multiple_of(8) {
        return None;
    }
    let at = top.checked_sub(PT_REGS_SIZE)?;
    let mut frame = [0u8; PT_REGS_SIZE as usize];
    gva::read_virt(mem, cr3, at, &mut frame).ok()?;
    let reg = |i: usize| saved_reg(&frame, i);
    let (rip, rsp, cs) = (reg(PT_REGS_RIP), reg(PT_REGS_RSP), reg(PT_REGS_CS));
    (cs & 3 == 3 && rip < USER_END && rsp < USER_END).then_some((at, frame))
}

fn saved_reg(frame: &[u8; PT_REGS_SIZE as usize], index: usize) -> u64 {
    u64::from_le_bytes(
        frame[index * 8..index * 8 + 8]
            .try_into()
            .unwrap_or_default(),
    )
}

/// The top of the current task's kernel stack, from the guest kernel
/// variable at `top_of_stack` (`cpu_current_top_of_stack`).
pub fn kernel_stack_top(mem: &GuestMemoryMmap, cr3: u64, top_of_stack: u64) -> Option<u64> {
    let mut word = [0u8; 8];
    gva::peek_virt(mem, cr3, top_of_stack, &mut word).ok()?;
    let top = u64::from_le_bytes(word);
    (top >= USER_END && top.is_multiple_of(8)).then_some(top)
}

/// What a task's last kernel entry from user mode saved of its user
/// registers (`pt_regs`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SavedUserRegs {
    pub regs: kvm_regs,
    /// The system call number of a system call, the error code of an
    /// exception, -1 otherwise.
    pub orig_rax: u64,
    pub cs: u64,
    pub ss: u64,
}

/// The user registers a task saved below `top`, the top of its kernel
/// stack (it need not be the current task); `None` unless they look like
/// user mode's.
pub fn saved_user_regs(mem: &GuestMemoryMmap, cr3: u64, top: u64) -> Option<SavedUserRegs> {
    let at = top.checked_sub(PT_REGS_SIZE)?;
    let mut frame = [0u8; PT_REGS_SIZE as usize];
    gva::peek_virt(mem, cr3, at, &mut frame).ok()?;
    let r = |i: usize| saved_reg(&frame, i);
    let regs = kvm_regs {
        r15: r(0),
        r14: r(1),
        r13: r(2),
        r12: r(3),
        rbp: r(4),
        rbx: r(5),
        r11: r(6),
        r10: r(7),
        r9: r(8),
        r8: r(9),
        rax: r(10),
        rcx: r(11),
        rdx: r(12),
        rsi: r(13),
        rdi: r(14),
        rip: r(PT_REGS_RIP),
        rflags: r(PT_REGS_FLAGS),
        rsp: r(PT_REGS_RSP),
    };
    let cs = r(PT_REGS_CS);
    (cs & 3 == 3 && regs.rip < USER_END && regs.rsp < USER_END).then_some(SavedUserRegs {
        regs,
        orig_rax: r(15),
        cs,
        ss: r(20),
    })
}

/// The user registers (RIP, RSP, RBP) of the task in the guest kernel, as
/// its kernel entry saved them (see [`saved_user_frame`]).
pub fn user_regs_in_kernel(mem: &GuestMemoryMmap, cr3: u64, top_of_stack: u64) -> Option<[u64; 3]> {
    let (_, frame) = saved_user_frame(mem, cr3, top_of_stack)?;
    Some([PT_REGS_RIP, PT_REGS_RSP, PT_REGS_RBP].map(|i| saved_reg(&frame, i)))
}

/// Whether the user registers `regs` are all (RIP, RSP and the general
/// registers) as the current task's last kernel entry saved them (see
/// [`saved_user_frame`]): the task has not run an instruction since the
/// kernel returned to it.
pub fn user_regs_as_saved(
    mem: &GuestMemoryMmap,
    cr3: u64,
    top_of_stack: u64,
    regs: &kvm_regs,
) -> bool {
    let Some((_, frame)) = saved_user_frame(mem, cr3, top_of_stack) else {
        return false;
    };
    let gprs_saved = pt_regs_gprs(regs)
        .into_iter()
        .enumerate()
        .all(|(i, value)| saved_reg(&frame, i) == value);
    gprs_saved
        && saved_reg(&frame, PT_REGS_RIP) == regs.rip
        && saved_reg(&frame, PT_REGS_RSP) == regs.rsp
}

/// The general registers of `regs` in `struct pt_regs` order (its first
/// 15 words: R15 down to RDI; RSP comes later, with RIP).
fn pt_regs_gprs(r: &kvm_regs) -> [u64; 15] {
    [
        r.r15, r.r14, r.r13, r.r12, r.rbp, r.rbx, r.r11, r.r10, r.r9, r.r8, r.rax, r.rcx, r.rdx,
        r.rsi, r.rdi,
    ]
}

/// A user register the guest kernel saved on entry (`pt_regs`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SavedReg {
    /// RFLAGS, which the return to user mode loads.
    Flags,
    /// R11, which the program gets back from a system call.
    R11,
}

/// Sets the bits `set` and clears the bits `clear` of `reg` among the
/// user registers the current task's kernel entry saved (see
/// [`saved_user_frame`]), if it saved some and, with `returns_to`, they
/// return there; whether it changed them.
pub fn update_saved_user_reg(
    mem: &GuestMemoryMmap,
    cr3: u64,
    top_of_stack: u64,
    reg: SavedReg,
    (set, clear): (u64, u64),
    returns_to: Option<u64>,
) -> bool {
    let Some((at, frame)) = saved_user_frame(mem, cr3, top_of_stack) else {
        return false;
    };
    if returns_to.is_some_and(|rip| rip != saved_reg(&frame, PT_REGS_RIP)) {
        return false;
    }
    let index = match reg {
        SavedReg::Flags => PT_REGS_FLAGS,
        SavedReg::R11 => PT_REGS_R11,
    };
    let value = (saved_reg(&frame, index) | set) & !clear;
    gva::write_virt(mem, cr3, at + index as u64 * 8, &value.to_le_bytes()).is_ok()
}

/// The guest kernel's context-switch ring (docs/events.md): a header
/// (magic "INSW", size, head = records ever written) and `size` records
/// of (from pid, from lwpid, to pid, to lwpid), all u32 but `head`.
pub struct SwitchRing {
    gpa: u64,
    /// Records read so far.
    seen: u64,
}

const RING_MAGIC: u32 = 0x5753_4e49;
const RING_HEADER: u64 = 16;
const RING_MAX: u32 = 1 << 16;

/// New records of a drain, and how many the ring overwrote unread.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Switches {
    pub records: Vec<[u32; 4]>,
    pub lost: u64,
}

impl SwitchRing {
    /// Where the ring is and how many records were read (a checkpoint).
    pub fn position(&self) -> (u64, u64) {
        (self.gpa, self.seen)
    }

    /// The ring at `gpa` with `seen` records read, checked as by `new`.
    pub fn resume(mem: &GuestMemoryMmap, gpa: u64, seen: u64) -> Result<Self, String> {
        let mut ring = Self::new(mem, gpa)?;
        ring.seen = seen;
        Ok(ring)
    }

    /// The ring at `gpa` with every record written so far taken as read
    /// (a VM restored from a boot snapshot: the boot's switches are not
    /// part of the recording).
    pub fn from_head(mem: &GuestMemoryMmap, gpa: u64) -> Result<Self, String> {
        let mut ring = Self::new(mem, gpa)?;
        ring.seen = mem.read_obj(GuestAddress(gpa + 8)).unwrap_or(0);
        Ok(ring)
    }

    /// The ring at guest physical `gpa`, checked: an error says why it
    /// cannot be used.
    pub fn new(mem: &GuestMemoryMmap, gpa: u64) -> Result<Self, String> {
        let magic: u32 = mem
            .read_obj(GuestAddress(gpa))
            .map_err(|_| format!("ring at {gpa:#x} is outside guest memory"))?;
        let size: u32 = mem
            .read_obj(GuestAddress(gpa + 4))
            .map_err(|_| format!("ring at {gpa:#x} is outside guest memory"))?;
        if magic != RING_MAGIC {
            return Err(format!("ring at {gpa:#x} has magic {magic:#x}"));
        }
        if !size.is_power_of_two() || size > RING_MAX {
            return Err(format!("ring at {gpa:#x} has {size} records"));
        }
        let end = gpa + RING_HEADER + u64::from(size) * 16 - 1;
        if mem.read_obj::<u8>(GuestAddress(end)).is_err() {
            return Err(format!("ring at {gpa:#x} ends outside guest memory"));
        }
        Ok(SwitchRing { gpa, seen: 0 })
    }

    /// The records written since the last drain, oldest first.
    pub fn drain(&mut self, mem: &GuestMemoryMmap) -> Switches {
        self.drain_to(mem, u64::MAX)
    }

    /// The records written since the last drain and before record number
    /// `until` (counted from the ring's start), oldest first.
    pub fn drain_to(&mut self, mem: &GuestMemoryMmap, until: u64) -> Switches {
        let mut out = Switches::default();
        let read_u32 = |at: u64| mem.read_obj::<u32>(GuestAddress(at)).unwrap_or(0);
        let size = u64::from(read_u32(self.gpa + 4));
        let head: u64 = mem
            .read_obj(GuestAddress(self.gpa + 8))
            .unwrap_or(self.seen);
        if size == 0 || !size.is_power_of_two() || size > u64::from(RING_MAX) || head < self.seen {
            // The guest broke its own ring: start over from its head.
            self.seen = head;
            return out;
        }
        if head - self.seen > size {
            out.lost = head - self.seen - size;
            self.seen = head - size;
        }
        let end = head.min(until);
        while self.seen < end {
            let at = self.gpa + RING_HEADER + (self.seen & (size - 1)) * 16;
            out.records.push([
                read_u32(at),
                read_u32(at + 4),
                read_u32(at + 8),
                read_u32(at + 12),
            ]);
            self.seen += 1;
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use events::abi::{encode, lock_payload, Kind};

    const CR3: u64 = 0x1000;

    /// Guest memory whose first 2 MiB are identity-mapped by one huge page,
    /// and page tables at 0x1000.. (PML4 0x1000, PDPT 0x2000, PD 0x3000).
    fn memory() -> GuestMemoryMmap {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 4 << 20)]).unwrap();
        mem.write_obj(0x2003u64, GuestAddress(0x1000)).unwrap();
        mem.write_obj(0x3003u64, GuestAddress(0x2000)).unwrap();
        mem.write_obj(0x83u64, GuestAddress(0x3000)).unwrap();
        mem
    }

    /// Maps the 2 MiB page holding kernel address `va` to physical
    /// 0x20_0000 (PDPT at 0x4000, PD at 0x5000).
    fn map_kernel_page(mem: &GuestMemoryMmap, va: u64) {
        let index = |shift: u32| (va >> shift) & 0x1ff;
        mem.write_obj(0x4003u64, GuestAddress(CR3 + 8 * index(39)))
            .unwrap();
        mem.write_obj(0x5003u64, GuestAddress(0x4000 + 8 * index(30)))
            .unwrap();
        mem.write_obj(0x20_0083u64, GuestAddress(0x5000 + 8 * index(21)))
            .unwrap();
    }

    /// The kernel variable holding the top of the current kernel stack.
    const TOP_OF_STACK: u64 = 0xffff_ffff_81a3_a030;

    /// Where kernel address `va`, in the page `kernel_stack` maps, is.
    fn kernel_phys(va: u64) -> GuestAddress {
        GuestAddress(0x20_0000 + (va - (TOP_OF_STACK & !0x1f_ffff)))
    }

    /// Maps `TOP_OF_STACK`'s page, with a kernel stack in it whose top the
    /// variable holds; writes word `i` of the `pt_regs` below that top.
    fn kernel_stack(mem: &GuestMemoryMmap) -> impl Fn(usize, u64) + '_ {
        map_kernel_page(mem, TOP_OF_STACK);
        let top = (TOP_OF_STACK & !0x1f_ffff) + 0x10_0000;
        mem.write_obj(top, kernel_phys(TOP_OF_STACK)).unwrap();
        let frame = top - PT_REGS_SIZE;
        move |i, v| mem.write_obj(v, kernel_phys(frame + 8 * i as u64)).unwrap()
    }

    #[test]
    fn user_registers_come_from_the_top_of_the_kernel_stack() {
        let mem = memory();
        let var = TOP_OF_STACK;
        let put = kernel_stack(&mem);
        put(PT_REGS_RBP, 0x7ffd_0100);
        put(PT_REGS_RIP, 0x40_1234);
        put(PT_REGS_CS, 0x33);
        put(PT_REGS_RSP, 0x7ffd_0000);
        assert_eq!(
            user_regs_in_kernel(&mem, CR3, var),
            Some([0x40_1234, 0x7ffd_0000, 0x7ffd_0100])
        );
        // Registers saved from kernel mode, or a user RIP that is not one.
        put(PT_REGS_CS, 0x10);
        assert_eq!(user_regs_in_kernel(&mem, CR3, var), None);
        put(PT_REGS_CS, 0x33);
        put(PT_REGS_RIP, 0xffff_ffff_8100_0000);
        assert_eq!(user_regs_in_kernel(&mem, CR3, var), None);
        // A variable that is not mapped, or that holds no kernel address.
        assert_eq!(user_regs_in_kernel(&mem, CR3, var + (4 << 20)), None);
        mem.write_obj(0x7000u64, kernel_phys(var)).unwrap();
        assert_eq!(user_regs_in_kernel(&mem, CR3, var), None);
    }

    #[test]
    fn a_task_not_moved_since_its_kernel_returned_has_the_saved_registers() {
        let mem = memory();
        let var = TOP_OF_STACK;
        let put = kernel_stack(&mem);
        // A page fault at a store in a loop: R13 is the loop's pointer.
        let mut regs = kvm_regs {
            rip: 0x40_1172,
            rsp: 0x7ffd_0000,
            rbp: 0x7ffd_0100,
            r13: 0x7f00_3000,
            rax: 7,
            ..Default::default()
        };
        let save = |r: &kvm_regs| {
            for (i, v) in pt_regs_gprs(r).into_iter().enumerate() {
                put(i, v);
            }
            put(PT_REGS_RIP, r.rip);
            put(PT_REGS_CS, 0x33);
            put(PT_REGS_FLAGS, 0x246);
            put(PT_REGS_RSP, r.rsp);
        };
        save(&regs);
        assert!(user_regs_as_saved(&mem, CR3, var, &regs));
        // The same store a loop iteration later: one register moved on.
        regs.r13 -= 8;
        assert!(!user_regs_as_saved(&mem, CR3, var, &regs));
        regs.r13 += 8;
        regs.rip += 4;
        assert!(!user_regs_as_saved(&mem, CR3, var, &regs));
        regs.rip -= 4;
        // Saved from kernel mode: no user registers to compare with.
        put(PT_REGS_CS, 0x10);
        assert!(!user_regs_as_saved(&mem, CR3, var, &regs));
    }

    #[test]
    fn reads_exactly_the_declared_event() {
        let mem = memory();
        let ev = encode(Kind::Lock as u16, 1, 2, "a", &lock_payload(1, 2, 3));
        mem.write_slice(&ev, GuestAddress(0x10_0000)).unwrap();
        let got = read_buffer(&mem, CR3, 0x10_0000, true).unwrap();
        assert_eq!(got, ev);
    }

    #[test]
    fn rejects_what_it_cannot_read_safely() {
        let mem = memory();
        assert_eq!(
            read_buffer(&mem, CR3, 0x40_0000, true),
            Err(BufferError::Unmapped(0x40_0000))
        );
        assert_eq!(
            read_buffer(&mem, CR3, 0xffff_8000_0000_0000, true),
            Err(BufferError::NotUser(0xffff_8000_0000_0000))
        );
        // An event whose declared size runs past its page.
        let ev = encode(Kind::Lock as u16, 1, 2, "a", &lock_payload(1, 2, 3));
        let at = 0x10_0000 + PAGE as u64 - 60;
        mem.write_slice(&ev[..60], GuestAddress(at)).unwrap();
        assert_eq!(
            read_buffer(&mem, CR3, at, true),
            Err(BufferError::CrossesPage {
                gva: at,
                size: ev.len() as u64
            })
        );
        // Not even the header fits.
        assert!(matches!(
            read_buffer(&mem, CR3, 0x10_0000 + PAGE as u64 - 8, true),
            Err(BufferError::CrossesPage { .. })
        ));
        // A size beyond any page: the page's bytes, for the parser to refuse.
        let mut big = ev.clone();
        big[8..12].copy_from_slice(&100_000u32.to_le_bytes());
        mem.write_slice(&big, GuestAddress(0x10_2000)).unwrap();
        assert_eq!(read_buffer(&mem, CR3, 0x10_2000, true).unwrap().len(), PAGE);
    }

    fn write_ring(mem: &GuestMemoryMmap, at: u64, size: u32, records: &[[u32; 4]]) {
        mem.write_obj(RING_MAGIC, GuestAddress(at)).unwrap();
        mem.write_obj(size, GuestAddress(at + 4)).unwrap();
        for (i, r) in records.iter().enumerate() {
            let slot = at + RING_HEADER + (i as u64 % u64::from(size)) * 16;
            for (j, v) in r.iter().enumerate() {
                mem.write_obj(*v, GuestAddress(slot + 4 * j as u64))
                    .unwrap();
            }
        }
        mem.write_obj(records.len() as u64, GuestAddress(at + 8))
            .unwrap();
    }

    #[test]
    fn the_switch_ring_yields_each_record_once_and_counts_overruns() {
        let mem = memory();
        let at = 0x20_0000;
        let recs: Vec<[u32; 4]> = (0..6).map(|i| [1, i, 1, i + 1]).collect();
        write_ring(&mem, at, 4, &recs[..3]);
        let mut ring = SwitchRing::new(&mem, at).unwrap();
        assert_eq!(ring.drain(&mem).records, recs[..3]);
        assert!(ring.drain(&mem).records.is_empty());
        // Three more, then five more: the ring holds four, one is lost.
        write_ring(&mem, at, 4, &recs);
        assert_eq!(ring.drain(&mem).records, recs[3..]);
        let many: Vec<[u32; 4]> = (0..11).map(|i| [2, i, 2, i + 1]).collect();
        write_ring(&mem, at, 4, &many);
        let d = ring.drain(&mem);
        assert_eq!((d.lost, d.records.len()), (1, 4));
        assert_eq!(d.records[3], [2, 10, 2, 11]);
        // A head that goes backwards is not trusted.
        mem.write_obj(2u64, GuestAddress(at + 8)).unwrap();
        assert_eq!(ring.drain(&mem), Switches::default());
    }

    #[test]
    fn a_bad_ring_is_refused() {
        let mem = memory();
        assert!(SwitchRing::new(&mem, 0x20_0000).is_err(), "no magic");
        write_ring(&mem, 0x20_0000, 3, &[]);
        assert!(SwitchRing::new(&mem, 0x20_0000).is_err(), "size 3");
        write_ring(&mem, (4 << 20) - 64, 1024, &[]);
        assert!(
            SwitchRing::new(&mem, (4 << 20) - 64).is_err(),
            "past the end"
        );
        assert!(SwitchRing::new(&mem, u64::MAX - 2).is_err());
    }

    #[test]
    fn follows_frame_pointers_until_they_stop_making_sense() {
        let mem = memory();
        // Three frames at 0x11000 -> 0x11100 -> 0x11200 -> 0 (end).
        for (fp, next, ret) in [
            (0x11000u64, 0x11100u64, 0x401000u64),
            (0x11100, 0x11200, 0x402000),
            (0x11200, 0, 0x403000),
        ] {
            mem.write_obj(next, GuestAddress(fp)).unwrap();
            mem.write_obj(ret, GuestAddress(fp + 8)).unwrap();
        }
        assert_eq!(
            frame_chain(&mem, CR3, 0x11000, 32),
            [0x401000, 0x402000, 0x403000]
        );
        assert_eq!(frame_chain(&mem, CR3, 0x11000, 2).len(), 2);
        // A loop, a misaligned and an unmapped frame pointer.
        mem.write_obj(0x11000u64, GuestAddress(0x11200)).unwrap();
        assert_eq!(frame_chain(&mem, CR3, 0x11000, 32).len(), 3);
        assert!(frame_chain(&mem, CR3, 0x11003, 32).is_empty());
        assert!(frame_chain(&mem, CR3, 0x40_0000, 32).is_empty());
    }
}
