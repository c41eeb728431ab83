//! Inputs made visible to the guest: finished disk requests and received
//! network frames, published at once when not recording, right after a
//! deterministic exit when recording (and logged), and where the log says
//! when replaying.

use devices::{virtio_blk, virtio_net};

use super::{Vm, VmError};
use journal::{Input, Journal};

impl Vm {
    /// Makes what devices received visible to the guest — finished disk
    /// requests, network frames —: at any time when not recording; right
    /// after a deterministic exit when recording (logged); where the log
    /// says when replaying (waiting for the disk if needed).
    pub(super) fn publish_inputs(&mut self) -> Result<(), VmError> {
        match &self.journal {
            Journal::Live => {
                if let Some(block) = &mut self.block {
                    let n = block.publishable();
                    block.publish(n, &self.mem);
                }
                if let Some(net) = &mut self.net {
                    net.deliver_received(&self.mem);
                }
            }
            Journal::Record(_) if self.at_delivery_point => {
                if let Some(block) = &mut self.block {
                    let n = block.publishable();
                    if block.publish(n, &self.mem) > 0 {
                        self.journal.record_disk_done(block.published())?;
                    }
                }
                if let Some(net) = &mut self.net {
                    let frames = net.deliver_received(&self.mem);
                    if !frames.is_empty() {
                        self.journal.record_net_rx(&frames)?;
                    }
                }
            }
            Journal::Replay(_) if self.at_delivery_point => {
                while let Some(input) = self.journal.replay_input()? {
                    self.replay_input(input)?;
                }
            }
            Journal::Record(_) | Journal::Replay(_) => {}
        }
        if self.block.as_mut().is_some_and(|b| b.take_irq()) {
            self.platform.pic.pulse_irq(virtio_blk::IRQ);
        }
        if self.net.as_mut().is_some_and(|n| n.take_irq()) {
            self.platform.pic.pulse_irq(virtio_net::IRQ);
        }
        Ok(())
    }

    /// Makes visible what the recording made visible here.
    pub(super) fn replay_input(&mut self, input: Input) -> Result<(), VmError> {
        match input {
            Input::Disk(completed) => {
                let (published, submitted) = self
                    .block
                    .as_ref()
                    .map_or((0, 0), |b| (b.published(), b.submitted()));
                let Some(block) = self
                    .block
                    .as_mut()
                    .filter(|_| completed > published && completed <= submitted)
                else {
                    return Err(self
                        .journal
                        .impossible_disk_done(completed, submitted)
                        .into());
                };
                let count = completed - published;
                block.wait_publishable(count)?;
                block.publish(count, &self.mem);
            }
            Input::Net(frames) => {
                let result = match self.net.as_mut() {
                    Some(net) => net.deliver(&frames, &self.mem).map_err(|e| e.to_string()),
                    None => Err("the guest has no network device".to_owned()),
                };
                if let Err(why) = result {
                    return Err(self.journal.undeliverable_frames(&frames, why).into());
                }
            }
        }
        Ok(())
    }
}
