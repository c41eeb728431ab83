//! What gdb reads of the debugged program from the target rather than
//! from the host: its files (the recording's own, from the trace's
//! initramfs and the run's archive, never the host's), its auxiliary
//! vector, and the list of shared libraries the dynamic linker keeps in
//! its memory.

use guestfiles::elf::LoadImage;
use guestfiles::{ElfSymbols, GuestFiles};

/// An open file of the guest's, for gdb's host I/O.
pub(crate) struct OpenFiles {
    files: GuestFiles,
    open: Vec<Option<Vec<u8>>>,
}

/// The most files gdb may hold open at once.
const MAX_OPEN: usize = 256;

impl OpenFiles {
    pub(crate) fn new(files: GuestFiles) -> Self {
        OpenFiles {
            files,
            open: Vec::new(),
        }
    }

    /// Opens the guest's file at `path` (read only); its descriptor.
    pub(crate) fn open(&mut self, path: &str) -> Option<u32> {
        let bytes = self.files.get(path)?.to_vec();
        let slot = match self.open.iter().position(Option::is_none) {
            Some(free) => free,
            None if self.open.len() < MAX_OPEN => {
                self.open.push(None);
                self.open.len() - 1
            }
            None => return None,
        };
        self.open[slot] = Some(bytes);
        u32::try_from(slot).ok()
    }

    pub(crate) fn close(&mut self, fd: u32) -> bool {
        self.open
            .get_mut(fd as usize)
            .and_then(Option::take)
            .is_some()
    }

    /// The contents of an open file.
    pub(crate) fn get(&self, fd: u32) -> Option<&[u8]> {
        self.open.get(fd as usize)?.as_deref()
    }

    /// The guest's file at `path`, not opened.
    pub(crate) fn guest_file(&self, path: &str) -> Option<&[u8]> {
        self.files.get(path)
    }

    /// Where the program a process executed as `exe` is among the guest's
    /// files: `exe` itself, or, for a path relative to the directory it
    /// ran in (`./prog`, a program from the host recorded by its path),
    /// that path from the command's working directory (the run's
    /// `/etc/insight/workdir`, else `/root`, where insight-init starts
    /// it).
    pub(crate) fn program_path(&self, exe: &str) -> String {
        if exe.starts_with('/') || self.files.get(exe).is_some() {
            return exe.to_owned();
        }
        let workdir = self
            .files
            .get(guest::spec::WORKDIR_FILE)
            .map(|b| String::from_utf8_lossy(b).trim_end_matches('\n').to_owned())
            .unwrap_or_else(|| "/root".to_owned());
        let mut parts: Vec<&str> = Vec::new();
        for part in workdir.split('/').chain(exe.split('/')) {
            match part {
                "" | "." => {}
                ".." => {
                    parts.pop();
                }
                p => parts.push(p),
            }
        }
        let joined = format!("/{}", parts.join("/"));
        match self.files.get(&joined) {
            Some(_) => joined,
            None => exe.to_owned(),
        }
    }
}

/// Reads the process's memory at `at` from the files it maps, for pages
/// the program has not touched yet (the kernel maps file pages on first
/// touch, so a debugger stopped at the start of a program finds none of
/// its code in memory). The objects are the program (its bias from
/// `AT_ENTRY`), its dynamic linker (`AT_BASE`) and the libraries the
/// dynamic linker has loaded (`libraries`, name and bias). Untouched
/// private pages hold their file's bytes, since the guest has no swap.
pub(crate) fn read_from_files(
    files: &OpenFiles,
    exe: &str,
    auxv: &[u8],
    libraries: &[(String, u64)],
    at: u64,
    buf: &mut [u8],
) -> usize {
    objects(files, exe, auxv, libraries)
        .into_iter()
        .filter_map(|(_, data, bias)| Some((LoadImage::parse(data).ok()?, bias)))
        .map(|(elf, bias)| elf.read(bias, at, buf))
        .find(|&n| n > 0)
        .unwrap_or(0)
}

/// The objects the debugged process maps: enough to find where its
/// functions start.
pub(crate) struct MappedObjects {
    pub(crate) exe: String,
    pub(crate) auxv: Vec<u8>,
    /// The shared libraries, as (path, load bias).
    pub(crate) libraries: Vec<(String, u64)>,
}

impl MappedObjects {
    /// Where the function that holds the code at `at` starts, from the
    /// symbol tables of the object mapped there (and of its debug file,
    /// if the recording has one); `None` where no symbol covers it.
    pub(crate) fn function_start(&self, files: &OpenFiles, at: u64) -> Option<u64> {
        let (path, data, bias) = objects(files, &self.exe, &self.auxv, &self.libraries)
            .into_iter()
            .find(|(_, data, bias)| {
                LoadImage::parse(data).is_ok_and(|e| e.read(*bias, at, &mut [0]) > 0)
            })?;
        let symbols = ElfSymbols::parse_with_debug(data, files.files.debug_file(&path))?;
        let start = symbols.function_start(at.wrapping_sub(bias))?;
        Some(start.wrapping_add(bias))
    }
}

