//! insight's replay events: the probe ABI (what a probe or the guest
//! kernel leaves in an event buffer) and the event database.

pub mod abi;
pub mod capture;
pub mod db;
pub mod packed;
pub mod probe_spec;
#[cfg(test)]
mod testing;
