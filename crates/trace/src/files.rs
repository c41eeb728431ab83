//! Opening files that a trace, a config or a user names, none of which is
//! trusted: a path may name a FIFO (opening it for reading would wait for
//! a writer forever), a device such as `/dev/zero` (reading it whole would
//! never end), or a file far larger than anything insight wrote.
//!
//! [`open_regular`] opens without blocking and insists on a regular file;
//! [`read_bounded`] also refuses a file larger than the bound its caller
//! gives for that kind of file, before reading anything.

use std::fs::{File, OpenOptions};
use std::io::Read;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum FileError {
    #[error("{path}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path} is {kind}, not a regular file")]
    NotRegular { path: PathBuf, kind: &'static str },
    #[error("{path} holds {size} bytes, more than the {max} a {what} may have")]
    TooLarge {
        path: PathBuf,
        what: &'static str,
        size: u64,
        max: u64,
    },
}

/// Describes a file type for an error message ("a FIFO", "a directory").
pub fn kind_of(file_type: std::fs::FileType) -> &'static str {
    if file_type.is_dir() {
        "a directory"
    } else if file_type.is_fifo() {
        "a FIFO"
    } else if file_type.is_char_device() {
        "a character device"
    } else if file_type.is_block_device() {
        "a block device"
    } else if file_type.is_socket() {
        "a socket"
    } else if file_type.is_symlink() {
        "a symbolic link"
    } else if file_type.is_file() {
        "a regular file"
    } else {
        "an unknown kind of file"
    }
}

/// Opens `path` for reading, following symbolic links, without blocking
/// on a FIFO; what is opened must be a regular file.
pub fn open_regular(path: &Path) -> Result<File, FileError> {
    let io = |source| FileError::Io {
        path: path.to_owned(),
        source,
    };
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(path)
        .map_err(io)?;
    // What was opened is what is checked (the path may change meanwhile).
    let file_type = file.metadata().map_err(io)?.file_type();
    if !file_type.is_file() {
        return Err(FileError::NotRegular {
            path: path.to_owned(),
            kind: kind_of(file_type),
        });
    }
    Ok(file)
}

/// Reads the regular file `path` whole, refusing it before reading if it
/// holds more than `max` bytes (`what` names the kind of file in the
/// error); a file that grows while it is read is cut at `max + 1` bytes
/// and refused the same way.
pub fn read_bounded(path: &Path, max: u64, what: &'static str) -> Result<Vec<u8>, FileError> {
    let file = open_regular(path)?;
    let io = |source| FileError::Io {
        path: path.to_owned(),
        source,
    };
    let size = file.metadata().map_err(io)?.len();
    let too_large = |size| FileError::TooLarge {
        path: path.to_owned(),
        what,
        size,
        max,
    };
    if size > max {
        return Err(too_large(size));
    }
    let mut bytes = Vec::with_capacity(size as usize);
    file.take(max + 1).read_to_end(&mut bytes).map_err(io)?;
    if bytes.len() as u64 > max {
        return Err(too_large(bytes.len() as u64));
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp_dir(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("insight-files-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn a_fifo_is_refused_without_waiting_for_a_writer() {
        let dir = temp_dir("fifo");
        let fifo = dir.join("fifo");
        let made = std::process::Command::new("mkfifo").arg(&fifo).status();
        assert!(made.is_ok_and(|s| s.success()), "mkfifo failed");
        let err = read_bounded(&fifo, 100, "header").unwrap_err();
        assert!(
            matches!(err, FileError::NotRegular { kind: "a FIFO", .. }),
            "{err}"
        );
        assert!(
            err.to_string().contains("is a FIFO, not a regular file"),
            "{err}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn devices_directories_and_links_to_them_are_refused() {
        let dir = temp_dir("devices");
        let link = dir.join("link");
        std::os::unix::fs::symlink("/dev/zero", &link).unwrap();
        let err = read_bounded(&link, 100, "header").unwrap_err();
        assert!(
            matches!(
                err,
                FileError::NotRegular {
                    kind: "a character device",
                    ..
                }
            ),
            "{err}"
        );
        let err = open_regular(&dir).unwrap_err();
        assert!(
            matches!(
                err,
                FileError::NotRegular {
                    kind: "a directory",
                    ..
                }
            ),
            "{err}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn files_over_the_bound_are_refused_and_others_read_whole() {
        let dir = temp_dir("bound");
        let file = dir.join("f");
        std::fs::write(&file, [7u8; 101]).unwrap();
        let err = read_bounded(&file, 100, "completion summary").unwrap_err();
        assert!(
            matches!(
                err,
                FileError::TooLarge {
                    size: 101,
                    max: 100,
                    ..
                }
            ),
            "{err}"
        );
        assert!(err
            .to_string()
            .contains("more than the 100 a completion summary may have"));
        assert_eq!(read_bounded(&file, 101, "x").unwrap(), vec![7u8; 101]);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
