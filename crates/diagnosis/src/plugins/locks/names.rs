//! What reports call a lock (or another synchronisation object): its
//! global variable where a symbol covers it; else where it was
//! initialised, with as many of the init's callers as tell apart the locks
//! one helper initialises for several callers ("init at new_lock+0x1c in
//! prog ← setup_jobs+0x31"); else the object and offset of a stripped
//! program's static ("pigz+0x133e0"). Never one name for two objects: the
//! ones still alike are numbered by address.

use std::collections::hash_map::Entry;
use std::collections::{HashMap, HashSet};

use events::abi::Kind;
use events::db::Row;
use guestfiles::Symbolizer;

use crate::plugin::{PluginContext, PluginError};

/// At most this many of an init's callers go into a name.
const MAX_CALLERS: usize = 4;

/// Gathers, from the events in order, what names each object.
#[derive(Default)]
pub struct LockNames {
    /// Object -> the process that used it first (whose symbols name it).
    first_user: HashMap<u64, u32>,
    /// Lock -> (pid, return address) of its first init.
    init_site: HashMap<u64, (u32, u64)>,
    /// Lock -> the return addresses of its first init's stack, innermost
    /// first.
    init_stack: HashMap<u64, Vec<u64>>,
    /// Condition variable -> the mutex of its first wait: what names a
    /// condition variable no symbol names.
    cond_mutex: HashMap<u64, u64>,
    /// The lock whose first init was the last event passed.
    last_init: Option<u64>,
}

impl LockNames {
    /// Object `addr` used by process `pid` (its first user names it).
    pub fn used(&mut self, addr: u64, pid: u32) {
        self.first_user.entry(addr).or_insert(pid);
    }

    /// The first user of `addr`, if any event used it.
    pub fn first_user(&self, addr: u64) -> Option<u32> {
        self.first_user.get(&addr).copied()
    }

    /// Every event passes here, before its stack: a LOCKINIT records the
    /// site of a lock's first init.
    pub fn event(&mut self, row: &Row) {
        self.last_init = None;
        if let (Kind::CondWait, Some(mutex), Some(cond)) = (row.kind, row.addr, row.value) {
            self.cond_mutex.entry(cond as u64).or_insert(mutex);
        }
        if row.kind != Kind::LockInit {
            return;
        }
        if let (Some(lock), Some(site)) = (row.addr, row.caller) {
            if let Entry::Vacant(first) = self.init_site.entry(lock) {
                first.insert((row.pid, site));
                self.last_init = Some(lock);
            }
        }
    }

    /// The user stack of the event just passed.
    pub fn stack(&mut self, frames: &[u64]) {
        if let Some(lock) = self.last_init.take() {
            self.init_stack.insert(lock, frames.to_vec());
        }
    }

    /// Every used object's name, where something names it.
    pub fn names(&self, cx: &PluginContext) -> Result<HashMap<u64, String>, PluginError> {
        let mut sym = Symbolizer::new(cx.files);
        let mut pids: Vec<u32> = self.first_user.values().copied().collect();
        pids.extend(self.init_site.values().map(|&(pid, _)| pid));
        pids.sort_unstable();
        pids.dedup();
        for pid in pids {
            sym.add_process(pid, cx.db.objects(pid)?);
        }
        let mut named: Vec<(u64, String)> = Vec::new();
        // Locks named by their init site, by that name: the ones a helper
        // initialises share it.
        let mut by_site: HashMap<String, Vec<u64>> = HashMap::new();
        // Condition variables named after their mutex, once it has its
        // name.
        let mut conds: Vec<(u64, u64)> = Vec::new();
        for (&lock, &pid) in &self.first_user {
            if let Some(name) = sym.variable(pid, lock) {
                named.push((lock, name));
            } else if let Some(&(init_pid, site)) = self.init_site.get(&lock) {
                let name = format!("init at {}", sym.describe_return(init_pid, site));
                by_site.entry(name).or_default().push(lock);
            } else if let Some(name) = sym.object_offset(pid, lock) {
                named.push((lock, name));
            } else if let Some(&mutex) = self.cond_mutex.get(&lock) {
                conds.push((lock, mutex));
            }
        }
        for (name, locks) in by_site {
            if locks.len() == 1 {
                named.push((locks[0], name));
                continue;
            }
            let callers: Vec<Vec<String>> = locks
                .iter()
                .map(|lock| self.callers(&mut sym, *lock))
                .collect();
            // The fewest callers that tell as many of them apart as any
            // number does (locks initialised in one loop stay alike).
            let kinds = |d: usize| {
                callers
                    .iter()
                    .map(|c| &c[..d.min(c.len())])
                    .collect::<HashSet<_>>()
                    .len()
            };
            let most = kinds(MAX_CALLERS);
            let depth = (0..=MAX_CALLERS)
                .find(|&d| kinds(d) == most)
                .unwrap_or(MAX_CALLERS);
            for (lock, callers) in locks.iter().zip(&callers) {
                let mut name = name.clone();
                for caller in &callers[..depth.min(callers.len())] {
                    name.push_str(" ← ");
                    name.push_str(caller);
                }
                named.push((*lock, name));
            }
        }
        let mut names = number_alike(named);
        for (cond, mutex) in conds {
            if let Some(name) = names.get(&mutex) {
                let name = format!("waited with {name}");
                names.insert(cond, name);
            }
        }
        Ok(names)
    }

    /// The callers of `lock`'s first init, outermost last, each short
    /// ("setup_jobs+0x31", or "pigz+0x5a2c" without a symbol).
    fn callers(&self, sym: &mut Symbolizer<'_>, lock: u64) -> Vec<String> {
        let (Some(&(pid, site)), Some(stack)) =
            (self.init_site.get(&lock), self.init_stack.get(&lock))
        else {
            return Vec::new();
        };
        // The stack starts at the probe library's wrapper or at the init
        // site itself: its callers are the frames above the site.
        let above = stack
            .iter()
            .position(|&ra| ra == site)
            .map_or(&stack[..0], |i| &stack[i + 1..]);
        above
            .iter()
            .map(|&ra| {
                let short = sym.call_site(pid, ra);
                if short.starts_with("0x") {
                    sym.object_offset(pid, ra).unwrap_or(short)
                } else {
                    short
                }
            })
            .collect()
    }
}

/// The names with those that are still alike numbered by address ("#1",
/// "#2"), so that no two objects share one.
fn number_alike(mut named: Vec<(u64, String)>) -> HashMap<u64, String> {
    named.sort();
    let mut count: HashMap<String, usize> = HashMap::new();
    for (_, name) in &named {
        *count.entry(name.clone()).or_insert(0) += 1;
    }
    let mut nth: HashMap<String, usize> = HashMap::new();
    named
        .into_iter()
        .map(|(lock, name)| match count[&name] {
            1 => (lock, name),
            _ => {
                let n = nth.entry(name.clone()).or_insert(0);
                *n += 1;
                (lock, format!("{name} #{n}"))
            }
        })
        .collect()
}
