//! The guest's tasks as the engine follows them: which task is on the
//! CPU (the guest kernel's context-switch ring), the process held once it
//! has started (a debugger's) and the processes followed (the probes'),
//! what is known of each of the held process's threads between their
//! runs (where their kernel stacks are, their segment bases), and a
//! thread's user state.

use std::collections::BTreeMap;

use introspect::guest_events::{self, SavedUserRegs, SwitchRing};
use introspect::gva;
use introspect::instructions::TF;
use kvm_bindings::kvm_regs;
use vm_memory::GuestMemoryMmap;

/// RFLAGS.RF, which the CPU sets and clears on its own around faults.
pub(crate) const RF: u64 = 1 << 16;

/// Which processes the engine holds: a debugger's, or those probes go
/// into.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ProcessSelector {
    /// The process with this pid, from the first program it executes
    /// (or from its first instruction if it already runs one).
    Pid(u32),
    /// The first process that executes a program of this name: its path
    /// ends in it, or its first 15 characters match it (the kernel's
    /// `comm`).
    Name(String),
    /// Every process, from each program it executes (probes given at
    /// replay in a library every process may load).
    Any,
}

impl ProcessSelector {
    /// Whether a program executed from `path` by process `pid` is the
    /// one.
    pub(crate) fn matches(&self, pid: u32, path: &str) -> bool {
        match self {
            ProcessSelector::Pid(p) => *p == pid,
            ProcessSelector::Name(name) => crate::tools::exec::program_named(path, name),
            ProcessSelector::Any => true,
        }
    }
}

/// A process that started a program.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProcessInfo {
    /// Its pid (the guest's thread group id).
    pub pid: u32,
    /// Its page-table root (CR3 without PCID bits).
    pub cr3: u64,
    /// The path of the program it executed, as it named it.
    pub exe: String,
    /// The auxiliary vector the kernel gave the program (`Elf64_auxv_t`
    /// pairs, through `AT_NULL`).
    pub auxv: Vec<u8>,
}

/// What is known of a thread of the process held.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct ThreadInfo {
    /// The top of its kernel stack, where its user registers are saved
    /// while it is in the kernel.
    pub(crate) stack_top: Option<u64>,
    /// FS and GS bases, as it last ran with them.
    pub(crate) fs_base: u64,
    pub(crate) gs_base: u64,
    /// It exited.
    pub(crate) exited: bool,
}

/// The tasks as of the last look.
#[derive(Clone, Default)]
pub(crate) struct Tasks {
    /// The guest kernel's context-switch ring: (address, records read).
    ring: Option<(u64, u64)>,
    /// The task on the CPU: (pid, lwpid).
    pub(crate) current: Option<(u32, u32)>,
    pub(crate) process: Option<ProcessInfo>,
    /// The process's threads by lwpid, in the order first seen.
    pub(crate) threads: BTreeMap<u32, ThreadInfo>,
    /// Program executions that may be the one selected, until their
    /// tasks return to user mode.
    pub(crate) execs: Vec<Exec>,
    /// The processes a collecting tool follows, by pid.
    pub(crate) followed: BTreeMap<u32, Followed>,
    /// Forks by their threads under way, until the parent and the child
    /// have both returned to user mode.
    pub(crate) forks: Vec<Fork>,
}

/// A fork by a thread of a followed process (its memory copied: the
/// child runs the same code at the same addresses).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Fork {
    pub(crate) pid: u32,
    pub(crate) lwpid: u32,
    /// The parent's address space.
    pub(crate) cr3: u64,
    /// Where the system call returns, in both.
    pub(crate) returns_to: u64,
    /// The child's pid, once the parent returned with it.
    pub(crate) child: Option<u32>,
    /// The child has returned to user mode (and is followed).
    pub(crate) child_seen: bool,
}

