//! Symbolization of guest addresses: the guest's files come from its
//! initramfs (the "newc" cpio archives the kernel unpacked), the function
//! names from their ELF symbol tables.
//!
//! The archive and the ELF files are inputs insight did not write: a
//! malformed one yields fewer files or no symbols, never a panic.

use std::cell::OnceCell;
use std::collections::HashMap;
use std::rc::Rc;

use object::{Object, ObjectSection, ObjectSegment, ObjectSymbol, SymbolKind};

/// Sections are copied (and decompressed when compressed, as with `-gz`
/// and Debian's debug files) into shared buffers.
type DwarfReader = gimli::EndianRcSlice<gimli::RunTimeEndian>;

/// A DWARF section that says it decompresses to more is not read.
const MAX_DWARF_SECTION: u64 = 256 << 20;

/// The regular files and symbolic links of concatenated newc archives,
/// later entries replacing earlier ones (as the kernel unpacks them).
#[derive(Default)]
pub struct GuestFiles {
    files: HashMap<String, Vec<u8>>,
    links: HashMap<String, String>,
    /// Detached debug files of stripped ELF files, by the ELF file's key.
    debug: HashMap<String, Vec<u8>>,
    /// The guest kernel's ELF image (`vmlinux`), for the names of kernel
    /// functions.
    kernel: Option<Vec<u8>>,
}

const S_IFMT: u32 = 0o170000;
const S_IFREG: u32 = 0o100000;
const S_IFLNK: u32 = 0o120000;

fn hex_field(b: &[u8], at: usize) -> Option<u32> {
    let s = std::str::from_utf8(b.get(at..at + 8)?).ok()?;
    u32::from_str_radix(s, 16).ok()
}

fn align4(n: usize) -> usize {
    (n + 3) & !3
}

/// "/usr/bin/x", "usr/bin/x", "./usr/bin/x" -> "usr/bin/x".
fn normalize(path: &str) -> String {
    path.trim_start_matches("./")
        .trim_start_matches('/')
        .to_owned()
}

impl GuestFiles {
    /// Reads every archive in `data`; stops quietly at the first malformed
    /// header (what came before stays).
    pub fn from_initramfs(data: &[u8]) -> Self {
        let mut g = GuestFiles::default();
        let mut at = 0;
        while at + 110 <= data.len() {
            // Archives are padded with zeros between them.
            if data[at] == 0 {
                at += 4;
                continue;
            }
            if &data[at..at + 6] != b"070701" {
                break;
            }
            let (Some(mode), Some(size), Some(namesize)) = (
                hex_field(data, at + 14),
                hex_field(data, at + 54),
                hex_field(data, at + 94),
            ) else {
                break;
            };
            let name_start = at + 110;
            let Some(name_end) = name_start.checked_add(namesize as usize) else {
                break;
            };
            let data_start = align4(name_end);
            let Some(data_end) = data_start.checked_add(size as usize) else {
                break;
            };
            if data_end > data.len() || namesize == 0 {
                break;
            }
            let name = String::from_utf8_lossy(&data[name_start..name_end - 1]).into_owned();
            if name == "TRAILER!!!" {
                at = align4(data_end);
                continue;
            }
            let body = &data[data_start..data_end];
            let key = normalize(&name);
            match mode & S_IFMT {
                S_IFREG => {
                    g.links.remove(&key);
                    g.files.insert(key, body.to_vec());
                }
                S_IFLNK => {
                    g.files.remove(&key);
                    g.links
                        .insert(key, String::from_utf8_lossy(body).into_owned());
                }
                _ => {}
            }
            at = align4(data_end);
        }
        g
    }

    /// The contents of the file at `path`, following symbolic links.
    pub fn get(&self, path: &str) -> Option<&[u8]> {
        self.files.get(&self.resolve(path)?).map(Vec::as_slice)
    }

