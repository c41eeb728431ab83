//! The probes a replay arms, resolved against the recording's files, and
//! how the event database names them.

use events::db::ProbeRow;
use events::probe_spec::{ProbeAt, ProbeSpec};

use crate::tools::control::ProcessSelector;

/// The probes a replay arms, resolved against the recording's files.
#[derive(Clone, Debug)]
pub struct ProbePlan {
    /// The program the probes in an executable name functions of: its
    /// path in the guest.
    pub exe_path: String,
    /// Its ELF entry point (its load bias is where the kernel says the
    /// program starts, less this).
    pub exe_entry: u64,
    pub probes: Vec<PlannedProbe>,
}

/// One probe: its number, its spec, where it goes in its object (before
/// the object's load bias), and which processes it goes into.
#[derive(Clone, Debug)]
pub struct PlannedProbe {
    pub id: u32,
    pub spec: ProbeSpec,
    /// The shared library it goes into (its guest path), or `None`: the
    /// executable.
    pub object: Option<String>,
    pub site: u64,
    /// The global variables it captures or compares: their addresses in
    /// the object and sizes (1 to 8 bytes).
    pub globals: Vec<(String, u64, u8)>,
    /// The processes it goes into, each from the start of a program it
    /// executes (a probe in the executable: those that execute the plan's
    /// program).
    pub process: ProcessSelector,
}

impl PlannedProbe {
    /// How the event database names it, with its value slots: the
    /// captures, then for a `return` probe the call's duration.
    pub fn row(&self) -> ProbeRow {
        let mut captures = self.spec.capture_names();
        if self.spec.at == ProbeAt::Return {
            captures.push(DURATION.to_owned());
        }
        ProbeRow {
            id: self.id,
            spec: self.spec.text.clone(),
            captures,
        }
    }
}

/// The name of a return probe's last value slot.
pub const DURATION: &str = "duration_ns";

/// The probes of a spec list as the database declares them.
pub fn probe_rows(plan: &ProbePlan) -> Vec<ProbeRow> {
    plan.probes.iter().map(PlannedProbe::row).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn planned(text: &str) -> PlannedProbe {
        PlannedProbe {
            id: 3,
            spec: ProbeSpec::parse(text).unwrap(),
            object: None,
            site: 0x1130,
            globals: Vec::new(),
            process: ProcessSelector::Any,
        }
    }

    #[test]
    fn return_probes_take_their_duration_in_the_last_slot() {
        let row = planned("work return capture arg0, retval").row();
        assert_eq!(row.captures, ["arg0", "retval", DURATION]);
        assert_eq!(row.id, 3);
        assert_eq!(planned("work capture arg1").row().captures, ["arg1"]);
    }
}
