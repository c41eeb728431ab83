//! Symbolization of guest addresses: which object, function, variable
//! and source line an address of a process (or of the guest kernel) is,
//! from the objects each process announced and the guest's files.

use std::cell::OnceCell;
use std::collections::HashMap;

use crate::guest_files::GuestFiles;
use crate::symbols::ElfSymbols;

/// The object (and, without symbols, the function) of kernel addresses.
pub const KERNEL: &str = "[kernel]";

/// Where an address of a process lies.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct CodeLocation {
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

    /// The path of the object of process `pid` that covers `addr`.
    pub fn object(&self, pid: u32, addr: u64) -> Option<&str> {
        self.object_at(pid, addr).map(|(path, _, _)| path)
    }

    /// The source line of code address `addr` of process `pid`
    /// ("file.c:42"), where DWARF tells.
    pub fn line(&self, pid: u32, addr: u64) -> Option<String> {
        let (_, elf, rel) = self.object_at(pid, addr)?;
        elf.line(rel)
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

    /// An address of process `pid` inside one of its objects that no
    /// symbol names (a stripped program's static), by the object and its
    /// offset there: "pigz+0x133e0", the same in every run.
    pub fn object_offset(&mut self, pid: u32, addr: u64) -> Option<String> {
        let (path, _, rel) = self.object_at(pid, addr)?;
        let object = path.rsplit('/').next().unwrap_or(path);
        Some(format!("{object}+{rel:#x}"))
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
    pub fn locate_kernel(&self, addr: u64) -> CodeLocation {
        let elf = self.kernel.get_or_init(|| {
            let image = self.files.kernel()?;
            ElfSymbols::parse(image).filter(|elf| !elf.functions.is_empty())
        });
        let function = elf.as_ref().filter(|elf| elf.covers(addr)).and_then(|elf| {
            // The kernel's assembly (entry code, interrupt stubs) has
            // symbols without a size: they reach to the next one.
            let i = elf.functions.partition_point(|f| f.0 <= addr);
            let (start, end, name) = elf.functions.get(i.checked_sub(1)?)?;
            (addr < *end || *end == start + 1).then_some(name.as_str())
        });
        CodeLocation {
            object: KERNEL.to_owned(),
            function: function.unwrap_or(KERNEL).to_owned(),
        }
    }

    /// Where `addr` of process `pid` lies.
    pub fn locate(&mut self, pid: u32, addr: u64) -> CodeLocation {
        match self.object_at(pid, addr) {
            Some((path, elf, rel)) => CodeLocation {
                function: elf
                    .function(rel)
                    .map_or_else(|| format!("{rel:#x}"), str::to_owned),
                object: path.to_owned(),
            },
            None => CodeLocation {
                object: "[unknown]".to_owned(),
                function: "[unknown]".to_owned(),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::guest_files::stripped_build_id;
    use crate::newc::{write_entry, S_IFDIR, S_IFREG, TRAILER};

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

        let archive = |lib: &[u8]| {
            let mut a = Vec::new();
            write_entry(&mut a, 1, "usr", S_IFDIR | 0o755, b"");
            write_entry(&mut a, 2, "usr/lib", S_IFDIR | 0o755, b"");
            write_entry(&mut a, 3, "usr/lib/libt.so", S_IFREG | 0o755, lib);
            write_entry(&mut a, 4, TRAILER, 0, b"");
            a
        };
        let a = archive(&stripped);
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
        std::fs::write(by_id.join(format!("{}.debug", &hex[2..])), b"not an elf").unwrap();
        let mut g = GuestFiles::from_initramfs(&a);
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
