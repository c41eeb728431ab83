//! What insight reads of the ELF files a guest runs, beside their symbols
//! (`symbols.rs`): how the loader maps one (its entry point, its loadable
//! segments, its interpreter), what it links against (DT_NEEDED,
//! DT_RPATH, DT_RUNPATH), its build ID, and the sections unwinding by
//! call-frame information reads.
//!
//! Every byte of these files is untrusted: each read is bounded by the
//! file, and a malformed file is an error naming the cause or `None`,
//! never a panic.

use object::elf::{self, FileHeader64, ProgramHeader64};
use object::read::elf::{Dyn, FileHeader, ProgramHeader};
use object::{LittleEndian, Object, ObjectSection, ObjectSegment};

/// Why an ELF file cannot be read as the x86-64 guest would load it.
#[derive(Debug, thiserror::Error)]
pub enum ElfError {
    #[error("{0} (not a 64-bit little-endian ELF file)")]
    NotElf64(object::Error),
    #[error("machine {0}")]
    Machine(u16),
    #[error("bad PT_INTERP")]
    Interp,
    #[error(transparent)]
    Malformed(#[from] object::Error),
}

/// A 64-bit little-endian ELF file's header.
fn header64(data: &[u8]) -> Result<&FileHeader64<LittleEndian>, ElfError> {
    let header = FileHeader64::<LittleEndian>::parse(data).map_err(ElfError::NotElf64)?;
    header.endian()?;
    Ok(header)
}

/// Whether `data` is a 64-bit x86-64 ELF file (the loader skips other
/// architectures' files of a library's name and searches on).
pub fn is_x86_64(data: &[u8]) -> bool {
    header64(data).is_ok_and(|h| h.e_machine(LittleEndian) == elf::EM_X86_64)
}

/// The GNU build ID of an ELF file, if it has one.
pub fn build_id(data: &[u8]) -> Option<&[u8]> {
    object::File::parse(data).ok()?.build_id().ok()?
}

/// The lowest address and the end of what an ELF file's loadable
/// segments cover, before the load bias; `None` when they cover nothing.
pub(crate) fn load_span(file: &object::File<'_>) -> Option<(u64, u64)> {
    let mut span = (u64::MAX, 0u64);
    for seg in file.segments() {
        span.0 = span.0.min(seg.address());
        span.1 = span.1.max(seg.address().saturating_add(seg.size()));
    }
    (span.0 < span.1).then_some(span)
}

/// The text of a NUL-terminated string field (all of it without a NUL).
fn c_text(bytes: &[u8]) -> String {
    let end = bytes.iter().position(|&b| b == 0).unwrap_or(bytes.len());
    String::from_utf8_lossy(&bytes[..end]).into_owned()
}

/// A loadable segment: where it lies in the file and in the object's
/// address space (before the load bias).
struct Segment {
    offset: u64,
    vaddr: u64,
    filesz: u64,
    memsz: u64,
    /// Mapped executable (PF_X).
    code: bool,
}

/// A 64-bit little-endian ELF file as the loader maps it: its entry
/// point, its loadable segments and the interpreter it names.
pub struct LoadImage<'a> {
    data: &'a [u8],
    entry: u64,
    segments: Vec<Segment>,
    interp: Option<String>,
}

impl<'a> LoadImage<'a> {
    /// Reads `data`'s program headers (any machine).
    pub fn parse(data: &'a [u8]) -> Result<Self, ElfError> {
        Self::from_header(header64(data)?, data)
    }

    fn from_header(header: &FileHeader64<LittleEndian>, data: &'a [u8]) -> Result<Self, ElfError> {
        let endian = LittleEndian;
        let mut image = LoadImage {
            data,
            entry: header.e_entry(endian),
            segments: Vec::new(),
            interp: None,
        };
        for ph in header.program_headers(endian, data)? {
            match ph.p_type(endian) {
                elf::PT_LOAD => image.segments.push(segment(ph)),
                elf::PT_INTERP => {
                    let bytes = ph.data(endian, data).map_err(|()| ElfError::Interp)?;
                    image.interp = Some(c_text(bytes));
                }
                _ => {}
            }
        }
        Ok(image)
    }

