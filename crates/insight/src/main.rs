//! `insight`: record, replay and diagnose a Linux VM.

mod cli;
mod cmd;
mod exit;
mod guest_args;
mod outputs;
mod pcap;
mod position;
mod status;
mod traces;

use std::process::ExitCode;

fn main() -> ExitCode {
    match cli::main() {
        Ok(code) => code,
        Err(err) => {
            // Errors quote configs, traces and guest text: escaped.
            let message = exit::message(&err);
            eprintln!("insight: error: {}", status::printable(&message));
            ExitCode::from(exit::status_of(&err))
        }
    }
}
