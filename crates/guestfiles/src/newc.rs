//! The "newc" cpio format, the one the Linux initramfs unpacker reads: the
//! encoding of one entry (the image builder's writer appends them), and
//! the reader of the entries of archives laid one after another, as an
//! initramfs holds them.
//!
//! An entry is a 110-byte header of ASCII hex fields, the name with its
//! NUL, the body; name and body each padded to 4 bytes.

use std::borrow::Cow;

/// The type bits of an entry's mode, and the types insight reads.
pub const S_IFMT: u32 = 0o170000;
pub const S_IFDIR: u32 = 0o040000;
pub const S_IFREG: u32 = 0o100000;
pub const S_IFLNK: u32 = 0o120000;

/// The name of the entry that ends an archive.
pub const TRAILER: &str = "TRAILER!!!";

const MAGIC: &[u8; 6] = b"070701";
const HEADER_LEN: usize = 110;
/// Offsets of the header fields this reads.
const MODE_AT: usize = 14;
const SIZE_AT: usize = 54;
const NAMESIZE_AT: usize = 94;

/// Appends an entry to `out`, which holds whole entries only (the padding
/// is counted from its start). The body must be shorter than 4 GiB, the
/// format's bound; the caller checks it.
pub fn write_entry(out: &mut Vec<u8>, ino: u32, name: &str, mode: u32, body: &[u8]) {
    let nlink = if mode & S_IFMT == S_IFDIR { 2 } else { 1 };
    let header = format!(
        "070701{ino:08X}{mode:08X}{uid:08X}{gid:08X}{nlink:08X}{mtime:08X}{size:08X}\
         {dmaj:08X}{dmin:08X}{rmaj:08X}{rmin:08X}{namesize:08X}{check:08X}",
        uid = 0,
        gid = 0,
        mtime = 0,
        size = body.len(),
        dmaj = 0,
        dmin = 0,
        rmaj = 0,
        rmin = 0,
        namesize = name.len() + 1,
        check = 0,
    );
    out.extend_from_slice(header.as_bytes());
    out.extend_from_slice(name.as_bytes());
    out.push(0);
    pad(out);
    out.extend_from_slice(body);
    pad(out);
}

fn pad(out: &mut Vec<u8>) {
    while !out.len().is_multiple_of(4) {
        out.push(0);
    }
}

/// One entry of an archive, as stored.
pub struct ArchiveMember<'a> {
    /// Its name, as the archive spells it (UTF-8 or not).
    pub name: Cow<'a, str>,
    pub mode: u32,
    pub body: &'a [u8],
}

/// The entries of the archives in `data`, trailers included. Reading
/// stops at the first malformed header, keeping what came before: an
/// archive cut short still says what its complete entries are.
pub fn entries(data: &[u8]) -> Entries<'_> {
    Entries { data, at: 0 }
}

/// The iterator [`entries`] returns.
pub struct Entries<'a> {
    data: &'a [u8],
    at: usize,
}

impl<'a> Entries<'a> {
    /// Where reading stands: past the last entry returned, or at the
    /// malformed header that ended it.
    pub fn offset(&self) -> usize {
        self.at
    }

    fn field(&self, at: usize) -> Option<usize> {
        let text = std::str::from_utf8(self.data.get(at..at.checked_add(8)?)?).ok()?;
        u32::from_str_radix(text, 16).ok().map(|v| v as usize)
    }

    fn read(&self, at: usize) -> Option<(ArchiveMember<'a>, usize)> {
        if !self.data[at..].starts_with(MAGIC) {
            return None;
        }
        let mode = self.field(at + MODE_AT)?;
        let size = self.field(at + SIZE_AT)?;
        let namesize = self.field(at + NAMESIZE_AT)?;
        let name_start = at + HEADER_LEN;
        let name_end = name_start.checked_add(namesize)?;
        let body_start = name_end.checked_next_multiple_of(4)?;
        let body_end = body_start.checked_add(size)?;
        if namesize == 0 || body_end > self.data.len() {
            return None;
        }
        let entry = ArchiveMember {
            name: String::from_utf8_lossy(&self.data[name_start..name_end - 1]),
            mode: mode as u32,
            body: &self.data[body_start..body_end],
        };
        Some((entry, body_end.checked_next_multiple_of(4)?))
    }
}

impl<'a> Iterator for Entries<'a> {
    type Item = ArchiveMember<'a>;

    fn next(&mut self) -> Option<ArchiveMember<'a>> {
        while self.at + HEADER_LEN <= self.data.len() {
            // Archives are padded with zeros between them.
            if self.data[self.at] == 0 {
                self.at += 4;
                continue;
            }
            // A malformed header ends the reading where it stands.
            let (entry, next) = self.read(self.at)?;
            self.at = next;
            return Some(entry);
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_round_trip_across_concatenated_archives() {
        let mut a = Vec::new();
        write_entry(&mut a, 1, "usr", S_IFDIR | 0o755, b"");
        write_entry(&mut a, 2, "usr/x", S_IFREG | 0o644, b"hello");
        write_entry(&mut a, 3, TRAILER, 0, b"");
        a.extend_from_slice(&[0; 512]);
        write_entry(&mut a, 1, "l", S_IFLNK | 0o777, b"usr/x");
        let read: Vec<_> = entries(&a)
            .map(|e| (e.name.into_owned(), e.mode, e.body.to_vec()))
            .collect();
        assert_eq!(
            read,
            [
                ("usr".to_owned(), S_IFDIR | 0o755, b"".to_vec()),
                ("usr/x".to_owned(), S_IFREG | 0o644, b"hello".to_vec()),
                (TRAILER.to_owned(), 0, b"".to_vec()),
                ("l".to_owned(), S_IFLNK | 0o777, b"usr/x".to_vec()),
            ]
        );
        let mut all = entries(&a);
        all.by_ref().for_each(drop);
        assert_eq!(all.offset(), a.len());
        // Cut in the last entry's body (its last 3 bytes are padding).
        let mut cut = entries(&a[..a.len() - 4]);
        assert_eq!(cut.by_ref().count(), 3);
        // At the header of the entry cut short (110 + "l\0", padded, and
        // the body, padded: 120 bytes).
        assert_eq!(cut.offset(), a.len() - 120);
        // Cut anywhere: the complete entries before the cut, no panic.
        for n in 0..a.len() {
            assert!(entries(&a[..n]).count() <= 4);
        }
    }

    #[test]
    fn a_malformed_header_ends_the_reading() {
        let mut a = Vec::new();
        write_entry(&mut a, 1, "a", S_IFREG, b"1");
        let good = a.len();
        write_entry(&mut a, 2, "b", S_IFREG, b"2");
        write_entry(&mut a, 3, "c", S_IFREG, b"3");
        for (at, byte) in [
            (good, b'1'),
            (good + SIZE_AT, b'g'),
            (good + NAMESIZE_AT + 7, b'0'),
        ] {
            let mut bad = a.clone();
            bad[at] = byte;
            let names: Vec<_> = entries(&bad).map(|e| e.name.into_owned()).collect();
            assert_eq!(names, ["a"], "byte {at}");
        }
        // A size reaching past the end.
        let mut bad = a.clone();
        bad[good + SIZE_AT..good + SIZE_AT + 8].copy_from_slice(b"FFFFFFFF");
        assert_eq!(entries(&bad).count(), 1);
    }
}