    /// The paths of its regular files (without the leading `/`).
    pub fn paths(&self) -> impl Iterator<Item = &str> {
        self.files.keys().map(String::as_str)
    }

    /// Gives the guest kernel's image: kernel addresses are then named by
    /// its symbol table (a `vmlinux` has one; a compressed `bzImage` is
    /// not an ELF file, and kernel addresses stay `[kernel]`).
    pub fn set_kernel(&mut self, image: Vec<u8>) {
        self.kernel = Some(image);
    }

    /// The detached debug file found for the ELF file at `path`.
    pub fn debug_file(&self, path: &str) -> Option<&[u8]> {
        self.debug.get(&self.resolve(path)?).map(Vec::as_slice)
    }

    /// Finds, for each of the guest files at `paths` that is an ELF file
    /// without a symbol table of its own (a stripped library), its
    /// detached debug file by build ID under `dir` (`.build-id/xx/yyyy.debug`,
    /// the layout of Debian's `-dbg` and `-dbgsym` packages, with `dir`
    /// usually `/usr/lib/debug`), and keeps it when it is a regular file of
    /// at most `MAX_DEBUG_FILE` bytes with the same build ID. Returns how
    /// many were found.
    pub fn add_debug_files<'p>(
        &mut self,
        dir: &std::path::Path,
        paths: impl IntoIterator<Item = &'p str>,
    ) -> usize {
        let mut found = 0;
        for path in paths {
            let Some(key) = self.resolve(path) else {
                continue;
            };
            if self.debug.contains_key(&key) {
                continue;
            }
            let Some(id) = stripped_build_id(&self.files[&key]) else {
                continue;
            };
            let hex: String = id.iter().map(|b| format!("{b:02x}")).collect();
            let path = dir
                .join(".build-id")
                .join(&hex[..2])
                .join(format!("{}.debug", &hex[2..]));
            let usable =
                std::fs::metadata(&path).is_ok_and(|m| m.is_file() && m.len() <= MAX_DEBUG_FILE);
            let Some(debug) = usable.then(|| std::fs::read(&path).ok()).flatten() else {
                continue;
            };
            let matches = object::File::parse(&*debug)
                .ok()
                .and_then(|f| f.build_id().ok().flatten().map(|d| d == id.as_slice()))
                .unwrap_or(false);
            if matches {
                self.debug.insert(key, debug);
                found += 1;
            }
        }
        found
    }

    /// The key of the regular file `path` names, following symbolic links.
    fn resolve(&self, path: &str) -> Option<String> {
        let mut key = normalize(path);
        for _ in 0..16 {
            if self.files.contains_key(&key) {
                return Some(key);
            }
            let target = self.links.get(&key)?;
            key = if target.starts_with('/') {
                normalize(target)
            } else {
                let dir = key.rsplit_once('/').map_or("", |(d, _)| d);
                normalize(&format!("{dir}/{target}"))
            };
        }
        None
    }
}

/// Debug files larger than this are not read (1 GiB).
const MAX_DEBUG_FILE: u64 = 1 << 30;

/// The build ID of an ELF file without a `.symtab`, at least 4 bytes long
/// (shorter ones would make a file name of nothing).
fn stripped_build_id(data: &[u8]) -> Option<Vec<u8>> {
    let file = object::File::parse(data).ok()?;
    if file.section_by_name(".symtab").is_some() {
        return None;
    }
    let id = file.build_id().ok()??;
    (id.len() >= 4).then(|| id.to_vec())
}

