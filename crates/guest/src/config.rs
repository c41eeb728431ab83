//! The VM configuration file (TOML), documented in docs/config.md.
//!
//! ```toml
//! kernel = "/path/to/vmlinux"          # default: the built guest image
//! initramfs = "/path/to/initramfs.cpio"
//! memory_mib = 128
//! cmdline = "loglevel=7"               # appended to insight's own
//! command = ["sh", "-c", "echo hi"]    # or a string run by `sh -c`
//! probes = true                        # preload the probe library in it
//! workdir = "/root/data"               # the command's working directory
//! console = "virtio"                   # the command's terminal, or "serial"
//!
//! [[files]]                            # host files to add to the guest
//! host = "build/myprog"                # relative to this file
//! guest = "/usr/local/bin/myprog"
//!
//! [net]                                # a virtio network device
//! tap = "insight0"                     # created if it does not exist
//! guest_address = "10.0.2.15/24"       # eth0 in the guest
//! host_address = "10.0.2.2/24"         # given to the TAP device
//! ```

use std::collections::BTreeMap;
use std::fmt;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::host_program::HostCommand;

/// Limits on guest memory (MiB). The upper bound keeps RAM below the
/// 32-bit MMIO hole.
pub const MIN_MEMORY_MIB: u64 = 32;
pub const MAX_MEMORY_MIB: u64 = 3072;
/// Largest config file read (a config is a few lines of TOML).
pub const MAX_CONFIG_BYTES: u64 = 1 << 20;
/// Boot time grows with memory (the kernel initializes and frees every
/// page while interpreted), so the default is modest.
pub const DEFAULT_MEMORY_MIB: u64 = 128;

/// Directories the guest's /init mounts kernel file systems on, where no
/// file can be placed. (/tmp and /run are tmpfs mounts made before /init
/// unpacks the run's archive: files placed there land in them.)
pub const MOUNTED_AT_BOOT: [&str; 3] = ["/proc", "/sys", "/dev"];

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config {path}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot read config")]
    File(#[from] trace::files::FileError),
    #[error("config {path} is not valid: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("config {path}: {message}")]
    Invalid { path: PathBuf, message: String },
}

/// The guest command: an argv, or a string for `sh -c`.
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(untagged)]
enum CommandSpec {
    Shell(String),
    Argv(Vec<String>),
}

/// A host file or directory to place in the guest.
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct FileSpec {
    /// Host path; relative paths are relative to the config file.
    pub host: PathBuf,
    /// Absolute path in the guest.
    pub guest: PathBuf,
}

impl FileSpec {
    /// Checks a path the guest is to have: absolute, and not where /init
    /// mounts a file system over what the archive placed.
    pub fn check_guest(guest: &Path) -> Result<(), String> {
        if !guest.is_absolute() {
            return Err(format!("guest path {} must be absolute", guest.display()));
        }
        if let Some(mount) = MOUNTED_AT_BOOT.iter().find(|m| guest.starts_with(m)) {
            return Err(format!(
                "guest path {} would be hidden by the file system /init mounts on {mount}",
                guest.display()
            ));
        }
        Ok(())
    }
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    kernel: Option<PathBuf>,
    initramfs: Option<PathBuf>,
    memory_mib: Option<u64>,
    cmdline: Option<String>,
    command: Option<CommandSpec>,
    #[serde(default)]
    env: BTreeMap<String, String>,
    #[serde(default)]
    probes: bool,
    #[serde(default)]
    files: Vec<FileSpec>,
    workdir: Option<PathBuf>,
    disk: Option<PathBuf>,
    net: Option<RawNet>,
    #[serde(default)]
    console: ConsoleKind,
    host_files: Option<Vec<PathBuf>>,
}

/// The guest command's terminal.
#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum ConsoleKind {
    /// A virtio console (`hvc0`): a VM exit per buffer of output.
    #[default]
    Virtio,
    /// The 16550 UART (`ttyS0`), as the kernel's messages use: a VM exit
    /// per byte, for a guest kernel without virtio-console.
    Serial,
}

