//! A process's program and libraries as its dynamic linker finds them:
//! the program's load bias and dynamic section from its auxiliary vector
//! and program headers, the libraries from the linker's `r_debug` list.

use crate::tools::control::tasks::{auxv_value, AT_PHDR, AT_PHNUM};

/// The load bias of a library a probe names (`object`) in a process's
/// list of loaded libraries.
pub(super) fn library_base(libraries: &[(String, u64)], object: &str) -> Option<u64> {
    (libraries.iter())
        .find(|(p, _)| same_object(p, object))
        .map(|&(_, base)| base)
}

/// Program header types.
const PT_DYNAMIC: u32 = 2;
const PT_PHDR: u32 = 6;
/// The size of an `Elf64_Phdr`, and the most read.
const PHDR_SIZE: usize = 56;
const MAX_PHDRS: u64 = 128;

/// A program, from its auxiliary vector and its program headers in
/// memory (read with `read`), as the dynamic linker finds itself: its
/// load bias (where the headers are, less where `PT_PHDR` says they are)
/// and its dynamic section (`None`: a static program). `None` while the
/// headers are not in memory.
pub(crate) fn loaded_program(
    read: &dyn Fn(u64, &mut [u8]) -> usize,
    auxv: &[u8],
) -> Option<(Option<u64>, Option<u64>)> {
    let (Some(phdr), Some(phnum)) = (auxv_value(auxv, AT_PHDR), auxv_value(auxv, AT_PHNUM)) else {
        return Some((None, None));
    };
    let mut headers = vec![0u8; PHDR_SIZE * phnum.min(MAX_PHDRS) as usize];
    if read(phdr, &mut headers) < headers.len() {
        return None;
    }
    let field =
        |h: &[u8], at: usize| u64::from_le_bytes(h[at..at + 8].try_into().expect("8 bytes"));
    let of_type = |t: u32| {
        headers
            .chunks_exact(PHDR_SIZE)
            .find(|h| u32::from_le_bytes(h[..4].try_into().expect("4 bytes")) == t)
            .map(|h| field(h, 16))
    };
    let Some(bias) = of_type(PT_PHDR).map(|vaddr| phdr.wrapping_sub(vaddr)) else {
        return Some((None, None));
    };
    Some((
        Some(bias),
        of_type(PT_DYNAMIC).map(|v| bias.wrapping_add(v)),
    ))
}

/// Whether the dynamic linker's name of a library (`path`) is the one a
/// probe names (`object`: a path, or a file name).
pub(super) fn same_object(path: &str, object: &str) -> bool {
    let name = |p: &str| p.rsplit('/').next().unwrap_or(p).to_owned();
    path == object || name(path) == name(object)
}

/// `DT_DEBUG`, the dynamic-section tag whose value the dynamic linker
/// sets to its `r_debug`.
const DT_DEBUG: u64 = 21;
/// The most dynamic entries and libraries read.
const MAX_DYNAMIC: u64 = 256;
const MAX_LIBRARIES: usize = 1024;

