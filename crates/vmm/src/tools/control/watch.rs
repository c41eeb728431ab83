//! Write watchpoints. This host's KVM delivers no debug-register trap in
//! user mode, so the pages the watched bytes lie in are made read only in
//! KVM's memory slots: every write to them — by the program, by another
//! process sharing the page, by the kernel on the program's behalf —
//! exits to the VMM as an MMIO write, which the VMM performs and then
//! compares the watched bytes with what they were.

use vm_memory::{Bytes, GuestAddress};

use crate::vm::{Machine, VmError};
use introspect::gva::{self, peek_user, PAGE_SIZE};

/// The most pages watched at once (each costs two memory slots).
pub(crate) const MAX_PAGES: usize = 64;

/// Watched bytes of the process, and the value they had when last looked
/// at (empty while unreadable).
struct Watch {
    addr: u64,
    len: u64,
    value: Vec<u8>,
}

/// The write watchpoints of the process held and the memory layout
/// that traps writes to them.
#[derive(Default)]
pub(crate) struct Watches {
    watches: Vec<Watch>,
    /// The guest physical pages read only now, sorted.
    protected: Vec<u64>,
    /// How many memory slots guest RAM is in now (0: the VM's own
    /// layout, never changed).
    slots: u32,
    /// A watched page was not mapped at the last `sync`.
    pub(crate) missing: bool,
    /// The supervisor wants the watched pages protected (not while a replay
    /// that records no hits passes); set before each `sync`.
    pub(crate) armed: bool,
}

impl Watches {
    pub(crate) fn add(&mut self, addr: u64, len: u64) {
        if !self.watches.iter().any(|w| w.addr == addr && w.len == len) {
            self.watches.push(Watch {
                addr,
                len,
                value: Vec::new(),
            });
        }
    }

    pub(crate) fn remove(&mut self, addr: u64, len: u64) -> bool {
        let before = self.watches.len();
        self.watches.retain(|w| !(w.addr == addr && w.len == len));
        self.watches.len() != before
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.watches.is_empty()
    }

    /// The guest physical pages the watches lie in (process `cr3`), and
    /// whether some are not mapped.
    fn pages(&self, m: &Machine, cr3: u64) -> (Vec<u64>, bool) {
        let mut pages = Vec::new();
        let mut missing = false;
        for w in &self.watches {
            let mut va = w.addr & !(PAGE_SIZE - 1);
            while va < w.addr.saturating_add(w.len) {
                match gva::translate_user(&m.vm.mem, cr3, va) {
                    Ok(gpa) => pages.push(gpa & !(PAGE_SIZE - 1)),
                    Err(_) => missing = true,
                }
                va += PAGE_SIZE;
            }
        }
        pages.sort_unstable();
        pages.dedup();
        pages.truncate(MAX_PAGES);
        (pages, missing)
    }

    /// Protects the pages the watches lie in now, in process `cr3` (none
    /// without `cr3` or watches), and takes the watched values (`all`:
    /// every one, else those not known yet).
    pub(crate) fn sync(&mut self, m: &Machine, cr3: Option<u64>, all: bool) -> Result<(), VmError> {
        let (pages, missing) = cr3.map(|c| self.pages(m, c)).unwrap_or_default();
        self.missing = missing;
        if pages != self.protected {
            self.layout(m, pages)?;
        }
        if let Some(cr3) = cr3 {
            for w in self
                .watches
                .iter_mut()
                .filter(|w| all || w.value.is_empty())
            {
                w.value = read(m, cr3, w.addr, w.len);
            }
        }
        Ok(())
    }

    /// Makes every page writable again (the VM's own layout).
    pub(crate) fn unprotect(&mut self, m: &Machine) -> Result<(), VmError> {
        if self.protected.is_empty() {
            return Ok(());
        }
        self.layout(m, Vec::new())
    }

    fn layout(&mut self, m: &Machine, pages: Vec<u64>) -> Result<(), VmError> {
        self.slots = crate::kvm_ext::layout_ram(m.vm.fd(), &m.vm.mem, &pages, self.slots)
            .map_err(|e| VmError::Debug(format!("cannot protect watched memory: {e}")))?;
        self.protected = pages;
        Ok(())
    }

    /// Whether a write at guest physical `gpa` is to a watched page.
    pub(crate) fn claims(&self, gpa: u64) -> bool {
        self.protected
            .binary_search(&(gpa & !(PAGE_SIZE - 1)))
            .is_ok()
    }

    /// Performs the guest's write of `data` at `gpa` (a protected page).
    pub(crate) fn write(m: &Machine, gpa: u64, data: &[u8]) -> Result<(), VmError> {
        m.vm.mem
            .write_slice(data, GuestAddress(gpa))
            .map_err(|e| VmError::Debug(format!("cannot perform a write at {gpa:#x}: {e}")))
    }

    /// The watches whose bytes changed since last looked at (process
    /// `cr3`), by address; the new values are kept.
    pub(crate) fn changed(&mut self, m: &Machine, cr3: u64) -> Vec<u64> {
        let mut changed = Vec::new();
        for w in &mut self.watches {
            let now = read(m, cr3, w.addr, w.len);
            if now != w.value {
                changed.push(w.addr);
                w.value = now;
            }
        }
        changed
    }
}

/// The process's bytes at `addr` (empty where unreadable).
fn read(m: &Machine, cr3: u64, addr: u64, len: u64) -> Vec<u8> {
    let mut buf = vec![0u8; len.min(PAGE_SIZE) as usize];
    let n = peek_user(&m.vm.mem, cr3, addr, &mut buf);
    buf.truncate(n);
    buf
}