/// A process a collecting tool follows: its address space and its
/// threads (whether each exited).
#[derive(Clone, Debug, Default)]
pub(crate) struct Followed {
    pub(crate) cr3: u64,
    pub(crate) threads: BTreeMap<u32, bool>,
}

/// A program execution that may be the one selected, until it returns to
/// user mode: (lwpid, path, where the system call returns if it fails).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Exec {
    pub(crate) pid: u32,
    pub(crate) lwpid: u32,
    pub(crate) path: String,
    pub(crate) returns_to: u64,
}

impl Tasks {
    /// The guest kernel announced its ring at `gpa`; what it holds so far
    /// is the past.
    pub(crate) fn ring_announced(&mut self, mem: &GuestMemoryMmap, gpa: u64) {
        self.ring = SwitchRing::from_head(mem, gpa).ok().map(|r| r.position());
    }

    /// Reads the switches logged since the last look: who is on the CPU.
    pub(crate) fn follow_switches(&mut self, mem: &GuestMemoryMmap) {
        let Some((gpa, seen)) = self.ring else {
            return;
        };
        let Ok(mut ring) = SwitchRing::resume(mem, gpa, seen) else {
            return;
        };
        let switches = ring.drain(mem);
        self.ring = Some(ring.position());
        let pid = self.process.as_ref().map(|p| p.pid);
        for [from_pid, from_lwpid, to_pid, to_lwpid] in switches.records {
            for (p, l) in [(from_pid, from_lwpid), (to_pid, to_lwpid)] {
                if Some(p) == pid {
                    self.threads.entry(l).or_default();
                }
                if let Some(f) = self.followed.get_mut(&p) {
                    f.threads.entry(l).or_default();
                }
            }
            self.current = Some((to_pid, to_lwpid));
        }
    }

    /// The current task, if it is a thread of the process.
    pub(crate) fn current_thread(&self) -> Option<u32> {
        let pid = self.process.as_ref()?.pid;
        self.current.filter(|c| c.0 == pid).map(|c| c.1)
    }

    /// A program execution that may be the one selected: it replaces any
    /// the same task started before.
    pub(crate) fn exec_started(&mut self, exec: Exec) {
        self.execs.retain(|e| e.lwpid != exec.lwpid);
        self.execs.push(exec);
    }

    /// The program execution of task (pid, lwpid) under way, taken.
    pub(crate) fn take_exec(&mut self, pid: u32, lwpid: u32) -> Option<Exec> {
        let at = (self.execs.iter()).position(|e| (e.pid, e.lwpid) == (pid, lwpid))?;
        Some(self.execs.remove(at))
    }

    /// The process's threads that have not exited.
    pub(crate) fn live_threads(&self) -> Vec<u32> {
        self.threads
            .iter()
            .filter(|(_, t)| !t.exited)
            .map(|(&l, _)| l)
            .collect()
    }

    /// Notes what a thread of the process on the CPU shows of itself:
    /// its kernel stack (from the guest kernel's variable at
    /// `top_of_stack`) and segment bases.
    pub(crate) fn note_current(
        &mut self,
        mem: &GuestMemoryMmap,
        cr3: u64,
        top_of_stack: Option<u64>,
        (fs_base, gs_base): (u64, u64),
    ) {
        let Some(lwpid) = self.current_thread() else {
            return;
        };
        let top = top_of_stack.and_then(|v| guest_events::kernel_stack_top(mem, cr3, v));
        let info = self.threads.entry(lwpid).or_default();
        if top.is_some() {
            info.stack_top = top;
        }
        (info.fs_base, info.gs_base) = (fs_base, gs_base);
    }

    /// The user registers thread `lwpid` saved on its way into the kernel
    /// (a thread not on the CPU, or on it in the kernel), read through
    /// `cr3`, the address space the vCPU runs in: kernel stacks are mapped
    /// alike in every one, and the process's own may already be freed and
    /// reused when its last thread exits.
    pub(crate) fn saved_regs(
        &self,
        mem: &GuestMemoryMmap,
        cr3: u64,
        lwpid: u32,
    ) -> Option<SavedUserRegs> {
        self.process.as_ref()?;
        let top = self.threads.get(&lwpid)?.stack_top?;
        guest_events::saved_user_regs(mem, cr3, top)
    }
}

