//! Inputs made visible to the guest: finished disk requests, received
//! network frames, typed input and the terminal's size for the virtio
//! console, published at once in a plain run, right after a
//! deterministic exit when recording (and logged), and where the log says
//! when replaying.

use devices::{virtio_9p, virtio_blk, virtio_console, virtio_net};
use journal::{Input, Recorder, Replayer};

use crate::vm::{Machine, VmError};

/// A plain run: everything the devices have, at once.
pub(super) fn publish_live(m: &mut Machine) {
    let vm = &mut m.vm;
    if let Some(block) = &mut vm.block {
        let n = block.publishable();
        block.publish(n, &vm.mem);
    }
    if let Some(net) = &mut vm.net {
        net.deliver_received(&vm.mem);
    }
    if vm.status.terminal == Some(true) {
        vm.console.deliver_input(&vm.mem);
    }
    if let Some(size) = terminal_size_to_tell(m) {
        m.vm.console.resize(size);
    }
    pulse_irqs(m);
}

/// The host terminal's size, if the command's terminal is the virtio
/// console (open: its driver drops a size it is told before) and it has
/// not been told it.
fn terminal_size_to_tell(m: &Machine) -> Option<(u16, u16)> {
    let console = &m.vm.console;
    m.vm.terminal.size.filter(|&size| {
        m.vm.status.terminal == Some(true) && console.driver_ok() && size != console.size()
    })
}

/// Recording: what the devices have, at a delivery point only, logged.
pub(super) fn publish_recorded(m: &mut Machine, recorder: &mut Recorder) -> Result<(), VmError> {
    if m.vcpu.at_delivery_point {
        let vm = &mut m.vm;
        if let Some(block) = &mut vm.block {
            let n = block.publishable();
            if block.publish(n, &vm.mem) > 0 {
                recorder.disk_done(block.published())?;
            }
        }
        if let Some(net) = &mut vm.net {
            let frames = net.deliver_received(&vm.mem);
            if !frames.is_empty() {
                recorder.net_rx(&frames)?;
            }
        }
        if vm.status.terminal == Some(true) {
            let typed = vm.console.deliver_input(&vm.mem);
            if !typed.is_empty() {
                recorder.console_rx(typed)?;
            }
        }
        if let Some(size) = terminal_size_to_tell(m) {
            m.vm.console.resize(size);
            recorder.console_size(size)?;
        }
    }
    pulse_irqs(m);
    Ok(())
}

/// Replay: what the recording made visible at this delivery point, from
/// the log (waiting for the disk if needed).
pub(super) fn publish_replayed(m: &mut Machine, log: &mut Replayer) -> Result<(), VmError> {
    if m.vcpu.at_delivery_point {
        while let Some(input) = log.input()? {
            replay_input(m, log, input)?;
        }
    }
    pulse_irqs(m);
    Ok(())
}

/// Makes visible what the recording made visible here.
fn replay_input(m: &mut Machine, log: &mut Replayer, input: Input) -> Result<(), VmError> {
    let vm = &mut m.vm;
    match input {
        Input::Disk(completed) => {
            let (published, submitted) = vm
                .block
                .as_ref()
                .map_or((0, 0), |b| (b.published(), b.submitted()));
            let Some(block) = vm
                .block
                .as_mut()
                .filter(|_| completed > published && completed <= submitted)
            else {
                return Err(log.impossible_disk_done(completed, submitted).into());
            };
            let count = completed - published;
            block.wait_publishable(count)?;
            block.publish(count, &vm.mem);
        }
        Input::Net(frames) => {
            let result = match vm.net.as_mut() {
                Some(net) => net.deliver(&frames, &vm.mem).map_err(|e| e.to_string()),
                None => Err("the guest has no network device".to_owned()),
            };
            if let Err(why) = result {
                return Err(log.undeliverable_frames(&frames, why).into());
            }
        }
        Input::Console(bytes) => {
            if let Err(why) = vm.console.deliver(&bytes, &vm.mem) {
                let why = format!("{} bytes of console input: {why}", bytes.len());
                return Err(log.undeliverable_console(why).into());
            }
        }
        Input::ConsoleSize(cols, rows) => {
            if !vm.console.driver_ok() {
                let why = format!(
                    "console size {cols}x{rows}: the guest's virtio console driver is not running"
                );
                return Err(log.undeliverable_console(why).into());
            }
            vm.console.resize((cols, rows));
        }
    }
    Ok(())
}

/// Devices that completed something raise their interrupt line.
fn pulse_irqs(m: &mut Machine) {
    let vm = &mut m.vm;
    if vm.block.as_mut().is_some_and(|b| b.take_irq()) {
        vm.platform.pic.pulse_irq(virtio_blk::IRQ);
    }
    if vm.net.as_mut().is_some_and(|n| n.take_irq()) {
        vm.platform.pic.pulse_irq(virtio_net::IRQ);
    }
    if vm.console.take_irq() {
        vm.platform.pic.pulse_irq(virtio_console::IRQ);
    }
    if vm.host_files.as_mut().is_some_and(|h| h.device.take_irq()) {
        vm.platform.pic.pulse_irq(virtio_9p::IRQ);
    }
}
