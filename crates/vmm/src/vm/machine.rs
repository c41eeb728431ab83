//! The machine: the VM and its vCPU, and what every kind of run does with
//! them between two `KVM_RUN`s (console input, the run's archive, waiting
//! at HLT, injecting, dispatching an exit).

use std::io::Write;
use std::time::Duration;

use introspect::gva;
use kvm_ioctls::VcpuExit;
use vm_memory::{Bytes, GuestAddress};

use super::dispatch::{dispatch, Bus, GuestMsrs, Next};
use super::{kvm_err, HostStreams, Vcpu, Vm, VmError, BOOT_VCPU};
use crate::console::ConsoleInput;
use guest::config::ConsoleKind;
use journal::{Entry, Replayer};

/// How long a halted vCPU sleeps at most while console input is
/// attached: keys are looked for every few milliseconds.
const INPUT_POLL_NS: u64 = 5_000_000;

/// A piece of the command's output relayed to the host's stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct StreamWritten {
    pub(crate) bytes: u64,
    /// FNV-1a, as `StreamOut` logs it.
    pub(crate) digest: u64,
    /// The host's stream takes no more (a pipe whose reader has gone).
    pub(crate) closed: bool,
}

/// What the last exit left for interrupt delivery.
pub(crate) struct Delivery {
    /// The vCPU is at a delivery point (a deterministic exit or an
    /// asynchronous point).
    pub(crate) at_point: bool,
    /// It can take an interrupt now.
    pub(crate) can_inject: bool,
    /// An exception injected since the last KVM_RUN is on its way.
    pub(crate) exception_pending: bool,
}

/// A created VM and its vCPU, ready to run.
pub struct Machine {
    // Field order is drop order: the vCPU fd goes before the VM fd.
    pub(crate) vcpu: Vcpu,
    pub(crate) vm: Vm,
}

impl Machine {
    /// The VM without the vCPU.
    pub fn vm(&self) -> &Vm {
        &self.vm
    }

    /// Keeps the vCPU thread on host CPU `cpu` (`crate::host_cpu`).
    pub fn run_on_host_cpu(&mut self, cpu: usize) {
        self.vcpu.run_on_host_cpu(cpu);
    }

    /// Feeds host input to the guest's serial console.
    pub fn attach_input(&mut self, input: ConsoleInput) {
        self.vm.terminal.input = Some(input);
    }

    /// Also hands every Ethernet frame the guest transmits to `capture`.
    pub fn capture_net_tx(&mut self, capture: devices::virtio_net::FrameSink) {
        if let Some(net) = &mut self.vm.net {
            net.capture_tx(capture);
        }
    }

    /// Sends what `/init` relays of the command's standard output and
    /// error to `streams` (else to the console).
    pub fn set_streams(&mut self, streams: HostStreams) {
        self.vm.terminal.streams = streams;
    }

    /// Dispatches `exit`; `log` answers the guest's reads at replay.
    pub(crate) fn dispatch(
        vm: &mut Vm,
        (log, msrs): (Option<&mut Replayer>, Option<&mut dyn GuestMsrs>),
        exit: VcpuExit<'_>,
    ) -> Result<(Next, Option<Entry>), VmError> {
        let attached = vm.status.devices_attached;
        dispatch(
            &mut Bus {
                platform: &mut vm.platform,
                block: vm.block.as_mut().filter(|_| attached),
                net: vm.net.as_mut().filter(|_| attached),
                console: Some(&mut vm.console).filter(|_| attached),
                host_files: (vm.host_files.as_mut())
                    .map(|h| &mut h.device)
                    .filter(|_| attached),
                mem: &vm.mem,
            },
            log,
            msrs,
            &vm.clock,
            &mut vm.exits,
            BOOT_VCPU,
            exit,
        )
    }

    /// Injects external interrupt `vector`.
    pub(crate) fn inject(&mut self, vector: u8) -> Result<(), VmError> {
        self.vcpu.inject(vector)?;
        self.vm.exits.interrupts_injected += 1;
        Ok(())
    }

    /// Takes what the last exit left for interrupt delivery (see
    /// [`Delivery`]); under the `exit_clock` an interrupt may be injected
    /// only at a delivery point.
    pub(crate) fn take_delivery(&mut self, exit_clock: bool) -> Delivery {
        let at_point = std::mem::take(&mut self.vcpu.at_delivery_point);
        // The flags describe the vCPU at the last exit, before any
        // exception the VMM injected since.
        let can_inject = self.vcpu.interruptible() && (at_point || !exit_clock);
        Delivery {
            at_point,
            can_inject,
            exception_pending: std::mem::take(&mut self.vcpu.exception_pending),
        }
    }

