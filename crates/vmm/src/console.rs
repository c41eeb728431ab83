//! Host standard input for the guest's serial console.
//!
//! A reader thread collects bytes from standard input; the vCPU thread
//! moves them into the UART as its receive FIFO has room, at VM exits. On a
//! terminal, input is raw (keys go to the guest, Ctrl-C included) and
//! Ctrl-A x stops the VM; Ctrl-A Ctrl-A sends one Ctrl-A.

use std::collections::VecDeque;
use std::io::Read;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use crate::sys::RawStdin;

const CTRL_A: u8 = 0x01;

#[derive(Default)]
struct Shared {
    pending: Mutex<VecDeque<u8>>,
    quit: AtomicBool,
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
            shared: Arc::new(Shared::default()),
        };
        let shared = Arc::clone(&input.shared);
        // The thread ends at end of input; at exit the process ends it.
        let _ = std::thread::Builder::new()
            .name("console-input".into())
            .spawn(move || {
                let mut filter = EscapeFilter::new(escapes);
                let mut buf = [0u8; 256];
                let mut stdin = std::io::stdin().lock();
                while let Ok(n @ 1..) = stdin.read(&mut buf) {
                    let bytes = filter.feed(&buf[..n]);
                    if filter.quit {
                        shared.quit.store(true, Ordering::Release);
                        return;
                    }
                    if let Ok(mut q) = shared.pending.lock() {
                        q.extend(bytes);
                    }
                }
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
