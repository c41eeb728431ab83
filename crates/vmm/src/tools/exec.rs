//! A program's execution, seen at the guest kernel's deterministic point
//! at every kernel entry from user mode: a task entering `execve` names
//! the program it is about to run. The debugger and the tracing of a
//! process by name both start from it.

use introspect::{guest_events, gva};
use journal::preempt::state::CR3_ROOT;
use journal::Entry;
use vm_memory::GuestMemoryMmap;

/// The system calls that execute a program.
const EXECVE: u64 = 59;
const EXECVEAT: u64 = 322;
/// The system calls that make a task: a process of its own memory unless
/// `CLONE_VM` (`clone`'s first argument, `clone3`'s first field).
const CLONE: u64 = 56;
const FORK: u64 = 57;
const CLONE3: u64 = 435;
const CLONE_VM: u64 = 0x100;
/// The control port message of the guest kernel's deterministic point at
/// every kernel entry from user mode (`INSIGHT_CTL_SYNC`).
const SYNC_POINT: u32 = 0x0500_0000;
const CONTROL_PORT: u16 = 0x0f00;

/// A task entering `execve`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct ExecCall {
    /// The path it names, as the program gave it.
    pub(crate) path: String,
    /// Where the system call returns if it fails (the new program starts
    /// elsewhere).
    pub(crate) returns_to: u64,
}

/// Whether `entry` is the guest kernel's deterministic point at a kernel
/// entry from user mode.
pub(crate) fn is_kernel_entry(entry: &Entry) -> bool {
    matches!(
        entry,
        Entry::Out {
            port: CONTROL_PORT,
            value: SYNC_POINT,
            ..
        }
    )
}

/// At a kernel entry from user mode (`is_kernel_entry`), in the address
/// space `cr3`: the program the current task is executing, if it entered
/// `execve` or `execveat`. `stack_top_var` is the guest kernel's variable
/// with the top of the current task's kernel stack.
pub(crate) fn exec_call(mem: &GuestMemoryMmap, cr3: u64, stack_top_var: u64) -> Option<ExecCall> {
    let top = guest_events::kernel_stack_top(mem, cr3, stack_top_var)?;
    let saved = guest_events::saved_user_regs(mem, cr3, top)?;
    let path_at = match saved.orig_rax {
        EXECVE => saved.regs.rdi,
        EXECVEAT => saved.regs.rsi,
        _ => return None,
    };
    Some(ExecCall {
        path: user_string(mem, cr3 & CR3_ROOT, path_at, 4096)?,
        returns_to: saved.regs.rip,
    })
}

/// At a kernel entry from user mode (`is_kernel_entry`), in the address
/// space `cr3`: whether the current task entered a system call that makes
/// a process with memory of its own (`fork`, `clone` or `clone3` without
/// `CLONE_VM`; a `vfork` child shares its parent's until it executes a
/// program); then where the call returns, in the parent and the child.
pub(crate) fn fork_call(mem: &GuestMemoryMmap, cr3: u64, stack_top_var: u64) -> Option<u64> {
    let top = guest_events::kernel_stack_top(mem, cr3, stack_top_var)?;
    let saved = guest_events::saved_user_regs(mem, cr3, top)?;
    let flags = match saved.orig_rax {
        FORK => 0,
        CLONE => saved.regs.rdi,
        CLONE3 => {
            let pa = gva::translate_user(mem, cr3 & CR3_ROOT, saved.regs.rdi).ok()?;
            vm_memory::Bytes::read_obj::<u64>(mem, vm_memory::GuestAddress(pa)).ok()?
        }
        _ => return None,
    };
    (flags & CLONE_VM == 0).then_some(saved.regs.rip)
}

/// Reads a NUL-terminated string of at most `max` bytes at user address
/// `at` of the address space `cr3`.
pub(crate) fn user_string(mem: &GuestMemoryMmap, cr3: u64, at: u64, max: usize) -> Option<String> {
    let mut out = Vec::new();
    let mut va = at;
    while out.len() < max {
        let mut chunk = [0u8; 64];
        let n = (0x1000 - (va & 0xfff)).min(64) as usize;
        let pa = gva::translate_user(mem, cr3, va).ok()?;
        vm_memory::Bytes::read_slice(mem, &mut chunk[..n], vm_memory::GuestAddress(pa)).ok()?;
        if let Some(end) = chunk[..n].iter().position(|&b| b == 0) {
            out.extend_from_slice(&chunk[..end]);
            return String::from_utf8(out).ok();
        }
        out.extend_from_slice(&chunk[..n]);
        va += n as u64;
    }
    None
}

/// Whether a program executed from `path` is the one `name` names: its
/// file name is `name`, or both begin with the same 15 characters (what
/// the kernel keeps of a name, `comm`).
pub(crate) fn program_named(path: &str, name: &str) -> bool {
    let base = path.rsplit('/').next().unwrap_or(path);
    let short = |s: &str| s.chars().take(15).collect::<String>();
    base == name || short(base) == short(name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn programs_are_named_by_file_name_or_comm() {
        assert!(program_named("/usr/bin/mem_access", "mem_access"));
        assert!(program_named("./mem_access", "mem_access"));
        assert!(!program_named("/usr/bin/mem_access2", "mem_access"));
        // The kernel's 15 characters of a longer name.
        assert!(program_named(
            "/opt/a_very_long_program_name",
            "a_very_long_pro"
        ));
        assert!(!program_named("/bin/sh", "bash"));
    }
}
