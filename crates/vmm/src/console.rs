//! Host standard input for the guest's console.
//!
//! A reader thread collects bytes from standard input; the vCPU thread
//! moves them into the UART as its receive FIFO has room, or into the
//! virtio console, at VM exits. On a terminal, input is raw (keys go to
//! the guest, Ctrl-C included) and Ctrl-A x stops the VM; Ctrl-A Ctrl-A
//! sends one Ctrl-A. The terminal's size is looked up now and then for the
//! virtio console.

use std::collections::VecDeque;
use std::io::Read;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use crate::sys::RawStdin;

const CTRL_A: u8 = 0x01;

/// How often the terminal's size is looked up (a window being resized
/// is followed within this long).
const SIZE_POLL_NS: u64 = 100_000_000;
/// How much of a file or pipe on standard input is read ahead of what the
/// guest took.
const MAX_READ_AHEAD: usize = 4 << 20;

struct Shared {
    pending: Mutex<VecDeque<u8>>,
    quit: AtomicBool,
    /// Standard input is a terminal, whose size the guest is told.
    terminal: bool,
    /// Standard input ended (all it gave is in `pending`).
    ended: AtomicBool,
    since: Instant,
    /// Nanoseconds after `since` when the size is next looked up.
    next_size_poll: AtomicU64,
}

/// Bytes typed or piped for the guest.
#[derive(Clone)]
pub struct ConsoleInput {
    shared: Arc<Shared>,
}

/// Keeps the terminal raw while it lives.
pub struct TerminalGuard {
    _raw: Option<RawStdin>,
}

impl ConsoleInput {
    /// Starts reading standard input. The guard restores the terminal.
    pub fn from_stdin() -> (Self, TerminalGuard) {
        let raw = RawStdin::enter();
        let escapes = raw.is_some();
        let input = ConsoleInput {
            shared: Arc::new(Shared {
                pending: Mutex::default(),
                quit: AtomicBool::new(false),
                terminal: escapes,
                ended: AtomicBool::new(false),
                since: Instant::now(),
                next_size_poll: AtomicU64::new(0),
            }),
        };
        let shared = Arc::clone(&input.shared);
        // The thread ends at end of input; at exit the process ends it.
        let _ = std::thread::Builder::new()
            .name("console-input".into())
            .spawn(move || {
                let mut filter = EscapeFilter::new(escapes);
                let mut stdin = std::io::stdin().lock();
                let mut buf = vec![0u8; if escapes { 256 } else { 64 << 10 }];
                loop {
                    // A file or pipe is read ahead only so far.
                    while shared
                        .pending
                        .lock()
                        .is_ok_and(|q| q.len() >= MAX_READ_AHEAD)
                    {
                        std::thread::sleep(std::time::Duration::from_millis(1));
                    }
                    let Ok(n @ 1..) = stdin.read(&mut buf) else {
                        break;
                    };
                    let bytes = filter.feed(&buf[..n]);
                    if filter.quit {
                        shared.quit.store(true, Ordering::Release);
                        return;
                    }
                    if let Ok(mut q) = shared.pending.lock() {
                        q.extend(bytes);
                    }
                }
                shared.ended.store(true, Ordering::Release);
            });
        (input, TerminalGuard { _raw: raw })
    }

    /// Up to `max` pending bytes.
    pub fn take(&self, max: usize) -> Vec<u8> {
        match self.shared.pending.lock() {
            Ok(mut q) => {
                let n = max.min(q.len());
                q.drain(..n).collect()
            }
            Err(_) => Vec::new(),
        }
    }

    /// Up to `max` pending bytes, and whether standard input ended after
    /// them (for the command's standard input where it is a pipe).
    pub fn take_stream(&self, max: usize) -> (Vec<u8>, bool) {
        // Everything read is pending once the end is seen.
        let ended = self.shared.ended.load(Ordering::Acquire);
        match self.shared.pending.lock() {
            Ok(mut q) => {
                let n = max.min(q.len());
                let bytes = q.drain(..n).collect();
                (bytes, ended && q.is_empty())
            }
            Err(_) => (Vec::new(), true),
        }
    }

    /// Whether standard input is a terminal.
    pub fn is_terminal(&self) -> bool {
        self.shared.terminal
    }

    /// The terminal's size (columns, rows), looked up at most every
    /// `SIZE_POLL_NS`; `None` between lookups, and without a terminal.
    pub fn window_size(&self) -> Option<(u16, u16)> {
        let shared = &self.shared;
        if !shared.terminal {
            return None;
        }
        let now = shared.since.elapsed().as_nanos() as u64;
        if now < shared.next_size_poll.load(Ordering::Relaxed) {
            return None;
        }
        shared
            .next_size_poll
            .store(now + SIZE_POLL_NS, Ordering::Relaxed);
        crate::sys::stdin_terminal_size()
    }

    /// Whether the user asked to stop the VM (Ctrl-A x).
    pub fn quit_requested(&self) -> bool {
        self.shared.quit.load(Ordering::Acquire)
    }
}

/// Recognises the Ctrl-A escapes in terminal input.
struct EscapeFilter {
    enabled: bool,
    after_ctrl_a: bool,
    quit: bool,
}

impl EscapeFilter {
    fn new(enabled: bool) -> Self {
        EscapeFilter {
            enabled,
            after_ctrl_a: false,
            quit: false,
        }
    }

    fn feed(&mut self, input: &[u8]) -> Vec<u8> {
        if !self.enabled {
            return input.to_vec();
        }
        let mut out = Vec::with_capacity(input.len());
        for &b in input {
            if self.after_ctrl_a {
                self.after_ctrl_a = false;
                match b {
                    b'x' | b'X' => {
                        self.quit = true;
                        break;
                    }
                    CTRL_A => out.push(CTRL_A),
                    other => out.extend([CTRL_A, other]),
                }
            } else if b == CTRL_A {
                self.after_ctrl_a = true;
            } else {
                out.push(b);
            }
        }
        out
    }
}

/// Leaves the terminal's interrupt key (Ctrl-C) to a child program that
/// shares the terminal (`insight debug`'s gdb, which passes it on as an
/// interrupt of the replay): insight itself ignores it from now on.
pub fn leave_interrupt_key_to_child() {
    crate::sys::ignore_sigint();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escapes_on_a_terminal() {
        let mut f = EscapeFilter::new(true);
        assert_eq!(f.feed(b"ls\r"), b"ls\r");
        assert_eq!(f.feed(&[CTRL_A, CTRL_A, b'y']), [CTRL_A, b'y']);
        assert_eq!(f.feed(&[CTRL_A]), b"");
        assert_eq!(f.feed(b"q"), [CTRL_A, b'q']);
        assert!(!f.quit);
        assert_eq!(f.feed(&[b'a', CTRL_A, b'x', b'z']), b"a");
        assert!(f.quit);
    }

    #[test]
    fn piped_input_passes_through() {
        let mut f = EscapeFilter::new(false);
        assert_eq!(f.feed(&[CTRL_A, b'x']), [CTRL_A, b'x']);
        assert!(!f.quit);
    }
}