impl std::str::FromStr for ConsoleKind {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "virtio" => Ok(ConsoleKind::Virtio),
            "serial" => Ok(ConsoleKind::Serial),
            other => Err(format!(
                "{other:?} is not a console: \"virtio\" (hvc0) or \"serial\" (ttyS0)"
            )),
        }
    }
}

impl fmt::Display for ConsoleKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ConsoleKind::Virtio => "virtio",
            ConsoleKind::Serial => "serial",
        })
    }
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawNet {
    tap: String,
    mac: Option<String>,
    guest_address: Option<String>,
    host_address: Option<String>,
}

/// An IPv4 address with a prefix length ("10.0.2.15/24").
pub type Ipv4Net = (Ipv4Addr, u8);

/// The guest's network device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NetConfig {
    /// Host TAP device (created if it does not exist).
    pub tap: String,
    pub mac: [u8; 6],
    /// Address `/init` gives the guest's eth0 (none: left unconfigured).
    pub guest_address: Option<Ipv4Net>,
    /// Address insight gives the TAP device, bringing it up (none: the
    /// TAP device is configured by whoever created it).
    pub host_address: Option<Ipv4Net>,
}

/// Parses "a.b.c.d/len".
pub fn parse_ipv4_net(text: &str) -> Result<Ipv4Net, String> {
    let (addr, len) = text.split_once('/').ok_or_else(|| {
        format!("{text:?} is not an IPv4 address with a prefix length (a.b.c.d/len)")
    })?;
    let addr: Ipv4Addr = addr
        .parse()
        .map_err(|_| format!("{addr:?} is not an IPv4 address"))?;
    match len.parse::<u8>() {
        Ok(len) if (1..=30).contains(&len) => Ok((addr, len)),
        _ => Err(format!("prefix length {len:?} must be 1 to 30")),
    }
}

/// Parses "52:54:00:12:34:56"; multicast addresses are refused.
pub fn parse_mac(text: &str) -> Result<[u8; 6], String> {
    let bad = || format!("{text:?} is not a MAC address (six hex bytes separated by ':')");
    let parts: Vec<&str> = text.split(':').collect();
    if parts.len() != 6 {
        return Err(bad());
    }
    let mut mac = [0u8; 6];
    for (b, p) in mac.iter_mut().zip(parts) {
        if p.len() != 2 {
            return Err(bad());
        }
        *b = u8::from_str_radix(p, 16).map_err(|_| bad())?;
    }
    if mac[0] & 1 != 0 {
        return Err(format!("{text:?} is a multicast address"));
    }
    Ok(mac)
}

impl RawNet {
    fn validate(self) -> Result<NetConfig, ParseError> {
        let invalid = |m: String| ParseError::Invalid(format!("net: {m}"));
        devices::tap::check_name(&self.tap).map_err(invalid)?;
        let mac = match &self.mac {
            Some(m) => parse_mac(m).map_err(invalid)?,
            None => devices::virtio_net::DEFAULT_MAC,
        };
        let net = |a: &Option<String>| a.as_deref().map(parse_ipv4_net).transpose();
        let guest_address = net(&self.guest_address).map_err(invalid)?;
        let host_address = net(&self.host_address).map_err(invalid)?;
        if let (Some(g), Some(h)) = (guest_address, host_address) {
            if g.0 == h.0 {
                return Err(invalid(format!("guest and host both have address {}", g.0)));
            }
        }
        Ok(NetConfig {
            tap: self.tap,
            mac,
            guest_address,
            host_address,
        })
    }
}