/// The functions of one ELF file and the address range it occupies,
/// relative to its load base.
pub struct ElfSymbols<'a> {
    /// (start, end, name), sorted by start.
    functions: Vec<(u64, u64, String)>,
    /// Data objects (global variables), the same way.
    data: Vec<(u64, u64, String)>,
    /// The lowest and highest address its loadable segments cover.
    span: (u64, u64),
    /// Every function and data object name, aliases included: (start,
    /// end).
    names: HashMap<String, (u64, u64)>,
    /// The names that are indirect functions (`STT_GNU_IFUNC`): their
    /// address is a resolver's, which picks the implementation a call
    /// reaches.
    ifuncs: std::collections::HashSet<String>,
    /// Its entry point (ELF `e_entry`).
    entry: u64,
    /// Where its DWARF may be: the file itself, then its debug file.
    dwarf_in: [Option<&'a [u8]>; 2],
    /// Its DWARF line tables, read at the first lookup.
    lines: OnceCell<Option<addr2line::Context<DwarfReader>>>,
}

impl<'a> ElfSymbols<'a> {
    /// Parses `data`; `None` if it is not an ELF file this can read.
    pub fn parse(data: &'a [u8]) -> Option<Self> {
        Self::parse_with_debug(data, None)
    }

    /// Parses `data` and, if given, its detached debug file, which adds
    /// its symbol table and DWARF (the addresses are the same).
    pub fn parse_with_debug(elf: &'a [u8], debug: Option<&'a [u8]>) -> Option<Self> {
        let file = object::File::parse(elf).ok()?;
        let debug_file = debug.and_then(|d| object::File::parse(d).ok());
        let mut functions: Vec<(u64, u64, String)> = Vec::new();
        let mut data: Vec<(u64, u64, String)> = Vec::new();
        let mut ifuncs = std::collections::HashSet::new();
        let symbols = file
            .symbols()
            .chain(file.dynamic_symbols())
            .chain(debug_file.iter().flat_map(|d| d.symbols()));
        for sym in symbols {
            let list = match sym.kind() {
                SymbolKind::Text => &mut functions,
                SymbolKind::Data => &mut data,
                _ => continue,
            };
            let Ok(name) = sym.name() else { continue };
            if name.is_empty() || sym.address() == 0 {
                continue;
            }
            let end = sym.address().saturating_add(sym.size().max(1));
            list.push((sym.address(), end, name.to_owned()));
            if let object::SymbolFlags::Elf { st_info, .. } = sym.flags() {
                if st_info & 0xf == object::elf::STT_GNU_IFUNC {
                    ifuncs.insert(name.to_owned());
                }
            }
        }
        // Every name, aliases included (`pthread_mutex_lock` and
        // `__pthread_mutex_lock` are one function): (start, end).
        let mut names: HashMap<String, (u64, u64)> = HashMap::new();
        for (start, end, name) in functions.iter().chain(&data) {
            names.entry(name.clone()).or_insert((*start, *end));
        }
        for list in [&mut functions, &mut data] {
            list.sort();
            list.dedup_by(|b, a| a.0 == b.0);
        }
        let mut span = (u64::MAX, 0);
        for seg in file.segments() {
            span.0 = span.0.min(seg.address());
            span.1 = span.1.max(seg.address().saturating_add(seg.size()));
        }
        if span.0 > span.1 {
            span = (0, 0);
        }
        Some(ElfSymbols {
            functions,
            data,
            span,
            names,
            ifuncs,
            entry: file.entry(),
            dwarf_in: [Some(elf), debug],
            lines: OnceCell::new(),
        })
    }

    /// "file.c:42" for the relative address, from the DWARF line tables.
    pub fn line(&self, rel: u64) -> Option<String> {
        let lines = self.lines.get_or_init(|| {
            self.dwarf_in
                .iter()
                .flatten()
                .find_map(|d| dwarf(&object::File::parse(*d).ok()?))
        });
        let loc = lines.as_ref()?.find_location(rel).ok()??;
        let file = loc.file?.rsplit('/').next()?;
        Some(match loc.line {
            Some(line) => format!("{file}:{line}"),
            None => file.to_owned(),
        })
    }

    /// Whether the file, loaded at its base, covers the relative address.
    pub fn covers(&self, rel: u64) -> bool {
        (self.span.0..self.span.1).contains(&rel)
    }