/// The libraries in the dynamic linker's list of a process whose
/// executable's dynamic section is at `dynamic`, read with `read`:
/// (path, load bias). Empty until the dynamic linker has made the list;
/// a list the program damaged ends where it stops making sense.
pub(crate) fn loaded_libraries(
    read: &dyn Fn(u64, &mut [u8]) -> usize,
    dynamic: u64,
) -> Vec<(String, u64)> {
    let u64_at = |va: u64| {
        let mut b = [0u8; 8];
        (read(va, &mut b) == 8).then(|| u64::from_le_bytes(b))
    };
    let mut r_debug = None;
    for i in 0..MAX_DYNAMIC {
        let at = dynamic.wrapping_add(16 * i);
        match u64_at(at) {
            Some(0) | None => break,
            Some(DT_DEBUG) => {
                r_debug = u64_at(at.wrapping_add(8));
                break;
            }
            Some(_) => {}
        }
    }
    let Some(r_debug) = r_debug.filter(|&r| r != 0) else {
        return Vec::new();
    };
    // struct r_debug { int r_version; struct link_map *r_map; ... }
    let mut map = u64_at(r_debug.wrapping_add(8)).unwrap_or(0);
    let mut out = Vec::new();
    while map != 0 && out.len() < MAX_LIBRARIES {
        // struct link_map { l_addr; char *l_name; l_ld; l_next; l_prev }
        let (Some(base), Some(name_at), Some(next)) = (
            u64_at(map),
            u64_at(map.wrapping_add(8)),
            u64_at(map.wrapping_add(24)),
        ) else {
            break;
        };
        let mut name = vec![0u8; 512];
        let n = if name_at == 0 {
            0
        } else {
            read(name_at, &mut name)
        };
        name.truncate(n);
        if let Some(end) = name.iter().position(|&b| b == 0) {
            name.truncate(end);
        }
        out.push((String::from_utf8_lossy(&name).into_owned(), base));
        map = next;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Reads from `mem` as if it were mapped at address 0.
    fn reader(mem: Vec<u8>) -> impl Fn(u64, &mut [u8]) -> usize {
        move |va: u64, buf: &mut [u8]| {
            let at = (va as usize).min(mem.len());
            let n = buf.len().min(mem.len() - at);
            buf[..n].copy_from_slice(&mem[at..at + n]);
            n
        }
    }

    #[test]
    fn libraries_are_read_from_the_dynamic_linkers_list() {
        // Dynamic section at 0x1000: DT_NEEDED, DT_DEBUG -> r_debug at
        // 0x2000, whose r_map lists the executable ("") and libc.
        let mut mem = vec![0u8; 0x4000];
        let put = |mem: &mut Vec<u8>, at: usize, v: u64| {
            mem[at..at + 8].copy_from_slice(&v.to_le_bytes())
        };
        put(&mut mem, 0x1000, 1);
        put(&mut mem, 0x1008, 7);
        put(&mut mem, 0x1010, DT_DEBUG);
        put(&mut mem, 0x1018, 0x2000);
        put(&mut mem, 0x2008, 0x2100);
        put(&mut mem, 0x2100, 0x5555_0000);
        put(&mut mem, 0x2108, 0x3000);
        put(&mut mem, 0x2118, 0x2200);
        put(&mut mem, 0x2200, 0x7f00_0000);
        put(&mut mem, 0x2208, 0x3010);
        let path = b"/lib/x86_64-linux-gnu/libc.so.6\0";
        mem[0x3010..0x3010 + path.len()].copy_from_slice(path);
        let mut early = mem.clone();
        assert_eq!(
            loaded_libraries(&reader(mem), 0x1000),
            [
                (String::new(), 0x5555_0000),
                ("/lib/x86_64-linux-gnu/libc.so.6".to_owned(), 0x7f00_0000)
            ]
        );
        // Before the dynamic linker set DT_DEBUG: nothing.
        early[0x1018..0x1020].fill(0);
        assert!(loaded_libraries(&reader(early), 0x1000).is_empty());
        // A list that loops on itself ends.
        let mut looped = vec![0u8; 0x4000];
        put(&mut looped, 0x1000, DT_DEBUG);
        put(&mut looped, 0x1008, 0x2000);
        put(&mut looped, 0x2008, 0x2100);
        put(&mut looped, 0x2118, 0x2100);
        assert_eq!(
            loaded_libraries(&reader(looped), 0x1000).len(),
            MAX_LIBRARIES
        );
        assert!(same_object("/lib/x86_64-linux-gnu/libc.so.6", "libc.so.6"));
        assert!(same_object(
            "/lib/x86_64-linux-gnu/libc.so.6",
            "/usr/lib/x86_64-linux-gnu/libc.so.6"
        ));
        assert!(!same_object("/lib/libm.so.6", "libc.so.6"));
    }

    #[test]
    fn a_program_finds_its_bias_and_dynamic_section_in_its_headers() {
        // Program headers at 0x5555_0040 (PT_PHDR says 0x40): PT_LOAD,
        // PT_DYNAMIC at 0x2de0.
        let mut mem = vec![0u8; 0x200];
        let phdr = |mem: &mut Vec<u8>, n: usize, kind: u32, vaddr: u64| {
            let at = 0x40 + n * PHDR_SIZE;
            mem[at..at + 4].copy_from_slice(&kind.to_le_bytes());
            mem[at + 16..at + 24].copy_from_slice(&vaddr.to_le_bytes());
        };
        phdr(&mut mem, 0, PT_PHDR, 0x40);
        phdr(&mut mem, 1, 1, 0);
        phdr(&mut mem, 2, PT_DYNAMIC, 0x2de0);
        let base = 0x5555_0000u64;
        let read = |va: u64, buf: &mut [u8]| reader(mem.clone())(va.wrapping_sub(base), buf);
        let auxv: Vec<u8> = [(AT_PHDR, base + 0x40), (AT_PHNUM, 3), (0, 0)]
            .iter()
            .flat_map(|&(k, v): &(u64, u64)| k.to_le_bytes().into_iter().chain(v.to_le_bytes()))
            .collect();
        assert_eq!(
            loaded_program(&read, &auxv),
            Some((Some(base), Some(base + 0x2de0)))
        );
        // A static program: no dynamic section.
        let mut static_mem = mem.clone();
        static_mem[0x40 + 2 * PHDR_SIZE..0x40 + 2 * PHDR_SIZE + 4].fill(0);
        let read_static =
            |va: u64, buf: &mut [u8]| reader(static_mem.clone())(va.wrapping_sub(base), buf);
        assert_eq!(
            loaded_program(&read_static, &auxv),
            Some((Some(base), None))
        );
        // Not said: never known; not in memory yet: later.
        assert_eq!(loaded_program(&read, &auxv[16..]), Some((None, None)));
        assert_eq!(loaded_program(&|_, _| 0, &auxv), None);
    }
}
