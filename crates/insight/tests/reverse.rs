//! Reverse debugging checked by scenarios (tests/reverse/README.md): each
//! is a C program built on the host, recorded by its path, and a gdb
//! session over it with what each command must print. `under_insight` runs
//! it with `insight debug`; `under_record_full` runs the same session under
//! the host's gdb with `record full`, which checks the expectations.
//!
//! `gdb::` are gdb's own reverse-execution tests (binutils-gdb's
//! gdb/testsuite/gdb.reverse, tests/gdb.reverse/README.md): their programs
//! as gdb ships them, their `.exp` files' steps and expected stops as
//! scripts. `ours::` are scenarios of insight's own.

mod common;

use std::path::Path;

use common::gdb_scripts::{Debugger, Scenario};

fn check(dir: &str, name: &str, debugger: Debugger) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests")
        .join(dir);
    let dir = dir.canonicalize().unwrap_or(dir);
    Scenario::load(&dir, name).check(debugger);
}

/// A module per scenario of the folder `dir`, its two runs inside.
macro_rules! scenarios {
    ($dir:literal: $($name:ident),* $(,)?) => {$(
        mod $name {
            use super::super::*;

            #[test]
            #[ignore = "needs /dev/kvm, the guest image and gdb (tools/test runs it)"]
            fn under_insight() {
                check($dir, stringify!($name), Debugger::Insight);
            }

            #[test]
            #[ignore = "needs gdb and gcc (tools/test runs it)"]
            fn under_record_full() {
                check($dir, stringify!($name), Debugger::RecordFull);
            }
        }
    )*};
}

mod ours {
    scenarios!("reverse": same_registers, rdrand_value, syscall_buffers);
}

mod gdb {
    scenarios!("gdb.reverse":
        break_reverse,
        consecutive_reverse,
        finish_reverse,
        finish_reverse_bkpt,
        fstatat_reverse,
        getresuid_reverse,
        i387_stack_reverse,
        insn_reverse,
        machinestate,
        next_reverse_bkpt_over_sr,
        pipe_reverse,
        readv_reverse,
        recvmsg_reverse,
        solib_reverse,
        step_indirect_call_thunk,
        step_reverse,
        time_reverse,
        until_reverse,
        waitpid_reverse,
        watch_reverse,
    );
}
