//! A status line on standard error for long operations, shown only on a
//! terminal, that stays out of the way of the guest's console output.

use std::io::{IsTerminal, Write};
use std::sync::{Arc, Mutex};

#[derive(Default)]
struct State {
    /// The line is on screen now.
    shown: bool,
    /// The console's last byte ended a line: the status may be drawn
    /// without breaking a partial line (a shell prompt) of the guest.
    at_line_start: bool,
}

/// A status line shared by the progress reporter and the console.
#[derive(Clone)]
pub struct StatusLine {
    enabled: bool,
    state: Arc<Mutex<State>>,
}

impl StatusLine {
    /// A status line drawn only when standard error is a terminal.
    pub fn for_stderr() -> Self {
        StatusLine {
            enabled: std::io::stderr().is_terminal(),
            state: Arc::new(Mutex::new(State {
                shown: false,
                at_line_start: true,
            })),
        }
    }

    pub fn enabled(&self) -> bool {
        self.enabled
    }

    /// Draws `text` in place of the previous status.
    pub fn show(&self, text: &str) {
        if !self.enabled {
            return;
        }
        let Ok(mut state) = self.state.lock() else {
            return;
        };
        if !state.at_line_start {
            return;
        }
        let mut err = std::io::stderr().lock();
        let _ = write!(err, "\r\x1b[K{text}");
        let _ = err.flush();
        state.shown = true;
    }

    /// Removes the status from the screen.
    pub fn clear(&self) {
        if let Ok(mut state) = self.state.lock() {
            clear_locked(&mut state);
        }
    }

    /// Wraps the console so that guest output first clears the status.
    pub fn console(&self, inner: Box<dyn Write + Send>) -> Box<dyn Write + Send> {
        Box::new(StatusConsole {
            status: self.clone(),
            inner,
        })
    }
}

fn clear_locked(state: &mut State) {
    if state.shown {
        let mut err = std::io::stderr().lock();
        let _ = write!(err, "\r\x1b[K");
        let _ = err.flush();
        state.shown = false;
    }
}

struct StatusConsole {
    status: StatusLine,
    inner: Box<dyn Write + Send>,
}

impl Write for StatusConsole {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if !self.status.enabled {
            return self.inner.write(buf);
        }
        let Ok(mut state) = self.status.state.lock() else {
            return self.inner.write(buf);
        };
        clear_locked(&mut state);
        let n = self.inner.write(buf)?;
        if n > 0 {
            state.at_line_start = buf[n - 1] == b'\n';
        }
        // The status is drawn on the terminal right after this output.
        self.inner.flush()?;
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

/// `text` from a trace or the guest, safe to print on a terminal:
/// control characters other than newline and tab (an escape sequence
/// could move the cursor, retitle the window or worse) are shown as
/// `\x1b`-style escapes.
pub fn printable(text: &str) -> std::borrow::Cow<'_, str> {
    let unsafe_char = |c: char| c.is_control() && c != '\n' && c != '\t';
    if !text.contains(unsafe_char) {
        return std::borrow::Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len() + 8);
    for c in text.chars() {
        // Control characters (Unicode's Cc) are all below U+0100.
        if unsafe_char(c) {
            out.push_str(&format!("\\x{:02x}", c as u32));
        } else {
            out.push(c);
        }
    }
    std::borrow::Cow::Owned(out)
}

/// `bytes` in B, KiB, MiB or GiB.
pub fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 4] = ["B", "KiB", "MiB", "GiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn control_characters_are_escaped_for_the_terminal() {
        assert_eq!(
            printable("plain text\tand\nlines"),
            "plain text\tand\nlines"
        );
        assert_eq!(printable("\x1b]0;owned\x07red"), "\\x1b]0;owned\\x07red");
        assert_eq!(printable("csi \u{9b}31m"), "csi \\x9b31m");
        assert_eq!(printable("del \x7f"), "del \\x7f");
    }

    #[test]
    fn human_bytes_picks_the_unit() {
        assert_eq!(human_bytes(0), "0 B");
        assert_eq!(human_bytes(1023), "1023 B");
        assert_eq!(human_bytes(1536), "1.5 KiB");
        assert_eq!(human_bytes(5 << 20), "5.0 MiB");
        assert_eq!(human_bytes(3 << 30), "3.0 GiB");
    }
}
