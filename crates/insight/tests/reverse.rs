//! Reverse debugging checked by scenarios (tests/reverse/README.md): each
//! is a C program built on the host, recorded by its path, and a gdb
//! session over it with what each command must print. `under_insight` runs
//! it with `insight debug`; `under_record_full` runs the same session under
//! the host's gdb with `record full`, which checks the expectations.

mod common;

use std::path::Path;

use common::gdb_scripts::{Debugger, Scenario};

fn check(name: &str, debugger: Debugger) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/reverse");
    let dir = dir.canonicalize().unwrap_or(dir);
    Scenario::load(&dir, name).check(debugger);
}

/// A module per scenario, its two runs inside.
macro_rules! scenarios {
    ($($name:ident),* $(,)?) => {$(
        mod $name {
            use super::*;

            #[test]
            #[ignore = "needs /dev/kvm, the guest image and gdb (tools/test runs it)"]
            fn under_insight() {
                check(stringify!($name), Debugger::Insight);
            }

            #[test]
            #[ignore = "needs gdb and gcc (tools/test runs it)"]
            fn under_record_full() {
                check(stringify!($name), Debugger::RecordFull);
            }
        }
    )*};
}

scenarios!(same_registers, rdrand_value, syscall_buffers);
