//! The host's x86-64 programs and libraries as the guest image carries
//! its own (images/no-rdtsc): every RDTSC instruction in their code
//! sections replaced by a two-byte NOP (66 90).
//!
//! On a host that cannot trap user-mode RDTSC (`insight host-check`) the
//! instruction returns the host's time stamp counter, different in every
//! run, and glibc reads it (the dynamic loader's start-up statistics, the
//! jitter of adaptive mutexes' spinning): a replay of a program that read
//! it would find other bytes in memory. With the NOP, "the TSC" reads as
//! whatever EDX:EAX held, the same in every run. Instructions are found by
//! decoding each code section from its start, as objdump does, so bytes
//! 0f 31 inside another instruction are never touched; a file that is not
//! a well-formed 64-bit ELF file is left as it is.

use iced_x86::{Code, Decoder, DecoderOptions};

const SHT_PROGBITS: u32 = 1;
const SHF_EXECINSTR: u64 = 4;
const SECTION_HEADER_BYTES: usize = 64;

/// Replaces the RDTSC instructions of `file`'s code sections in place;
/// returns how many it replaced.
pub fn patch(file: &mut [u8]) -> usize {
    if file.len() < 64 || &file[..4] != b"\x7fELF" || file[4] != 2 || file[5] != 1 {
        return 0;
    }
    let u16_at = |f: &[u8], at: usize| f.get(at..at + 2).map(|b| u16::from_le_bytes([b[0], b[1]]));
    let u32_at = |f: &[u8], at: usize| {
        f.get(at..at + 4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    };
    let u64_at = |f: &[u8], at: usize| {
        f.get(at..at + 8).map(|b| {
            let mut v = [0u8; 8];
            v.copy_from_slice(b);
            u64::from_le_bytes(v)
        })
    };
    let (Some(shoff), Some(entsize), Some(count)) =
        (u64_at(file, 0x28), u16_at(file, 0x3a), u16_at(file, 0x3c))
    else {
        return 0;
    };
    if usize::from(entsize) != SECTION_HEADER_BYTES {
        return 0;
    }
    let mut sites = Vec::new();
    for i in 0..usize::from(count) {
        let Some(header) = usize::try_from(shoff)
            .ok()
            .and_then(|s| s.checked_add(i * SECTION_HEADER_BYTES))
        else {
            return 0;
        };
        let (Some(kind), Some(flags), Some(offset), Some(size)) = (
            u32_at(file, header + 4),
            u64_at(file, header + 8),
            u64_at(file, header + 0x18),
            u64_at(file, header + 0x20),
        ) else {
            return 0;
        };
        if kind != SHT_PROGBITS || flags & SHF_EXECINSTR == 0 {
            continue;
        }
        let range = usize::try_from(offset).ok().and_then(|start| {
            let end = start.checked_add(usize::try_from(size).ok()?)?;
            (end <= file.len()).then_some(start..end)
        });
        let Some(range) = range else {
            continue;
        };
        let code = &file[range.clone()];
        let mut decoder = Decoder::with_ip(64, code, 0, DecoderOptions::NONE);
        for instruction in &mut decoder {
            if instruction.code() == Code::Rdtsc {
                let at = range.start + instruction.ip() as usize;
                if file.get(at..at + 2) == Some(&b"\x0f\x31"[..]) {
                    sites.push(at);
                }
            }
        }
    }
    for &at in &sites {
        file[at..at + 2].copy_from_slice(b"\x66\x90");
    }
    sites.len()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A minimal ELF file with one code section holding `code` and one
    /// data section holding `data`.
    fn elf(code: &[u8], data: &[u8]) -> Vec<u8> {
        let mut f = vec![0u8; 64];
        f[..6].copy_from_slice(b"\x7fELF\x02\x01");
        let code_at = f.len();
        f.extend_from_slice(code);
        let data_at = f.len();
        f.extend_from_slice(data);
        let shoff = f.len();
        f[0x28..0x30].copy_from_slice(&(shoff as u64).to_le_bytes());
        f[0x3a..0x3c].copy_from_slice(&64u16.to_le_bytes());
        f[0x3c..0x3e].copy_from_slice(&3u16.to_le_bytes());
        f.extend_from_slice(&[0u8; 64]); // the null section
        for (at, len, flags) in [(code_at, code.len(), 6u64), (data_at, data.len(), 2)] {
            let mut h = [0u8; 64];
            h[4..8].copy_from_slice(&SHT_PROGBITS.to_le_bytes());
            h[8..16].copy_from_slice(&flags.to_le_bytes());
            h[0x18..0x20].copy_from_slice(&(at as u64).to_le_bytes());
            h[0x20..0x28].copy_from_slice(&(len as u64).to_le_bytes());
            f.extend_from_slice(&h);
        }
        f
    }

    #[test]
    fn rdtsc_in_code_becomes_a_nop_and_nothing_else_changes() {
        // mov eax, 0x00310f00 (bytes 0f 31 inside it), rdtsc, ret.
        let code = b"\xb8\x00\x0f\x31\x00\x0f\x31\xc3";
        let data = b"\x0f\x31\x0f\x31";
        let mut file = elf(code, data);
        let before = file.clone();
        assert_eq!(patch(&mut file), 1);
        let changed: Vec<usize> = (0..file.len()).filter(|&i| file[i] != before[i]).collect();
        assert_eq!(changed, vec![64 + 5, 64 + 6]);
        assert_eq!(&file[64 + 5..64 + 7], b"\x66\x90");
        // Not ELF, cut short, or a section beyond the file: left alone.
        let mut text = b"#!/bin/sh\n\x0f\x31".to_vec();
        assert_eq!(patch(&mut text), 0);
        let mut cut = before[..100].to_vec();
        assert_eq!(patch(&mut cut), 0);
        assert_eq!(cut, before[..100]);
    }

    /// The host's glibc, where there is one: as many replaced as objdump
    /// finds (the image's script finds them with objdump).
    #[test]
    fn the_hosts_libc_loses_what_objdump_finds() {
        let libc = std::path::Path::new("/lib/x86_64-linux-gnu/libc.so.6");
        let Ok(mut bytes) = std::fs::read(libc) else {
            return;
        };
        let Ok(listing) = std::process::Command::new("objdump")
            .args(["-d", "--no-show-raw-insn"])
            .arg(libc)
            .output()
        else {
            return;
        };
        let text = String::from_utf8_lossy(&listing.stdout);
        let expected = text
            .lines()
            .filter(|l| l.split_whitespace().nth(1) == Some("rdtsc"))
            .count();
        assert!(expected > 0, "glibc reads the TSC somewhere");
        assert_eq!(patch(&mut bytes), expected);
        assert_eq!(patch(&mut bytes), 0, "none left");
    }
}
