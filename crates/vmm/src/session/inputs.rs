//! Inputs made visible to the guest: finished disk requests and received
//! network frames, published at once in a plain run, right after a
//! deterministic exit when recording (and logged), and where the log says
//! when replaying.

use devices::{virtio_blk, virtio_net};
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
    pulse_irqs(m);
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
}
