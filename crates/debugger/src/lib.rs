//! `insight debug`: a replay served to gdb over its remote protocol, one
//! guest process at a time, forwards and backwards (docs/debugging.md).
//!
//! The replay runs on the thread that serves gdb: gdb's packets are read
//! by a thread of their own, which also interrupts a running replay when
//! gdb sends Ctrl-C. Going back is replaying again from snapshots the
//! replay keeps in memory (`history.rs`).

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::mpsc;
use std::time::Duration;

use gdbstub::conn::Connection;
use gdbstub::stub::state_machine::GdbStubStateMachine;
use gdbstub::stub::GdbStub;
use guestfiles::GuestFiles;
use vmm::session::{DebugDriver, DebugEvent, ReplaySession};
use vmm::tools::debug::{Resume, StopKind};
use vmm::ReplayPoint;
use vmm::VmError;

mod arch;
mod files;
mod history;
mod target;

use files::OpenFiles;
use history::History;
use target::{GdbStopReason, ReplayTarget};

#[derive(Debug, thiserror::Error)]
pub enum DebugError {
    #[error(transparent)]
    Vm(#[from] VmError),
    #[error("the replay ended before the process started ({0})")]
    NeverStarted(String),
    #[error("the gdb connection failed")]
    Connection(#[source] std::io::Error),
    #[error("the gdb protocol: {0}")]
    Protocol(String),
}

/// How a debugging session begins.
pub struct DebugOptions {
    /// Where the session opens instead of the program's first
    /// instruction.
    pub at: Option<At>,
    /// Take a snapshot about this often (host time of replay): how far a
    /// reverse command replays at most.
    pub snapshot_every: Duration,
}

/// Where a session opens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum At {
    /// The first exit at or after this point where a thread of the
    /// process runs.
    Point(ReplayPoint),
    /// The process's end: the last time one of its threads entered the
    /// kernel from its code (its `exit_group`, or the `tgkill` of an
    /// `abort`), where its memory and stack are still whole and a failure
    /// can be stepped back from.
    End,
}

/// A replay stopped where a debugging session begins, ready for gdb.
pub struct Prepared {
    target: ReplayTarget,
}

impl Prepared {
    /// The process stopped: its pid and program.
    pub fn process(&self) -> Option<(u32, String)> {
        self.target
            .driver
            .debug()
            .process()
            .map(|p| (p.pid, p.exe.clone()))
    }
}

/// Runs `session` (which has a debugger attached) on this thread until
/// the process it selects starts, or to `options.at`; the thread must
/// serve gdb afterwards. `files` are the guest's.
pub fn prepare(
    session: ReplaySession,
    files: GuestFiles,
    options: &DebugOptions,
) -> Result<Prepared, DebugError> {
    let mut driver = DebugDriver::new(session, Some(options.snapshot_every))?;
    let start = match driver.resume(Resume::Start)? {
        DebugEvent::Stopped(stop) if stop.kind == StopKind::Started => stop.position,
        DebugEvent::Stopped(stop) => {
            return Err(DebugError::NeverStarted(format!(
                "it stopped for {:?} first",
                stop.kind
            )))
        }
        DebugEvent::Ended { stop, .. } => {
            return Err(DebugError::NeverStarted(format!("{stop:?}")))
        }
    };
    let mut history = History::new(start);
    match options.at {
        Some(At::Point(at)) => match driver.resume(Resume::Until(at))? {
            DebugEvent::Stopped(stop) => history.now = stop.position,
            DebugEvent::Ended { stop, .. } => {
                return Err(DebugError::NeverStarted(format!(
                    "the replay ended ({stop:?}) before {at}"
                )))
            }
        },
        Some(At::End) => {
            // To the process's end, nothing stopping on the way; then back
            // to its last entry into the kernel.
            loop {
                match driver.resume(Resume::Continue)? {
                    DebugEvent::Stopped(stop)
                        if !matches!(stop.kind, StopKind::ProcessExited { .. }) =>
                    {
                        continue
                    }
                    _ => break,
                }
            }
            let last = driver.debug().last_kernel_entry().ok_or_else(|| {
                DebugError::NeverStarted("the process never entered the kernel".into())
            })?;
            let end = vmm::tools::debug::Position {
                ordinal: last,
                user: None,
            };
            history.seek(&mut driver, end)?;
        }
        None => {}
    }
    let target = ReplayTarget::new(driver, history, OpenFiles::new(files));
    let found = target.mapped_objects().unrecordable(&target.files);
    if !found.is_empty() {
        eprintln!(
            "insight: the program executes {}: this host cannot record what such an instruction \
             gives it (its user code runs natively), so this replay's values are its own, and \
             going back over one may not find the position again (docs/debugging.md)",
            files::unrecordable_text(&found)
        );
    }
    Ok(Prepared { target })
}

/// gdb's connection: replies are gathered and sent at each flush (gdbstub
/// writes them a byte at a time).
struct Conn {
    stream: TcpStream,
    out: Vec<u8>,
}

impl Connection for Conn {
    type Error = std::io::Error;

