//! What to boot, as `run` and `record` take it: the config, overrides,
//! the command; and what both do with the console and the network report.

use std::io::IsTerminal;
use std::os::fd::AsFd;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Context, Result};
use guest::config::FileSpec;
use guest::host_program::{absolute, HostCommand, PlacementReason};
use guest::VmConfig;
use guest::{BootOptions, CommandStreams, StreamKind};
use vmm::console::ConsoleInput;
use vmm::Machine;

/// What to boot: shared by `run` and `record`.
#[derive(clap::Args)]
pub struct GuestArgs {
    /// VM config file (TOML); default: the built-in guest.
    config: Option<PathBuf>,
    // Listed first; its help names the library by its one constant.
    #[arg(
        long,
        display_order = 0,
        help = "Preload the probe library in the guest command (events for diagnosis)",
        long_help = probes_help()
    )]
    probes: bool,
    /// Guest memory in MiB (overrides the config).
    #[arg(long, value_name = "MIB")]
    memory: Option<u64>,
    /// Extra kernel command-line text (appended to the config's).
    #[arg(long, value_name = "TEXT")]
    cmdline: Option<String>,
    /// Show the kernel's boot messages (no `quiet`; with a boot snapshot
    /// they appear only on the boot that takes it: add --cold-boot).
    #[arg(long)]
    verbose_boot: bool,
    /// Boot the guest kernel from power-on instead of restoring the boot
    /// snapshot of this image (taken on its first run, cached; `insight
    /// cache` lists and clears them).
    #[arg(long)]
    pub cold_boot: bool,
    /// Do not forward standard input: the command keeps the guest terminal, without input (else a
    /// terminal forwards keys to it, and a file or pipe becomes its standard input, a pipe).
    #[arg(long)]
    pub no_stdin: bool,
    /// The command's terminal: `virtio` (hvc0, a VM exit per buffer of
    /// output; the default) or `serial` (ttyS0, a VM exit per byte, for a
    /// guest kernel without virtio-console). Overrides the config's
    /// `console`.
    #[arg(long, value_name = "KIND")]
    console: Option<guest::config::ConsoleKind>,
    /// Look the command's program up on the host's PATH (not the guest's)
    /// and bring it into the guest, as a path (`./prog`) is brought.
    #[arg(long)]
    host_path: bool,
    /// Run the command in the host's files, which a command given on the
    /// command line does by default (without a config, --file or
    /// --host-path): the guest sees the host's /usr, /lib*, /bin, /sbin,
    /// /etc, /opt, $HOME and the working directory at their paths,
    /// read-only (its writes stay in its memory), with the host's
    /// environment, the image's programs last on PATH; a recording stores
    /// what the guest reads, each file once in the trace store
    /// (docs/host-files.md).
    #[arg(long, conflicts_with = "image")]
    host_fs: bool,
    /// A host directory the guest sees besides those of the host's files
    /// (which it implies); repeatable.
    #[arg(long = "host-dir", value_name = "DIR", conflicts_with = "image")]
    host_dirs: Vec<PathBuf>,
    /// Run the command in the built-in guest alone, without the host's
    /// files: the image's programs (its workloads, busybox) and what
    /// --file or a brought program adds.
    #[arg(long)]
    image: bool,
    /// A host file or directory (recursively) to place in the guest at
    /// GUEST, by default at the same absolute path; repeatable. As a
    /// config's `[[files]]`.
    #[arg(long = "file", value_name = "HOST[:GUEST]")]
    files: Vec<String>,
    /// Command to run in the guest instead of the config's. A program
    /// named by a path (`./myprog`, `~/bin/tool`) that the guest image
    /// does not hold is brought from the host to the same absolute path,
    /// with the shared libraries the image lacks; the command then runs in
    /// the host's working directory when the path is relative.
    #[arg(last = true, value_name = "COMMAND")]
    command: Vec<String>,
}

impl GuestArgs {
    /// A short name for a recording of this guest (`crate::traces`).
    pub fn trace_name(&self) -> String {
        let command = if self.command.is_empty() && self.config.is_none() {
            VmConfig::builtin().command
        } else {
            self.command.clone()
        };
        crate::traces::base_name(self.config.as_deref(), &command)
    }
}

fn probes_help() -> String {
    format!(
        "Preload the probe library ({}) in the guest command (LD_PRELOAD, after the \
         config's own), as `probes = true` in the config does: a replay of the recording \
         collects the command's lock, thread, fork and exit events",
        guest::PROBE_LIBRARY
    )
}