/// An instruction of the process's code whose result cannot be recorded
/// on this host (`introspect::instructions::unrecordable`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Unrecordable {
    pub(crate) addr: u64,
    pub(crate) name: &'static str,
    /// Where it is: "main+0x1c in prog", or the object alone.
    pub(crate) place: String,
}

impl MappedObjects {
    /// The instructions of the process's objects (the program, its
    /// dynamic linker and the libraries loaded) whose results this host
    /// cannot record, at their addresses in the process.
    pub(crate) fn unrecordable(&self, files: &OpenFiles) -> Vec<Unrecordable> {
        let mut found = Vec::new();
        for (path, data, bias) in objects(files, &self.exe, &self.auxv, &self.libraries) {
            let Ok(elf) = LoadImage::parse(data) else {
                continue;
            };
            let symbols = ElfSymbols::parse_with_debug(data, files.files.debug_file(&path));
            let file = path.rsplit('/').next().unwrap_or(&path).to_owned();
            for (vaddr, code) in elf.code() {
                for (at, name) in introspect::instructions::unrecordable(code, vaddr) {
                    let function = symbols.as_ref().and_then(|s| {
                        let name = s.function(at)?;
                        let start = s.function_start(at)?;
                        Some(format!("{name}+{:#x}", at - start))
                    });
                    found.push(Unrecordable {
                        addr: at.wrapping_add(bias),
                        name,
                        place: match function {
                            Some(f) => format!("{f} in {file}"),
                            None => file.clone(),
                        },
                    });
                }
            }
        }
        found
    }
}

/// What the process's code holds that insight cannot record, in words:
/// "RDRAND at 0x… (main+0x1c in prog)" for the first few; empty if none.
pub(crate) fn unrecordable_text(found: &[Unrecordable]) -> String {
    const SHOWN: usize = 3;
    let mut parts: Vec<String> = found
        .iter()
        .take(SHOWN)
        .map(|u| format!("{} at {:#x} ({})", u.name, u.addr, u.place))
        .collect();
    if found.len() > SHOWN {
        parts.push(format!("{} more", found.len() - SHOWN));
    }
    parts.join(", ")
}

/// The objects the process maps, as (path, contents, load bias): the
/// program (its bias from `AT_ENTRY`), its dynamic linker (`AT_BASE`) and
/// the libraries the dynamic linker has loaded (`libraries`, name and
/// bias).
fn objects<'f>(
    files: &'f OpenFiles,
    exe: &str,
    auxv: &[u8],
    libraries: &[(String, u64)],
) -> Vec<(String, &'f [u8], u64)> {
    let exe = files.program_path(exe);
    let exe = exe.as_str();
    let Some(program) = files.guest_file(exe) else {
        return Vec::new();
    };
    let Ok(elf) = LoadImage::parse(program) else {
        return Vec::new();
    };
    let mut objects = Vec::new();
    if let Some(entry) = auxv_value(auxv, AT_ENTRY) {
        objects.push((exe.to_owned(), program, entry.wrapping_sub(elf.entry())));
    }
    if let (Some(interp), Some(base)) = (elf.interp(), auxv_value(auxv, AT_BASE)) {
        if let Some(data) = files.guest_file(interp) {
            objects.push((interp.to_owned(), data, base));
        }
    }
    for (name, bias) in libraries {
        if let Some(data) = files.guest_file(name) {
            objects.push((name.clone(), data, *bias));
        }
    }
    objects
}

/// Copies what `data` holds from `offset`, at most `length` bytes and what
/// `buf` takes; how many.
pub(crate) fn copy_out(data: &[u8], offset: u64, length: usize, buf: &mut [u8]) -> usize {
    let start = usize::try_from(offset)
        .unwrap_or(usize::MAX)
        .min(data.len());
    let n = (data.len() - start).min(length).min(buf.len());
    buf[..n].copy_from_slice(&data[start..start + n]);
    n
}

/// The value of `key` in an auxiliary vector.
pub(crate) fn auxv_value(auxv: &[u8], key: u64) -> Option<u64> {
    auxv.chunks_exact(16).find_map(|pair| {
        let k = u64::from_le_bytes(pair[..8].try_into().ok()?);
        let v = u64::from_le_bytes(pair[8..].try_into().ok()?);
        (k == key).then_some(v)
    })
}