    fn write(&mut self, byte: u8) -> std::io::Result<()> {
        self.out.push(byte);
        Ok(())
    }

    fn write_all(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        self.out.extend_from_slice(bytes);
        Ok(())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Write::write_all(&mut self.stream, &self.out)?;
        self.out.clear();
        Ok(())
    }

    fn on_session_start(&mut self) -> std::io::Result<()> {
        self.stream.set_nodelay(true)
    }
}

/// What the reader thread passes on.
enum Incoming {
    Bytes(Vec<u8>),
    Closed,
}

/// The largest packet gdb may send or be sent (memory and file reads come
/// in pieces of this size).
const PACKET_SIZE: usize = 0x4000;

/// Shuts a connection down, both ways, when dropped.
struct CloseOnDrop(TcpStream);

impl Drop for CloseOnDrop {
    fn drop(&mut self) {
        let _ = self.0.shutdown(std::net::Shutdown::Both);
    }
}

/// Serves the prepared replay to the gdb connected on `stream` until gdb
/// disconnects or kills the session.
pub fn serve(prepared: Prepared, stream: TcpStream) -> Result<(), DebugError> {
    let mut target = prepared.target;
    let interrupter = target.driver.interrupter();
    let (tx, rx) = mpsc::channel::<Incoming>();
    let mut reader = stream.try_clone().map_err(DebugError::Connection)?;
    // However the session ends, gdb hears that it did (the reader's
    // clone would keep the connection open).
    let _closer = CloseOnDrop(stream.try_clone().map_err(DebugError::Connection)?);
    std::thread::Builder::new()
        .name("gdb-reader".into())
        .spawn(move || {
            let mut buf = [0u8; 4096];
            loop {
                match reader.read(&mut buf) {
                    Ok(0) | Err(_) => {
                        let _ = tx.send(Incoming::Closed);
                        break;
                    }
                    Ok(n) => {
                        if buf[..n].contains(&0x03) {
                            interrupter.interrupt();
                        }
                        if tx.send(Incoming::Bytes(buf[..n].to_vec())).is_err() {
                            break;
                        }
                    }
                }
            }
        })
        .map_err(DebugError::Connection)?;
    let conn = Conn {
        stream,
        out: Vec::new(),
    };
    let protocol = |e: &dyn std::fmt::Display| DebugError::Protocol(e.to_string());
    let stub = GdbStub::builder(conn)
        .packet_buffer_size(PACKET_SIZE)
        .build()
        .map_err(|e| protocol(&e))?;
    let mut gdb = stub
        .run_state_machine(&mut target)
        .map_err(|e| protocol(&e))?;
    let mut pending = std::collections::VecDeque::new();
    let mut stop = None;
    let result = loop {
        gdb = match gdb {
            GdbStubStateMachine::Disconnected(_) => break Ok(()),
            GdbStubStateMachine::CtrlCInterrupt(g) => g
                .interrupt_handled(&mut target, None::<GdbStopReason>)
                .map_err(|e| protocol(&e))?,
            GdbStubStateMachine::Idle(g) => {
                let byte = loop {
                    if let Some(b) = pending.pop_front() {
                        break Some(b);
                    }
                    match rx.recv() {
                        Ok(Incoming::Bytes(bytes)) => pending.extend(bytes),
                        Ok(Incoming::Closed) | Err(_) => break None,
                    }
                };
                let Some(byte) = byte else {
                    break Ok(());
                };
                target.selection.feed(byte);
                g.incoming_data(&mut target, byte)
                    .map_err(|e| protocol(&e))?
            }
            GdbStubStateMachine::Running(g) => {
                if let Some(byte) = pending.pop_front() {
                    target.selection.feed(byte);
                    g.incoming_data(&mut target, byte)
                        .map_err(|e| protocol(&e))?
                } else if let Some(reason) = stop.take() {
                    target.selection.stopped(&reason);
                    g.report_stop(&mut target, reason)
                        .map_err(|e| protocol(&e))?
                } else {
                    match target.perform() {
                        Ok(reason) => stop = Some(reason),
                        Err(e) => break Err(DebugError::Vm(e)),
                    }
                    // What gdb sent meanwhile (a Ctrl-C) comes before the
                    // stop.
                    while let Ok(Incoming::Bytes(bytes)) = rx.try_recv() {
                        pending.extend(bytes);
                    }
                    GdbStubStateMachine::Running(g)
                }
            }
        };
        let conn = match &mut gdb {
            GdbStubStateMachine::Idle(g) => Some(g.borrow_conn()),
            GdbStubStateMachine::Running(g) => Some(g.borrow_conn()),
            _ => None,
        };
        if let Some(conn) = conn {
            conn.flush().map_err(DebugError::Connection)?;
        }
    };
    target.driver.finish();
    result
}