    /// Injects the PIC's pending interrupt if the vCPU can take it
    /// (`can_inject`); returns its vector. Otherwise, unless `exit_clock`,
    /// asks KVM to exit as soon as it can: under the exit clock
    /// interrupts are injected only right after a deterministic exit, and
    /// the window exit is not one.
    pub(crate) fn inject_pending(
        &mut self,
        can_inject: bool,
        exit_clock: bool,
    ) -> Result<Option<u8>, VmError> {
        let pending = self.vm.platform.pic.has_pending();
        self.vcpu
            .request_interrupt_window(pending && !can_inject && !exit_clock);
        if pending && can_inject {
            if let Some(vector) = self.vm.platform.pic.acknowledge() {
                self.inject(vector)?;
                return Ok(Some(vector));
            }
        }
        Ok(None)
    }

    /// Moves pending host input to the command's terminal: into the UART
    /// as far as its FIFO has room, or into the virtio console, where it
    /// waits for the next delivery point; and notes the host terminal's
    /// size for the virtio console. UART input waits until `/init` runs:
    /// the console tty is open by then, and the kernel's serial driver
    /// resets the FIFO while it starts.
    pub(crate) fn feed_input(&mut self) -> Result<(), VmError> {
        let Some(input) = &self.vm.terminal.input else {
            return Ok(());
        };
        if input.quit_requested() {
            return Err(VmError::StoppedByUser);
        }
        // A command given the virtio console may still get the serial one
        // (a guest kernel without its driver): input waits until `/init`
        // says which.
        let virtio = match (self.vm.terminal.kind, self.vm.status.terminal) {
            (ConsoleKind::Serial, _) | (_, Some(false)) => false,
            (ConsoleKind::Virtio, Some(true)) => true,
            (ConsoleKind::Virtio, None) => return Ok(()),
        };
        if virtio {
            let console = &mut self.vm.console;
            let bytes = input.take(console.input_room());
            if !bytes.is_empty() {
                console.enqueue_input(&bytes);
            }
            if let Some(size) = input.window_size() {
                self.vm.terminal.size = Some(size);
            }
        } else if self.vm.status.init_reached.is_some() {
            let bytes = input.take(self.vm.platform.serial.input_room());
            if !bytes.is_empty() {
                self.vm.platform.receive_input(&bytes);
            }
        }
        Ok(())
    }

    /// The guest executed HLT: sleeps until an interrupt is due, calling
    /// `between` (housekeeping, inputs made visible) before each look at
    /// the PIC. `max_sleep_ns` bounds each sleep.
    pub(crate) fn wait_for_interrupt(
        &mut self,
        max_sleep_ns: u64,
        mut between: impl FnMut(&mut Machine) -> Result<(), VmError>,
    ) -> Result<(), VmError> {
        if !self.vcpu.halted_interruptible() {
            return Err(VmError::GuestHalted {
                rip: self.vcpu.rip_or_zero(),
            });
        }
        loop {
            self.feed_input()?;
            let now = self.vm.clock.now_ns();
            self.vm.platform.advance_to(now);
            between(self)?;
            if self.vm.platform.pic.has_pending() {
                return Ok(());
            }
            let max_sleep = if self.vm.terminal.input.is_some() {
                INPUT_POLL_NS
            } else {
                max_sleep_ns
            };
            match self.vm.platform.next_timer_ns() {
                Some(due) => {
                    let wait = due.saturating_sub(now).min(max_sleep);
                    self.vm.doorbell.wait(Duration::from_nanos(wait));
                }
                None => {
                    return Err(VmError::GuestHalted {
                        rip: self.vcpu.rip_or_zero(),
                    })
                }
            }
        }
    }

    /// `/init` asks for a piece of the run's archive: RCX bytes in, RDI
    /// bytes of it to its buffer at virtual address RSI. The same archive
    /// is written at the same exit in every replay.
    pub(crate) fn fetch_archive(&mut self) -> Result<(), VmError> {
        /// A piece larger than `/init`'s buffer is not one it asks for.
        const MAX_PIECE: u64 = 1 << 20;
        let regs = self.vcpu.synced_regs();
        let (gva, len, offset) = (regs.rsi, regs.rdi, regs.rcx);
        let archive = &self.vm.archive;
        let bad = |why: String| VmError::BadFetch { why };
        let end = offset
            .checked_add(len)
            .filter(|&end| end <= archive.len() as u64 && len <= MAX_PIECE)
            .ok_or_else(|| {
                bad(format!(
                    "at offset {offset}, {len} bytes, beyond its {} bytes",
                    archive.len()
                ))
            })?;
        let cr3 = self.vcpu.sregs()?.cr3;
        introspect::gva::write_virt(
            &self.vm.mem,
            cr3,
            gva,
            &archive[offset as usize..end as usize],
        )
        .map_err(|e| bad(format!("into a buffer at {gva:#x} it cannot write ({e})")))
    }

