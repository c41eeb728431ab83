//! `memory`: which variables and heap blocks a traced process read and
//! wrote, and how often, from the MEMACCESS events of `replay
//! --trace-process --trace-memory` (docs/expansion.md). Global and static
//! variables are named by the symbol tables of the objects the process
//! loaded (its SYMBOL events), as `name`; heap blocks by their allocation
//! site, `malloc@function+0x1f`, from the probe library's heap events
//! (HEAPCALL, ALLOC, FREE), which also show an access to a block after it
//! was freed; a thread's own stack as `stack:LWPID` (where the tracing
//! found it, by the thread's RSP); other memory by its page,
//! `[page 0x7ffd1000]`. Its SVG
//! attachment is a heat map of the accesses per page over the trace.

pub mod heatmap;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt::Write as _;

use events::abi::{HeapFunction, Kind, MemAccess};
use events::db::Row;
use guestfiles::Symbolizer;

use crate::plugin::{Attachment, Output, Plugin, PluginContext, PluginError, ReplayNeeds};

/// Rows of the report.
const SHOWN: usize = 40;

/// Accesses to one address, variable or block.
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

    fn count(&mut self, access: MemAccess, size: u32) {
        match access {
            MemAccess::Load => self.loads += 1,
            MemAccess::Store => self.stores += 1,
            MemAccess::Modify => self.modifies += 1,
        }
        self.bytes += u64::from(size);
    }

    fn total(&self) -> u64 {
        self.loads + self.stores + self.modifies
    }

    fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "loads": self.loads,
            "stores": self.stores,
            "modifies": self.modifies,
            "bytes": self.bytes,
        })
    }
}

/// A heap block: what an ALLOC returned, until a FREE.
struct Block {
    pid: u32,
    addr: u64,
    size: u64,
    function: HeapFunction,
    /// Return address into the allocation's caller.
    site: u64,
    /// How and where it was freed (return address), once it was.
    freed: Option<(HeapFunction, u64)>,
    /// Accesses while it was allocated.
    live: Counts,
    /// Accesses after it was freed, and the first of them: (lwpid, RIP).
    after_free: Counts,
    first_after_free: Option<(u32, u64)>,
}

/// The blocks of one process by start address: those allocated, and
/// those freed and not allocated again.
#[derive(Default)]
struct Heap {
    live: BTreeMap<u64, usize>,
    freed: BTreeMap<u64, usize>,
}

/// The block in `map` that holds `addr`.
fn holding(map: &BTreeMap<u64, usize>, blocks: &[Block], addr: u64) -> Option<usize> {
    let (_, &i) = map.range(..=addr).next_back()?;
    (addr - blocks[i].addr < blocks[i].size.max(1)).then_some(i)
}

/// Removes from `map` the blocks overlapping `start..end` and returns them.
fn take_overlapping(
    map: &mut BTreeMap<u64, usize>,
    blocks: &[Block],
    start: u64,
    end: u64,
) -> Vec<usize> {
    let mut first = start;
    if let Some(i) = holding(map, blocks, start) {
        first = blocks[i].addr;
    }
    let keys: Vec<u64> = map
        .range(first..end.max(first.saturating_add(1)))
        .map(|(&k, _)| k)
        .collect();
    keys.iter().filter_map(|k| map.remove(k)).collect()
}

#[derive(Default)]
pub struct Memory {
    /// (pid, address) -> counts outside heap blocks: named after the
    /// pass, when the process's objects are all known.
    by_address: HashMap<(u32, u64), Counts>,
    /// (pid, lwpid, page) -> counts of accesses to the thread's own stack.
    stacks: HashMap<(u32, u32, u64), Counts>,
    blocks: Vec<Block>,
    heaps: HashMap<u32, Heap>,
    /// Threads inside an allocation function (between HEAPCALL and its
    /// ALLOC or FREE): their accesses to heap blocks are the allocator's.
    in_allocator: HashSet<(u32, u32)>,
    /// Accesses the allocator made to blocks, live or freed.
    allocator: Counts,
    /// Heap events seen (none: the replay did not collect them).
    heap_events: u64,
    /// Accesses so far, and per (pid, page) how many fell in each
    /// [`heatmap::BUCKET`] of them: the heat map.
    accesses: u64,
    pages: HashMap<(u32, u64), BTreeMap<u64, u32>>,
    /// Events whose value does not say a kind of access or a function.
    malformed: u64,
}

