//! `insight replay --probe SPEC` and `--probes-file FILE`: the specs
//! (docs/probes.md) parsed, and checked against the recording's own
//! files before anything boots: an unknown function, line, variable or
//! object is an error that names it and the nearest matches.

use std::collections::HashMap;
use std::path::Path;

use anyhow::{bail, Context, Result};
use events::probe_spec::{nearest, CaptureItem, ProbeLocation, ProbeSpec, ProcessName, MAX_PROBES};
use guestfiles::{ElfSymbols, GuestFiles};
use vmm::tools::control::ProcessSelector;
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

/// Where a library named without a path is looked for, as the guest's
/// dynamic linker looks.
const LIBRARY_PATH: [&str; 6] = [
    "/lib/x86_64-linux-gnu",
    "/usr/lib/x86_64-linux-gnu",
    "/lib64",
    "/lib",
    "/usr/lib",
    "/usr/local/lib",
];

/// Where detached debug files are looked up by build ID.
const DEBUG_DIR: &str = "/usr/lib/debug";

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
pub(crate) fn plan(
    specs: Vec<ProbeSpec>,
    files: &mut GuestFiles,
    program: &str,
) -> Result<ProbePlan> {
    // Stripped libraries (the guest's glibc is the host's Debian one) are
    // named by their debug files, where the host has them (libc6-dbg).
    let libraries: Vec<String> = (specs.iter())
        .filter_map(|s| s.location.object())
        .filter_map(|o| find_library(files, o).map(|(path, _)| path))
        .collect();
    files.add_debug_files(Path::new(DEBUG_DIR), libraries.iter().map(String::as_str));
    let files = &*files;
    // The executable: the program `in NAME` names, or the recorded
    // command's.
    let exe_name = match (program_named(&specs)?, object_program(&specs)?) {
        (Some(name), _) => name,
        (None, Some(path)) => path,
        (None, None) => program.to_owned(),
    };
    let in_executable = specs.iter().any(|s| s.location.object().is_none());
    if exe_name.is_empty() && in_executable {
        bail!(
            "the recording does not say which program its command ran: name it with 'in PROGRAM'"
        );
    }
    for spec in &specs {
        if let Some(ProcessName::Name(name)) = &spec.process {
            if find_program(files, name).is_none() {
                bail!(
                    "probe '{}': the recording has no program '{name}' (looked in {})",
                    spec.text,
                    PATH.join(", ")
                );
            }
        }
    }
    let (exe_path, exe) = match find_program(files, &exe_name) {
        Some(found) => found,
        // Only probes in libraries: any program may load them.
        None if !in_executable => (String::new(), &[][..]),
        None => bail!(
            "the recording has no program '{exe_name}' (looked in {})",
            PATH.join(", ")
        ),
    };
    let debug = files.debug_file(&exe_path);
    let exe_symbols = match exe_path.is_empty() {
        true => None,
        false => Some(
            ElfSymbols::parse_with_debug(exe, debug)
                .with_context(|| format!("{exe_path} is not an ELF executable insight can read"))?,
        ),
    };
    let exe_file = exe_path.rsplit('/').next().unwrap_or(&exe_path).to_owned();
    // Each library's symbols, read once for all the probes in it.
    let mut libraries: HashMap<String, ElfSymbols> = HashMap::new();
    let mut probes = Vec::new();
    for (id, spec) in specs.into_iter().enumerate() {
        // The program's own code, or one of the libraries it loads.
        let library = spec
            .location
            .object()
            .filter(|o| o.rsplit('/').next() != Some(exe_file.as_str()));
        let library = match library {
            Some(name) => Some(
                find_library(files, name)
                    .map(|(path, _)| path)
                    .with_context(|| {
                        format!(
                            "probe '{}': the recording has no library '{name}' (looked in {}){}",
                            spec.text,
                            LIBRARY_PATH.join(", "),
                            suggest(&nearest(
                                name,
                                library_names(files).iter().map(String::as_str),
                                3
                            ))
                        )
                    })?,
            ),
            None => None,
        };
        if let Some(path) = library.as_ref().filter(|p| !libraries.contains_key(*p)) {
            let bytes = files.get(path).unwrap_or_default();
            let symbols = ElfSymbols::parse_with_debug(bytes, files.debug_file(path))
                .with_context(|| format!("{path} is not an ELF file insight can read"))?;
            libraries.insert(path.clone(), symbols);
        }
        let (symbols, object_path) = match &library {
            Some(path) => (&libraries[path], path.as_str()),
            None => (
                exe_symbols
                    .as_ref()
                    .context("no program for a probe in one")?,
                exe_path.as_str(),
            ),
        };
        let site = site(&spec, symbols, object_path)?;
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
                    "probe '{}': {object_path} has no global variable '{name}'{}",
                    spec.text,
                    suggest(&nearest(name, symbols.data_names(), 3))
                );
            };
            globals.push((name.clone(), addr, size.clamp(1, 8) as u8));
        }
        // Which processes: those `in` names; by default, for a probe in
        // the executable those that execute the program, for one in a
        // library every process that loads it.
        let process = match (&spec.process, &library) {
            (Some(ProcessName::Pid(pid)), _) => ProcessSelector::Pid(*pid),
            (Some(ProcessName::Name(name)), _) => ProcessSelector::Name(file_name(name)),
            (None, None) => ProcessSelector::Name(file_name(&exe_name)),
            (None, Some(_)) => ProcessSelector::Any,
        };
        probes.push(PlannedProbe {
            id: id as u32 + 1,
            spec,
            object: library,
            site,
            globals,
            process,
        });
    }
    Ok(ProbePlan {
        exe_path,
        exe_entry: exe_symbols.as_ref().map_or(0, |s| s.entry()),
        probes,
    })
}

