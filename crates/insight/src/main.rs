//! `insight`: record, replay and diagnose a Linux VM.

mod cli;
mod journal_cmds;
mod pcap;
mod report_cmds;
mod status;

use std::process::ExitCode;

fn main() -> ExitCode {
    match cli::main() {
        Ok(code) => code,
        Err(err) => {
            eprintln!("insight: error: {}", cli::error_chain(&err));
            ExitCode::from(cli::EXIT_INSIGHT_ERROR)
        }
    }
}