impl Memory {
    pub fn new() -> Self {
        Self::default()
    }

    fn alloc(&mut self, pid: u32, addr: u64, size: u64, function: HeapFunction, site: u64) {
        let blocks = &self.blocks;
        let heap = self.heaps.entry(pid).or_default();
        let end = addr.saturating_add(size.max(1));
        // Memory allocated again is no longer a freed block's; a live
        // block overlapping it was freed where the probes do not see
        // (inside the C library).
        take_overlapping(&mut heap.freed, blocks, addr, end);
        take_overlapping(&mut heap.live, blocks, addr, end);
        heap.live.insert(addr, self.blocks.len());
        self.blocks.push(Block {
            pid,
            addr,
            size,
            function,
            site,
            freed: None,
            live: Counts::default(),
            after_free: Counts::default(),
            first_after_free: None,
        });
    }

    fn free(&mut self, pid: u32, addr: u64, length: u64, function: HeapFunction, site: u64) {
        let heap = self.heaps.entry(pid).or_default();
        let freed: Vec<usize> = if function == HeapFunction::Munmap {
            let end = addr.saturating_add(length.max(1));
            take_overlapping(&mut heap.live, &self.blocks, addr, end)
        } else {
            heap.live.remove(&addr).into_iter().collect()
        };
        for i in freed {
            let b = &mut self.blocks[i];
            b.freed = Some((function, site));
            heap.freed.insert(b.addr, i);
        }
    }

    fn access(&mut self, row: &Row, addr: u64, access: MemAccess, size: u32, on_stack: bool) {
        *self
            .pages
            .entry((row.pid, addr & !0xfff))
            .or_default()
            .entry(self.accesses / heatmap::BUCKET)
            .or_insert(0) += 1;
        self.accesses += 1;
        if on_stack {
            self.stacks
                .entry((row.pid, row.lwpid, addr & !0xfff))
                .or_default()
                .count(access, size);
            return;
        }
        let heap = self.heaps.get(&row.pid);
        let live = heap.and_then(|h| holding(&h.live, &self.blocks, addr));
        let freed = || heap.and_then(|h| holding(&h.freed, &self.blocks, addr));
        if self.in_allocator.contains(&(row.pid, row.lwpid)) {
            if live.is_some() || freed().is_some() {
                self.allocator.count(access, size);
                return;
            }
        } else if let Some(i) = live {
            self.blocks[i].live.count(access, size);
            return;
        } else if let Some(i) = freed() {
            let b = &mut self.blocks[i];
            b.after_free.count(access, size);
            b.first_after_free
                .get_or_insert((row.lwpid, row.caller.unwrap_or(0)));
            return;
        }
        self.by_address
            .entry((row.pid, addr))
            .or_default()
            .count(access, size);
    }
}