fn load_config(path: Option<&PathBuf>) -> Result<VmConfig> {
    Ok(match path {
        Some(p) => VmConfig::from_file(p)?,
        None => VmConfig::builtin(),
    })
}

/// The config `args` name, with the command line's overrides applied.
fn guest_config(args: &GuestArgs) -> Result<VmConfig> {
    let mut config = load_config(args.config.as_ref())?;
    let cwd = std::env::current_dir().context("cannot read the working directory")?;
    let mut relative = false;
    if uses_host_files(args) {
        if args.host_path {
            bail!("--host-path brings a program into the guest image; with --host-fs the guest runs it from the host's files already");
        }
        let mut exports = config.host_files.take().unwrap_or_default();
        exports.extend(default_host_dirs(&cwd));
        exports.extend(args.host_dirs.iter().map(|d| absolute(&cwd, d)));
        config.host_files = Some(exports);
        config.workdir = Some(cwd.clone());
        // The host's environment, under the config's own settings.
        for (key, value) in std::env::vars_os() {
            if let (Some(k), Some(v)) = (key.to_str(), value.to_str()) {
                config
                    .env
                    .entry(k.to_owned())
                    .or_insert_with(|| v.to_owned());
            }
        }
        // The image's programs by their bare names, after the host's.
        let path = config
            .env
            .entry("PATH".to_owned())
            .or_insert_with(|| guest::DEFAULT_PATH.to_owned());
        *path = format!("{path}:{}", guest::IMAGE_PROGRAMS);
        if !args.command.is_empty() {
            config.command = args.command.clone();
        }
    } else if !args.command.is_empty() {
        config.command = args.command.clone();
        let program = &args.command[0];
        relative = program.contains('/') && !program.starts_with('/');
        config.host_command = Some(HostCommand {
            cwd: cwd.clone(),
            search_path: args.host_path,
        });
    } else if args.host_path {
        bail!("--host-path needs a command: insight record --host-path -- PROGRAM ARGS");
    }
    for file in &args.files {
        let (host, guest) = match file.split_once(':') {
            Some((host, guest)) => (host, PathBuf::from(guest)),
            None => (file.as_str(), absolute(&cwd, Path::new(file))),
        };
        if host.is_empty() {
            bail!("--file {file}: no host path");
        }
        relative |= !host.starts_with('/');
        FileSpec::check_guest(&guest).map_err(|why| anyhow!("--file {file}: {why}"))?;
        config.files.push(FileSpec {
            host: absolute(&cwd, Path::new(host)),
            guest,
        });
    }
    // Relative paths mean the same in the guest as on the host.
    if relative {
        config.workdir = Some(cwd);
    }
    if let Some(mib) = args.memory {
        config.memory_mib = mib;
        config.validate_memory().context("--memory")?;
    }
    if let Some(extra) = &args.cmdline {
        config.cmdline = format!("{} {}", config.cmdline, extra);
    }
    // The flag turns probes on; without it the config decides.
    config.probes |= args.probes;
    if let Some(kind) = args.console {
        config.console = kind;
    }
    Ok(config)
}

/// Whether the command runs in the host's files: where asked to
/// (`--host-fs`, `--host-dir`), and by default for a command given on the
/// command line whose program is a bare name on the host's PATH, unless
/// the built-in guest is asked for (`--image`) or given content (a config,
/// `--file`, `--host-path`). Another bare name is the image's (its
/// workloads); a program named by its path is brought into the image, with
/// its symbols for reports and the debugger.
fn uses_host_files(args: &GuestArgs) -> bool {
    let asked = args.host_fs || !args.host_dirs.is_empty();
    let by_default = !args.image
        && args.config.is_none()
        && args.files.is_empty()
        && !args.host_path
        && args.command.first().is_some_and(|program| {
            !program.contains('/') && guest::host_program::on_host_path(program).is_ok()
        });
    asked || by_default
}

/// The host directories the host's files show the guest, those that exist:
/// the system's programs, libraries and settings, the home directory and
/// the working directory `cwd`.
pub fn default_host_dirs(cwd: &Path) -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = [
        "/usr", "/lib", "/lib32", "/lib64", "/libx32", "/bin", "/sbin", "/etc", "/opt",
    ]
    .iter()
    .map(PathBuf::from)
    .collect();
    if let Some(home) = std::env::var_os("HOME").filter(|h| !h.is_empty()) {
        dirs.push(absolute(cwd, Path::new(&home)));
    }
    dirs.push(cwd.to_owned());
    dirs.retain(|d| std::fs::symlink_metadata(d).is_ok());
    dirs
}

