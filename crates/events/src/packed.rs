//! The packed event format: events in blocks of up to [`BLOCK_EVENTS`],
//! each stored as one zstd-compressed blob of column streams, so that an
//! event costs a few bytes instead of an SQLite row (docs/events.md,
//! "Packed blocks").
//!
//! A block, before compression:
//!
//! ```text
//! varint threads; per thread: varint pid, varint lwpid
//! then nine streams, each a varint length and that many bytes:
//!   kinds   varint per event
//!   flags   one byte per event: source (bits 0-1), has addr (2), has
//!           caller (3), has value (4), has stack (5)
//!   times   zigzag varint per event: difference to the previous event's
//!           time (the first: to 0)
//!   threads varint per event: index into the block's thread table
//!   addrs   zigzag varint per event with an addr but a SAMPLE: difference to the
//!           previous addr of an event of the same kind in the block (the
//!           first: to 0)
//!   callers the same for caller
//!   values  zigzag varint per event with a value
//!   stacks  per event with a stack: varint frames, then each frame as a
//!           zigzag difference to the frame before it (the first: to the
//!           first frame of the previous stack in the block)
//!   rips    the addrs of SAMPLE events, coded like addrs
//! ```
//!
//! Decoding trusts nothing: every length and index is checked, and the
//! decompressed size is bounded.

use crate::abi::{Kind, Source};

/// Events per block.
pub const BLOCK_EVENTS: usize = 4096;
/// Frames kept per stack.
pub const MAX_FRAMES: usize = 256;
/// The largest block this reader decompresses (a block of
/// [`BLOCK_EVENTS`] full events with full stacks stays well below).
const MAX_RAW: usize = 64 << 20;
const LEVEL: i32 = 9;
/// Kinds with a difference base of their own (larger ones share the last).
const BASES: usize = 32;

/// Samples' RIPs have a stream of their own: their differences are
/// random, the other addresses' repeat.
fn addr_stream(kind: Kind) -> usize {
    if kind == Kind::Sample {
        8
    } else {
        4
    }
}

fn base(kind: Kind) -> usize {
    usize::from(kind as u16).min(BASES - 1)
}

/// One event of a block.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PackedEvent {
    pub time: u64,
    pub kind: Kind,
    pub source: Source,
    pub pid: u32,
    pub lwpid: u32,
    pub addr: Option<u64>,
    pub caller: Option<u64>,
    pub value: Option<i64>,
    pub stack: Option<Vec<u64>>,
}

fn put(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn zigzag(v: i64) -> u64 {
    ((v << 1) ^ (v >> 63)) as u64
}

fn unzigzag(v: u64) -> i64 {
    ((v >> 1) as i64) ^ -((v & 1) as i64)
}

fn put_diff(out: &mut Vec<u8>, prev: &mut u64, v: u64) {
    put(out, zigzag(v.wrapping_sub(*prev) as i64));
    *prev = v;
}

/// Encodes and compresses `events` (at most [`BLOCK_EVENTS`]).
pub fn encode(events: &[PackedEvent]) -> Vec<u8> {
    debug_assert!(
        events.len() <= BLOCK_EVENTS,
        "a block holds at most {BLOCK_EVENTS} events"
    );
    let mut table: Vec<(u32, u32)> = Vec::new();
    let mut s: [Vec<u8>; 9] = Default::default();
    let (mut time, mut first_frame) = (0u64, 0u64);
    let (mut addr, mut caller) = ([0u64; BASES], [0u64; BASES]);
    for e in events {
        put(&mut s[0], u64::from(e.kind as u16));
        let flags = e.source as u8
            | u8::from(e.addr.is_some()) << 2
            | u8::from(e.caller.is_some()) << 3
            | u8::from(e.value.is_some()) << 4
            | u8::from(e.stack.is_some()) << 5;
        s[1].push(flags);
        put_diff(&mut s[2], &mut time, e.time);
        let thread = match table.iter().position(|&t| t == (e.pid, e.lwpid)) {
            Some(i) => i,
            None => {
                table.push((e.pid, e.lwpid));
                table.len() - 1
            }
        };
        put(&mut s[3], thread as u64);
        if let Some(a) = e.addr {
            put_diff(&mut s[addr_stream(e.kind)], &mut addr[base(e.kind)], a);
        }
        if let Some(c) = e.caller {
            put_diff(&mut s[5], &mut caller[base(e.kind)], c);
        }
        if let Some(v) = e.value {
            put(&mut s[6], zigzag(v));
        }
        if let Some(stack) = &e.stack {
            let frames = &stack[..stack.len().min(MAX_FRAMES)];
            put(&mut s[7], frames.len() as u64);
            let mut prev = first_frame;
            for (i, &f) in frames.iter().enumerate() {
                put_diff(&mut s[7], &mut prev, f);
                if i == 0 {
                    first_frame = f;
                }
            }
        }
    }
    let mut raw = Vec::new();
    put(&mut raw, table.len() as u64);
    for (pid, lwpid) in &table {
        put(&mut raw, u64::from(*pid));
        put(&mut raw, u64::from(*lwpid));
    }
    for stream in &s {
        put(&mut raw, stream.len() as u64);
        raw.extend_from_slice(stream);
    }
    // Compressing bytes in memory cannot fail but for allocation; keep the
    // raw block then (the reader tells them apart by the zstd magic).
    zstd::bulk::compress(&raw, LEVEL).unwrap_or(raw)
}

/// A reader over one stream.
struct Cursor<'a> {
    data: &'a [u8],
    at: usize,
    what: &'static str,
}