impl Plugin for Memory {
    fn name(&self) -> &'static str {
        "memory"
    }

    fn about(&self) -> &'static str {
        "per variable and heap block of a process traced at replay: loads, stores, \
         read-modify-writes, uses after free"
    }

    fn subscribes(&self) -> &'static [Kind] {
        &[Kind::MemAccess, Kind::HeapCall, Kind::Alloc, Kind::Free]
    }

    fn replay_needs(&self) -> ReplayNeeds {
        ReplayNeeds {
            traced_process: true,
            ..ReplayNeeds::default()
        }
    }

    fn event(&mut self, row: &Row) {
        let thread = (row.pid, row.lwpid);
        if row.kind == Kind::MemAccess {
            match (row.addr, row.value.and_then(MemAccess::from_value)) {
                (Some(addr), Some((access, size))) => {
                    let on_stack = row.value.is_some_and(MemAccess::on_stack);
                    self.access(row, addr, access, size, on_stack)
                }
                _ => self.malformed += 1,
            }
            return;
        }
        self.heap_events += 1;
        let Some((function, size)) = row.value.and_then(HeapFunction::from_value) else {
            self.malformed += 1;
            return;
        };
        if row.kind == Kind::HeapCall {
            self.in_allocator.insert(thread);
            return;
        }
        self.in_allocator.remove(&thread);
        let (addr, site) = (row.addr.unwrap_or(0), row.caller.unwrap_or(0));
        if addr == 0 {
            return; // the call failed
        }
        if row.kind == Kind::Alloc {
            self.alloc(row.pid, addr, size, function, site);
        } else {
            self.free(row.pid, addr, size, function, site);
        }
    }

    fn finish(&mut self, cx: &PluginContext) -> Result<Output, PluginError> {
        let mut sym = Symbolizer::new(cx.files);
        let mut pids: Vec<u32> = self.by_address.keys().map(|k| k.0).collect();
        pids.extend(self.blocks.iter().map(|b| b.pid));
        pids.extend(self.stacks.keys().map(|k| k.0));
        pids.sort_unstable();
        pids.dedup();
        for &pid in &pids {
            sym.add_process(pid, cx.db.objects(pid)?);
        }
        // Named by variable: the offset within it is dropped. Each page is
        // labelled in the heat map by what was accessed most on it.
        let mut by_name: BTreeMap<(u32, String), Counts> = BTreeMap::new();
        let mut on_page: HashMap<(u32, u64), BTreeMap<String, u64>> = HashMap::new();
        let mut label = |pid: u32, page: u64, n: u64, name: &str| {
            *on_page
                .entry((pid, page))
                .or_default()
                .entry(name.to_owned())
                .or_insert(0) += n;
        };
        for (&(pid, addr), c) in &self.by_address {
            let name = match sym.variable(pid, addr) {
                Some(v) => v.split('+').next().unwrap_or(&v).to_owned(),
                None => format!("[page {:#x}]", addr & !0xfff),
            };
            label(pid, addr & !0xfff, c.total(), &name);
            by_name.entry((pid, name)).or_default().add(c);
        }
        for (&(pid, lwpid, page), c) in &self.stacks {
            let name = format!("stack:{lwpid}");
            label(pid, page, c.total(), &name);
            by_name.entry((pid, name)).or_default().add(c);
        }
        // Heap blocks by their allocation site.
        let names: Vec<String> = self
            .blocks
            .iter()
            .map(|b| format!("{}@{}", b.function.name(), sym.call_site(b.pid, b.site)))
            .collect();
        for (b, name) in self.blocks.iter().zip(&names) {
            label(b.pid, b.addr & !0xfff, b.live.total(), name);
            if b.live.total() > 0 {
                by_name
                    .entry((b.pid, name.clone()))
                    .or_default()
                    .add(&b.live);
            }
            if b.after_free.total() > 0 {
                by_name
                    .entry((b.pid, format!("{name} (freed)")))
                    .or_default()
                    .add(&b.after_free);
            }
        }
        let mut rows: Vec<(&(u32, String), &Counts)> = by_name.iter().collect();
        rows.sort_by(|a, b| b.1.total().cmp(&a.1.total()).then(a.0.cmp(b.0)));
        let total = rows.iter().map(|r| r.1.total()).sum::<u64>() + self.allocator.total();
        let mut text = format!(
            "Memory accesses in {}: {total} by {} process{}; {} variables, heap allocation \
             sites and pages\n\n\
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
                "(no MEMACCESS events: replay with --diagnose memory, which traces the recorded \
                 command's process, or --trace-process PID|NAME)\n",
            );
        }
        if self.allocator.total() > 0 {
            let _ = writeln!(
                text,
                "\nThe allocator's own accesses to heap blocks (inside malloc, free ...): {}",
                self.allocator.total()
            );
        }
        let freed_use: Vec<(&Block, &String)> = self
            .blocks
            .iter()
            .zip(&names)
            .filter(|(b, _)| b.after_free.total() > 0)
            .collect();
        if !freed_use.is_empty() {
            let _ = writeln!(text, "\nUse after free:");
        }
        for (b, name) in &freed_use {
            let (lwpid, rip) = b.first_after_free.unwrap_or_default();
            let (how, at) = b.freed.unwrap_or((HeapFunction::Free, 0));
            let _ = writeln!(
                text,
                "  {} access{} to {name} ({} bytes at {:#x}), freed by {}@{}; first by thread \
                 {lwpid} at {}",
                b.after_free.total(),
                if b.after_free.total() == 1 { "" } else { "es" },
                b.size,
                b.addr,
                how.name(),
                sym.call_site(b.pid, at),
                sym.describe_code(b.pid, rip)
            );
        }
        let json: Vec<serde_json::Value> = rows
            .iter()
            .map(|((pid, name), c)| {
                let mut v = c.json();
                v["pid"] = (*pid).into();
                v["variable"] = name.as_str().into();
                v
            })
            .collect();
        let blocks: Vec<serde_json::Value> = self
            .blocks
            .iter()
            .zip(&names)
            .map(|(b, name)| {
                serde_json::json!({
                    "pid": b.pid,
                    "block": name,
                    "address": b.addr,
                    "size": b.size,
                    "freed_by": b.freed.map(|(how, at)| {
                        format!("{}@{}", how.name(), sym.call_site(b.pid, at))
                    }),
                    "accesses": b.live.json(),
                    "after_free": b.after_free.json(),
                })
            })
            .collect();
        let page_label: HashMap<(u32, u64), &str> = on_page
            .iter()
            .filter_map(|(&page, names)| {
                let top = names
                    .iter()
                    .max_by(|a, b| a.1.cmp(b.1).then(b.0.cmp(a.0)))?;
                // A page known by its address alone is labelled by it.
                (!top.0.starts_with("[page ")).then_some((page, top.0.as_str()))
            })
            .collect();
        let mut pages: Vec<_> = self.pages.iter().collect();
        pages.sort_by_key(|p| *p.0);
        let page_rows = pages
            .into_iter()
            .map(|(&(pid, page), buckets)| heatmap::PageRow {
                label: format!(
                    "{pid} {page:#x} {}",
                    page_label.get(&(pid, page)).copied().unwrap_or_default()
                ),
                buckets,
            })
            .collect();
        let svg = heatmap::svg(
            &format!("Memory accesses per page: {}", cx.label),
            page_rows,
            self.accesses,
        );
        let mut warnings = Vec::new();
        if self.malformed > 0 {
            warnings.push(format!(
                "{} MEMACCESS or heap events without an address, a kind of access or an \
                 allocation function were left out",
                self.malformed
            ));
        }
        if self.heap_events == 0 && !rows.is_empty() {
            warnings.push(
                "no heap events: heap blocks are named by their pages (record with --probes \
                 and replay with --heap-events or --trace-process)"
                    .to_owned(),
            );
        }
        Ok(Output {
            text,
            json: Some(serde_json::json!({
                "variables": json,
                "heap_blocks": blocks,
                "allocator_accesses": self.allocator.total(),
                "accesses": total,
            })),
            attachments: vec![Attachment {
                format: "svg",
                content: svg,
            }],
            warnings,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_db::TestDb;
    use events::abi::Source;

    fn access(addr: u64, kind: i64, size: i64) -> Row {
        on_thread(7, addr, kind, size)
    }

    fn on_thread(lwpid: u32, addr: u64, kind: i64, size: i64) -> Row {
        Row {
            seq: 0,
            time: 0,
            kind: Kind::MemAccess,
            source: Source::Host,
            pid: 7,
            lwpid,
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
        assert!(out.warnings[0].starts_with("2 MEMACCESS or heap events"));
        assert!(out.warnings[1].starts_with("no heap events"));
        assert!(out.text.contains("[page 0x7ffd2000]"));
    }

    fn heap(kind: Kind, addr: u64, size: u64, function: HeapFunction, caller: u64) -> Row {
        Row {
            kind,
            source: Source::Probe,
            addr: Some(addr),
            caller: Some(caller),
            value: Some(function.value(size)),
            ..access(0, 1, 1)
        }
    }

    /// One call: HEAPCALL, then what it returned.
    fn call(p: &mut Memory, kind: Kind, addr: u64, size: u64, f: HeapFunction, site: u64) {
        p.event(&heap(Kind::HeapCall, 0, size, f, site));
        p.event(&heap(kind, addr, size, f, site));
    }

    #[test]
    fn heap_blocks_count_apart_and_a_use_after_free_is_flagged() {
        let mut p = Memory::new();
        call(
            &mut p,
            Kind::Alloc,
            0x5000,
            64,
            HeapFunction::Malloc,
            0x401010,
        );
        call(
            &mut p,
            Kind::Alloc,
            0x5050,
            16,
            HeapFunction::Calloc,
            0x401020,
        );
        for i in 0..8 {
            p.event(&access(0x5000 + 8 * i, 2, 8));
        }
        p.event(&access(0x5050, 1, 4));
        // Inside free: the allocator's.
        p.event(&heap(
            Kind::HeapCall,
            0x5050,
            0,
            HeapFunction::Free,
            0x401030,
        ));
        p.event(&access(0x5050, 2, 8));
        p.event(&heap(Kind::Free, 0x5050, 0, HeapFunction::Free, 0x401030));
        // After: a use after free, twice.
        p.event(&access(0x5054, 2, 4));
        p.event(&access(0x5050, 1, 4));
        // Reused by a new block: its accesses are the new block's.
        call(
            &mut p,
            Kind::Alloc,
            0x5050,
            8,
            HeapFunction::Malloc,
            0x401040,
        );
        p.event(&access(0x5050, 3, 8));
        // A failed call allocates nothing; memory past every block is by page.
        call(
            &mut p,
            Kind::Alloc,
            0,
            1 << 40,
            HeapFunction::Malloc,
            0x401050,
        );
        p.event(&access(0x6000, 1, 1));
        let out = p
            .finish(&TestDb::with_rows("memory-heap", &[]).context())
            .unwrap();
        let json = out.json.clone().unwrap();
        let blocks = json["heap_blocks"].as_array().unwrap();
        assert_eq!(blocks.len(), 3, "{blocks:?}");
        // No symbols here: sites are named by their return addresses.
        assert_eq!(blocks[0]["block"], "malloc@0x401010");
        assert_eq!(blocks[0]["accesses"]["stores"].as_u64(), Some(8));
        assert_eq!(blocks[0]["freed_by"], serde_json::Value::Null);
        assert_eq!(blocks[1]["block"], "calloc@0x401020");
        assert_eq!(blocks[1]["size"].as_u64(), Some(16));
        assert_eq!(blocks[1]["accesses"]["loads"].as_u64(), Some(1));
        assert_eq!(blocks[1]["freed_by"], "free@0x401030");
        assert_eq!(blocks[1]["after_free"]["stores"].as_u64(), Some(1));
        assert_eq!(blocks[1]["after_free"]["loads"].as_u64(), Some(1));
        assert_eq!(blocks[2]["accesses"]["modifies"].as_u64(), Some(1));
        assert_eq!(json["allocator_accesses"].as_u64(), Some(1));
        assert_eq!(json["accesses"].as_u64(), Some(14));
        assert!(out.text.contains("Use after free:"), "{}", out.text);
        assert!(
            out.text.contains(
                "2 accesses to calloc@0x401020 (16 bytes at 0x5050), freed by free@0x401030"
            ),
            "{}",
            out.text
        );
        assert!(out.text.contains("calloc@0x401020 (freed)"));
        assert!(out.text.contains("[page 0x6000]"));
        // The heat map labels each page by what was accessed most there.
        let svg = out.attachment("svg").unwrap();
        assert!(svg.contains(">7 0x5000 malloc@0x401010<"), "{svg}");
        assert!(svg.contains(">7 0x6000 <"), "{svg}");
        assert!(out.warnings.is_empty(), "{:?}", out.warnings);
    }

    #[test]
    fn stack_accesses_are_named_by_their_thread() {
        let mut p = Memory::new();
        p.event(&on_thread(8, 0x7ffd_1ff8, 2 | 1 << 8, 8));
        p.event(&on_thread(8, 0x7ffd_1ff0, 1 | 1 << 8, 8));
        p.event(&on_thread(9, 0x7f00_0ff8, 2 | 1 << 8, 8));
        // The same address without the flag: by page.
        p.event(&on_thread(8, 0x7ffd_1ff8, 1, 8));
        let out = p
            .finish(&TestDb::with_rows("memory-stack", &[]).context())
            .unwrap();
        let json = out.json.clone().unwrap();
        let vars = json["variables"].as_array().unwrap();
        let row = |name: &str| vars.iter().find(|v| v["variable"] == name).unwrap();
        assert_eq!(row("stack:8")["stores"].as_u64(), Some(1));
        assert_eq!(row("stack:8")["loads"].as_u64(), Some(1));
        assert_eq!(row("stack:9")["stores"].as_u64(), Some(1));
        assert_eq!(row("[page 0x7ffd1000]")["loads"].as_u64(), Some(1));
        assert!(out
            .attachment("svg")
            .unwrap()
            .contains(">7 0x7ffd1000 stack:8<"));
    }

    #[test]
    fn blocks_at_the_top_of_the_address_space_do_not_overflow() {
        let mut p = Memory::new();
        call(
            &mut p,
            Kind::Alloc,
            u64::MAX,
            1 << 40,
            HeapFunction::Mmap,
            0x401010,
        );
        call(
            &mut p,
            Kind::Alloc,
            u64::MAX,
            16,
            HeapFunction::Malloc,
            0x401010,
        );
        call(
            &mut p,
            Kind::Free,
            u64::MAX - 8,
            u64::MAX,
            HeapFunction::Munmap,
            0x401020,
        );
        p.event(&access(u64::MAX, 1, 1));
        let out = p
            .finish(&TestDb::with_rows("memory-top", &[]).context())
            .unwrap();
        assert_eq!(out.json.unwrap()["accesses"].as_u64(), Some(1));
    }

    #[test]
    fn munmap_frees_every_block_it_covers() {
        let mut p = Memory::new();
        call(
            &mut p,
            Kind::Alloc,
            0x10000,
            0x2000,
            HeapFunction::Mmap,
            0x401010,
        );
        call(
            &mut p,
            Kind::Alloc,
            0x12000,
            0x1000,
            HeapFunction::Mmap,
            0x401010,
        );
        call(
            &mut p,
            Kind::Free,
            0x10000,
            0x3000,
            HeapFunction::Munmap,
            0x401020,
        );
        p.event(&access(0x12010, 1, 8));
        let out = p
            .finish(&TestDb::with_rows("memory-munmap", &[]).context())
            .unwrap();
        let json = out.json.unwrap();
        let blocks = json["heap_blocks"].as_array().unwrap();
        assert!(blocks.iter().all(|b| b["freed_by"] == "munmap@0x401020"));
        assert_eq!(blocks[1]["after_free"]["loads"].as_u64(), Some(1));
    }
}
