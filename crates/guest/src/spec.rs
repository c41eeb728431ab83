//! Turns a [`VmConfig`] into what the VM boots: the kernel, the base
//! initramfs and the command line, which are the same for every run of an
//! image (and make its boot snapshot), and the run's archive, which
//! `/init` fetches once it is ready: the guest command, its environment,
//! the user's files, the devices to attach, a random seed and, for a VM
//! restored from a snapshot, the wall-clock time.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use guestfiles::ArchiveFiles;

use crate::boot;
use crate::config::{ConsoleKind, VmConfig};
use crate::host_program::{self, Brought, HostProgramError};
use crate::image::{self, GuestQuirks};
use crate::initramfs::{CpioWriter, InitramfsError};

/// Everything needed to boot a VM.
#[derive(Debug)]
pub struct VmSpec {
    /// Where the kernel came from, and its content as read once: what is
    /// digested for a trace is what boots.
    pub kernel: PathBuf,
    pub kernel_image: Vec<u8>,
    /// The base initramfs image.
    pub initramfs: Vec<u8>,
    /// Where it came from.
    pub initramfs_path: PathBuf,
    /// The run's archive, which `/init` fetches once it is ready
    /// (`guest::spec`).
    pub archive: Vec<u8>,
    /// Whether the run boots the kernel or restores a boot snapshot.
    pub start: Start,
    /// The wall-clock time `/init` sets (a guest restored from a
    /// snapshot), as (seconds, nanoseconds) since the Unix epoch.
    pub wall_clock: Option<(u64, u32)>,
    /// Base image of the virtio disk, if the guest has one.
    pub disk: Option<DiskImage>,
    /// The virtio network device, if the guest has one.
    pub net: Option<NetSpec>,
    /// The command's terminal, where host input goes.
    pub console: ConsoleKind,
    pub cmdline: String,
    pub memory_mib: u64,
    /// Seed for the guest kernel's random number generator.
    pub rng_seed: [u8; boot::RNG_SEED_LEN],
    /// What the archive brings for a program named by its host path
    /// (`crate::host_program`); nothing for a replay.
    pub brought: BroughtProgram,
    /// The host's files device, if `/init` attaches it: the host's
    /// directories it serves (none at replay, where the log answers).
    pub host_files: Option<Vec<PathBuf>>,
}

/// The host files a run's archive brings for its program.
#[derive(Debug, Default)]
pub struct BroughtProgram {
    /// The program and the libraries the image lacks.
    pub files: Vec<Brought>,
    /// Directories of brought libraries added to the command's
    /// `LD_LIBRARY_PATH` (the guest's loader searches no others).
    pub library_dirs: Vec<PathBuf>,
}

/// Where a run begins.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Start {
    /// From power-on: the kernel boots.
    Cold,
    /// From the boot snapshot of this kernel, initramfs, memory size and
    /// command line in the snapshot cache, taken first if there is none
    /// (`crate::snapshot`).
    Snapshot,
    /// From a trace's boot snapshot, which must be the one it names.
    TraceSnapshot {
        path: PathBuf,
        snapshot: trace::SnapshotRef,
    },
}

/// The base image of the guest's disk, opened once: the file a trace's
/// digest was computed from is the file the guest reads.
#[derive(Debug)]
pub struct DiskImage {
    pub path: PathBuf,
    pub file: std::fs::File,
}

/// The guest's network device.
#[derive(Clone, Debug)]
pub struct NetSpec {
    pub mac: [u8; 6],
    /// The host TAP device and the address to give it; `None` at replay,
    /// where received frames come from the log and sent ones go nowhere.
    pub tap: Option<(String, Option<crate::config::Ipv4Net>)>,
}

/// The command the guest runs when neither the config nor the command line
/// names one.
pub const DEFAULT_COMMAND: &str = "insight-demo";
/// Where `/init` looks for the command and its environment.
pub const COMMAND_FILE: &str = "/etc/insight/command";
pub const ENV_FILE: &str = "/etc/insight/env";
/// The command's working directory, one line (default /root).
pub const WORKDIR_FILE: &str = "/etc/insight/workdir";
/// Where `/init` looks for the address of eth0 ("a.b.c.d/len").
pub const NET_FILE: &str = "/etc/insight/net";
/// Where `/init` looks for the platform devices to attach, one a line.
pub const DEVICES_FILE: &str = "/etc/insight/devices";
/// Where `/init` looks for the seed it mixes into the kernel's random
/// number generator.
pub const SEED_FILE: &str = "/etc/insight/seed";
/// Where `/init` looks for the wall-clock time ("SECONDS NANOSECONDS").
pub const CLOCK_FILE: &str = "/etc/insight/clock";
/// Which of the command's standard streams are pipes to the host's
/// ([`CommandStreams::init_file`]); without it both are its terminal.
pub const STREAMS_FILE: &str = "/etc/insight/streams";
/// The platform devices the kernel command line declares for the disk and
/// the network device, in its order: always declared, so that every run
/// of an image boots the same, and attached by `/init` when the run has
/// them.
const BLOCK_PLATFORM_DEVICE: &str = "virtio-mmio.0";
const NET_PLATFORM_DEVICE: &str = "virtio-mmio.1";
/// The virtio console, declared after them: with it attached, `/init`
/// gives the command `/dev/hvc0` as its terminal.
const CONSOLE_PLATFORM_DEVICE: &str = "virtio-mmio.2";
/// The host's files (virtio 9P), declared after the console.
const HOST_FILES_PLATFORM_DEVICE: &str = "virtio-mmio.3";
/// Where `/init` looks for the host's directories to show at their paths
/// (one a line): it mounts the host's files and an overlay over them and
/// runs the command in that tree.
pub const HOST_FILES_FILE: &str = "/etc/insight/host-files";
/// The probe library in the built guest image (`probes/`,
/// tools/build-guest), which `probes = true` or `--probes` preloads.
pub const PROBE_LIBRARY: &str = "/usr/lib/libinsight-probes.so";
/// Where `/init` shows the image's own programs (its `/usr/bin`: the
/// workloads) in the host's files, for the end of the command's PATH.
pub const IMAGE_PROGRAMS: &str = guestfiles::IMAGE_PROGRAMS;
/// The PATH `/init` gives a command whose environment names none.
pub const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