/// A validated VM configuration. Paths are absolute or relative to the
/// current directory.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct VmConfig {
    /// `None`: the built guest kernel.
    pub kernel: Option<PathBuf>,
    /// `None`: the built guest initramfs.
    pub initramfs: Option<PathBuf>,
    pub memory_mib: u64,
    /// Extra kernel command line, appended to insight's.
    pub cmdline: String,
    /// The guest command; empty means the image's default.
    pub command: Vec<String>,
    /// Environment for the guest command.
    pub env: BTreeMap<String, String>,
    /// Preload the probe library in the guest command
    /// (`crate::spec::PROBE_LIBRARY`, added to `LD_PRELOAD`).
    pub probes: bool,
    pub files: Vec<FileSpec>,
    /// The command's working directory in the guest (created if the image
    /// lacks it); `None`: /root.
    pub workdir: Option<PathBuf>,
    /// The command was given on the host's command line: a program named
    /// by a host path is brought into the guest (`crate::host_program`).
    pub host_command: Option<HostCommand>,
    /// Base image of the guest's virtio disk (`/dev/vda`), never written.
    pub disk: Option<PathBuf>,
    /// The guest's network device (`eth0`), if any.
    pub net: Option<NetConfig>,
    /// The guest command's terminal.
    pub console: ConsoleKind,
    /// The host's directories the guest sees at their host paths,
    /// read-only, its writes kept in memory (docs/host-files.md); `None`:
    /// the image's files only.
    pub host_files: Option<Vec<PathBuf>>,
}

impl VmConfig {
    /// The configuration used when no file is given.
    pub fn builtin() -> Self {
        VmConfig {
            memory_mib: DEFAULT_MEMORY_MIB,
            ..Default::default()
        }
    }

    /// Reads and validates a config file.
    pub fn from_file(path: &Path) -> Result<Self, ConfigError> {
        let bytes = trace::files::read_bounded(path, MAX_CONFIG_BYTES, "config file").map_err(
            |e| match e {
                trace::files::FileError::Io { path, source } => ConfigError::Read { path, source },
                other => ConfigError::File(other),
            },
        )?;
        let text = String::from_utf8(bytes).map_err(|_| ConfigError::Invalid {
            path: path.to_owned(),
            message: "it is not UTF-8 text".into(),
        })?;
        let base = path.parent().unwrap_or(Path::new("."));
        Self::parse(&text, base).map_err(|e| match e {
            ParseError::Syntax(message) => ConfigError::Parse {
                path: path.to_owned(),
                message,
            },
            ParseError::Invalid(message) => ConfigError::Invalid {
                path: path.to_owned(),
                message,
            },
        })
    }

    /// Parses config text; relative paths are resolved against `base`.
    fn parse(text: &str, base: &Path) -> Result<Self, ParseError> {
        let raw: RawConfig = toml::from_str(text).map_err(|e| ParseError::Syntax(one_line(&e)))?;
        let resolve = |p: PathBuf| if p.is_relative() { base.join(p) } else { p };

        let memory_mib = raw.memory_mib.unwrap_or(DEFAULT_MEMORY_MIB);
        check_memory(memory_mib).map_err(ParseError::Invalid)?;
        let command = match raw.command {
            None => Vec::new(),
            Some(CommandSpec::Shell(s)) => vec!["sh".into(), "-c".into(), s],
            Some(CommandSpec::Argv(v)) => {
                if v.first().is_none_or(|a| a.is_empty()) {
                    return Err(ParseError::Invalid(
                        "command must name a program".to_string(),
                    ));
                }
                v
            }
        };
        for arg in &command {
            check_no_nul("command", arg)?;
        }
        for (k, v) in &raw.env {
            if k.is_empty() || k.contains('=') {
                return Err(ParseError::Invalid(format!(
                    "env: invalid variable name {k:?}"
                )));
            }
            check_no_nul("env", k)?;
            check_no_nul("env", v)?;
        }
        let cmdline = raw.cmdline.unwrap_or_default();
        if cmdline.contains(['\n', '\0']) {
            return Err(ParseError::Invalid(
                "cmdline must be a single line".to_string(),
            ));
        }
        let mut files = Vec::with_capacity(raw.files.len());
        for f in raw.files {
            FileSpec::check_guest(&f.guest)
                .map_err(|why| ParseError::Invalid(format!("files: {why}")))?;
            files.push(FileSpec {
                host: resolve(f.host),
                guest: f.guest,
            });
        }
        if let Some(dir) = &raw.workdir {
            FileSpec::check_guest(dir)
                .map_err(|why| ParseError::Invalid(format!("workdir: {why}")))?;
        }
        if let Some(dir) = raw.host_files.iter().flatten().find(|d| !d.is_absolute()) {
            return Err(ParseError::Invalid(format!(
                "host_files: {} is not an absolute path",
                dir.display()
            )));
        }
        Ok(VmConfig {
            kernel: raw.kernel.map(resolve),
            initramfs: raw.initramfs.map(resolve),
            memory_mib,
            cmdline,
            command,
            env: raw.env,
            probes: raw.probes,
            files,
            workdir: raw.workdir,
            host_command: None,
            host_files: raw.host_files,
            disk: raw.disk.map(resolve),
            net: raw.net.map(RawNet::validate).transpose()?,
            console: raw.console,
        })
    }
}

