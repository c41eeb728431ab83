//! Writing Ethernet frames as a pcap capture file (the classic libpcap
//! format, microsecond timestamps), readable by tcpdump and Wireshark.

use std::fs::File;
use std::io::{self, BufWriter, Write};
use std::path::Path;

/// Longest frame stored whole (receive offload hands over 64 KiB frames).
const SNAPLEN: u32 = 262_144;
const LINKTYPE_ETHERNET: u32 = 1;

pub struct PcapWriter<W: Write> {
    out: W,
    frames: u64,
}

impl PcapWriter<BufWriter<File>> {
    pub fn create(path: &Path) -> io::Result<Self> {
        PcapWriter::new(BufWriter::new(File::create(path)?))
    }
}

impl<W: Write> PcapWriter<W> {
    pub fn new(mut out: W) -> io::Result<Self> {
        let mut header = Vec::with_capacity(24);
        header.extend_from_slice(&0xa1b2_c3d4u32.to_le_bytes());
        header.extend_from_slice(&2u16.to_le_bytes());
        header.extend_from_slice(&4u16.to_le_bytes());
        header.extend_from_slice(&0i32.to_le_bytes()); // UTC
        header.extend_from_slice(&0u32.to_le_bytes()); // accuracy
        header.extend_from_slice(&SNAPLEN.to_le_bytes());
        header.extend_from_slice(&LINKTYPE_ETHERNET.to_le_bytes());
        out.write_all(&header)?;
        Ok(PcapWriter { out, frames: 0 })
    }

    /// Appends `frame`, stamped `ns` nanoseconds after the epoch of the
    /// capture (guest or replay time).
    pub fn frame(&mut self, ns: u64, frame: &[u8]) -> io::Result<()> {
        let stored = frame.len().min(SNAPLEN as usize);
        let mut record = Vec::with_capacity(16 + stored);
        record.extend_from_slice(&((ns / 1_000_000_000) as u32).to_le_bytes());
        record.extend_from_slice(&((ns % 1_000_000_000 / 1000) as u32).to_le_bytes());
        record.extend_from_slice(&(stored as u32).to_le_bytes());
        record.extend_from_slice(&(frame.len() as u32).to_le_bytes());
        record.extend_from_slice(&frame[..stored]);
        self.out.write_all(&record)?;
        self.frames += 1;
        Ok(())
    }

    pub fn frames(&self) -> u64 {
        self.frames
    }

    pub fn flush(&mut self) -> io::Result<()> {
        self.out.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_and_records_have_the_libpcap_layout() {
        let mut w = PcapWriter::new(Vec::new()).unwrap();
        w.frame(1_500_000_000, &[0xaa; 60]).unwrap();
        let bytes = w.out;
        assert_eq!(bytes.len(), 24 + 16 + 60);
        assert_eq!(&bytes[..4], &[0xd4, 0xc3, 0xb2, 0xa1]);
        assert_eq!(u32::from_le_bytes(bytes[20..24].try_into().unwrap()), 1);
        assert_eq!(u32::from_le_bytes(bytes[24..28].try_into().unwrap()), 1);
        assert_eq!(
            u32::from_le_bytes(bytes[28..32].try_into().unwrap()),
            500_000
        );
        assert_eq!(u32::from_le_bytes(bytes[32..36].try_into().unwrap()), 60);
        assert_eq!(bytes[40], 0xaa);
    }
}