    /// The function containing the relative address.
    pub fn function(&self, rel: u64) -> Option<&str> {
        containing(&self.functions, rel).map(|f| f.2.as_str())
    }

    /// Where the function containing the relative address starts.
    pub fn function_start(&self, rel: u64) -> Option<u64> {
        containing(&self.functions, rel).map(|f| f.0)
    }

    /// The data object (global variable) containing the relative address.
    pub fn data(&self, rel: u64) -> Option<&str> {
        containing(&self.data, rel).map(|d| d.2.as_str())
    }

    /// The address of the data object (global variable) named `name`.
    pub fn data_address(&self, name: &str) -> Option<u64> {
        self.data.iter().find(|d| d.2 == name).map(|d| d.0)
    }

    /// Its entry point (ELF `e_entry`), before the load bias.
    pub fn entry(&self) -> u64 {
        self.entry
    }

    /// The address and size of the data object named `name` (any of its
    /// names).
    pub fn data_object(&self, name: &str) -> Option<(u64, u64)> {
        let &(start, end) = self.names.get(name)?;
        containing(&self.data, start).map(|_| (start, end - start))
    }

    /// The address of the function named `name` (any of its names).
    pub fn function_address(&self, name: &str) -> Option<u64> {
        let &(start, _) = self.names.get(name)?;
        containing(&self.functions, start).map(|_| start)
    }

    /// Whether `name` is an indirect function (`STT_GNU_IFUNC`, as glibc's
    /// `strlen` or `memcpy`): its address is its resolver's.
    pub fn is_indirect(&self, name: &str) -> bool {
        self.ifuncs.contains(name)
    }

    /// The names of its functions, aliases included.
    pub fn function_names(&self) -> impl Iterator<Item = &str> {
        (self.names.iter())
            .filter(|(_, &(start, _))| containing(&self.functions, start).is_some())
            .map(|(n, _)| n.as_str())
    }

    /// The names of its data objects, aliases included.
    pub fn data_names(&self) -> impl Iterator<Item = &str> {
        (self.names.iter())
            .filter(|(_, &(start, _))| containing(&self.data, start).is_some())
            .map(|(n, _)| n.as_str())
    }

    /// The lowest address the DWARF line tables give line `line` of the
    /// source file `file` (its name, or the end of its path); `Err` with
    /// the lines that file has code at nearest to it, or `None` for
    /// either when the file is unknown.
    pub fn line_address(&self, file: &str, line: u32) -> Result<u64, Option<Vec<u32>>> {
        let lines = self.lines.get_or_init(|| {
            self.dwarf_in
                .iter()
                .flatten()
                .find_map(|d| dwarf(&object::File::parse(*d).ok()?))
        });
        let Some(ctx) = lines.as_ref() else {
            return Err(None);
        };
        let Ok(rows) = ctx.find_location_range(self.span.0, self.span.1) else {
            return Err(None);
        };
        let wanted = |path: &str| path == file || path.ends_with(&format!("/{file}"));
        let mut best: Option<u64> = None;
        let mut near: Vec<u32> = Vec::new();
        for (addr, _, loc) in rows {
            let (Some(path), Some(l)) = (loc.file, loc.line) else {
                continue;
            };
            if !wanted(path) {
                continue;
            }
            if l == line {
                best = Some(best.map_or(addr, |b| b.min(addr)));
            } else {
                near.push(l);
            }
        }
        if let Some(addr) = best {
            return Ok(addr);
        }
        if near.is_empty() {
            return Err(None);
        }
        near.sort_unstable_by_key(|&l| (l.abs_diff(line), l));
        near.dedup();
        near.truncate(3);
        Err(Some(near))
    }
}