    /// `/init` relays what the command wrote to its standard `stream`
    /// (1: output, 2: error), a pipe in the guest: RDI bytes at virtual
    /// address RSI, read as user mode would (nothing in the guest
    /// changes). They go to the host's stream (`set_streams`), else to the
    /// console; returns what was written, which a recording logs and a
    /// replay checks.
    pub(crate) fn stream_output(&mut self, stream: u8) -> Result<StreamWritten, VmError> {
        /// `/init`'s buffer: a larger piece is not one it relays.
        const MAX_PIECE: u64 = 64 << 10;
        let regs = self.vcpu.synced_regs();
        let (gva, len) = (regs.rsi, regs.rdi);
        let bad = |why: String| VmError::BadOutput {
            what: journal::stream_name(stream),
            why,
        };
        if len == 0 || len > MAX_PIECE {
            return Err(bad(format!("in a piece of {len} bytes (1 to {MAX_PIECE})")));
        }
        let cr3 = self.vcpu.sregs()?.cr3;
        let mut text = vec![0u8; len as usize];
        let read = gva::peek_user(&self.vm.mem, cr3, gva, &mut text);
        if read != text.len() {
            return Err(bad(format!(
                "from a buffer at {gva:#x} it cannot read past byte {read} of {len}"
            )));
        }
        let streams = &mut self.vm.terminal.streams;
        let sink = match stream {
            1 => streams.out.as_mut(),
            _ => streams.err.as_mut(),
        };
        let written = match sink {
            Some(out) => out.write_all(&text).and_then(|()| out.flush()),
            None => {
                let console = self.vm.console.writer_mut();
                console.write_all(&text).and_then(|()| console.flush())
            }
        };
        if written.is_err() {
            self.vm.terminal.streams.errors += 1;
        }
        Ok(StreamWritten {
            bytes: len,
            digest: journal::output_digest(&text),
            closed: written.is_err_and(|e| e.kind() == std::io::ErrorKind::BrokenPipe),
        })
    }

    /// Tells `/init` that the host's stream of its last relayed piece
    /// takes no more: 1 in the u32 at virtual address R8 (0: it asked for
    /// no answer). Returns the guest-physical address written.
    pub(crate) fn answer_stream_closed(&mut self) -> Result<Option<u64>, VmError> {
        let at = self.vcpu.synced_regs().r8;
        if at == 0 {
            return Ok(None);
        }
        let cr3 = self.vcpu.sregs()?.cr3;
        let bad = |why: String| VmError::BadOutput {
            what: "output".to_owned(),
            why,
        };
        if !at.is_multiple_of(4) {
            return Err(bad(format!(
                "with an answer word at {at:#x}, not 4-byte aligned"
            )));
        }
        let gpa = gva::access(&self.vm.mem, cr3, at, true).map_err(|e| {
            bad(format!(
                "with an answer word at {at:#x} it cannot write ({e})"
            ))
        })?;
        self.vm
            .mem
            .write_obj(1u32, GuestAddress(gpa))
            .map_err(|e| {
                bad(format!(
                    "with an answer word at {at:#x} outside its memory ({e})"
                ))
            })?;
        Ok(Some(gpa))
    }

    /// `/init` asks for the command's standard input
    /// (`ControlMessage::Input`): at most RDI bytes (1 to 64 KiB) into its
    /// buffer at virtual address RSI, the answer to the u64 at R8. Checks
    /// that all of them can be written before anything is taken from the
    /// host; returns how many bytes it takes.
    pub(crate) fn stdin_request(&mut self) -> Result<usize, VmError> {
        const MAX_PIECE: u64 = 64 << 10;
        let regs = self.vcpu.synced_regs();
        let (gva, len, answer) = (regs.rsi, regs.rdi, regs.r8);
        let bad = |why: String| VmError::BadInput { why };
        if len == 0 || len > MAX_PIECE {
            return Err(bad(format!("in a piece of {len} bytes (1 to {MAX_PIECE})")));
        }
        if !answer.is_multiple_of(8) {
            return Err(bad(format!(
                "with an answer word at {answer:#x}, not 8-byte aligned"
            )));
        }
        if gva.checked_add(len).is_none() {
            return Err(bad(format!("into a buffer at {gva:#x} that wraps around")));
        }
        let cr3 = self.vcpu.sregs()?.cr3;
        let writable = |at: u64, len: u64| {
            gva::user_writable(&self.vm.mem, cr3, at, len as usize)
                .map_err(|e| bad(format!("into memory at {at:#x} it cannot write ({e})")))
        };
        writable(gva, len)?;
        writable(answer, 8)?;
        Ok(len as usize)
    }

