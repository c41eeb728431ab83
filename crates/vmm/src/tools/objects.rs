//! The objects of a process (its program and the libraries its dynamic
//! linker loaded, each at its load bias) found in its own memory, for
//! the user stacks of samples taken where no probe announced them (the
//! samples at a chaos recording's decisions): the program's path from
//! its `execve`, its auxiliary vector from the top of its first thread's
//! stack, then, as for probes, its program headers and the linker's
//! `r_debug` list.

use std::collections::HashMap;

use introspect::gva;
use journal::preempt::state::CR3_ROOT;
use vm_memory::GuestMemoryMmap;

use super::control::tasks::auxv_from;
use super::events::EventTool;
use super::exec;
use super::probes::loaded::{loaded_libraries, loaded_program};
use crate::vm::VmError;

/// The auxiliary vector's key of the page size.
const AT_PAGESZ: u64 = 6;
/// How far above a thread's stack pointer its auxiliary vector is
/// looked for (the arguments and environment lie between).
const MAX_SCAN: u64 = 256 << 10;

/// What is known of each process's objects.
#[derive(Default)]
pub(crate) struct FoundObjects {
    /// The program each process executed, by pid, and the address space
    /// it did so from (its objects are those of the next one).
    programs: HashMap<u32, (String, u64)>,
    /// Per process: the program's bias once found, and the libraries
    /// announced.
    found: HashMap<u32, (u64, Option<u64>, Vec<String>)>,
}

impl FoundObjects {
    /// At a kernel entry from user mode: process `pid` entering `execve`
    /// names its program.
    pub(crate) fn kernel_entry(
        &mut self,
        mem: &GuestMemoryMmap,
        cr3: u64,
        stack_top_var: u64,
        pid: u32,
    ) {
        if let Some(call) = exec::exec_call(mem, cr3, stack_top_var) {
            self.programs.insert(pid, (call.path, cr3 & CR3_ROOT));
            self.found.remove(&pid);
        }
    }

    /// With a task of process `pid` in user address space `cr3`, its user
    /// stack at `rsp`: announces to `events` what it has not yet of the
    /// process's program and libraries.
    pub(crate) fn look(
        &mut self,
        mem: &GuestMemoryMmap,
        cr3: u64,
        pid: u32,
        rsp: u64,
        events: &mut EventTool,
    ) -> Result<(), VmError> {
        let read = |va: u64, buf: &mut [u8]| gva::peek_user(mem, cr3, va, buf);
        if !self.found.contains_key(&pid) {
            let Some((path, before)) = self.programs.get(&pid) else {
                return Ok(());
            };
            // Still the memory the program was executed from.
            if cr3 & CR3_ROOT == *before {
                return Ok(());
            }
            let Some(auxv) = auxv_above(&read, rsp) else {
                return Ok(());
            };
            let Some((Some(bias), dynamic)) = loaded_program(&read, &auxv) else {
                return Ok(());
            };
            events.executable_seen(pid, bias, path)?;
            self.found.insert(pid, (bias, dynamic, Vec::new()));
        }
        let Some((_, Some(dynamic), libraries)) = self.found.get_mut(&pid) else {
            return Ok(());
        };
        for (path, base) in loaded_libraries(&read, *dynamic) {
            if !path.is_empty() && !libraries.contains(&path) {
                events.executable_seen(pid, base, &path)?;
                libraries.push(path);
            }
        }
        Ok(())
    }
}

/// The auxiliary vector the kernel put at the top of a process's first
/// thread's stack, looked for above `rsp`: from its `AT_PAGESZ` entry
/// (4096) to its end. `None` on a stack without it (another thread's).
fn auxv_above(read: &dyn Fn(u64, &mut [u8]) -> usize, rsp: u64) -> Option<Vec<u8>> {
    let word = |at: u64| {
        let mut b = [0u8; 8];
        (read(at, &mut b) == 8).then(|| u64::from_le_bytes(b))
    };
    let mut at = rsp & !7;
    let end = rsp.saturating_add(MAX_SCAN);
    while at < end {
        if word(at)? == AT_PAGESZ && word(at + 8)? == 4096 {
            return auxv_from(&word, at);
        }
        at += 8;
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_auxiliary_vector_is_found_above_the_stack_pointer() {
        // A stack: locals, argc, argv, NULL, envp, NULL, then the vector.
        let words: Vec<u64> = vec![
            7, 7, 1, 0x1000, 0, 0x2000, 0, 33, 0x5000, 6, 4096, 3, 0x40, 0, 0,
        ];
        let base = 0x7000;
        let read = |va: u64, buf: &mut [u8]| {
            let i = ((va - base) / 8) as usize;
            match words.get(i) {
                Some(w) => {
                    buf.copy_from_slice(&w.to_le_bytes());
                    8
                }
                None => 0,
            }
        };
        let auxv = auxv_above(&read, base + 8).unwrap();
        assert_eq!(auxv.len(), 3 * 16);
        assert_eq!(auxv[16..24], 3u64.to_le_bytes());
        // A stack without one ends where memory does.
        let none = |_: u64, _: &mut [u8]| 0;
        assert!(auxv_above(&none, base).is_none());
    }
}