/// The DWARF of `file` for line lookups; `None` without debug information
/// or when it cannot be read (malformed DWARF costs the lines, nothing
/// else).
fn dwarf(file: &object::File<'_>) -> Option<addr2line::Context<DwarfReader>> {
    file.section_by_name(".debug_line")?;
    let endian = if file.is_little_endian() {
        gimli::RunTimeEndian::Little
    } else {
        gimli::RunTimeEndian::Big
    };
    let load = |id: gimli::SectionId| -> Result<DwarfReader, gimli::Error> {
        let data = file
            .section_by_name(id.name())
            .and_then(|section| {
                let range = section.compressed_file_range().ok()?;
                if range.uncompressed_size > MAX_DWARF_SECTION {
                    return None;
                }
                section.uncompressed_data().ok()
            })
            .unwrap_or_default();
        Ok(gimli::EndianRcSlice::new(Rc::from(&*data), endian))
    };
    let dwarf = gimli::Dwarf::load(load).ok()?;
    addr2line::Context::from_dwarf(dwarf).ok()
}

fn containing(list: &[(u64, u64, String)], rel: u64) -> Option<&(u64, u64, String)> {
    let i = list.partition_point(|f| f.0 <= rel);
    let entry = list.get(i.checked_sub(1)?)?;
    (rel >= entry.0 && rel < entry.1).then_some(entry)
}

/// The object (and, without symbols, the function) of kernel addresses.
pub const KERNEL: &str = "[kernel]";

/// Where an address of a process lies.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Location {
    /// The object's path, or "[kernel]" / "[unknown]".
    pub object: String,
    /// The function, or "[unknown]" / the address when no symbol covers it.
    pub function: String,
}

/// Symbolizes addresses of the processes of an event database.
pub struct Symbolizer<'a> {
    files: &'a GuestFiles,
    parsed: HashMap<String, Option<ElfSymbols<'a>>>,
    /// pid -> (base, path) of its objects.
    objects: HashMap<u32, Vec<(u64, String)>>,
    /// The kernel's symbols, read at the first kernel address.
    kernel: OnceCell<Option<ElfSymbols<'a>>>,
}

impl<'a> Symbolizer<'a> {
    pub fn new(files: &'a GuestFiles) -> Self {
        Symbolizer {
            files,
            parsed: HashMap::new(),
            objects: HashMap::new(),
            kernel: OnceCell::new(),
        }
    }

    /// Declares the loaded objects of `pid` (its SYMBOL events).
    pub fn add_process(&mut self, pid: u32, objects: Vec<(u64, String)>) {
        for (_, path) in &objects {
            if !self.parsed.contains_key(path) {
                let debug = self.files.debug_file(path);
                let parsed = self
                    .files
                    .get(path)
                    .and_then(|data| ElfSymbols::parse_with_debug(data, debug));
                self.parsed.insert(path.clone(), parsed);
            }
        }
        self.objects.insert(pid, objects);
    }

    /// The object of process `pid` that covers `addr`: its path, its
    /// symbols and the address relative to its load base.
    fn object_at(&self, pid: u32, addr: u64) -> Option<(&str, &ElfSymbols<'a>, u64)> {
        self.objects.get(&pid)?.iter().find_map(|(base, path)| {
            let rel = addr.checked_sub(*base)?;
            let elf = self.parsed.get(path)?.as_ref()?;
            elf.covers(rel).then_some((path.as_str(), elf, rel))
        })
    }

    /// The global variable at `addr` of process `pid` ("L1", or
    /// "table+0x10"), if a symbol covers it.
    pub fn variable(&mut self, pid: u32, addr: u64) -> Option<String> {
        let (_, elf, rel) = self.object_at(pid, addr)?;
        let i = elf.data.partition_point(|d| d.0 <= rel);
        let (start, end, name) = elf.data.get(i.checked_sub(1)?)?;
        (rel < *end).then(|| {
            if rel == *start {
                name.clone()
            } else {
                format!("{name}+{:#x}", rel - start)
            }
        })
    }

