//! The function profiler: where the sampled threads spent their time,
//! from the SAMPLE events of an event database.

use std::collections::{BTreeMap, HashMap, HashSet};

use events::abi::SampleMode;
use events::db::{DbError, EventDb, Row};

use guestfiles::{CodeLocation, GuestFiles, Symbolizer, KERNEL};

/// Samples of one function.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProfileRow {
    pub location: CodeLocation,
    pub samples: u64,
}

/// One thread's part.
#[derive(Clone, Debug)]
pub struct ThreadProfile {
    pub pid: u32,
    pub lwpid: u32,
    pub comm: String,
    pub samples: u64,
    pub rows: Vec<ProfileRow>,
}

#[derive(Clone, Debug, Default)]
pub struct FunctionProfile {
    /// All samples; `kernel` of them were taken in the guest kernel,
    /// `kernel_boundary` of those as it was entered or left (in user mode
    /// at a return from it: counted as kernel time, with the user stack).
    pub samples: u64,
    pub kernel: u64,
    pub kernel_boundary: u64,
    /// Functions by samples, most first.
    pub rows: Vec<ProfileRow>,
    pub threads: Vec<ThreadProfile>,
    /// Folded stacks ("comm;outer;...;inner" -> samples), for flame graphs.
    pub folded: BTreeMap<String, u64>,
}

fn kernel() -> CodeLocation {
    CodeLocation {
        object: KERNEL.into(),
        function: KERNEL.into(),
    }
}

fn ranked(counts: HashMap<CodeLocation, u64>) -> Vec<ProfileRow> {
    let mut rows: Vec<ProfileRow> = counts
        .into_iter()
        .map(|(location, samples)| ProfileRow { location, samples })
        .collect();
    rows.sort_by(|a, b| b.samples.cmp(&a.samples).then(a.location.cmp(&b.location)));
    rows
}

/// Builds the profile of the SAMPLE events `samples` (rows of `db`) with
/// their `stacks` (by seq), symbolized with the ELF files in `files` (the
/// guest's initramfs).
pub fn profile(
    samples: &[Row],
    stacks: &HashMap<u64, Vec<u64>>,
    db: &EventDb,
    files: &GuestFiles,
) -> Result<FunctionProfile, DbError> {
    let names: HashMap<(u32, u32), String> = db
        .threads()?
        .into_iter()
        .map(|(pid, lwpid, comm)| ((pid, lwpid), comm))
        .collect();
    let mut sym = Symbolizer::new(files);
    let pids: HashSet<u32> = samples.iter().map(|r| r.pid).collect();
    for pid in pids {
        sym.add_process(pid, db.objects(pid)?);
    }

    let mut out = FunctionProfile::default();
    let mut all: HashMap<CodeLocation, u64> = HashMap::new();
    let mut per_thread: HashMap<(u32, u32), HashMap<CodeLocation, u64>> = HashMap::new();
    for r in samples {
        let Some(rip) = r.addr else { continue };
        // Any value but 0 (user) is kernel time, values unknown here too.
        let boundary = r.value == Some(SampleMode::KernelBoundary as i64);
        let location = if r.value.is_some_and(|v| v != 0) {
            out.kernel += 1;
            out.kernel_boundary += u64::from(boundary);
            if boundary {
                kernel()
            } else {
                // The kernel function it was in, when the kernel's
                // symbols are known.
                sym.locate_kernel(rip)
            }
        } else {
            sym.locate(r.pid, rip)
        };
        out.samples += 1;
        *all.entry(location.clone()).or_insert(0) += 1;
        *per_thread
            .entry((r.pid, r.lwpid))
            .or_default()
            .entry(location.clone())
            .or_insert(0) += 1;
        // Folded stack: the thread's name, callers outermost first (a
        // return address minus one lies in the call), then the function.
        let comm = names.get(&(r.pid, r.lwpid)).cloned().unwrap_or_default();
        let mut frames = vec![if comm.is_empty() {
            format!("lwpid {}", r.lwpid)
        } else {
            comm
        }];
        if let Some(stack) = stacks.get(&r.seq) {
            for ret in stack.iter().rev() {
                frames.push(sym.locate(r.pid, ret.saturating_sub(1)).function);
            }
        }
        if boundary {
            // The user function the kernel time was spent for.
            frames.push(sym.locate(r.pid, rip).function);
        }
        // Kernel time stands on a `[kernel]` frame, with the kernel's
        // function above it where its symbols name one.
        if location.object == KERNEL && location.function != KERNEL {
            frames.push(KERNEL.to_owned());
        }
        frames.push(location.function.clone());
        // ';' separates frames: a thread (named by the guest) or function
        // with one in its name must not make frames of its own.
        for f in &mut frames {
            if f.contains(';') {
                *f = f.replace(';', ":");
            }
        }
        *out.folded.entry(frames.join(";")).or_insert(0) += 1;
    }
    out.rows = ranked(all);
    let mut threads: Vec<ThreadProfile> = per_thread
        .into_iter()
        .map(|((pid, lwpid), counts)| {
            let rows = ranked(counts);
            ThreadProfile {
                pid,
                lwpid,
                comm: names.get(&(pid, lwpid)).cloned().unwrap_or_default(),
                samples: rows.iter().map(|r| r.samples).sum(),
                rows,
            }
        })
        .collect();
    threads.sort_by(|a, b| b.samples.cmp(&a.samples).then(a.lwpid.cmp(&b.lwpid)));
    out.threads = threads;
    Ok(out)
}