const AT_PHDR: u64 = 3;
const AT_BASE: u64 = 7;
const AT_ENTRY: u64 = 9;
const AT_PHENT: u64 = 4;
const AT_PHNUM: u64 = 5;
const PT_DYNAMIC: u32 = 2;
const PT_PHDR: u32 = 6;
const DT_NULL: u64 = 0;
const DT_DEBUG: u64 = 21;

/// An entry of the dynamic linker's `link_map` chain.
pub(crate) struct LinkEntry {
    /// The entry's own address.
    pub(crate) lm: u64,
    /// The object's load bias.
    pub(crate) l_addr: u64,
    /// Its dynamic section.
    pub(crate) l_ld: u64,
    pub(crate) name: String,
}

/// The dynamic linker's list of loaded objects, from its `r_debug` and
/// `link_map` chain in the process's memory (`read` reads it; `auxv` is
/// the program's): the main entry's address and the objects after it.
/// None until the dynamic linker has set it up.
pub(crate) fn link_map(
    auxv: &[u8],
    read: &dyn Fn(u64, &mut [u8]) -> usize,
) -> Option<(u64, Vec<LinkEntry>)> {
    let word = |at: u64| -> Option<u64> {
        let mut b = [0u8; 8];
        (read(at, &mut b) == 8).then(|| u64::from_le_bytes(b))
    };
    let phdr = auxv_value(auxv, AT_PHDR)?;
    let phent = auxv_value(auxv, AT_PHENT)?;
    let phnum = auxv_value(auxv, AT_PHNUM)?;
    if phent < 56 || phnum > 1024 {
        return None;
    }
    // The program's load bias, from its own program header (PT_PHDR).
    let mut bias = None;
    let mut dynamic = None;
    for i in 0..phnum {
        let at = phdr + i * phent;
        let (kind, vaddr) = (word(at)?, word(at + 16)?);
        match kind as u32 {
            PT_PHDR => bias = Some(phdr.wrapping_sub(vaddr)),
            PT_DYNAMIC => dynamic = Some(vaddr),
            _ => {}
        }
    }
    let dynamic = dynamic?.wrapping_add(bias.unwrap_or(0));
    let mut r_debug = None;
    for i in 0..512 {
        let (Some(tag), Some(value)) = (word(dynamic + 16 * i), word(dynamic + 16 * i + 8)) else {
            break;
        };
        match tag {
            DT_NULL => break,
            DT_DEBUG => r_debug = Some(value),
            _ => {}
        }
    }
    let main_lm = r_debug.filter(|&r| r != 0).and_then(|r| word(r + 8))?;
    let mut entries = Vec::new();
    let mut lm = word(main_lm + 24).unwrap_or(0);
    while lm != 0 && entries.len() < 4096 {
        let (Some(l_addr), Some(name_at), Some(l_ld), Some(next)) =
            (word(lm), word(lm + 8), word(lm + 16), word(lm + 24))
        else {
            break;
        };
        let name = c_string(read, name_at, 4096);
        entries.push(LinkEntry {
            lm,
            l_addr,
            l_ld,
            name,
        });
        lm = next;
    }
    Some((main_lm, entries))
}