/// The boot specification for `args`, and a description of the config
/// for trace headers.
pub fn prepare_guest(args: &GuestArgs) -> Result<(guest::VmSpec, String)> {
    let config = guest_config(args)?;
    let options = BootOptions {
        quirks: vmm::host_check::guest_quirks()?,
        quiet: !args.verbose_boot,
        cold_boot: args.cold_boot,
        streams: command_streams(args.no_stdin),
    };
    let spec = guest::prepare(&config, &options)?;
    let mut description = describe(args.config.as_ref(), &config);
    if !spec.brought.files.is_empty() {
        let brought = brought(&spec.brought.files);
        eprintln!("insight: brought from the host: {}", brought.join(", "));
        for line in brought {
            description += &format!("# brought from the host: {line}\n");
        }
    }
    if !spec.brought.library_dirs.is_empty() {
        let dirs: Vec<_> = spec
            .brought
            .library_dirs
            .iter()
            .map(|d| d.display().to_string())
            .collect();
        let line = format!("LD_LIBRARY_PATH in the guest gains {}", dirs.join(":"));
        eprintln!("insight: {line}");
        description += &format!("# {line}\n");
    }
    Ok((spec, description))
}

/// The host files a run brings, in words.
fn brought(files: &[guest::host_program::Brought]) -> Vec<String> {
    files
        .iter()
        .map(|b| {
            let why = match b.reason {
                PlacementReason::Program => "the program",
                PlacementReason::Missing => "not in the guest image",
                PlacementReason::OtherVersion => "replaces another version in the guest image",
            };
            match b.host == b.guest {
                true => format!("{} ({why})", b.host.display()),
                false => format!("{} as {} ({why})", b.host.display(), b.guest.display()),
            }
        })
        .collect()
}

/// The config for people reading a trace header: the file's text, then
/// what the command line changed.
fn describe(path: Option<&PathBuf>, config: &VmConfig) -> String {
    let mut description = match path {
        Some(path) => format!(
            "# {}\n{}",
            path.display(),
            trace::files::read_bounded(path, guest::config::MAX_CONFIG_BYTES, "config file")
                .ok()
                .and_then(|b| String::from_utf8(b).ok())
                .unwrap_or_default()
        ),
        None => "# built-in guest\n".to_string(),
    };
    description += &format!("# command: {:?}\n", config.command);
    if config.probes {
        description += &format!("# probes: {} preloaded\n", guest::PROBE_LIBRARY);
    }
    description += &format!("# console: {}\n", config.console);
    description
}

/// Creates the machine for `spec` and, unless it boots cold, restores
/// its boot snapshot (taking it first if the cache has none). `console`
/// gets the guest's output; so does the boot that takes a snapshot, when
/// `spec` shows boot messages.
pub fn start_machine(
    spec: &guest::VmSpec,
    console: vmm::vm::Console,
    build_console: impl FnOnce() -> vmm::vm::Console,
) -> Result<(Machine, Option<vmm::snapshot_cache::CacheStart>)> {
    let mut say = |text: &str| eprintln!("insight: {text}");
    let (machine, started) = vmm::builder::machine(spec, console, build_console, &mut say)?;
    if let Some(built) = started.as_ref().and_then(|s| s.built.as_ref()) {
        eprintln!(
            "insight: boot snapshot taken at guest time {:.1} s ({}, {:.2} s to store) in {}",
            built.vm_ns as f64 / 1e9,
            crate::status::human_bytes(built.bytes),
            built.took_ns as f64 / 1e9,
            started
                .as_ref()
                .map_or_else(Default::default, |s| s.path.display().to_string())
        );
    }
    Ok((machine, started))
}

/// What the command's standard streams are, after insight's own: the
/// guest's terminal where insight's is a terminal, else a pipe whose bytes
/// come from insight's standard input (unless `no_stdin`) or reach its
/// stream of that number; standard error in standard output's pipe where
/// both of insight's are one file or pipe (`>log 2>&1`), so that they keep
/// their order.
fn command_streams(no_stdin: bool) -> CommandStreams {
    let out = std::io::stdout();
    let err = std::io::stderr();
    let same_file = || {
        let id = |fd: std::os::fd::BorrowedFd<'_>| {
            let file = std::fs::File::from(fd.try_clone_to_owned().ok()?);
            let meta = file.metadata().ok()?;
            Some((meta.dev(), meta.ino()))
        };
        matches!((id(out.as_fd()), id(err.as_fd())), (Some(a), Some(b)) if a == b)
    };
    let kind = |terminal: bool| match terminal {
        true => StreamKind::Terminal,
        false => StreamKind::Pipe,
    };
    let mut streams = CommandStreams {
        input_pipe: !no_stdin && !std::io::stdin().is_terminal(),
        out: kind(out.is_terminal()),
        err: kind(err.is_terminal()),
    };
    if streams.out == StreamKind::Pipe && streams.err == StreamKind::Pipe && same_file() {
        streams.err = StreamKind::WithOutput;
    }
    streams
}