    /// The caller a return address of process `pid` names, short:
    /// "function+0x1f" (the offset of the return address), or the bare
    /// address when no symbol covers its call.
    pub fn call_site(&mut self, pid: u32, ra: u64) -> String {
        let Some((_, elf, rel)) = self.object_at(pid, ra.saturating_sub(1)) else {
            return format!("{ra:#x}");
        };
        let i = elf.functions.partition_point(|f| f.0 <= rel);
        match i.checked_sub(1).and_then(|i| elf.functions.get(i)) {
            Some((start, end, name)) if rel < *end => format!("{name}+{:#x}", rel + 1 - start),
            _ => format!("{ra:#x}"),
        }
    }

    /// A return address of process `pid` described where its call is
    /// (the byte before it), as [`Self::describe_code`] does.
    pub fn describe_return(&mut self, pid: u32, ra: u64) -> String {
        self.describe_code(pid, ra.saturating_sub(1))
    }

    /// A stack's return addresses, innermost first, each described at its
    /// call.
    pub fn describe_stack(&mut self, pid: u32, stack: &[u64]) -> Vec<String> {
        stack
            .iter()
            .map(|&ra| self.describe_return(pid, ra))
            .collect()
    }

    /// A code address of process `pid` for people: "function+0x1f in
    /// object (file.c:42)" (the line where DWARF tells), or the bare
    /// address.
    pub fn describe_code(&mut self, pid: u32, addr: u64) -> String {
        let Some((path, elf, rel)) = self.object_at(pid, addr) else {
            return format!("{addr:#x}");
        };
        let object = path.rsplit('/').next().unwrap_or(path);
        let i = elf.functions.partition_point(|f| f.0 <= rel);
        let place = match i.checked_sub(1).and_then(|i| elf.functions.get(i)) {
            Some((start, end, name)) if rel < *end => {
                format!("{name}+{:#x} in {object}", rel - start)
            }
            _ => format!("{rel:#x} in {object}"),
        };
        match elf.line(rel) {
            Some(line) => format!("{place} ({line})"),
            None => place,
        }
    }

    /// Where the guest kernel address `addr` lies: object `[kernel]`, the
    /// function of the kernel's symbol table that covers it, else
    /// `[kernel]` again (no kernel image, or none that names it).
    pub fn locate_kernel(&self, addr: u64) -> Location {
        let elf = self.kernel.get_or_init(|| {
            let image = self.files.kernel.as_deref()?;
            ElfSymbols::parse(image).filter(|elf| !elf.functions.is_empty())
        });
        let function = elf.as_ref().filter(|elf| elf.covers(addr)).and_then(|elf| {
            // The kernel's assembly (entry code, interrupt stubs) has
            // symbols without a size: they reach to the next one.
            let i = elf.functions.partition_point(|f| f.0 <= addr);
            let (start, end, name) = elf.functions.get(i.checked_sub(1)?)?;
            (addr < *end || *end == start + 1).then_some(name.as_str())
        });
        Location {
            object: KERNEL.to_owned(),
            function: function.unwrap_or(KERNEL).to_owned(),
        }
    }

