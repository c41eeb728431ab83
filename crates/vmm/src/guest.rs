//! Turns a [`VmConfig`] into what the VM boots: the kernel, the base
//! initramfs with an archive appended that carries the guest command, its
//! environment and the user's files, and the command line.

use std::path::PathBuf;

use crate::config::VmConfig;
use crate::image::{self, GuestQuirks};
use crate::initramfs::{CpioWriter, InitramfsError};
use crate::vm::VmSpec;

/// The command the guest runs when neither the config nor the command line
/// names one.
pub const DEFAULT_COMMAND: &str = "insight-demo";
/// Where `/init` looks for the command and its environment.
pub const COMMAND_FILE: &str = "/etc/insight/command";
pub const ENV_FILE: &str = "/etc/insight/env";

#[derive(Debug, thiserror::Error)]
pub enum GuestError {
    #[error("{0}")]
    MissingImage(String),
    #[error("cannot read initramfs {path}")]
    ReadInitramfs {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Files(#[from] InitramfsError),
    #[error("cannot read a random seed from /dev/urandom")]
    Seed(#[source] std::io::Error),
}

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

/// Builds the boot specification for `config`.
pub fn prepare(config: &VmConfig, options: &BootOptions) -> Result<VmSpec, GuestError> {
    let kernel = config.kernel.clone().unwrap_or_else(image::default_kernel);
    image::require(&kernel, "guest kernel").map_err(GuestError::MissingImage)?;
    let initramfs_path = config
        .initramfs
        .clone()
        .unwrap_or_else(image::default_initramfs);
    image::require(&initramfs_path, "guest initramfs").map_err(GuestError::MissingImage)?;
    let mut initramfs =
        std::fs::read(&initramfs_path).map_err(|source| GuestError::ReadInitramfs {
            path: initramfs_path.clone(),
            source,
        })?;

    let mut extra = CpioWriter::new();
    for file in &config.files {
        extra.add_host_path(&file.host, &file.guest)?;
    }
    let command: Vec<&str> = if config.command.is_empty() {
        vec![DEFAULT_COMMAND]
    } else {
        config.command.iter().map(String::as_str).collect()
    };
    extra.add_file(COMMAND_FILE.as_ref(), 0o644, &nul_separated(command))?;
    let env: Vec<String> = config.env.iter().map(|(k, v)| format!("{k}={v}")).collect();
    extra.add_file(
        ENV_FILE.as_ref(),
        0o644,
        &nul_separated(env.iter().map(String::as_str)),
    )?;

    // Concatenated archives must each start 4-byte aligned.
    initramfs.resize(initramfs.len().next_multiple_of(4), 0);
    initramfs.extend_from_slice(&extra.finish());

    Ok(VmSpec {
        kernel,
        initramfs,
        cmdline: image::kernel_cmdline(options.quirks, options.quiet, &config.cmdline),
        memory_mib: config.memory_mib,
        rng_seed: random_seed()?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

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
        };
        let err = prepare(&config, &opts).unwrap_err().to_string();
        assert!(
            err.contains("/no/such/vmlinux") && err.contains("tools/build-guest"),
            "{err}"
        );
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
        };
        let spec = prepare(&config, &opts).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(&spec.initramfs[..8], b"BASE1\0\0\0");
        assert_eq!(&spec.initramfs[8..14], b"070701");
        let text = String::from_utf8_lossy(&spec.initramfs);
        assert!(text.contains("usr/local/bin/prog"));
        assert!(text.contains("prog\0a b\0"));
        assert!(text.contains("X=1\0"));
        assert!(spec.cmdline.contains("insight.syscall=pf"));
    }
}
