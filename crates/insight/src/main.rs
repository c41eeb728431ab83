//! `insight`: record, replay and diagnose a Linux VM.

mod cli;
mod cmd;
mod exit;
mod guest_args;
mod pcap;
mod status;
mod traces;

use std::process::ExitCode;

fn main() -> ExitCode {
    match cli::main() {
        Ok(code) => code,
        Err(err) => {
            eprintln!("insight: error: {}", exit::error_chain(&err));
            ExitCode::from(exit::EXIT_INSIGHT_ERROR)
        }
    }
}