/// Which processes the probes of `plan` go into, in words.
pub(crate) fn armed_in(plan: &ProbePlan) -> String {
    let mut named: Vec<String> = Vec::new();
    for p in &plan.probes {
        let words = match &p.process {
            ProcessSelector::Pid(pid) => format!("process {pid}"),
            ProcessSelector::Name(name) => format!("every process that runs {name}"),
            ProcessSelector::Any => match &p.object {
                Some(object) => format!("every process that loads {}", file_name(object)),
                None => "every process".to_owned(),
            },
        };
        if !named.contains(&words) {
            named.push(words);
        }
    }
    named.join(", ")
}

fn file_name(path: &str) -> String {
    path.rsplit('/').next().unwrap_or(path).to_owned()
}

/// The program the probes in the executable name with `in NAME` (they
/// must agree: one replay resolves functions in one program).
fn program_named(specs: &[ProbeSpec]) -> Result<Option<String>> {
    let mut named: Option<(&ProbeSpec, &String)> = None;
    for spec in specs.iter().filter(|s| s.location.object().is_none()) {
        let Some(ProcessName::Name(name)) = &spec.process else {
            continue;
        };
        match named {
            Some((first, other)) if other != name => bail!(
                "probes '{}' and '{}' name functions of different programs: one replay probes \
                 one program's own functions (replay once per program; probes in libraries \
                 may name any)",
                first.text,
                spec.text
            ),
            _ => named = Some((spec, name)),
        }
    }
    Ok(named.map(|(_, name)| name.clone()))
}

/// The program whose own functions probes name by its path
/// (`/path/prog:func`, an object that is no shared library): they are
/// probes in that program, as `func in /path/prog` would be. They must
/// agree, as `in PROGRAM` must.
fn object_program(specs: &[ProbeSpec]) -> Result<Option<String>> {
    let mut named: Option<(&ProbeSpec, &str)> = None;
    let programs = specs.iter().filter_map(|s| {
        let object = s.location.object()?;
        (object.starts_with('/') && !file_name(object).contains(".so")).then_some((s, object))
    });
    for (spec, path) in programs {
        match named {
            Some((first, other)) if other != path => bail!(
                "probes '{}' and '{}' name functions of different programs: one replay probes \
                 one program's own functions (replay once per program)",
                first.text,
                spec.text
            ),
            _ => named = Some((spec, path)),
        }
    }
    Ok(named.map(|(_, path)| path.to_owned()))
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

/// The guest file of the shared library `name` (a path, or a file name
/// looked up as the dynamic linker would).
fn find_library<'f>(files: &'f GuestFiles, name: &str) -> Option<(String, &'f [u8])> {
    if name.contains('/') {
        return files.get(name).map(|b| (name.to_owned(), b));
    }
    LIBRARY_PATH.iter().find_map(|dir| {
        let path = format!("{dir}/{name}");
        files.get(&path).map(|b| (path, b))
    })
}

/// The file names of the guest's libraries, where the dynamic linker
/// looks.
fn library_names(files: &GuestFiles) -> Vec<String> {
    let dirs: Vec<&str> = LIBRARY_PATH
        .iter()
        .map(|d| d.trim_start_matches('/'))
        .collect();
    let mut names: Vec<String> = (files.paths())
        .filter_map(|p| p.rsplit_once('/'))
        .filter(|(dir, name)| dirs.contains(dir) && name.contains(".so"))
        .map(|(_, name)| name.to_owned())
        .collect();
    names.sort_unstable();
    names.dedup();
    names
}

/// Where `spec` goes in its object (at `exe_path`), before the object's
/// load bias.
fn site(spec: &ProbeSpec, symbols: &ElfSymbols, exe_path: &str) -> Result<u64> {
    match &spec.location {
        ProbeLocation::Function { name, .. } if symbols.is_indirect(name) => {
            // glibc names them `__NAME_VARIANT` (`__strlen_evex`,
            // `__cos_fma`; `__cos_ifunc` is the resolver); else any
            // internal name containing NAME.
            let internal = |f: &&str| {
                f.starts_with("__") && f.contains(name.as_str()) && !symbols.is_indirect(f)
            };
            let prefix = format!("__{name}_");
            let mut variants: Vec<&str> = (symbols.function_names())
                .filter(|f| internal(f) && f.starts_with(&prefix) && !f.ends_with("_ifunc"))
                .collect();
            if variants.is_empty() {
                variants = symbols.function_names().filter(internal).collect();
            }
            variants.sort_unstable();
            variants.truncate(8);
            bail!(
                "probe '{}': {name} in {exe_path} is an indirect function: its address is a \
                 resolver the dynamic linker calls once to pick the implementation calls reach; \
                 probe that implementation{}",
                spec.text,
                match variants.is_empty() {
                    true => " (the library's debug symbols name its implementations: install \
                              its -dbg package on this host, e.g. libc6-dbg, or probe an \
                              address)"
                        .to_owned(),
                    false => format!(" ({})", variants.join(", ")),
                }
            )
        }
        ProbeLocation::Function { name, .. } => symbols.function_address(name).with_context(|| {
            format!(
                "probe '{}': {exe_path} has no function '{name}'{}",
                spec.text,
                suggest(&nearest(name, symbols.function_names(), 3))
            )
        }),
        ProbeLocation::Address { addr, .. } => {
            if symbols.function(*addr).is_none() && !symbols.covers(*addr) {
                bail!(
                    "probe '{}': {addr:#x} is not in {exe_path}'s code (an address as its \
                     symbols give it, e.g. from nm)",
                    spec.text
                );
            }
            Ok(*addr)
        }
        ProbeLocation::Line { file, line } => match symbols.line_address(file, *line) {
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