    /// Its entry point (`e_entry`), before the load bias.
    pub fn entry(&self) -> u64 {
        self.entry
    }

    /// The interpreter it names (PT_INTERP): the dynamic loader.
    pub fn interp(&self) -> Option<&str> {
        self.interp.as_deref()
    }

    /// The executable segments' file contents, each with its address
    /// before the load bias.
    pub fn code(&self) -> impl Iterator<Item = (u64, &'a [u8])> + '_ {
        self.segments.iter().filter(|s| s.code).filter_map(|s| {
            let start = usize::try_from(s.offset).ok()?;
            let end = start.checked_add(usize::try_from(s.filesz).ok()?)?;
            Some((s.vaddr, self.data.get(start..end)?))
        })
    }

    /// Copies what the object, loaded at `bias`, holds at `at` (to the end
    /// of the segment or of `buf`); how many bytes, none if no segment
    /// covers `at`. Past a segment's file contents lies zero-filled memory.
    pub fn read(&self, bias: u64, at: u64, buf: &mut [u8]) -> usize {
        let rel = at.wrapping_sub(bias);
        let Some(seg) = self
            .segments
            .iter()
            .find(|s| rel >= s.vaddr && rel - s.vaddr < s.memsz)
        else {
            return 0;
        };
        let into = rel - seg.vaddr;
        let n = usize::try_from(seg.memsz - into)
            .unwrap_or(usize::MAX)
            .min(buf.len());
        for (i, b) in buf[..n].iter_mut().enumerate() {
            let k = into + i as u64;
            *b = if k < seg.filesz {
                let Some(v) = usize::try_from(seg.offset + k)
                    .ok()
                    .and_then(|o| self.data.get(o))
                else {
                    return i;
                };
                *v
            } else {
                0
            };
        }
        n
    }
}

fn segment(ph: &ProgramHeader64<LittleEndian>) -> Segment {
    let endian = LittleEndian;
    Segment {
        offset: ph.p_offset(endian),
        vaddr: ph.p_vaddr(endian),
        filesz: ph.p_filesz(endian),
        memsz: ph.p_memsz(endian),
        code: ph.p_flags(endian) & elf::PF_X != 0,
    }
}

/// What the dynamic loader reads of an x86-64 ELF file to link it.
#[derive(Debug, Default)]
pub struct DynamicLinking {
    /// Its DT_NEEDED libraries, in order.
    pub needed: Vec<String>,
    /// Its DT_RPATH and DT_RUNPATH, as written (empty without one).
    pub rpath: String,
    pub runpath: String,
    /// Its interpreter (PT_INTERP).
    pub interp: Option<String>,
}

/// The dynamic linking of `data`; `None` if it is not ELF (a script runs
/// with its interpreter), an error if it is ELF but not an x86-64 program
/// or library the guest can run.
pub fn dynamic_linking(data: &[u8]) -> Result<Option<DynamicLinking>, ElfError> {
    if !data.starts_with(&elf::ELFMAG) {
        return Ok(None);
    }
    let endian = LittleEndian;
    let header = header64(data)?;
    if header.e_machine(endian) != elf::EM_X86_64 {
        return Err(ElfError::Machine(header.e_machine(endian)));
    }
    let mut info = DynamicLinking {
        interp: LoadImage::from_header(header, data)?.interp,
        ..Default::default()
    };
    let sections = header.sections(endian, data)?;
    if let Some((entries, link)) = sections.dynamic(endian, data)? {
        let strings = sections.strings(endian, data, link)?;
        for entry in entries {
            let value = || entry.string(endian, strings).map(c_text);
            match entry.tag32(endian) {
                Some(elf::DT_NEEDED) => info.needed.push(value()?),
                Some(elf::DT_RPATH) => info.rpath = value()?,
                Some(elf::DT_RUNPATH) => info.runpath = value()?,
                _ => {}
            }
        }
    }
    Ok(Some(info))
}

/// What unwinding by call-frame information reads of an ELF file, in the
/// file's own addresses.
pub struct UnwindSections<'a> {
    /// The `.eh_frame` section's bytes (empty without one) and address.
    pub eh_frame: &'a [u8],
    pub eh_frame_address: u64,
    /// The addresses of `.text` and `.got`, bases of pointer encodings.
    pub text: Option<u64>,
    pub got: Option<u64>,
    /// What its loadable segments cover: lowest address, end.
    pub span: (u64, u64),
}

