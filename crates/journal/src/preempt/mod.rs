//! Preempting guest user code under the exit clock, on hosts without a
//! PMU (docs/ARCHITECTURE.md, "Asynchronous points").
//!
//! While recording, a timer interrupt that has waited a whole tick for a
//! deterministic exit is delivered where the guest's user code stands when
//! the VMM kicks the vCPU, and the complete state there is logged
//! ([`state`]). At replay a trampoline ([`trampoline`]) patched over the
//! code at that position ([`site`]) compares the registers on every pass,
//! natively, and exits when they match; the VMM checks the rest of the
//! state and delivers the interrupt there. The trampoline lives in pages
//! the guest kernel maps into every process (`introspect::stub_area`).

use serde::{Deserialize, Serialize};

pub mod guest_code;
pub mod site;
pub mod state;
pub mod trampoline;

use state::UserState;
use trampoline::StubPages;

use introspect::gva::PAGE_SIZE;

/// An asynchronous point as logged: where an interrupt was delivered
/// that no exit of the guest's own brought.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AsyncPoint {
    /// The state to find again.
    pub state: UserState,
    /// Where the process maps the trampoline's code page (its data and
    /// exit pages follow).
    pub stub: u64,
    /// The pages of code around the position, (virtual, guest physical):
    /// the one it is on, and the ones before and after where mapped. The
    /// guest kernel may map them only after the exit before the point
    /// (the task faulted on its code), so replay patches and reads them
    /// by these addresses, not through page tables that may not map them
    /// yet.
    pub code_pages: Vec<(u64, u64)>,
    /// Host nanoseconds the guest ran from the preceding exit to this
    /// point: a bound for replay's search.
    pub run_ns: u64,
}

/// A sample the recording took at a kick of its sampling clock: where
/// the task on the vCPU stood, for replay to collect its thread and stack
/// there. Every replay then takes the same samples, at positions of the
/// recording's time (docs/profiler-comparison.md).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SampleMark {
    /// VM time of the recording at the kick, in nanoseconds.
    pub ns: u64,
    pub at: MarkAt,
}

/// Where a [`SampleMark`]'s task stood.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum MarkAt {
    /// In the guest kernel at `rip`: replay samples the task (its thread
    /// and user stack) where its next search for a position begins, after
    /// the exit or the mark before this one.
    Kernel { rip: u64 },
    /// In user mode at `rip`, at the kernel's boundary (returning from a
    /// system call or a fault, at the probe gate): kernel time, sampled as
    /// for `Kernel`.
    Boundary { rip: u64 },
    /// In user code, at this position. Only its registers count (no
    /// words, pages, digests: an earlier pass with the same registers is
    /// an equally good sample); replay's trampoline stops there as it does
    /// at an asynchronous point.
    User(Box<AsyncPoint>),
}

/// Guest physical addresses of code pages by their virtual page address:
/// a process's page tables, or what a point recorded of them.
pub trait CodePages {
    fn page_gpa(&self, page: u64) -> Option<u64>;

    /// The guest physical address of virtual address `va`.
    fn gpa(&self, va: u64) -> Option<u64> {
        self.page_gpa(va & !(PAGE_SIZE - 1))
            .map(|p| p + (va & (PAGE_SIZE - 1)))
    }
}

impl CodePages for Vec<(u64, u64)> {
    fn page_gpa(&self, page: u64) -> Option<u64> {
        self.iter().find(|p| p.0 == page).map(|p| p.1)
    }
}

impl AsyncPoint {
    /// The trampoline pages in the target's address space.
    pub fn pages(&self) -> StubPages {
        Self::pages_at(self.stub)
    }

    /// The trampoline pages of a mapping whose code page is at `stub`.
    pub fn pages_at(stub: u64) -> StubPages {
        StubPages {
            code: stub,
            data: stub + PAGE_SIZE,
            exit: stub + 2 * PAGE_SIZE,
        }
    }
}