    /// The host's standard input for the command, at most `max` bytes of
    /// it, and whether it ended after them (an empty one where the run has
    /// none).
    pub(crate) fn host_stdin(&self, max: usize) -> (Vec<u8>, bool) {
        match &self.vm.terminal.streams.input {
            Some(input) => input.take_stream(max),
            None => (Vec::new(), true),
        }
    }

    /// Gives `/init` the `bytes` of standard input it asked for
    /// ([`Machine::stdin_request`]) and the answer word: their count, bit
    /// 63 set if the input `ended` after them. Returns the guest-physical
    /// addresses written, each within one page.
    pub(crate) fn answer_stdin(&mut self, bytes: &[u8], ended: bool) -> Result<Vec<u64>, VmError> {
        let regs = self.vcpu.synced_regs();
        let (to, answer) = (regs.rsi, regs.r8);
        let cr3 = self.vcpu.sregs()?.cr3;
        let mem = &self.vm.mem;
        let bad = |at: u64, why: String| VmError::BadInput {
            why: format!("into memory at {at:#x} it cannot write ({why})"),
        };
        let mut written =
            gva::write_virt_pieces(mem, cr3, to, bytes).map_err(|e| bad(to, e.to_string()))?;
        let word = bytes.len() as u64 | (u64::from(ended) << 63);
        written.extend(
            gva::write_virt_pieces(mem, cr3, answer, &word.to_le_bytes())
                .map_err(|e| bad(answer, e.to_string()))?,
        );
        Ok(written)
    }

    /// The guest kernel hands a copy to or from user memory (guest kernel
    /// patch 0013), or a page it clears or copies (patch 0015), to the VMM
    /// (`ControlMessage::Copy`): RCX bytes from virtual address RSI to
    /// RDI, both through the current page tables as the kernel's own copy
    /// would go (accessed and dirty bits set; a write needs every level
    /// writable, as with CR0.WP), up to the first page either side cannot
    /// reach. The count of bytes not copied, which the kernel copies, and
    /// faults on, itself, goes to the u64 at virtual address R8. The same
    /// memory gives the same copy at the same exit in every replay.
    /// Returns the guest-physical addresses of the pieces written, each
    /// within one page.
    pub(crate) fn guest_copy(&mut self) -> Result<Vec<u64>, VmError> {
        const PAGE: u64 = gva::PAGE_SIZE;
        let regs = self.vcpu.synced_regs();
        let (to, from, len, answer) = (regs.rdi, regs.rsi, regs.rcx, regs.r8);
        let cr3 = self.vcpu.sregs()?.cr3;
        let mem = &self.vm.mem;
        let mut buf = [0u8; PAGE as usize];
        let mut written = Vec::new();
        let mut done = 0;
        while done < len {
            let (src, dst) = (from.wrapping_add(done), to.wrapping_add(done));
            let n = (len - done).min(PAGE - src % PAGE).min(PAGE - dst % PAGE);
            let (Ok(src), Ok(dst)) = (
                gva::access(mem, cr3, src, false),
                gva::access(mem, cr3, dst, true),
            ) else {
                break;
            };
            let piece = &mut buf[..n as usize];
            if mem.read_slice(piece, GuestAddress(src)).is_err()
                || mem.write_slice(piece, GuestAddress(dst)).is_err()
            {
                break;
            }
            written.push(dst);
            done += n;
        }
        let copies = &mut self.vm.exits.copies;
        copies.calls += 1;
        copies.bytes += done;
        copies.short += u64::from(done < len);
        // An answer that cannot be written leaves the kernel's "no answer"
        // there: it copies the whole itself (the bytes copied here again).
        let _ = gva::write_virt(mem, cr3, answer, &(len - done).to_le_bytes());
        Ok(written)
    }

    /// The KVM dirty log of guest RAM (the only memory slot): the pages
    /// written since the last call, as a bitmap of 64-page words.
    pub(crate) fn dirty_log(&self) -> Result<Vec<u64>, VmError> {
        let size = self.vm.ram_bytes();
        self.vm
            .fd()
            .get_dirty_log(RAM_SLOT, size)
            .map_err(kvm_err("GET_DIRTY_LOG"))
    }

    /// Turns KVM's dirty log of guest RAM on.
    pub(crate) fn start_dirty_log(&self) -> Result<(), VmError> {
        crate::kvm_ext::log_dirty_pages(self.vm.fd(), &self.vm.mem)
            .map_err(kvm_err("SET_USER_MEMORY_REGION (dirty log)"))
    }
}

/// The slot of guest RAM (the only one).
const RAM_SLOT: u32 = 0;
