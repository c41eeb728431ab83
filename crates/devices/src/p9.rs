//! The 9P2000.L wire format: message types, and reading and writing the
//! little-endian fields of a message. Every read is bounds-checked: a
//! request is guest input.

/// A message's header: size[4] type[1] tag[2].
pub const HEADER_BYTES: usize = 7;
/// An `Rread`'s header before its data: the message header and count[4].
pub const READ_HEADER_BYTES: usize = HEADER_BYTES + 4;

pub const RLERROR: u8 = 7;
pub const TSTATFS: u8 = 8;
pub const RSTATFS: u8 = 9;
pub const TLOPEN: u8 = 12;
pub const RLOPEN: u8 = 13;
pub const TLCREATE: u8 = 14;
pub const TSYMLINK: u8 = 16;
pub const TMKNOD: u8 = 18;
pub const TRENAME: u8 = 20;
pub const TREADLINK: u8 = 22;
pub const RREADLINK: u8 = 23;
pub const TGETATTR: u8 = 24;
pub const RGETATTR: u8 = 25;
pub const TSETATTR: u8 = 26;
pub const TXATTRWALK: u8 = 30;
pub const TXATTRCREATE: u8 = 32;
pub const TREADDIR: u8 = 40;
pub const RREADDIR: u8 = 41;
pub const TFSYNC: u8 = 50;
pub const RFSYNC: u8 = 51;
pub const TLOCK: u8 = 52;
pub const RLOCK: u8 = 53;
pub const TLINK: u8 = 70;
pub const TMKDIR: u8 = 72;
pub const TRENAMEAT: u8 = 74;
pub const TUNLINKAT: u8 = 76;
pub const TVERSION: u8 = 100;
pub const RVERSION: u8 = 101;
pub const TATTACH: u8 = 104;
pub const RATTACH: u8 = 105;
pub const TFLUSH: u8 = 108;
pub const RFLUSH: u8 = 109;
pub const TWALK: u8 = 110;
pub const RWALK: u8 = 111;
pub const TREAD: u8 = 116;
pub const RREAD: u8 = 117;
pub const TWRITE: u8 = 118;
pub const TCLUNK: u8 = 120;
pub const RCLUNK: u8 = 121;
pub const TREMOVE: u8 = 122;

/// Whether a request of type `kind` would change the file system.
pub fn is_write(kind: u8) -> bool {
    matches!(
        kind,
        TLCREATE
            | TSYMLINK
            | TMKNOD
            | TRENAME
            | TSETATTR
            | TXATTRCREATE
            | TLINK
            | TMKDIR
            | TRENAMEAT
            | TUNLINKAT
            | TWRITE
            | TREMOVE
    )
}

/// Qid types.
pub const QTDIR: u8 = 0x80;
pub const QTSYMLINK: u8 = 0x02;
pub const QTFILE: u8 = 0;

/// A file's identity as the server gives it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Qid {
    pub kind: u8,
    pub version: u32,
    pub path: u64,
}

/// A request's type and tag, if it has a whole header.
pub fn header(message: &[u8]) -> Option<(u8, u16)> {
    let kind = *message.get(4)?;
    let tag = u16::from_le_bytes([*message.get(5)?, *message.get(6)?]);
    Some((kind, tag))
}

/// The fields of a message, read in order.
pub struct Reader<'a> {
    buf: &'a [u8],
    at: usize,
}

/// A message ended before a field it should have.
#[derive(Debug, PartialEq, Eq)]
pub struct Short;

impl<'a> Reader<'a> {
    /// The body of `message`, after its header.
    pub fn body(message: &'a [u8]) -> Self {
        Reader {
            buf: message,
            at: HEADER_BYTES.min(message.len()),
        }
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], Short> {
        let end = self.at.checked_add(n).ok_or(Short)?;
        let bytes = self.buf.get(self.at..end).ok_or(Short)?;
        self.at = end;
        Ok(bytes)
    }

    pub fn u16(&mut self) -> Result<u16, Short> {
        let b = self.take(2)?;
        Ok(u16::from_le_bytes([b[0], b[1]]))
    }