fn check_memory(mib: u64) -> Result<(), String> {
    if (MIN_MEMORY_MIB..=MAX_MEMORY_MIB).contains(&mib) {
        Ok(())
    } else {
        Err(format!(
            "memory_mib = {mib} is outside {MIN_MEMORY_MIB}..={MAX_MEMORY_MIB}"
        ))
    }
}

/// A memory size set outside a config file is out of range.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct MemoryRangeError(String);

impl VmConfig {
    /// Checks `memory_mib` after it was changed outside a config file.
    pub fn validate_memory(&self) -> Result<(), MemoryRangeError> {
        check_memory(self.memory_mib).map_err(MemoryRangeError)
    }
}

enum ParseError {
    Syntax(String),
    Invalid(String),
}

fn check_no_nul(what: &str, s: &str) -> Result<(), ParseError> {
    if s.contains('\0') {
        return Err(ParseError::Invalid(format!("{what}: NUL byte in {s:?}")));
    }
    Ok(())
}

/// toml's messages span several lines: position, source excerpt, caret,
/// problem. Fold them into one: "position: problem (in `excerpt`)".
fn one_line(e: &impl fmt::Display) -> String {
    let text = e.to_string();
    let lines: Vec<&str> = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect();
    let first = lines.first().copied().unwrap_or("");
    let last = lines.last().copied().unwrap_or("");
    let excerpt = lines
        .iter()
        .filter_map(|l| l.split_once(" | ").map(|(_, code)| code.trim()))
        .find(|code| !code.is_empty() && !code.chars().all(|c| c == '^' || c == ' '));
    let mut out = first.to_string();
    if last != first {
        out = format!("{out}: {last}");
    }
    if let Some(code) = excerpt {
        out = format!("{out} (in `{code}`)");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<VmConfig, String> {
        VmConfig::parse(text, Path::new("/cfg")).map_err(|e| match e {
            ParseError::Syntax(m) | ParseError::Invalid(m) => m,
        })
    }

    #[test]
    fn empty_config_takes_defaults() {
        let c = parse("").unwrap();
        assert_eq!(c, VmConfig::builtin());
    }

    #[test]
    fn full_config() {
        let c = parse(
            r#"
            kernel = "k/vmlinux"
            initramfs = "/abs/initrd.cpio"
            memory_mib = 512
            cmdline = "loglevel=7"
            command = ["/usr/local/bin/prog", "--flag"]
            env = { RUST_LOG = "debug" }
            [[files]]
            host = "build/prog"
            guest = "/usr/local/bin/prog"
            "#,
        )
        .unwrap();
        assert_eq!(c.kernel.as_deref(), Some(Path::new("/cfg/k/vmlinux")));
        assert_eq!(c.initramfs.as_deref(), Some(Path::new("/abs/initrd.cpio")));
        assert_eq!(c.memory_mib, 512);
        assert_eq!(c.cmdline, "loglevel=7");
        assert_eq!(c.command, ["/usr/local/bin/prog", "--flag"]);
        assert_eq!(c.env["RUST_LOG"], "debug");
        assert_eq!(c.files[0].host, Path::new("/cfg/build/prog"));
        assert!(!c.probes);
    }

    #[test]
    fn probes_are_a_boolean_off_by_default() {
        assert!(parse("probes = true").unwrap().probes);
        assert!(!parse("probes = false").unwrap().probes);
        assert!(!parse("").unwrap().probes);
        let err = parse("probes = \"yes\"").unwrap_err();
        assert!(err.contains("probes"), "{err}");
    }

    #[test]
    fn the_console_is_virtio_unless_serial_is_asked_for() {
        assert_eq!(parse("").unwrap().console, ConsoleKind::Virtio);
        assert_eq!(
            parse("console = \"serial\"").unwrap().console,
            ConsoleKind::Serial
        );
        assert_eq!(
            parse("console = \"virtio\"").unwrap().console,
            ConsoleKind::Virtio
        );
        let err = parse("console = \"vga\"").unwrap_err();
        assert!(err.contains("console") && err.contains("serial"), "{err}");
    }

    #[test]
    fn string_command_runs_through_the_shell() {
        let c = parse(r#"command = "echo hi; exit 3""#).unwrap();
        assert_eq!(c.command, ["sh", "-c", "echo hi; exit 3"]);
    }

    #[test]
    fn rejects_bad_values_with_the_cause() {
        assert!(parse("memory_mib = 4")
            .unwrap_err()
            .contains("memory_mib = 4"));
        assert!(parse("memory_mib = 99999999")
            .unwrap_err()
            .contains("outside"));
        assert!(parse("command = []").unwrap_err().contains("command"));
        assert!(parse("colour = 3").unwrap_err().contains("colour"));
        assert!(parse("memory_mib = \"lots\"")
            .unwrap_err()
            .contains("memory_mib"));
        assert!(parse("[[files]]\nhost = \"a\"\nguest = \"rel\"")
            .unwrap_err()
            .contains("absolute"));
        assert!(parse("env = { \"A=B\" = \"x\" }")
            .unwrap_err()
            .contains("A=B"));
        assert!(parse("[[files]]\nhost = \"a\"\nguest = \"/proc/a\"")
            .unwrap_err()
            .contains("hidden"));
        // /tmp is mounted before the archive is unpacked into it.
        assert!(parse("[[files]]\nhost = \"a\"\nguest = \"/tmp/a\"").is_ok());
        assert!(parse("workdir = \"rel\"").unwrap_err().contains("workdir"));
        assert!(parse("kernel = ").unwrap_err().contains("line 1"));
    }

    #[test]
    fn net_section() {
        let c = parse(
            "[net]\ntap = \"tap7\"\nmac = \"02:00:00:00:00:01\"\n\
             guest_address = \"10.9.0.2/24\"\nhost_address = \"10.9.0.1/24\"",
        )
        .unwrap();
        let net = c.net.unwrap();
        assert_eq!(net.tap, "tap7");
        assert_eq!(net.mac, [2, 0, 0, 0, 0, 1]);
        assert_eq!(net.guest_address, Some((Ipv4Addr::new(10, 9, 0, 2), 24)));
        assert_eq!(net.host_address, Some((Ipv4Addr::new(10, 9, 0, 1), 24)));
        let d = parse("[net]\ntap = \"t\"").unwrap().net.unwrap();
        assert_eq!(d.mac, devices::virtio_net::DEFAULT_MAC);
        assert_eq!(d.guest_address, None);
        for (bad, cause) in [
            ("[net]\ntap = \"a/b\"", "a/b"),
            ("[net]\ntap = \"t\"\nmac = \"01:00:00:00:00:01\"", "multicast"),
            ("[net]\ntap = \"t\"\nmac = \"zz\"", "MAC"),
            ("[net]\ntap = \"t\"\nguest_address = \"10.0.0.1\"", "prefix"),
            ("[net]\ntap = \"t\"\nguest_address = \"10.0.0.1/33\"", "1 to 30"),
            ("[net]\ntap = \"t\"\nhost_address = \"10.0.0.300/24\"", "IPv4"),
            (
                "[net]\ntap = \"t\"\nguest_address = \"10.0.0.1/24\"\nhost_address = \"10.0.0.1/24\"",
                "both",
            ),
            ("[net]\ntap = \"t\"\nspeed = 10", "speed"),
        ] {
            let err = parse(bad).unwrap_err();
            assert!(err.contains(cause), "{bad}: {err}");
        }
    }

    #[test]
    fn missing_file_names_the_path() {
        let err = VmConfig::from_file(Path::new("/nonexistent/vm.toml")).unwrap_err();
        assert!(err.to_string().contains("/nonexistent/vm.toml"));
    }
}
