//! The symbols of one ELF file: its functions and data objects (with
//! their aliases) from its symbol tables and those of its detached debug
//! file, and its source lines from their DWARF.
//!
//! The ELF files are inputs insight did not write: a malformed one yields
//! no symbols or no lines, never a panic.

use std::cell::OnceCell;
use std::collections::HashMap;
use std::rc::Rc;

use object::{Object, ObjectSection, ObjectSymbol, SymbolKind};

use crate::elf::load_span;

/// Sections are copied (and decompressed when compressed, as with `-gz`
/// and Debian's debug files) into shared buffers.
type DwarfReader = gimli::EndianRcSlice<gimli::RunTimeEndian>;

/// A DWARF section that says it decompresses to more is not read.
const MAX_DWARF_SECTION: u64 = 256 << 20;

/// The functions of one ELF file and the address range it occupies,
/// relative to its load base.
pub struct ElfSymbols<'a> {
    /// (start, end, name), sorted by start.
    pub(crate) functions: Vec<(u64, u64, String)>,
    /// Data objects (global variables), the same way.
    pub(crate) data: Vec<(u64, u64, String)>,
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
        let span = load_span(&file).unwrap_or((0, 0));
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

#[cfg(test)]
mod tests {
    use super::*;

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
}