impl<'a> Cursor<'a> {
    fn new(data: &'a [u8], what: &'static str) -> Self {
        Cursor { data, at: 0, what }
    }

    fn varint(&mut self) -> Result<u64, String> {
        let mut v = 0u64;
        for shift in (0..64).step_by(7) {
            let b = *self
                .data
                .get(self.at)
                .ok_or_else(|| format!("the {} stream ends early", self.what))?;
            self.at += 1;
            v |= u64::from(b & 0x7f) << shift;
            if b & 0x80 == 0 {
                return Ok(v);
            }
        }
        Err(format!("an overlong number in the {} stream", self.what))
    }

    fn diff(&mut self, prev: &mut u64) -> Result<u64, String> {
        let d = unzigzag(self.varint()?);
        *prev = prev.wrapping_add(d as u64);
        Ok(*prev)
    }

    fn byte(&mut self) -> Result<u8, String> {
        let b = *self
            .data
            .get(self.at)
            .ok_or_else(|| format!("the {} stream ends early", self.what))?;
        self.at += 1;
        Ok(b)
    }

    fn bytes(&mut self, n: usize) -> Result<&'a [u8], String> {
        let end = self
            .at
            .checked_add(n)
            .filter(|&e| e <= self.data.len())
            .ok_or_else(|| format!("the {} stream is cut short", self.what))?;
        let b = &self.data[self.at..end];
        self.at = end;
        Ok(b)
    }

    fn u32(&mut self) -> Result<u32, String> {
        let v = self.varint()?;
        u32::try_from(v).map_err(|_| format!("{v} in the {} stream is not a u32", self.what))
    }
}

const ZSTD_MAGIC: [u8; 4] = [0x28, 0xb5, 0x2f, 0xfd];