#[derive(Debug, thiserror::Error)]
pub enum GuestError {
    #[error("{0}")]
    MissingImage(String),
    #[error(transparent)]
    Files(#[from] InitramfsError),
    #[error(transparent)]
    HostProgram(#[from] HostProgramError),
    #[error("cannot read a random seed from /dev/urandom")]
    Seed(#[source] std::io::Error),
    #[error("cannot read {path}")]
    ReadImage {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot use this image")]
    Image(#[from] trace::files::FileError),
    #[error("the trace was recorded with {role} {path} of SHA-256 {recorded}, but that file now has SHA-256 {found}: replay needs the exact image the recording booted (rebuild or restore it)")]
    ImageChanged {
        role: String,
        path: String,
        recorded: String,
        found: String,
    },
    #[error("the trace header names no {0} image")]
    MissingRole(&'static str),
    #[error("the trace's random seed has {0} bytes, not {len}", len = crate::boot::RNG_SEED_LEN)]
    BadSeed(usize),
    #[error("the guest {what} has {count} {unit}; the guest's /init takes at most {limit}")]
    TooLong {
        what: &'static str,
        count: usize,
        unit: &'static str,
        limit: usize,
    },
    #[error("the guest keeps its files in its memory, at most half of it: {files_mib} MiB of files (the guest image's {image_mib} MiB, {run_mib} MiB brought for this run) do not fit in {memory_mib} MiB; {hint}")]
    FilesDoNotFit {
        files_mib: u64,
        image_mib: u64,
        run_mib: u64,
        memory_mib: u64,
        hint: String,
    },
}

/// What the guest kernel keeps of its memory before the root file system
/// (which may hold half of the rest) can have any: its code and tables.
const KERNEL_MIB: u64 = 24;

/// Checks that the guest image's files and the run's archive fit in the
/// guest's root file system (a tmpfs of half the memory the kernel leaves)
/// before anything is copied into it, naming the memory that would do.
fn check_files_fit(
    image_bytes: usize,
    run_bytes: usize,
    memory_mib: u64,
) -> Result<(), GuestError> {
    const MIB: u64 = 1 << 20;
    let files = (image_bytes + run_bytes) as u64;
    let room = memory_mib.saturating_sub(KERNEL_MIB) * MIB / 2;
    if files <= room {
        return Ok(());
    }
    let files_mib = files.div_ceil(MIB);
    // Room for the files twice over, the kernel, and the program's own
    // memory, in steps of 64 MiB.
    let suggest = (2 * files_mib + KERNEL_MIB + 64).div_ceil(64) * 64;
    let hint = if suggest <= crate::config::MAX_MEMORY_MIB {
        format!("give --memory {suggest} (memory_mib = {suggest} in a config)")
    } else {
        format!(
            "bring fewer files: the largest guest ({} MiB) holds {} MiB",
            crate::config::MAX_MEMORY_MIB,
            (crate::config::MAX_MEMORY_MIB - KERNEL_MIB) / 2
        )
    };
    Err(GuestError::FilesDoNotFit {
        files_mib,
        image_mib: (image_bytes as u64).div_ceil(MIB),
        run_mib: (run_bytes as u64).div_ceil(MIB),
        memory_mib,
        hint,
    })
}

/// The guest's `/init` (images/init/insight-init.c) reads at most this
/// many command arguments, and as many environment entries...
const INIT_MAX_STRINGS: usize = 4096;
/// ... from files shorter than its buffers (256 and 64 KiB) by the NUL it
/// appends and one byte more, which it takes for a file too long.
const INIT_COMMAND_BYTES: usize = 256 * 1024 - 2;
const INIT_ENV_BYTES: usize = 64 * 1024 - 2;

/// A fresh seed for the guest's random number generator.
fn random_seed() -> Result<[u8; crate::boot::RNG_SEED_LEN], GuestError> {
    use std::io::Read;
    let mut seed = [0u8; crate::boot::RNG_SEED_LEN];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut seed))
        .map_err(GuestError::Seed)?;
    Ok(seed)
}

/// Options that do not come from the config file.
#[derive(Clone, Debug)]
pub struct BootOptions {
    pub quirks: GuestQuirks,
    /// `quiet` on the kernel command line.
    pub quiet: bool,
    /// Boot the kernel from power-on instead of restoring the cached boot
    /// snapshot.
    pub cold_boot: bool,
    /// What the command's standard output and error are.
    pub streams: CommandStreams,
}

/// What the command's standard output and error are in the guest: its
/// terminal, or pipes whose bytes `/init` relays to the host's streams
/// (where those are not terminals: `insight run -- prog | wc -c`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CommandStreams {
    /// Standard input a pipe whose bytes `/init` asks the hypervisor for
    /// (where the host's is no terminal: `prog < file`, `cmd | insight
    /// run -- prog`), else the terminal.
    pub input_pipe: bool,
    pub out: StreamKind,
    pub err: StreamKind,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum StreamKind {
    /// The command's terminal, as its standard input is.
    #[default]
    Terminal,
    /// A pipe of its own, relayed to the host's stream of that number.
    Pipe,
    /// Standard output's pipe (for standard error where the host's two
    /// streams are one file or pipe: `>log 2>&1`), so that their bytes
    /// stay in the order they were written.
    WithOutput,
}

impl CommandStreams {
    /// The file `/init` reads them from ([`STREAMS_FILE`]): a line per
    /// stream that is not the terminal, `0` for standard input's pipe, `1`
    /// or `2` for a pipe of its own, `2>&1` for standard error in standard
    /// output's; `None` where all are the terminal.
    pub fn init_file(&self) -> Option<String> {
        let mut text = String::new();
        if self.input_pipe {
            text += "0\n";
        }
        if self.out == StreamKind::Pipe {
            text += "1\n";
        }
        match self.err {
            StreamKind::Terminal => {}
            StreamKind::Pipe => text += "2\n",
            StreamKind::WithOutput if self.out == StreamKind::Pipe => text += "2>&1\n",
            // Standard output is the terminal: standard error with it.
            StreamKind::WithOutput => {}
        }
        (!text.is_empty()).then_some(text)
    }
}

/// NUL-terminated strings, the format `/init` reads.
fn nul_separated<'a>(items: impl IntoIterator<Item = &'a str>) -> Vec<u8> {
    let mut out = Vec::new();
    for item in items {
        out.extend_from_slice(item.as_bytes());
        out.push(0);
    }
    out
}

/// `items` as the file `/init` reads them from, if it can read them all:
/// beyond its limits it would drop the rest without a word.
fn init_strings(
    what: &'static str,
    items: &[&str],
    max_bytes: usize,
) -> Result<Vec<u8>, GuestError> {
    if items.len() > INIT_MAX_STRINGS {
        return Err(GuestError::TooLong {
            what,
            count: items.len(),
            unit: "entries",
            limit: INIT_MAX_STRINGS,
        });
    }
    let bytes = nul_separated(items.iter().copied());
    if bytes.len() > max_bytes {
        return Err(GuestError::TooLong {
            what,
            count: bytes.len(),
            unit: "bytes (each with its NUL)",
            limit: max_bytes,
        });
    }
    Ok(bytes)
}

/// The guest command's environment, `KEY=VALUE` entries as `/init` reads
/// them: the config's, with [`PROBE_LIBRARY`] appended to `LD_PRELOAD`
/// (after the libraries the config preloads itself) when it asks for probes.
pub fn command_env(config: &VmConfig) -> Vec<String> {
    let env = env_map(config);
    env.iter().map(|(k, v)| format!("{k}={v}")).collect()
}

fn env_map(config: &VmConfig) -> BTreeMap<String, String> {
    let mut env = config.env.clone();
    if config.probes {
        let preload = env.entry("LD_PRELOAD".to_owned()).or_default();
        // The dynamic loader takes a list separated by spaces or colons.
        if !preload.split([' ', ':']).any(|lib| lib == PROBE_LIBRARY) {
            if !preload.is_empty() {
                preload.push(':');
            }
            preload.push_str(PROBE_LIBRARY);
        }
    }
    env
}

/// Builds the boot specification for `config`.
pub fn prepare(config: &VmConfig, options: &BootOptions) -> Result<VmSpec, GuestError> {
    let kernel = config.kernel.clone().unwrap_or_else(image::default_kernel);
    image::require(&kernel, "guest kernel").map_err(GuestError::MissingImage)?;
    let initramfs_path = config
        .initramfs
        .clone()
        .unwrap_or_else(image::default_initramfs);
    image::require(&initramfs_path, "guest initramfs").map_err(GuestError::MissingImage)?;
    let kernel_image = read_image(&kernel)?;
    let initramfs = read_image(&initramfs_path)?;
    let rng_seed = random_seed()?;

    let mut extra = CpioWriter::new();
    for file in &config.files {
        extra.add_host_path(&file.host, &file.guest)?;
    }
    let mut command: Vec<String> = if config.command.is_empty() {
        vec![DEFAULT_COMMAND.to_owned()]
    } else {
        config.command.clone()
    };
    let mut env = env_map(config);
    let mut brought = Vec::new();
    let mut library_dirs = Vec::new();
    if let Some(how) = &config.host_command {
        let mut image = ArchiveFiles::default();
        image.add(&initramfs);
        image.add(extra.written());
        let library_path = env.get("LD_LIBRARY_PATH").map(String::as_str);
        if let Some(program) = host_program::find(&command[0], how, &image, library_path)? {
            // Found on the host's PATH: the guest runs it by its path (one
            // given as a path runs as given, relative ones from the same
            // working directory).
            if !command[0].contains('/') {
                command[0] = program.path.to_string_lossy().into_owned();
            }
            for (file, data) in program.files {
                extra.add_file(&file.guest, 0o755, &data)?;
                brought.push(file);
            }
            if !program.library_dirs.is_empty() {
                let dirs: Vec<_> = program
                    .library_dirs
                    .iter()
                    .map(|d| d.to_string_lossy())
                    .collect();
                let path = env.entry("LD_LIBRARY_PATH".to_owned()).or_default();
                // The command's own directories come first.
                if !path.is_empty() {
                    path.push(':');
                }
                path.push_str(&dirs.join(":"));
                library_dirs = program.library_dirs;
            }
        }
    }
    let command: Vec<&str> = command.iter().map(String::as_str).collect();
    let command = init_strings("command", &command, INIT_COMMAND_BYTES)?;
    let env: Vec<String> = env.iter().map(|(k, v)| format!("{k}={v}")).collect();
    let env: Vec<&str> = env.iter().map(String::as_str).collect();
    let env = init_strings("environment", &env, INIT_ENV_BYTES)?;
    extra.add_file(COMMAND_FILE.as_ref(), 0o644, &command)?;
    extra.add_file(ENV_FILE.as_ref(), 0o644, &env)?;
    if let Some(dir) = &config.workdir {
        extra.add_dir(dir)?;
        let mut line = dir.as_os_str().as_encoded_bytes().to_vec();
        line.push(b'\n');
        extra.add_file(WORKDIR_FILE.as_ref(), 0o644, &line)?;
    }

    if let Some((addr, len)) = config.net.as_ref().and_then(|n| n.guest_address) {
        extra.add_file(
            NET_FILE.as_ref(),
            0o644,
            format!("{addr}/{len}\n").as_bytes(),
        )?;
    }

    let mut attach = String::new();
    if let Some(disk) = &config.disk {
        image::require(disk, "disk image").map_err(GuestError::MissingImage)?;
        attach += &format!("{BLOCK_PLATFORM_DEVICE}\n");
    }
    if config.net.is_some() {
        attach += &format!("{NET_PLATFORM_DEVICE}\n");
    }
    if config.console == ConsoleKind::Virtio {
        attach += &format!("{CONSOLE_PLATFORM_DEVICE}\n");
    }
    if let Some(exports) = &config.host_files {
        attach += &format!("{HOST_FILES_PLATFORM_DEVICE}\n");
        let mut list = Vec::new();
        for dir in exports {
            list.extend_from_slice(dir.as_os_str().as_encoded_bytes());
            list.push(b'\n');
        }
        extra.add_file(HOST_FILES_FILE.as_ref(), 0o644, &list)?;
    }
    if !attach.is_empty() {
        extra.add_file(DEVICES_FILE.as_ref(), 0o644, attach.as_bytes())?;
    }
    if let Some(streams) = options.streams.init_file() {
        extra.add_file(STREAMS_FILE.as_ref(), 0o644, streams.as_bytes())?;
    }
    let (start, wall_clock) = if options.cold_boot {
        (Start::Cold, None)
    } else {
        // The snapshot's clock stopped when it was taken; a booted kernel
        // reads the time from the CMOS clock instead.
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        (Start::Snapshot, Some((now.as_secs(), now.subsec_nanos())))
    };
    let archive = extra.finish();
    check_files_fit(initramfs.len(), archive.len(), config.memory_mib)?;
    Ok(VmSpec {
        kernel,
        kernel_image,
        initramfs,
        initramfs_path,
        archive,
        start,
        wall_clock,
        disk: config.disk.as_deref().map(open_disk).transpose()?,
        net: config.net.as_ref().map(|n| NetSpec {
            mac: n.mac,
            tap: Some((n.tap.clone(), n.host_address)),
        }),
        console: config.console,
        cmdline: base_cmdline(options, config.probes, &config.cmdline),
        memory_mib: config.memory_mib,
        rng_seed,
        brought: BroughtProgram {
            files: brought,
            library_dirs,
        },
        host_files: config.host_files.clone(),
    })
}

/// The terminal a run's archive gives the command: the virtio console if
/// it has `/init` attach it.
pub fn console_of_archive(archive: &[u8]) -> ConsoleKind {
    if attached(archive, CONSOLE_PLATFORM_DEVICE) {
        ConsoleKind::Virtio
    } else {
        ConsoleKind::Serial
    }
}

/// Whether a run's archive has `/init` attach platform device `device`.
fn attached(archive: &[u8], device: &str) -> bool {
    let mut files = ArchiveFiles::default();
    files.add(archive);
    files.file(DEVICES_FILE.as_ref()).is_some_and(|list| {
        list.split(|&b| b == b'\n')
            .any(|line| line == device.as_bytes())
    })
}

/// The kernel command line of every run of an image: the disk and network
/// devices are always declared (and answer once `/init` attaches them).
/// A run with probes has its own (`insight.probes`), hence its own boot
/// snapshot.
fn base_cmdline(options: &BootOptions, probes: bool, extra: &str) -> String {
    format!(
        "{} {} {} {} {}",
        image::kernel_cmdline(options.quirks, probes, options.quiet, extra),
        devices::virtio_blk::kernel_cmdline(),
        devices::virtio_net::kernel_cmdline(),
        devices::virtio_console::kernel_cmdline(),
        devices::virtio_9p::kernel_cmdline()
    )
}

/// What `/init` fetches: the run's `archive`, followed by one with the
/// random seed and, for a guest restored from a snapshot, the wall-clock
/// time (seconds, nanoseconds): they differ in every run, and the trace
/// header keeps them apart from the archive.
pub fn delivered_archive(
    archive: &[u8],
    rng_seed: &[u8; crate::boot::RNG_SEED_LEN],
    wall_clock: Option<(u64, u32)>,
) -> Result<Vec<u8>, GuestError> {
    let mut own = CpioWriter::new();
    own.add_file(SEED_FILE.as_ref(), 0o600, rng_seed)?;
    if let Some((secs, nanos)) = wall_clock {
        own.add_file(
            CLOCK_FILE.as_ref(),
            0o644,
            format!("{secs} {nanos}\n").as_bytes(),
        )?;
    }
    Ok(with_archive(archive, &own.finish()))
}

/// `initramfs` with `archive` appended, as a kernel unpacks them both:
/// what a guest booted outside insight needs, and where the files of a
/// run are found for symbols.
pub fn with_archive(initramfs: &[u8], archive: &[u8]) -> Vec<u8> {
    let mut out = initramfs.to_vec();
    // Concatenated archives must each start 4-byte aligned.
    out.resize(out.len().next_multiple_of(4), 0);
    out.extend_from_slice(archive);
    out
}

/// SHA-256 of `bytes`, in hex.
pub fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::{Digest, Sha256};
    hex(&Sha256::digest(bytes))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Largest kernel or initramfs image read: none larger fits in the
/// largest guest memory.
pub const MAX_IMAGE_BYTES: u64 = crate::config::MAX_MEMORY_MIB << 20;

fn read_image(path: &std::path::Path) -> Result<Vec<u8>, GuestError> {
    Ok(trace::files::read_bounded(
        path,
        MAX_IMAGE_BYTES,
        "boot image",
    )?)
}

/// The images and boot parameters of `spec`, for a trace header: the
/// digests are of the bytes `spec` boots, not of the files as they are now.
pub fn trace_images(
    spec: &VmSpec,
) -> Result<(Vec<trace::ImageDigest>, trace::BootParams), GuestError> {
    let kernel = &spec.kernel_image;
    let initramfs = &spec.initramfs;
    // The resolved paths: the cache's `default` links move with rebuilds,
    // the content-keyed directories they point to do not.
    let resolved = |p: &std::path::Path| {
        std::fs::canonicalize(p)
            .unwrap_or_else(|_| p.to_owned())
            .display()
            .to_string()
    };
    let mut images = vec![
        trace::ImageDigest {
            role: "kernel".into(),
            path: resolved(&spec.kernel),
            digest: sha256_hex(kernel),
        },
        trace::ImageDigest {
            role: "initramfs".into(),
            path: resolved(&spec.initramfs_path),
            digest: sha256_hex(initramfs),
        },
    ];
    if let Some(disk) = &spec.disk {
        images.push(trace::ImageDigest {
            role: "disk".into(),
            path: resolved(&disk.path),
            digest: sha256_of_file(disk)?,
        });
    }
    let boot = trace::BootParams {
        cmdline: spec.cmdline.clone(),
        memory_mib: spec.memory_mib,
        rng_seed: spec.rng_seed.to_vec(),
        archive: spec.archive.clone(),
        wall_clock: spec.wall_clock,
        net: spec.net.as_ref().map(|n| trace::NetParams { mac: n.mac }),
        // Known once the VM has started (`Vm::started_from`).
        snapshot: None,
    };
    Ok((images, boot))
}

/// Rebuilds the boot specification the trace in `dir` was recorded with,
/// checking that the image files are the ones it booted.
pub fn from_trace(header: &trace::Header, dir: &Path) -> Result<VmSpec, GuestError> {
    let image = |role: &'static str| -> Result<(PathBuf, Vec<u8>), GuestError> {
        let d = header
            .images
            .iter()
            .find(|i| i.role == role)
            .ok_or(GuestError::MissingRole(role))?;
        image_checked(d, role)
    };
    let (kernel, kernel_image) = image("kernel")?;
    let (initramfs_path, initramfs) = image("initramfs")?;
    let disk = match header.images.iter().find(|i| i.role == "disk") {
        Some(d) => {
            let disk = open_disk(Path::new(&d.path))?;
            check_digest(d, "disk", sha256_of_file(&disk)?)?;
            Some(disk)
        }
        None => None,
    };
    let rng_seed = header
        .boot
        .rng_seed
        .as_slice()
        .try_into()
        .map_err(|_| GuestError::BadSeed(header.boot.rng_seed.len()))?;
    Ok(VmSpec {
        kernel,
        kernel_image,
        initramfs,
        initramfs_path,
        archive: header.boot.archive.clone(),
        wall_clock: header.boot.wall_clock,
        start: match &header.boot.snapshot {
            Some(snapshot) => Start::TraceSnapshot {
                path: dir.join(trace::SNAPSHOT_FILE),
                snapshot: snapshot.clone(),
            },
            None => Start::Cold,
        },
        disk,
        // Replay needs no network: received frames come from the log.
        net: header.boot.net.as_ref().map(|n| NetSpec {
            mac: n.mac,
            tap: None,
        }),
        console: console_of_archive(&header.boot.archive),
        cmdline: header.boot.cmdline.clone(),
        memory_mib: header.boot.memory_mib,
        rng_seed,
        brought: BroughtProgram::default(),
        host_files: attached(&header.boot.archive, HOST_FILES_PLATFORM_DEVICE).then(Vec::new),
    })
}

/// Reads an image a trace names and checks its content.
fn image_checked(
    d: &trace::ImageDigest,
    role: &'static str,
) -> Result<(PathBuf, Vec<u8>), GuestError> {
    let path = PathBuf::from(&d.path);
    let bytes = read_image(&path)?;
    check_digest(d, role, sha256_hex(&bytes))?;
    Ok((path, bytes))
}

fn check_digest(
    d: &trace::ImageDigest,
    role: &'static str,
    found: String,
) -> Result<(), GuestError> {
    if found != d.digest {
        return Err(GuestError::ImageChanged {
            role: role.into(),
            path: d.path.clone(),
            recorded: d.digest.clone(),
            found,
        });
    }
    Ok(())
}

fn open_disk(path: &Path) -> Result<DiskImage, GuestError> {
    let file = trace::files::open_regular(path)?;
    Ok(DiskImage {
        path: path.to_owned(),
        file,
    })
}

/// SHA-256 of a disk image in hex, read through its open file a piece at
/// a time (a disk can be larger than memory).
fn sha256_of_file(disk: &DiskImage) -> Result<String, GuestError> {
    use sha2::{Digest, Sha256};
    use std::os::unix::fs::FileExt;
    let err = |source| GuestError::ReadImage {
        path: disk.path.clone(),
        source,
    };
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut offset = 0u64;
    loop {
        let n = match disk.file.read_at(&mut buf, offset) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(err(e)),
        };
        hasher.update(&buf[..n]);
        offset += n as u64;
    }
    Ok(hex(&hasher.finalize()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_init_would_cut_is_refused_before_boot() {
        let numbers: Vec<String> = (0..=INIT_MAX_STRINGS).map(|n| n.to_string()).collect();
        let args: Vec<&str> = numbers.iter().map(String::as_str).collect();
        let bytes = init_strings("command", &args[..INIT_MAX_STRINGS], INIT_COMMAND_BYTES).unwrap();
        assert_eq!(bytes.iter().filter(|&&b| b == 0).count(), INIT_MAX_STRINGS);
        let err = init_strings("command", &args, INIT_COMMAND_BYTES).unwrap_err();
        assert_eq!(
            err.to_string(),
            "the guest command has 4097 entries; the guest's /init takes at most 4096"
        );
        let long = "x".repeat(INIT_ENV_BYTES - 1);
        assert!(init_strings("environment", &[&long], INIT_ENV_BYTES).is_ok());
        let longer = "x".repeat(INIT_ENV_BYTES);
        let err = init_strings("environment", &[&longer], INIT_ENV_BYTES).unwrap_err();
        assert!(err.to_string().contains("65535 bytes"), "{err}");
    }

    #[test]
    fn a_disk_is_hashed_through_its_open_file() {
        let path = std::env::temp_dir().join(format!("insight-disk-{}", std::process::id()));
        // Over two read pieces, not a multiple of either.
        let bytes: Vec<u8> = (0..(5u32 << 19) + 77).map(|i| (i % 251) as u8).collect();
        std::fs::write(&path, &bytes).unwrap();
        let disk = open_disk(&path).unwrap();
        // Replacing the file by name does not change what was opened.
        std::fs::remove_file(&path).unwrap();
        std::fs::write(&path, b"another image").unwrap();
        assert_eq!(sha256_of_file(&disk).unwrap(), sha256_hex(&bytes));
        std::fs::remove_file(&path).unwrap();
    }

    #[test]
    fn missing_default_image_explains_how_to_build_it() {
        let config = VmConfig {
            kernel: Some("/no/such/vmlinux".into()),
            ..VmConfig::builtin()
        };
        let opts = BootOptions {
            quirks: GuestQuirks {
                syscall_trap: false,
            },
            quiet: true,
            cold_boot: false,
            streams: CommandStreams::default(),
        };
        let err = prepare(&config, &opts).unwrap_err().to_string();
        assert!(
            err.contains("/no/such/vmlinux") && err.contains("tools/build-guest"),
            "{err}"
        );
    }

    /// The entry `--probes` and `probes = true` must put in the guest
    /// command's environment (spelled out: it checks the constant too).
    const PROBES_PRELOADED: &str = "LD_PRELOAD=/usr/lib/libinsight-probes.so";

    fn contains(haystack: &[u8], needle: &str) -> bool {
        haystack
            .windows(needle.len())
            .any(|w| w == needle.as_bytes())
    }

    #[test]
    fn probes_put_the_library_in_ld_preload_and_nothing_else_does() {
        let mut config = VmConfig::builtin();
        config.env.insert("X".into(), "1".into());
        assert_eq!(command_env(&config), ["X=1"]);
        config.probes = true;
        assert_eq!(command_env(&config), [PROBES_PRELOADED, "X=1"]);
        assert!(
            !config.env.contains_key("LD_PRELOAD"),
            "the config is left as is"
        );
    }

    #[test]
    fn a_user_ld_preload_is_kept_and_the_library_appended_once() {
        let mut config = VmConfig::builtin();
        config
            .env
            .insert("LD_PRELOAD".into(), "/opt/a.so /opt/b.so".into());
        assert_eq!(command_env(&config), ["LD_PRELOAD=/opt/a.so /opt/b.so"]);
        config.probes = true;
        assert_eq!(
            command_env(&config),
            ["LD_PRELOAD=/opt/a.so /opt/b.so:/usr/lib/libinsight-probes.so"]
        );
        // Already preloaded by the user, in either separator's list.
        for own in [
            "/usr/lib/libinsight-probes.so",
            "/opt/a.so:/usr/lib/libinsight-probes.so",
            "/usr/lib/libinsight-probes.so /opt/a.so",
        ] {
            config.env.insert("LD_PRELOAD".into(), own.into());
            assert_eq!(command_env(&config), [format!("LD_PRELOAD={own}")]);
        }
        config.env.insert("LD_PRELOAD".into(), String::new());
        assert_eq!(command_env(&config), [PROBES_PRELOADED]);
    }

    /// Stand-in images in a directory of their own: `prepare` reads them,
    /// nothing boots them.
    fn config_with_stand_in_images(name: &str) -> (PathBuf, VmConfig) {
        let dir = std::env::temp_dir().join(format!("insight-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (kernel, initramfs) = (dir.join("vmlinux"), dir.join("base.cpio"));
        std::fs::write(&kernel, b"").unwrap();
        std::fs::write(&initramfs, b"BASE").unwrap();
        let config = VmConfig {
            kernel: Some(kernel),
            initramfs: Some(initramfs),
            command: vec!["syn_cont".into(), "1000".into()],
            ..VmConfig::builtin()
        };
        (dir, config)
    }

    const OPTIONS: BootOptions = BootOptions {
        quirks: GuestQuirks {
            syscall_trap: false,
        },
        quiet: true,
        cold_boot: false,
        streams: CommandStreams {
            input_pipe: false,
            out: StreamKind::Terminal,
            err: StreamKind::Terminal,
        },
    };

    #[test]
    fn probes_reach_the_archive_the_trace_keeps_and_replay_boots() {
        let (dir, mut config) = config_with_stand_in_images("probes-trace");
        let without = prepare(&config, &OPTIONS).unwrap();
        assert!(!contains(&without.archive, "LD_PRELOAD"));
        assert!(!without.cmdline.contains("insight.probes"));
        config.probes = true;
        let spec = prepare(&config, &OPTIONS).unwrap();
        // The kernel's deterministic point after each switch, for probes only.
        assert!(spec.cmdline.contains(" insight.probes "));
        let entry = format!("{PROBES_PRELOADED}\0");
        assert!(contains(&spec.archive, &entry));
        assert!(
            !contains(&spec.initramfs, &entry),
            "the base image is every run's"
        );

        // Recorded: the header holds the archive; replay rebuilds the
        // guest from the header alone, probes included.
        let (images, boot) = trace_images(&spec).unwrap();
        let header = trace::Header {
            clock: trace::ClockKind::Exit,
            created_unix_secs: 0,
            guest_cpuid: Vec::new(),
            kvm_caps: Vec::new(),
            user_rdtsc_traps: false,
            host_apic_id: None,
            config: String::new(),
            images,
            boot,
            digest_interval: 1,
            sample_period_ns: 0,
            chaos: None,
        };
        let trace_dir = dir.join("trace");
        let writer = trace::TraceWriter::<()>::create(&trace_dir, &header).unwrap();
        writer.finish().unwrap();
        let reader = trace::TraceReader::<()>::open(&trace_dir).unwrap();
        let replayed = from_trace(&reader.header, &trace_dir).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(replayed.archive, spec.archive);
        assert_eq!(replayed.cmdline, spec.cmdline);
        assert_eq!(replayed.wall_clock, spec.wall_clock);
        assert_eq!(replayed.rng_seed, spec.rng_seed);
        assert!(
            spec.wall_clock.is_some(),
            "a snapshot run is given the time"
        );
        // No snapshot was taken for this header: replay boots.
        assert_eq!(replayed.start, Start::Cold);
    }

    #[test]
    fn files_that_do_not_fit_in_the_guests_memory_name_the_memory_that_would_do() {
        let (dir, mut config) = config_with_stand_in_images("files-fit");
        let big = dir.join("big");
        std::fs::write(&big, vec![7u8; 60 << 20]).unwrap();
        config.files.push(crate::config::FileSpec {
            host: big.clone(),
            guest: "/data/big".into(),
        });
        let err = prepare(&config, &OPTIONS).unwrap_err().to_string();
        assert!(err.contains("61 MiB of files"), "{err}");
        assert!(err.contains("do not fit in 128 MiB"), "{err}");
        assert!(err.contains("give --memory 256 "), "{err}");
        config.memory_mib = 256;
        assert!(prepare(&config, &OPTIONS).is_ok());
        std::fs::remove_dir_all(&dir).unwrap();
        // Beyond the largest guest: fewer files.
        let err = check_files_fit(6 << 20, 2000 << 20, 128)
            .unwrap_err()
            .to_string();
        assert!(err.contains("bring fewer files"), "{err}");
    }

    #[test]
    fn the_archive_says_which_console_the_command_has() {
        let (dir, mut config) = config_with_stand_in_images("console-kind");
        let spec = prepare(&config, &OPTIONS).unwrap();
        assert_eq!(spec.console, ConsoleKind::Virtio);
        assert!(contains(&spec.archive, "virtio-mmio.2\n"));
        assert_eq!(console_of_archive(&spec.archive), ConsoleKind::Virtio);
        // Every run declares the console's transport: one boot snapshot.
        assert!(spec
            .cmdline
            .contains(&devices::virtio_console::kernel_cmdline()));
        config.console = ConsoleKind::Serial;
        let serial = prepare(&config, &OPTIONS).unwrap();
        assert_eq!(serial.cmdline, spec.cmdline);
        assert_eq!(console_of_archive(&serial.archive), ConsoleKind::Serial);
        assert_eq!(console_of_archive(b"not an archive"), ConsoleKind::Serial);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_streams_file_names_the_pipes_only() {
        use StreamKind::*;
        let file = |out, err| {
            CommandStreams {
                input_pipe: false,
                out,
                err,
            }
            .init_file()
        };
        assert_eq!(file(Terminal, Terminal), None);
        assert_eq!(file(Pipe, Terminal).as_deref(), Some("1\n"));
        assert_eq!(file(Terminal, Pipe).as_deref(), Some("2\n"));
        assert_eq!(file(Pipe, Pipe).as_deref(), Some("1\n2\n"));
        assert_eq!(file(Pipe, WithOutput).as_deref(), Some("1\n2>&1\n"));
        assert_eq!(file(Terminal, WithOutput), None, "with the terminal");
        let input = CommandStreams {
            input_pipe: true,
            out: Pipe,
            err: Terminal,
        };
        assert_eq!(input.init_file().as_deref(), Some("0\n1\n"));
        // Both terminals: no file, the archive as before.
        let (dir, config) = config_with_stand_in_images("streams");
        let spec = prepare(&config, &OPTIONS).unwrap();
        assert!(!contains(&spec.archive, "etc/insight/streams"));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn appends_command_env_and_files_after_the_base_image() {
        let dir = std::env::temp_dir().join(format!("insight-guest-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (k, i, f) = (dir.join("vmlinux"), dir.join("base.cpio"), dir.join("prog"));
        std::fs::write(&k, b"").unwrap();
        std::fs::write(&i, b"BASE1").unwrap(); // 5 bytes: needs padding
        std::fs::write(&f, b"#!/bin/sh\n").unwrap();
        let mut config = VmConfig::builtin();
        config.kernel = Some(k);
        config.initramfs = Some(i);
        config.command = vec!["prog".into(), "a b".into()];
        config.env.insert("X".into(), "1".into());
        config.files.push(crate::config::FileSpec {
            host: f,
            guest: "/usr/local/bin/prog".into(),
        });
        let opts = BootOptions {
            quirks: GuestQuirks { syscall_trap: true },
            quiet: false,
            cold_boot: true,
            streams: CommandStreams {
                input_pipe: false,
                out: StreamKind::Pipe,
                err: StreamKind::WithOutput,
            },
        };
        let spec = prepare(&config, &opts).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(spec.initramfs, b"BASE1", "the base image as it is");
        assert_eq!(spec.start, Start::Cold);
        assert_eq!(
            spec.wall_clock, None,
            "a booted kernel reads the CMOS clock"
        );
        assert_eq!(&spec.archive[..6], b"070701");
        let text = String::from_utf8_lossy(&spec.archive);
        assert!(text.contains("usr/local/bin/prog"));
        assert!(text.contains("prog\0a b\0"));
        assert!(text.contains("X=1\0"));
        // No disk, no network: /init attaches the console only.
        assert!(text.contains("etc/insight/devices") && text.contains("virtio-mmio.2\n"));
        assert!(!text.contains("virtio-mmio.0") && !text.contains("virtio-mmio.1"));
        // Standard output a pipe, standard error in it.
        assert!(text.contains("etc/insight/streams") && text.contains("1\n2>&1\n"));
        assert!(spec.cmdline.contains("insight.syscall=pf"));
        // The devices are always declared, in the order /init names them.
        let blk = spec
            .cmdline
            .find("virtio_mmio.device=0x200@0xd0000000")
            .unwrap();
        let net = spec
            .cmdline
            .find("virtio_mmio.device=0x200@0xd0000200")
            .unwrap();
        assert!(blk < net);

        // For a QEMU boot: the archives after the base, 4-byte aligned,
        // the seed in a second one.
        let delivered = delivered_archive(&spec.archive, &spec.rng_seed, Some((5, 6))).unwrap();
        let text = String::from_utf8_lossy(&delivered);
        assert!(text.contains("etc/insight/seed") && text.contains("5 6\n"));
        let booted = with_archive(&spec.initramfs, &spec.archive);
        assert_eq!(&booted[..8], b"BASE1\0\0\0");
        assert_eq!(&booted[8..14], b"070701");
    }
}