/// Where the guest's terminal writes on the host: insight's standard
/// output if that is a terminal, else its standard error if that is one
/// (`insight run -- prog | wc -c`: what the command writes to its
/// terminal, and the guest's messages, are not in the pipe), else
/// standard output.
pub fn terminal_output() -> vmm::vm::Console {
    if !std::io::stdout().is_terminal() && std::io::stderr().is_terminal() {
        Box::new(std::io::stderr())
    } else {
        Box::new(std::io::stdout())
    }
}

/// insight's standard output and error, for the command's relayed ones,
/// each through `wrap`, and its standard input for the command's where
/// that is a pipe.
pub fn host_streams(
    wrap: impl Fn(vmm::vm::Console) -> vmm::vm::Console,
    input: Option<ConsoleInput>,
) -> vmm::vm::HostStreams {
    vmm::vm::HostStreams {
        out: Some(wrap(Box::new(std::io::stdout()))),
        err: Some(wrap(Box::new(std::io::stderr()))),
        errors: 0,
        input,
    }
}

/// insight's standard input for the guest, unless told not to.
pub struct HostInput {
    /// For the command's terminal.
    pub terminal: Option<ConsoleInput>,
    /// For the command's standard input, a pipe (`spec.streams`).
    pub pipe: Option<ConsoleInput>,
    /// Keeps the terminal raw until the run ends.
    _raw: Option<vmm::console::TerminalGuard>,
}

/// Standard input for the guest unless `no_stdin`: where the command has
/// a pipe (insight's is no terminal, [`command_streams`]), for that pipe,
/// else for its terminal.
pub fn stdin_input(no_stdin: bool) -> HostInput {
    let (input, raw) = match no_stdin {
        true => (None, None),
        false => {
            let (input, raw) = ConsoleInput::from_stdin();
            (Some(input), Some(raw))
        }
    };
    let pipe = !std::io::stdin().is_terminal();
    HostInput {
        terminal: input.clone().filter(|_| !pipe),
        pipe: input.filter(|_| pipe),
        _raw: raw,
    }
}