    /// Where `addr` of process `pid` lies.
    pub fn locate(&mut self, pid: u32, addr: u64) -> Location {
        match self.object_at(pid, addr) {
            Some((path, elf, rel)) => Location {
                function: elf
                    .function(rel)
                    .map_or_else(|| format!("{rel:#x}"), str::to_owned),
                object: path.to_owned(),
            },
            None => Location {
                object: "[unknown]".to_owned(),
                function: "[unknown]".to_owned(),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(out: &mut Vec<u8>, name: &str, mode: u32, body: &[u8]) {
        let header = format!(
            "070701{:08X}{mode:08X}{:08X}{:08X}{:08X}{:08X}{:08X}{:08X}{:08X}{:08X}{:08X}{:08X}{:08X}",
            1,
            0,
            0,
            1,
            0,
            body.len(),
            0,
            0,
            0,
            0,
            name.len() + 1,
            0
        );
        out.extend_from_slice(header.as_bytes());
        out.extend_from_slice(name.as_bytes());
        out.push(0);
        while !out.len().is_multiple_of(4) {
            out.push(0);
        }
        out.extend_from_slice(body);
        while !out.len().is_multiple_of(4) {
            out.push(0);
        }
    }

    #[test]
    fn reads_files_and_links_of_concatenated_archives() {
        let mut a = Vec::new();
        entry(&mut a, "usr/bin/x", S_IFREG | 0o755, b"first");
        entry(&mut a, "lib64/ld.so", S_IFLNK | 0o777, b"/lib/real-ld.so");
        entry(&mut a, "lib/real-ld.so", S_IFREG | 0o755, b"loader");
        entry(&mut a, "TRAILER!!!", 0, b"");
        a.extend_from_slice(&[0; 512]);
        entry(&mut a, "usr/bin/x", S_IFREG | 0o755, b"second");
        entry(&mut a, "TRAILER!!!", 0, b"");
        let g = GuestFiles::from_initramfs(&a);
        assert_eq!(g.get("/usr/bin/x"), Some(&b"second"[..]));
        assert_eq!(g.get("/lib64/ld.so"), Some(&b"loader"[..]));
        assert_eq!(g.get("/nope"), None);
        // Any truncation keeps what came before it and never panics.
        for n in 0..a.len() {
            let _ = GuestFiles::from_initramfs(&a[..n]).get("/usr/bin/x");
        }
    }

    #[test]
    fn link_loops_end() {
        let mut a = Vec::new();
        entry(&mut a, "a", S_IFLNK | 0o777, b"b");
        entry(&mut a, "b", S_IFLNK | 0o777, b"a");
        assert_eq!(GuestFiles::from_initramfs(&a).get("/a"), None);
    }

    #[test]
    fn symbolizes_this_test_binary() {
        // The test executable itself is an ELF file with a symbol table.
        let exe = std::fs::read(std::env::current_exe().unwrap()).unwrap();
        let elf = ElfSymbols::parse(&exe).unwrap();
        let main = elf
            .functions
            .iter()
            .find(|f| f.2 == "main")
            .expect("a main symbol");
        assert_eq!(elf.function(main.0), Some("main"));
        assert!(elf.covers(main.0));
        assert!(ElfSymbols::parse(b"not an elf file").is_none());
    }

    #[test]
    fn stripped_files_get_symbols_from_their_debug_file_by_build_id() {
        use std::process::Command;
        let dir = std::env::temp_dir().join(format!("insight-debuglink-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let src = dir.join("lib.c");
        std::fs::write(
            &src,
            "static int __attribute__((noinline)) internal_helper(int x) { return x * 3 + 1; }\n\
             int exported(int x) { return internal_helper(x) + 2; }\n",
        )
        .unwrap();
        let lib = dir.join("libt.so");
        let debug = dir.join("libt.debug");
        let run = |cmd: &mut Command| {
            let out = cmd.output().expect("gcc and binutils are needed");
            assert!(
                out.status.success(),
                "{cmd:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        };
        run(Command::new("gcc")
            // -gz: compressed DWARF sections, as in Debian's debug files.
            .args([
                "-O2",
                "-g",
                "-gz",
                "-shared",
                "-fPIC",
                "-Wl,--build-id=sha1",
                "-o",
            ])
            .arg(&lib)
            .arg(&src));
        run(Command::new("objcopy")
            .arg("--only-keep-debug")
            .arg(&lib)
            .arg(&debug));
        run(Command::new("strip").arg("--strip-all").arg(&lib));
        let stripped = std::fs::read(&lib).unwrap();
        let id = stripped_build_id(&stripped).expect("stripped, with a build ID");
        let hex: String = id.iter().map(|b| format!("{b:02x}")).collect();
        let debug_dir = dir.join("debug");
        let by_id = debug_dir.join(".build-id").join(&hex[..2]);
        std::fs::create_dir_all(&by_id).unwrap();
        std::fs::copy(&debug, by_id.join(format!("{}.debug", &hex[2..]))).unwrap();

        let mut a = Vec::new();
        entry(&mut a, "usr/lib/libt.so", S_IFREG | 0o755, &stripped);
        entry(&mut a, "TRAILER!!!", 0, b"");
        let mut g = GuestFiles::from_initramfs(&a);
        // The static function is in the debug file's .symtab only.
        let helper_of = |g: &GuestFiles| {
            let elf = ElfSymbols::parse_with_debug(
                g.get("/usr/lib/libt.so").unwrap(),
                g.debug_file("/usr/lib/libt.so"),
            )
            .unwrap();
            elf.functions
                .iter()
                .find(|f| f.2.starts_with("internal_helper"))
                .map(|f| f.0)
        };
        assert_eq!(helper_of(&g), None);
        let lib = ["/usr/lib/libt.so"];
        assert_eq!(g.add_debug_files(&dir.join("nowhere"), lib), 0);
        assert_eq!(g.add_debug_files(&debug_dir, ["/usr/lib/other.so"]), 0);
        assert_eq!(g.add_debug_files(&debug_dir, lib), 1);
        let at = helper_of(&g).expect("internal_helper from the debug file");
        let mut sym = Symbolizer::new(&g);
        sym.add_process(1, vec![(0x7f00_0000_0000, "/usr/lib/libt.so".into())]);
        let here = sym.locate(1, 0x7f00_0000_0000 + at);
        assert!(here.function.starts_with("internal_helper"), "{here:?}");
        // Its line, from the debug file's compressed DWARF.
        let described = sym.describe_code(1, 0x7f00_0000_0000 + at);
        assert!(described.ends_with("(lib.c:1)"), "{described}");

        // A file at that place that is not a debug file of the same build
        // is not used.
        let mut other = Vec::new();
        entry(&mut other, "usr/lib/libt.so", S_IFREG | 0o755, &stripped);
        std::fs::write(by_id.join(format!("{}.debug", &hex[2..])), b"not an elf").unwrap();
        let mut g = GuestFiles::from_initramfs(&other);
        assert_eq!(g.add_debug_files(&debug_dir, lib), 0);
        // Nor is anything but a regular file.
        std::fs::remove_file(by_id.join(format!("{}.debug", &hex[2..]))).unwrap();
        std::fs::create_dir(by_id.join(format!("{}.debug", &hex[2..]))).unwrap();
        assert_eq!(g.add_debug_files(&debug_dir, lib), 0);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn kernel_addresses_are_named_by_the_kernel_image() {
        // Any ELF file with a symbol table stands for a vmlinux: this test's
        // own executable.
        let image = std::fs::read(std::env::current_exe().unwrap()).unwrap();
        let elf = ElfSymbols::parse(&image).unwrap();
        let (start, end, name) = elf
            .functions
            .iter()
            .find(|f| f.1 > f.0 + 1 && elf.covers(f.0))
            .cloned()
            .unwrap();
        let mut files = GuestFiles::default();
        let unnamed = Symbolizer::new(&files).locate_kernel(start);
        assert_eq!(
            (unnamed.object.as_str(), unnamed.function.as_str()),
            (KERNEL, KERNEL)
        );
        files.set_kernel(image.clone());
        let sym = Symbolizer::new(&files);
        let at = sym.locate_kernel(start + (end - start) / 2);
        assert_eq!(
            (at.object.as_str(), at.function.as_str()),
            (KERNEL, name.as_str())
        );
        assert_eq!(sym.locate_kernel(u64::MAX - 1).function, KERNEL);
        // Not an ELF file (a bzImage): unnamed, no panic.
        files.set_kernel(b"MZ not an ELF file".to_vec());
        assert_eq!(
            Symbolizer::new(&files).locate_kernel(start).function,
            KERNEL
        );
    }
}