    pub fn u32(&mut self) -> Result<u32, Short> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    pub fn u64(&mut self) -> Result<u64, Short> {
        let b = self.take(8)?;
        let mut v = [0u8; 8];
        v.copy_from_slice(b);
        Ok(u64::from_le_bytes(v))
    }

    /// A string: len[2] then its bytes.
    pub fn string(&mut self) -> Result<&'a [u8], Short> {
        let len = self.u16()?;
        self.take(usize::from(len))
    }
}

/// A reply being written; `finish` fills in its size.
pub struct Writer {
    buf: Vec<u8>,
}

impl Writer {
    pub fn new(kind: u8, tag: u16) -> Self {
        let mut buf = Vec::with_capacity(64);
        buf.extend_from_slice(&[0; 4]);
        buf.push(kind);
        buf.extend_from_slice(&tag.to_le_bytes());
        Writer { buf }
    }

    pub fn len(&self) -> usize {
        self.buf.len()
    }

    pub fn is_empty(&self) -> bool {
        self.buf.is_empty()
    }

    pub fn u8(&mut self, v: u8) -> &mut Self {
        self.buf.push(v);
        self
    }

    pub fn u16(&mut self, v: u16) -> &mut Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }

    pub fn u32(&mut self, v: u32) -> &mut Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }

    pub fn u64(&mut self, v: u64) -> &mut Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }

    pub fn bytes(&mut self, v: &[u8]) -> &mut Self {
        self.buf.extend_from_slice(v);
        self
    }

    /// A string: len[2] then its bytes (cut at 65535 bytes).
    pub fn string(&mut self, v: &[u8]) -> &mut Self {
        let v = &v[..v.len().min(usize::from(u16::MAX))];
        self.u16(v.len() as u16).bytes(v)
    }

    pub fn qid(&mut self, q: Qid) -> &mut Self {
        self.u8(q.kind).u32(q.version).u64(q.path)
    }

    pub fn finish(mut self) -> Vec<u8> {
        let size = self.buf.len() as u32;
        self.buf[..4].copy_from_slice(&size.to_le_bytes());
        self.buf
    }
}

/// An `Rlerror` carrying `errno`.
pub fn error(tag: u16, errno: i32) -> Vec<u8> {
    let mut w = Writer::new(RLERROR, tag);
    w.u32(errno as u32);
    w.finish()
}

/// The header of an `Rread` of `count` bytes, which follow it.
pub fn read_header(tag: u16, count: u32) -> [u8; READ_HEADER_BYTES] {
    let mut h = [0u8; READ_HEADER_BYTES];
    let size = READ_HEADER_BYTES as u32 + count;
    h[..4].copy_from_slice(&size.to_le_bytes());
    h[4] = RREAD;
    h[5..7].copy_from_slice(&tag.to_le_bytes());
    h[7..].copy_from_slice(&count.to_le_bytes());
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_round_trip_and_short_messages_are_refused() {
        let mut w = Writer::new(TWALK, 7);
        w.u32(1).u32(2).u16(1).string(b"usr");
        let msg = w.finish();
        assert_eq!(u32::from_le_bytes(msg[..4].try_into().unwrap()), 22);
        assert_eq!(header(&msg), Some((TWALK, 7)));
        let mut r = Reader::body(&msg);
        assert_eq!((r.u32(), r.u32(), r.u16()), (Ok(1), Ok(2), Ok(1)));
        assert_eq!(r.string(), Ok(&b"usr"[..]));
        assert_eq!(r.u16(), Err(Short));
        // A string longer than what is left.
        let mut bad = Writer::new(TWALK, 7);
        bad.u16(200).bytes(b"ab");
        assert_eq!(Reader::body(&bad.finish()).string(), Err(Short));
        assert_eq!(header(&[1, 2, 3]), None);
        let h = read_header(9, 100);
        assert_eq!(u32::from_le_bytes(h[..4].try_into().unwrap()), 111);
        assert_eq!(header(&h), Some((RREAD, 9)));
    }
}