/// What went wrong on the network device, in words (None: nothing did).
pub fn net_problems(report: Option<&vmm::NetReport>) -> Option<String> {
    let report = report?;
    let s = &report.stats;
    let mut parts = Vec::new();
    if let Some(failure) = &report.failure {
        parts.push(format!("the TAP device stopped working ({failure})"));
    }
    let counts = [
        (
            s.rx_bad_size,
            "received frames of a size the guest does not accept were dropped",
        ),
        (
            s.rx_overflow,
            "received frames were dropped while the guest took none",
        ),
        (
            s.rx_host_dropped,
            "frames for the guest were dropped by the host kernel at the TAP device before \
             insight read them",
        ),
        (
            s.rx_bad_chains,
            "receive buffers from the guest were malformed",
        ),
        (
            s.tx_bad_chains,
            "transmit requests from the guest were malformed",
        ),
        (s.tx_errors, "sent frames were refused by the TAP device"),
    ];
    for (n, what) in counts {
        if n > 0 {
            parts.push(format!("{n} {what}"));
        }
    }
    (!parts.is_empty()).then(|| format!("network: {}", parts.join("; ")))
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    /// `run` and `record` flatten these arguments.
    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        guest: GuestArgs,
    }

    const PROBES_PRELOADED: &str = "LD_PRELOAD=/usr/lib/libinsight-probes.so";

    /// The guest command's environment for these arguments.
    fn env_for(argv: &[&str]) -> Vec<String> {
        let cli =
            Cli::try_parse_from(std::iter::once("insight").chain(argv.iter().copied())).unwrap();
        guest::command_env(&guest_config(&cli.guest).unwrap())
    }

    /// A config file in a directory of its own.
    fn config_file(name: &str, text: &str) -> (PathBuf, String) {
        let dir = std::env::temp_dir().join(format!("insight-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("vm.toml");
        std::fs::write(&path, text).unwrap();
        let arg = path.to_str().unwrap().to_owned();
        (dir, arg)
    }

    #[test]
    fn the_probes_flag_preloads_the_library_and_nothing_else_does() {
        assert_eq!(
            env_for(&["--image", "--probes", "--", "syn_cont", "1000", "2000"]),
            [PROBES_PRELOADED]
        );
        assert!(env_for(&["--image", "--", "syn_cont", "1000", "2000"]).is_empty());
        assert!(env_for(&[]).is_empty());
        // The env form is a command like any other, passed on unchanged.
        let cli = Cli::try_parse_from([
            "insight",
            "--image",
            "--",
            "env",
            PROBES_PRELOADED,
            "syn_cont",
        ])
        .unwrap();
        let config = guest_config(&cli.guest).unwrap();
        assert_eq!(config.command, ["env", PROBES_PRELOADED, "syn_cont"]);
        assert!(guest::command_env(&config).is_empty());
    }

    #[test]
    fn probes_in_the_config_preload_the_library_and_the_flag_adds_to_the_config() {
        let (dir, with) = config_file("probes-config-on", "probes = true\ncommand = \"true\"\n");
        let (dir_off, without) = config_file(
            "probes-config-off",
            "probes = false\nenv = { LD_PRELOAD = \"/opt/mine.so\", A = \"1\" }\n",
        );
        let on = env_for(&[&with]);
        let off = env_for(&[&without]);
        let added = env_for(&["--probes", &without]);
        std::fs::remove_dir_all(&dir).unwrap();
        std::fs::remove_dir_all(&dir_off).unwrap();
        assert_eq!(on, [PROBES_PRELOADED]);
        assert_eq!(off, ["A=1", "LD_PRELOAD=/opt/mine.so"]);
        // The user's own preload is kept, the library appended.
        assert_eq!(
            added,
            [
                "A=1",
                "LD_PRELOAD=/opt/mine.so:/usr/lib/libinsight-probes.so"
            ]
        );
    }

    /// The config `argv` gives.
    fn config_for(argv: &[&str]) -> VmConfig {
        let cli =
            Cli::try_parse_from(std::iter::once("insight").chain(argv.iter().copied())).unwrap();
        guest_config(&cli.guest).unwrap()
    }

    #[test]
    fn a_host_program_runs_in_the_host_files_unless_the_image_is_asked_for() {
        let host = config_for(&["--probes", "--", "sh", "-c", "true"]);
        let exports = host.host_files.as_deref().unwrap_or_default();
        assert!(
            exports.iter().any(|d| d == Path::new("/usr")),
            "{exports:?}"
        );
        let cwd = std::env::current_dir().unwrap();
        assert_eq!(host.workdir.as_deref(), Some(cwd.as_path()));
        // The host's PATH first, the image's programs last.
        let path = &host.env["PATH"];
        assert!(
            path.ends_with(&format!(":{}", guest::IMAGE_PROGRAMS)),
            "{path}"
        );
        if let Ok(own) = std::env::var("PATH") {
            assert!(path.starts_with(&own), "{path}");
        }
        assert!(host.probes);
        // The built-in guest alone: asked for, or given content of its own.
        let (dir, vm) = config_file("host-files-config", "command = \"true\"\n");
        let image = [
            config_for(&["--image", "--", "sh"]),
            // Not a host program: the image's.
            config_for(&["--", "insight-image-only-program"]),
            // Named by its path: brought.
            config_for(&["--", "./insight-brought-program"]),
            config_for(&["--file", "Cargo.toml", "--", "cat", "Cargo.toml"]),
            config_for(&["--host-path", "--", "sh"]),
            config_for(&[&vm, "--", "true"]),
            config_for(&[]),
        ];
        std::fs::remove_dir_all(&dir).unwrap();
        for config in image {
            assert!(config.host_files.is_none(), "{:?}", config.command);
            assert!(!config.env.contains_key("PATH"), "{:?}", config.command);
        }
        // The two are exclusive.
        let cli = Cli::try_parse_from(["insight", "--image", "--host-fs", "--", "true"]);
        assert!(cli.is_err(), "--image and --host-fs together");
    }

    #[test]
    fn a_trace_header_describes_the_probes_and_the_console() {
        let mut config = VmConfig::builtin();
        config.command = vec!["syn_cont".into()];
        assert_eq!(
            describe(None, &config),
            "# built-in guest\n# command: [\"syn_cont\"]\n# console: virtio\n"
        );
        config.probes = true;
        config.console = guest::config::ConsoleKind::Serial;
        assert_eq!(
            describe(None, &config),
            "# built-in guest\n# command: [\"syn_cont\"]\n\
             # probes: /usr/lib/libinsight-probes.so preloaded\n# console: serial\n"
        );
    }
}