/// A thread's user-mode state that names a position in its run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct UserPoint {
    pub lwpid: u32,
    pub rip: u64,
    /// RAX, RCX, RDX, RBX, RSP, RBP, RSI, RDI, R8..R15.
    pub gprs: [u64; 16],
    /// RFLAGS without the trap and resume flags.
    pub rflags: u64,
    /// A digest of the top of its stack and of the return addresses
    /// found by its frame pointers (`stack_digest`): what tells apart two
    /// passes through the same registers between two exits, such as two
    /// calls of one function with the same arguments from different
    /// places.
    pub stack: u64,
}

/// Bytes of the stack above RSP a position's digest covers.
const STACK_DIGEST_BYTES: usize = 256;
/// Frame-pointer links followed for return addresses, at most.
const STACK_DIGEST_FRAMES: usize = 8;
/// The farthest a frame pointer is followed above the stack pointer.
const STACK_DIGEST_SPAN: u64 = 1 << 20;

impl UserPoint {
    /// Thread `lwpid`'s position at the user registers `r`, its stack
    /// read in the address space `cr3` of `mem`.
    pub(crate) fn at(mem: &GuestMemoryMmap, cr3: u64, lwpid: u32, r: &kvm_regs) -> Self {
        UserPoint {
            stack: stack_digest(|at, buf| gva::peek_user(mem, cr3, at, buf), r.rsp, r.rbp),
            ..Self::registers(lwpid, r)
        }
    }

    /// The registers alone (`stack` 0): for telling whether the thread
    /// moved since, where its memory cannot have changed.
    pub(crate) fn registers(lwpid: u32, r: &kvm_regs) -> Self {
        UserPoint {
            lwpid,
            rip: r.rip,
            gprs: [
                r.rax, r.rcx, r.rdx, r.rbx, r.rsp, r.rbp, r.rsi, r.rdi, r.r8, r.r9, r.r10, r.r11,
                r.r12, r.r13, r.r14, r.r15,
            ],
            rflags: r.rflags & !(TF | RF),
            stack: 0,
        }
    }
}