/// The sections unwinding reads of a 64-bit little-endian ELF file;
/// `None` if it is not one, or has no loadable segments.
pub fn unwind_sections(data: &[u8]) -> Option<UnwindSections<'_>> {
    let file = object::File::parse(data).ok()?;
    if !file.is_64() || !file.is_little_endian() {
        return None;
    }
    let span = load_span(&file)?;
    let address = |name: &str| file.section_by_name(name).map(|s| s.address());
    let (eh_frame, eh_frame_address) = match file.section_by_name(".eh_frame") {
        Some(s) => (s.data().ok()?, s.address()),
        None => (&[][..], 0),
    };
    Some(UnwindSections {
        eh_frame,
        eh_frame_address,
        text: address(".text"),
        got: address(".got"),
        span,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn this_exe() -> Vec<u8> {
        std::fs::read(std::env::current_exe().unwrap()).unwrap()
    }

    #[test]
    fn this_test_binary_links_against_libc_through_its_loader() {
        let exe = this_exe();
        let linking = dynamic_linking(&exe).unwrap().unwrap();
        assert!(
            linking.needed.iter().any(|n| n.starts_with("libc.so")),
            "{:?}",
            linking.needed
        );
        let interp = linking.interp.expect("an interpreter");
        assert!(interp.contains("ld-linux"), "{interp}");
        assert!(is_x86_64(&exe));
        assert!(build_id(&exe).is_some_and(|id| !id.is_empty()));
        // Not ELF: no linking; ELF of another machine: named.
        assert!(dynamic_linking(b"#!/bin/sh\n").unwrap().is_none());
        let mut arm = exe.clone();
        arm[18..20].copy_from_slice(&elf::EM_AARCH64.to_le_bytes());
        let err = dynamic_linking(&arm).unwrap_err();
        assert_eq!(err.to_string(), format!("machine {}", elf::EM_AARCH64));
        assert!(!is_x86_64(&arm));
        let err = dynamic_linking(b"\x7fELF\x01\x01").unwrap_err();
        assert!(err.to_string().contains("not a 64-bit"), "{err}");
    }

    #[test]
    fn a_load_image_reads_what_its_segments_map() {
        let exe = this_exe();
        let image = LoadImage::parse(&exe).unwrap();
        assert!(image.interp().is_some());
        // The ELF header is at the start of the first loadable segment
        // (at offset 0) in a position-independent executable.
        let bias = 0x5555_0000_0000;
        let mut magic = [0u8; 4];
        let low = image.segments.iter().map(|s| s.vaddr).min().unwrap();
        assert_eq!(image.read(bias, bias + low, &mut magic), 4);
        assert_eq!(&magic, b"\x7fELF");
        // Nothing below it, nor past the end of the last segment.
        let end = (image.segments.iter())
            .map(|s| s.vaddr + s.memsz)
            .max()
            .unwrap();
        assert_eq!(image.read(bias, bias + end, &mut magic), 0);
        assert_eq!(image.read(bias, bias.wrapping_sub(1), &mut magic), 0);
        // Cut anywhere: an error or an image, no panic.
        for n in (0..4096.min(exe.len())).step_by(7) {
            if let Ok(cut) = LoadImage::parse(&exe[..n]) {
                cut.read(bias, bias + low, &mut [0; 64]);
            }
            let _ = dynamic_linking(&exe[..n]);
            let _ = unwind_sections(&exe[..n]);
        }
    }

    #[test]
    fn unwind_sections_are_found_in_this_test_binary() {
        let exe = this_exe();
        let sections = unwind_sections(&exe).unwrap();
        assert!(!sections.eh_frame.is_empty());
        assert!(sections.text.is_some());
        assert!(sections.span.0 < sections.span.1);
        assert!(unwind_sections(b"not an ELF file").is_none());
    }
}