/// The shared libraries of the process as gdb's `qXfer:libraries-svr4`
/// takes them (see [`link_map`]); empty until the dynamic linker has set
/// its list up.
pub(crate) fn libraries_svr4(auxv: &[u8], read: &dyn Fn(u64, &mut [u8]) -> usize) -> String {
    let Some((main_lm, entries)) = link_map(auxv, read) else {
        return r#"<library-list-svr4 version="1.0"/>"#.to_owned();
    };
    let mut xml = format!(r#"<library-list-svr4 version="1.0" main-lm="{main_lm:#x}">"#);
    for e in entries.iter().filter(|e| !e.name.is_empty()) {
        xml += &format!(
            r#"<library name="{}" lm="{:#x}" l_addr="{:#x}" l_ld="{:#x}" lmid="0x0"/>"#,
            xml_escape(&e.name),
            e.lm,
            e.l_addr,
            e.l_ld
        );
    }
    xml + "</library-list-svr4>"
}

/// A NUL-terminated string of at most `max` bytes at `at`.
fn c_string(read: &dyn Fn(u64, &mut [u8]) -> usize, at: u64, max: usize) -> String {
    let mut out = Vec::new();
    let mut chunk = [0u8; 64];
    while out.len() < max {
        let n = read(at + out.len() as u64, &mut chunk);
        if n == 0 {
            break;
        }
        if let Some(end) = chunk[..n].iter().position(|&b| b == 0) {
            out.extend_from_slice(&chunk[..end]);
            break;
        }
        out.extend_from_slice(&chunk[..n]);
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn xml_escape(text: &str) -> String {
    text.chars()
        .map(|c| match c {
            '&' => "&amp;".to_owned(),
            '<' => "&lt;".to_owned(),
            '>' => "&gt;".to_owned(),
            '"' => "&quot;".to_owned(),
            '\'' => "&apos;".to_owned(),
            c if c.is_control() => format!("&#{};", c as u32),
            c => c.to_string(),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    /// A little memory of words and strings, as a process would have it.
    struct Mem(BTreeMap<u64, u8>);

    impl Mem {
        fn put(&mut self, at: u64, bytes: &[u8]) {
            for (i, b) in bytes.iter().enumerate() {
                self.0.insert(at + i as u64, *b);
            }
        }
        fn word(&mut self, at: u64, value: u64) {
            self.put(at, &value.to_le_bytes());
        }
        fn read(&self, at: u64, buf: &mut [u8]) -> usize {
            for (i, b) in buf.iter_mut().enumerate() {
                match self.0.get(&(at + i as u64)) {
                    Some(v) => *b = *v,
                    None => return i,
                }
            }
            buf.len()
        }
    }

    fn auxv(pairs: &[(u64, u64)]) -> Vec<u8> {
        pairs
            .iter()
            .flat_map(|(k, v)| k.to_le_bytes().into_iter().chain(v.to_le_bytes()))
            .collect()
    }

    #[test]
    fn the_library_list_follows_the_dynamic_linkers_chain() {
        let bias = 0x5555_0000_0000u64;
        let mut m = Mem(BTreeMap::new());
        // Program headers at bias+0x40: PT_PHDR (vaddr 0x40), PT_DYNAMIC
        // (vaddr 0x3000).
        m.word(bias + 0x40, u64::from(PT_PHDR));
        m.word(bias + 0x40 + 16, 0x40);
        m.word(bias + 0x40 + 56, u64::from(PT_DYNAMIC));
        m.word(bias + 0x40 + 56 + 16, 0x3000);
        let a = auxv(&[
            (AT_PHDR, bias + 0x40),
            (AT_PHENT, 56),
            (AT_PHNUM, 2),
            (0, 0),
        ]);
        // No DT_DEBUG yet: nothing.
        m.word(bias + 0x3000, DT_DEBUG);
        m.word(bias + 0x3008, 0);
        m.word(bias + 0x3010, DT_NULL);
        m.word(bias + 0x3018, 0);
        assert_eq!(
            libraries_svr4(&a, &|at, buf| m.read(at, buf)),
            r#"<library-list-svr4 version="1.0"/>"#
        );
        // r_debug at 0x9000, the chain: main (no name) -> libc -> ld.so.
        m.word(bias + 0x3008, 0x9000);
        m.word(0x9008, 0xa000);
        m.word(0xa000 + 24, 0xb000);
        m.word(0xb000, 0x7f00_0000_0000);
        m.word(0xb008, 0xc000);
        m.word(0xb010, 0x7f00_0000_3000);
        m.word(0xb018, 0xd000);
        m.put(0xc000, b"/lib/x86_64-linux-gnu/libc.so.6\0");
        m.word(0xd000, 0x7f10_0000_0000);
        m.word(0xd008, 0xe000);
        m.word(0xd010, 0x7f10_0000_2000);
        m.word(0xd018, 0);
        m.put(0xe000, b"/lib64/ld-<x>.so\0");
        let xml = libraries_svr4(&a, &|at, buf| m.read(at, buf));
        assert_eq!(
            xml,
            concat!(
                r#"<library-list-svr4 version="1.0" main-lm="0xa000">"#,
                r#"<library name="/lib/x86_64-linux-gnu/libc.so.6" lm="0xb000" l_addr="0x7f0000000000" l_ld="0x7f0000003000" lmid="0x0"/>"#,
                r#"<library name="/lib64/ld-&lt;x&gt;.so" lm="0xd000" l_addr="0x7f1000000000" l_ld="0x7f1000002000" lmid="0x0"/>"#,
                "</library-list-svr4>"
            )
        );
        // A vector without program headers, or a garbage one: empty.
        assert!(libraries_svr4(&auxv(&[(0, 0)]), &|at, buf| m.read(at, buf)).ends_with("/>"));
    }

    #[test]
    fn reads_past_the_end_copy_nothing() {
        let mut buf = [0u8; 4];
        assert_eq!(copy_out(b"abcdef", 4, 10, &mut buf), 2);
        assert_eq!(&buf[..2], b"ef");
        assert_eq!(copy_out(b"abc", 9, 10, &mut buf), 0);
        assert_eq!(copy_out(b"abcdef", 0, 2, &mut buf), 2);
    }
}
