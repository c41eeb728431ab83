//! Instructions that KVM's emulator cannot execute in guest ring 0 on
//! hosts that interpret the guest kernel, and how the VMM completes them.
//!
//! Only instructions whose effect the VMM can reproduce exactly belong
//! here; anything else stops the VM with the instruction bytes and RIP.

use introspect::xstate::{self, XInsn};

/// What the VMM does for an instruction the emulator rejected.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Completion {
    /// XSAVE/XRSTOR: move extended state between guest memory and the
    /// vCPU (see `xstate`).
    Xstate(XInsn),
    /// Advance RIP by this many bytes: the instruction has no effect the
    /// guest can observe here.
    Skip(u64),
    /// Advance RIP by `len` and raise exception `vector`, as a trap-type
    /// exception leaves it: the guest's handler sees the next RIP.
    Trap { len: u64, vector: u8 },
}

/// Decides how to complete the instruction starting with `bytes`.
pub fn complete(bytes: &[u8]) -> Option<Completion> {
    if let Some(x) = xstate::decode(bytes) {
        return Some(Completion::Xstate(x));
    }
    match bytes {
        // FWAIT: waits for pending x87 exceptions. Linux issues it only to
        // discard a dying task's pending exceptions (fpu__drop), and the
        // state it would report is thrown away with the task.
        [0x9b, ..] => Some(Completion::Skip(1)),
        // INT3 in ring 0 (Linux's alternatives self-test, BUG_ON-free
        // kernels' text poking): deliver #BP to the guest as the CPU would.
        [0xcc, ..] => Some(Completion::Trap { len: 1, vector: 3 }),
        _ => None,
    }
}

/// Formats instruction bytes for an error message.
pub fn hex_bytes(bytes: &[u8]) -> String {
    bytes
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fwait_is_skipped_and_others_are_not_guessed() {
        assert_eq!(complete(&[0x9b, 0x90]), Some(Completion::Skip(1)));
        assert_eq!(
            complete(&[0xcc]),
            Some(Completion::Trap { len: 1, vector: 3 })
        );
        // xsave and xrstor go to the extended-state completion.
        for insn in [[0x0f, 0xae, 0x27], [0x0f, 0xae, 0x2f]] {
            assert!(
                matches!(complete(&insn), Some(Completion::Xstate(_))),
                "{insn:x?}"
            );
        }
        // lock cmpxchg16b, fxsave, clac: not completable.
        assert_eq!(complete(&[0xf0, 0x48, 0x0f, 0xc7, 0x0e]), None);
        assert_eq!(complete(&[0x0f, 0xae, 0x00]), None);
        assert_eq!(complete(&[0x0f, 0x01, 0xca]), None);
        assert_eq!(complete(&[]), None);
        assert_eq!(hex_bytes(&[0x0f, 0xae]), "0f ae");
    }
}