/// FNV-1a over the `STACK_DIGEST_BYTES` above `rsp` (the return address
/// of a function's first instructions, its caller's locals) and the
/// return addresses a chain of frame pointers from `rbp` leads to (a
/// deeper frame's callers), read with `read` (how many bytes it could
/// read). The same memory gives the same digest, whatever the code: a
/// program without frame pointers just has another chain.
fn stack_digest(read: impl Fn(u64, &mut [u8]) -> usize, rsp: u64, rbp: u64) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |bytes: &[u8]| {
        for &b in bytes {
            hash = (hash ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
    };
    let mut top = [0u8; STACK_DIGEST_BYTES];
    let n = read(rsp, &mut top);
    eat(&top[..n]);
    eat(&(n as u64).to_le_bytes());
    let mut frame = rbp;
    for _ in 0..STACK_DIGEST_FRAMES {
        if frame < rsp || frame - rsp > STACK_DIGEST_SPAN || !frame.is_multiple_of(8) {
            break;
        }
        let mut link = [0u8; 16];
        if read(frame, &mut link) < 16 {
            break;
        }
        eat(&link[8..]);
        let next = u64::from_le_bytes(link[..8].try_into().unwrap_or_default());
        if next <= frame {
            break;
        }
        frame = next;
    }
    hash
}

/// A thread's user registers as its program sees them.
#[derive(Clone, Copy, Debug)]
pub struct ThreadRegs {
    pub regs: kvm_regs,
    /// The system call it is in (-1: none).
    pub orig_rax: u64,
    pub fs_base: u64,
    pub gs_base: u64,
    /// Whether it is on the vCPU in user mode (its extended state is the
    /// vCPU's).
    pub running: bool,
}

/// The auxiliary vector's keys of where the program headers are, how
/// many, and the program's entry point.
pub(crate) const AT_PHDR: u64 = 3;
pub(crate) const AT_PHNUM: u64 = 5;
pub(crate) const AT_ENTRY: u64 = 9;

/// The value of `key` in an auxiliary vector (`Elf64_auxv_t` pairs).
pub(crate) fn auxv_value(auxv: &[u8], key: u64) -> Option<u64> {
    auxv.chunks_exact(16).find_map(|pair| {
        let k = u64::from_le_bytes(pair[..8].try_into().ok()?);
        let v = u64::from_le_bytes(pair[8..].try_into().ok()?);
        (k == key).then_some(v)
    })
}

/// The auxiliary vector on a new program's stack, whose RSP points at
/// argc: past argv and envp, pairs of words through AT_NULL (at most
/// 64 pairs).
pub(crate) fn auxv_at_start(mem: &GuestMemoryMmap, cr3: u64, rsp: u64) -> Option<Vec<u8>> {
    let word = |at: u64| -> Option<u64> {
        let mut b = [0u8; 8];
        (gva::peek_user(mem, cr3, at, &mut b) == 8).then(|| u64::from_le_bytes(b))
    };
    let argc = word(rsp)?;
    if argc > 1 << 20 {
        return None;
    }
    // argv[argc] is NULL; envp follows until its NULL.
    let mut at = rsp + 8 * (argc + 2);
    for _ in 0..(1 << 16) {
        if word(at)? == 0 {
            break;
        }
        at += 8;
    }
    auxv_from(&word, at + 8)
}

/// The auxiliary vector whose first pair is at `at`, `word` reading the
/// process's memory: pairs of words through AT_NULL (at most 64 pairs),
/// as bytes.
pub(crate) fn auxv_from(word: &dyn Fn(u64) -> Option<u64>, mut at: u64) -> Option<Vec<u8>> {
    let mut auxv = Vec::new();
    for _ in 0..64 {
        let (key, value) = (word(at)?, word(at + 8)?);
        auxv.extend(key.to_le_bytes());
        auxv.extend(value.to_le_bytes());
        if key == 0 {
            return Some(auxv);
        }
        at += 16;
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_stack_tells_apart_two_calls_with_the_same_registers() {
        // A stack at 0x1000: a return address at RSP, a frame at 0x1040
        // whose saved RBP leads to 0x1180, beyond the bytes above RSP the
        // digest reads, and its return address.
        let stack = |ret: u64, outer: u64| {
            let mut m = vec![0u8; 0x200];
            m[0..8].copy_from_slice(&ret.to_le_bytes());
            m[0x40..0x48].copy_from_slice(&0x1180u64.to_le_bytes());
            m[0x48..0x50].copy_from_slice(&0x4011u64.to_le_bytes());
            m[0x188..0x190].copy_from_slice(&outer.to_le_bytes());
            m
        };
        let digest = |m: &[u8]| {
            stack_digest(
                |at, buf| {
                    let from = (at - 0x1000) as usize;
                    let n = buf.len().min(m.len().saturating_sub(from));
                    buf[..n].copy_from_slice(&m[from..from + n]);
                    n
                },
                0x1000,
                0x1040,
            )
        };
        let first = digest(&stack(0x4001, 0x5001));
        assert_eq!(first, digest(&stack(0x4001, 0x5001)));
        // Called from elsewhere: another return address at RSP.
        assert_ne!(first, digest(&stack(0x4002, 0x5001)));
        // Deeper than the words above RSP: the frame chain's return address.
        assert_ne!(first, digest(&stack(0x4001, 0x5002)));
    }
}