/// Decodes a block of `count` events.
pub fn decode(blob: &[u8], count: usize) -> Result<Vec<PackedEvent>, String> {
    if count > BLOCK_EVENTS {
        return Err(format!(
            "{count} events in a block (at most {BLOCK_EVENTS})"
        ));
    }
    let raw;
    let data: &[u8] = if blob.starts_with(&ZSTD_MAGIC) {
        // The frame says how large it decompresses to: allocate that much,
        // not the most any block may be.
        let size = zstd::zstd_safe::get_frame_content_size(blob)
            .ok()
            .flatten()
            .ok_or("a compressed block that does not say its size")?;
        if size > MAX_RAW as u64 {
            return Err(format!(
                "a block of {size} bytes uncompressed (at most {MAX_RAW})"
            ));
        }
        raw = zstd::bulk::decompress(blob, size as usize)
            .map_err(|e| format!("cannot decompress: {e}"))?;
        &raw
    } else {
        blob
    };
    let mut c = Cursor::new(data, "block");
    let threads = c.varint()?;
    if threads > count as u64 {
        return Err(format!("{threads} threads for {count} events"));
    }
    let mut table = Vec::with_capacity(threads as usize);
    for _ in 0..threads {
        table.push((c.u32()?, c.u32()?));
    }
    const NAMES: [&str; 9] = [
        "kinds", "flags", "times", "threads", "addrs", "callers", "values", "stacks", "rips",
    ];
    let mut s: Vec<Cursor> = Vec::with_capacity(NAMES.len());
    for name in NAMES {
        let len = usize::try_from(c.varint()?).map_err(|_| "a stream length overflows")?;
        s.push(Cursor::new(c.bytes(len)?, name));
    }
    if c.at != data.len() {
        return Err(format!("{} bytes after the last stream", data.len() - c.at));
    }
    let (mut time, mut first_frame) = (0u64, 0u64);
    let (mut addr, mut caller) = ([0u64; BASES], [0u64; BASES]);
    let mut out = Vec::with_capacity(count);
    for _ in 0..count {
        let raw_kind = s[0].varint()?;
        let kind = u16::try_from(raw_kind)
            .ok()
            .and_then(Kind::from_u16)
            .ok_or_else(|| format!("unknown kind {raw_kind}"))?;
        let flags = s[1].byte()?;
        let source =
            Source::from_u8(flags & 3).ok_or_else(|| format!("unknown source {}", flags & 3))?;
        if flags >> 6 != 0 {
            return Err(format!("unknown flags {flags:#x}"));
        }
        let time_v = s[2].diff(&mut time)?;
        let index = s[3].varint()?;
        let &(pid, lwpid) = usize::try_from(index)
            .ok()
            .and_then(|i| table.get(i))
            .ok_or_else(|| format!("thread {index} of a table of {}", table.len()))?;
        let addr_v = if flags & 4 != 0 {
            Some(s[addr_stream(kind)].diff(&mut addr[base(kind)])?)
        } else {
            None
        };
        let caller_v = if flags & 8 != 0 {
            Some(s[5].diff(&mut caller[base(kind)])?)
        } else {
            None
        };
        let value = if flags & 16 != 0 {
            Some(unzigzag(s[6].varint()?))
        } else {
            None
        };
        let stack = if flags & 32 != 0 {
            let n = s[7].varint()?;
            if n > MAX_FRAMES as u64 {
                return Err(format!("a stack of {n} frames"));
            }
            let mut frames = Vec::with_capacity(n as usize);
            let mut prev = first_frame;
            for i in 0..n {
                let f = s[7].diff(&mut prev)?;
                if i == 0 {
                    first_frame = f;
                }
                frames.push(f);
            }
            Some(frames)
        } else {
            None
        };
        out.push(PackedEvent {
            time: time_v,
            kind,
            source,
            pid,
            lwpid,
            addr: addr_v,
            caller: caller_v,
            value,
            stack,
        });
    }
    if let Some(rest) = s.iter().find(|c| c.at != c.data.len()) {
        return Err(format!("bytes left over in the {} stream", rest.what));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(n: u64) -> Vec<PackedEvent> {
        let mut v = Vec::new();
        for i in 0..n {
            v.push(PackedEvent {
                time: 1_000_000 + i * 1234 - (i % 7) * 3000,
                kind: if i % 10 == 9 {
                    Kind::Sample
                } else {
                    Kind::Lock
                },
                source: if i % 10 == 9 {
                    Source::Host
                } else {
                    Source::Probe
                },
                pid: 100,
                lwpid: 100 + (i % 3) as u32,
                addr: Some(0x5555_0000_1000 + (i % 2) * 64),
                caller: (i % 4 != 0).then_some(0x5555_0000_0100),
                value: (i % 5 == 0).then_some(-(i as i64)),
                stack: (i % 10 == 9)
                    .then(|| vec![0x7fff_0000_1000 + i, 0x5555_0000_2000, u64::MAX]),
            });
        }
        v
    }

    #[test]
    fn round_trips_and_is_small() {
        let events = sample(1000);
        let blob = encode(&events);
        assert_eq!(decode(&blob, events.len()).unwrap(), events);
        // Far below an SQLite row (about 37 bytes).
        assert!(blob.len() < 8 * events.len(), "{} bytes", blob.len());
        assert_eq!(decode(&encode(&[]), 0).unwrap(), []);
    }

    #[test]
    fn corrupt_blocks_are_errors_not_panics() {
        let events = sample(200);
        let blob = encode(&events);
        let raw = zstd::bulk::decompress(&blob, MAX_RAW).unwrap();
        // Every prefix, and every byte flipped, of the raw block.
        for n in 0..raw.len() {
            let _ = decode(&raw[..n], events.len());
        }
        for i in 0..raw.len() {
            let mut bad = raw.clone();
            bad[i] ^= 0x5a;
            let _ = decode(&bad, events.len());
        }
        assert!(decode(&raw, events.len() + 1).is_err());
        assert!(decode(&blob[..blob.len() / 2], events.len()).is_err());
        assert!(decode(&blob, BLOCK_EVENTS + 1).is_err());
    }
}
