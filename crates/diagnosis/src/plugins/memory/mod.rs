//! `memory`: which variables a traced process read and wrote, and how
//! often, from the MEMACCESS events of `replay --trace-process --trace-memory`
//! (docs/expansion.md). Accesses are named by the symbol tables of the
//! objects the process loaded (its SYMBOL events), as `name` or
//! `name+offset`; the others by their page, `[page 0x7ffd1000]`.

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;

use events::abi::{Kind, MemAccess};
use events::db::Row;

use crate::plugin::{Context, Output, Plugin, PluginError};
use crate::symbols::Symbolizer;

/// Rows of the report.
const SHOWN: usize = 40;

/// Accesses to one address.
#[derive(Clone, Copy, Default)]
struct Counts {
    loads: u64,
    stores: u64,
    modifies: u64,
    bytes: u64,
}

impl Counts {
    fn add(&mut self, other: &Counts) {
        self.loads += other.loads;
        self.stores += other.stores;
        self.modifies += other.modifies;
        self.bytes += other.bytes;
    }

    fn total(&self) -> u64 {
        self.loads + self.stores + self.modifies
    }
}

#[derive(Default)]
pub struct Memory {
    /// (pid, address) -> counts: named after the pass, when the
    /// process's objects are all known.
    by_address: HashMap<(u32, u64), Counts>,
    /// Events whose value does not say a kind of access.
    malformed: u64,
}

impl Memory {
    pub fn new() -> Self {
        Self::default()
    }
}

impl Plugin for Memory {
    fn name(&self) -> &'static str {
        "memory"
    }

    fn about(&self) -> &'static str {
        "per variable of a process traced at replay: loads, stores and read-modify-writes"
    }

    fn subscribes(&self) -> &'static [Kind] {
        &[Kind::MemAccess]
    }

    fn event(&mut self, row: &Row) {
        let (Some(addr), Some((access, size))) =
            (row.addr, row.value.and_then(MemAccess::from_value))
        else {
            self.malformed += 1;
            return;
        };
        let c = self.by_address.entry((row.pid, addr)).or_default();
        match access {
            MemAccess::Load => c.loads += 1,
            MemAccess::Store => c.stores += 1,
            MemAccess::Modify => c.modifies += 1,
        }
        c.bytes += u64::from(size);
    }

    fn finish(&mut self, cx: &Context) -> Result<Output, PluginError> {
        let mut sym = Symbolizer::new(cx.files);
        let mut pids: Vec<u32> = self.by_address.keys().map(|k| k.0).collect();
        pids.sort_unstable();
        pids.dedup();
        for &pid in &pids {
            sym.add_process(pid, cx.db.objects(pid)?);
        }
        // Named by variable: the offset within it is dropped.
        let mut by_name: BTreeMap<(u32, String), Counts> = BTreeMap::new();
        for (&(pid, addr), c) in &self.by_address {
            let name = match sym.variable(pid, addr) {
                Some(v) => v.split('+').next().unwrap_or(&v).to_owned(),
                None => format!("[page {:#x}]", addr & !0xfff),
            };
            by_name.entry((pid, name)).or_default().add(c);
        }
        let mut rows: Vec<(&(u32, String), &Counts)> = by_name.iter().collect();
        rows.sort_by(|a, b| b.1.total().cmp(&a.1.total()).then(a.0.cmp(b.0)));
        let total: u64 = rows.iter().map(|r| r.1.total()).sum();
        let mut text = format!(
            "Memory accesses in {}: {total} by {} process{}; {} variables and pages\n\n\
             {:>7}  {:<32}  {:>10}  {:>10}  {:>10}  {:>12}\n",
            cx.label,
            pids.len(),
            if pids.len() == 1 { "" } else { "es" },
            rows.len(),
            "pid",
            "variable",
            "loads",
            "stores",
            "modifies",
            "bytes"
        );
        for ((pid, name), c) in rows.iter().take(SHOWN) {
            let _ = writeln!(
                text,
                "{pid:>7}  {name:<32}  {:>10}  {:>10}  {:>10}  {:>12}",
                c.loads, c.stores, c.modifies, c.bytes
            );
        }
        if rows.len() > SHOWN {
            let _ = writeln!(
                text,
                "... and {} more (--json lists all)",
                rows.len() - SHOWN
            );
        }
        if rows.is_empty() {
            text.push_str(
                "(no MEMACCESS events: replay with --trace-process PID --trace-memory FILE)\n",
            );
        }
        let json: Vec<serde_json::Value> = rows
            .iter()
            .map(|((pid, name), c)| {
                serde_json::json!({
                    "pid": pid,
                    "variable": name,
                    "loads": c.loads,
                    "stores": c.stores,
                    "modifies": c.modifies,
                    "bytes": c.bytes,
                })
            })
            .collect();
        let mut warnings = Vec::new();
        if self.malformed > 0 {
            warnings.push(format!(
                "{} MEMACCESS events without an address or a kind of access were left out",
                self.malformed
            ));
        }
        Ok(Output {
            text,
            json: Some(serde_json::json!({ "variables": json, "accesses": total })),
            warnings,
            ..Output::default()
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_db::TestDb;
    use events::abi::Source;

    fn access(addr: u64, kind: i64, size: i64) -> Row {
        Row {
            seq: 0,
            time: 0,
            kind: Kind::MemAccess,
            source: Source::Host,
            pid: 7,
            lwpid: 7,
            addr: Some(addr),
            caller: Some(0x401000),
            value: Some(size | (kind << 32)),
        }
    }

    #[test]
    fn counts_by_kind_and_names_unknown_memory_by_page() {
        let mut p = Memory::new();
        for i in 0..3 {
            p.event(&access(0x7ffd_1000 + 8 * i, 1, 8));
        }
        p.event(&access(0x7ffd_1ff8, 2, 8));
        p.event(&access(0x7ffd_2000, 3, 4));
        p.event(&access(0x7ffd_2000, 9, 4));
        let mut none = access(0, 1, 1);
        none.addr = None;
        p.event(&none);
        let out = p
            .finish(&TestDb::with_rows("memory", &[]).context())
            .unwrap();
        let json = out.json.unwrap();
        let vars = json["variables"].as_array().unwrap();
        assert_eq!(vars.len(), 2);
        assert_eq!(vars[0]["variable"], "[page 0x7ffd1000]");
        assert_eq!(
            (vars[0]["loads"].as_u64(), vars[0]["stores"].as_u64()),
            (Some(3), Some(1))
        );
        assert_eq!(vars[0]["bytes"].as_u64(), Some(32));
        assert_eq!(vars[1]["modifies"].as_u64(), Some(1));
        assert_eq!(json["accesses"].as_u64(), Some(5));
        assert!(out.warnings[0].starts_with("2 MEMACCESS events"));
        assert!(out.text.contains("[page 0x7ffd2000]"));
    }
}
