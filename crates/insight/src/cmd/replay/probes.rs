//! `insight replay --probe SPEC` and `--probes-file FILE`: the specs
//! (docs/probes.md) parsed, and checked against the recording's own
//! files before anything boots: an unknown function, line, variable or
//! object is an error that names it and the nearest matches.

use std::path::Path;

use anyhow::{bail, Context, Result};
use diagnosis::symbols::{ElfSymbols, GuestFiles};
use events::probe_spec::{nearest, CaptureItem, Location, ProbeSpec, ProcessName, MAX_PROBES};
use vmm::tools::debug::ProcessSelector;
use vmm::tools::probes::{PlannedProbe, ProbePlan};

/// Where a program named without a path is looked for in the guest, as
/// the guest's PATH has it.
const PATH: [&str; 6] = [
    "/usr/local/bin",
    "/usr/bin",
    "/bin",
    "/usr/local/sbin",
    "/usr/sbin",
    "/sbin",
];

/// The specs of `--probe` and `--probes-file`, in that order.
pub(crate) fn specs(given: &[String], file: Option<&Path>) -> Result<Vec<ProbeSpec>> {
    let mut specs = Vec::new();
    for text in given {
        specs.push(ProbeSpec::parse(text)?);
    }
    if let Some(path) = file {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("--probes-file {}", path.display()))?;
        specs.extend(ProbeSpec::parse_file(&text).with_context(|| format!("{}", path.display()))?);
    }
    if specs.len() > MAX_PROBES {
        bail!(
            "{} probes given: one replay arms at most {MAX_PROBES} (docs/probes.md)",
            specs.len()
        );
    }
    Ok(specs)
}

/// The plan of `specs` for the recording whose files are `files` and
/// whose command ran `program` (its name, as `traces::recorded_program`
/// gives it).
pub(crate) fn plan(specs: Vec<ProbeSpec>, files: &GuestFiles, program: &str) -> Result<ProbePlan> {
    let process = one_process(&specs)?;
    // The executable: the object a location names, the process's program,
    // or the recorded command's.
    let exe_name = match &process {
        Some(ProcessName::Name(name)) => name.clone(),
        _ => program.to_owned(),
    };
    if exe_name.is_empty() {
        bail!(
            "the recording does not say which program its command ran: name it with 'in PROGRAM'"
        );
    }
    let (exe_path, exe) = find_program(files, &exe_name).with_context(|| {
        format!(
            "the recording has no program '{exe_name}' (looked in {})",
            PATH.join(", ")
        )
    })?;
    let debug = files.debug_file(&exe_path);
    let symbols = ElfSymbols::parse_with_debug(exe, debug)
        .with_context(|| format!("{exe_path} is not an ELF executable insight can read"))?;
    let mut probes = Vec::new();
    for (id, spec) in specs.into_iter().enumerate() {
        let site = site(&spec, &symbols, &exe_path)?;
        let mut globals = Vec::new();
        let operand = spec.condition.as_ref().map(|c| &c.operand);
        for item in spec.captures.iter().chain(operand) {
            let CaptureItem::Global(name) = item else {
                continue;
            };
            if globals
                .iter()
                .any(|(n, _, _): &(String, u64, u8)| n == name)
            {
                continue;
            }
            let Some((addr, size)) = symbols.data_object(name) else {
                bail!(
                    "probe '{}': {exe_path} has no global variable '{name}'{}",
                    spec.text,
                    suggest(&nearest(name, symbols.data_names(), 3))
                );
            };
            globals.push((name.clone(), addr, size.clamp(1, 8) as u8));
        }
        probes.push(PlannedProbe {
            id: id as u32 + 1,
            spec,
            site,
            globals,
        });
    }
    let process = match process {
        Some(ProcessName::Pid(pid)) => ProcessSelector::Pid(pid),
        Some(ProcessName::Name(name)) => ProcessSelector::Name(name),
        None => ProcessSelector::Name(exe_name.rsplit('/').next().unwrap_or(&exe_name).to_owned()),
    };
    Ok(ProbePlan {
        process,
        exe_path,
        exe_entry: symbols.entry(),
        probes,
    })
}

/// The process every spec names (they must agree: one replay probes one
/// process).
fn one_process(specs: &[ProbeSpec]) -> Result<Option<ProcessName>> {
    let mut named: Option<&ProbeSpec> = None;
    for spec in specs.iter().filter(|s| s.process.is_some()) {
        match named {
            Some(first) if first.process != spec.process => bail!(
                "probes '{}' and '{}' name different processes: one replay probes one process \
                 (replay once per process)",
                first.text,
                spec.text
            ),
            _ => named = Some(spec),
        }
    }
    Ok(named.and_then(|s| s.process.clone()))
}

/// The guest file of the program `name` (a path, or a name looked up in
/// the guest's PATH).
fn find_program<'f>(files: &'f GuestFiles, name: &str) -> Option<(String, &'f [u8])> {
    if name.contains('/') {
        let path = match name.starts_with('/') {
            true => name.to_owned(),
            false => format!("/{}", name.trim_start_matches("./")),
        };
        return files.get(&path).map(|b| (path, b));
    }
    PATH.iter().find_map(|dir| {
        let path = format!("{dir}/{name}");
        files.get(&path).map(|b| (path, b))
    })
}

/// Where `spec` goes in the executable, before its load bias.
fn site(spec: &ProbeSpec, symbols: &ElfSymbols, exe_path: &str) -> Result<u64> {
    let exe_name = exe_path.rsplit('/').next().unwrap_or(exe_path);
    if let Some(object) = spec.location.object() {
        let object_name = object.rsplit('/').next().unwrap_or(object);
        if object_name != exe_name {
            bail!(
                "probe '{}': {object} is not the program ({exe_path}); probes go into the \
                 program's own code in this version, not into its shared libraries",
                spec.text
            );
        }
    }
    match &spec.location {
        Location::Function { name, .. } => symbols.function_address(name).with_context(|| {
            format!(
                "probe '{}': {exe_path} has no function '{name}'{}",
                spec.text,
                suggest(&nearest(name, symbols.function_names(), 3))
            )
        }),
        Location::Address { addr, .. } => {
            if symbols.function(*addr).is_none() && !symbols.covers(*addr) {
                bail!(
                    "probe '{}': {addr:#x} is not in {exe_path}'s code (an address as its \
                     symbols give it, e.g. from nm)",
                    spec.text
                );
            }
            Ok(*addr)
        }
        Location::Line { file, line } => match symbols.line_address(file, *line) {
            Ok(addr) => Ok(addr),
            Err(Some(near)) => bail!(
                "probe '{}': {file}:{line} has no code in {exe_path}; nearest lines with code: {}",
                spec.text,
                near.iter()
                    .map(|l| format!("{file}:{l}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
            Err(None) => bail!(
                "probe '{}': {exe_path} has no line table for {file} (built without -g, or \
                 another file name)",
                spec.text
            ),
        },
    }
}

fn suggest(names: &[String]) -> String {
    match names {
        [] => String::new(),
        _ => format!(" (nearest: {})", names.join(", ")),
    }
}
