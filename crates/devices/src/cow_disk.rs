//! A disk made of a read-only base image and a copy-on-write overlay.
//!
//! The base file is opened read-only and never written; every write of a
//! run goes to an overlay that belongs to that run alone (an unlinked
//! temporary file) and is gone when the run ends. Reads take each sector
//! from the overlay if the run wrote it, from the base otherwise. So a
//! recording and each of its replays start from the same disk.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

pub const SECTOR_SIZE: u64 = 512;

#[derive(Debug, thiserror::Error)]
pub enum DiskError {
    #[error("cannot open disk image {path}")]
    Open {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("disk image {path} is {size} bytes, not a whole number of 512-byte sectors")]
    Size { path: PathBuf, size: u64 },
    #[error("cannot create the disk overlay in {dir}")]
    Overlay {
        dir: PathBuf,
        #[source]
        source: io::Error,
    },
}

pub struct CowDisk {
    base: File,
    overlay: File,
    sectors: u64,
    /// One bit per sector: written in this run, so in the overlay.
    written: Vec<u64>,
    /// Sectors written since `take_changes` last ran, as `written`.
    changed: Vec<u64>,
}

/// Consecutive sectors of a disk and their bytes.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SectorRun {
    pub sector: u64,
    pub data: Vec<u8>,
}

/// Longest run `take_changes` returns (bounds one allocation).
const MAX_RUN_SECTORS: u64 = 2048;

impl CowDisk {
    /// Opens `base` read-only, with a fresh overlay in `overlay_dir`.
    pub fn open(base: &Path, overlay_dir: &Path) -> Result<Self, DiskError> {
        let file = File::open(base).map_err(|source| DiskError::Open {
            path: base.to_owned(),
            source,
        })?;
        Self::over(file, base, overlay_dir)
    }

    /// The same over `file`, the base image already opened from `base`
    /// (so that what was checked is what the guest reads).
    pub fn over(file: File, base: &Path, overlay_dir: &Path) -> Result<Self, DiskError> {
        let open_err = |source| DiskError::Open {
            path: base.to_owned(),
            source,
        };
        let size = file.metadata().map_err(open_err)?.len();
        if size % SECTOR_SIZE != 0 {
            return Err(DiskError::Size {
                path: base.to_owned(),
                size,
            });
        }
        let overlay = anonymous_file(overlay_dir).map_err(|source| DiskError::Overlay {
            dir: overlay_dir.to_owned(),
            source,
        })?;
        let sectors = size / SECTOR_SIZE;
        Ok(CowDisk {
            base: file,
            overlay,
            sectors,
            written: vec![0; sectors.div_ceil(64) as usize],
            changed: vec![0; sectors.div_ceil(64) as usize],
        })
    }

    pub fn sectors(&self) -> u64 {
        self.sectors
    }

    fn is_written(&self, sector: u64) -> bool {
        self.written[(sector / 64) as usize] & (1 << (sector % 64)) != 0
    }

    /// Whether `len` bytes from `sector` lie inside the disk.
    pub fn in_range(&self, sector: u64, len: u64) -> bool {
        len.is_multiple_of(SECTOR_SIZE)
            && sector
                .checked_add(len / SECTOR_SIZE)
                .is_some_and(|end| end <= self.sectors)
    }

    /// Reads whole sectors starting at `sector` into `buf`.
    pub fn read(&self, sector: u64, buf: &mut [u8]) -> io::Result<()> {
        if !self.in_range(sector, buf.len() as u64) {
            return Err(io::Error::from(io::ErrorKind::InvalidInput));
        }
        // Runs of sectors from the same file in one read each.
        let mut done = 0usize;
        while done < buf.len() {
            let s = sector + (done as u64) / SECTOR_SIZE;
            let from_overlay = self.is_written(s);
            let mut run = 1u64;
            while done + ((run * SECTOR_SIZE) as usize) < buf.len()
                && self.is_written(s + run) == from_overlay
            {
                run += 1;
            }
            let end = done + (run * SECTOR_SIZE) as usize;
            let file = if from_overlay {
                &self.overlay
            } else {
                &self.base
            };
            file.read_exact_at(&mut buf[done..end], s * SECTOR_SIZE)?;
            done = end;
        }
        Ok(())
    }

    /// Writes whole sectors starting at `sector` (into the overlay).
    pub fn write(&mut self, sector: u64, data: &[u8]) -> io::Result<()> {
        if !self.in_range(sector, data.len() as u64) {
            return Err(io::Error::from(io::ErrorKind::InvalidInput));
        }
        self.overlay.write_all_at(data, sector * SECTOR_SIZE)?;
        for s in sector..sector + data.len() as u64 / SECTOR_SIZE {
            self.written[(s / 64) as usize] |= 1 << (s % 64);
            self.changed[(s / 64) as usize] |= 1 << (s % 64);
        }
        Ok(())
    }

    /// The sectors written since the last call, with their contents, in
    /// runs of at most 1 MiB; afterwards none counts as changed.
    pub fn take_changes(&mut self) -> io::Result<Vec<SectorRun>> {
        let changed = |s: u64| self.changed[(s / 64) as usize] & (1 << (s % 64)) != 0;
        let mut runs = Vec::new();
        let mut s = 0;
        while s < self.sectors {
            if self.changed[(s / 64) as usize] == 0 {
                s = (s / 64 + 1) * 64;
                continue;
            }
            if !changed(s) {
                s += 1;
                continue;
            }
            let mut n = 1;
            while s + n < self.sectors && n < MAX_RUN_SECTORS && changed(s + n) {
                n += 1;
            }
            let mut data = vec![0u8; (n * SECTOR_SIZE) as usize];
            self.overlay.read_exact_at(&mut data, s * SECTOR_SIZE)?;
            runs.push(SectorRun { sector: s, data });
            s += n;
        }
        self.changed.fill(0);
        Ok(runs)
    }

    /// Writes `runs` (a restored checkpoint's) into the overlay; they
    /// count as written, not as changed since.
    pub fn apply(&mut self, runs: &[SectorRun]) -> io::Result<()> {
        for run in runs {
            self.write(run.sector, &run.data)?;
        }
        self.changed.fill(0);
        Ok(())
    }
}

/// A new file in `dir` that no other process can open: unlinked at once.
fn anonymous_file(dir: &Path) -> io::Result<File> {
    for attempt in 0..100u32 {
        let path = dir.join(format!(".insight-overlay-{}-{attempt}", std::process::id()));
        match std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&path)
        {
            Ok(file) => {
                std::fs::remove_file(&path)?;
                return Ok(file);
            }
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(e),
        }
    }
    Err(io::Error::from(io::ErrorKind::AlreadyExists))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn base_image(name: &str, sectors: u64) -> PathBuf {
        let path = std::env::temp_dir().join(format!("insight-cow-{}-{name}", std::process::id()));
        let data: Vec<u8> = (0..sectors * SECTOR_SIZE)
            .map(|i| (i / 512) as u8)
            .collect();
        std::fs::write(&path, data).unwrap();
        path
    }

    #[test]
    fn writes_go_to_the_overlay_and_the_base_never_changes() {
        let base = base_image("rw", 8);
        let before = std::fs::read(&base).unwrap();
        let mut disk = CowDisk::open(&base, &std::env::temp_dir()).unwrap();
        assert_eq!(disk.sectors(), 8);
        disk.write(2, &[0xaa; 1024]).unwrap();
        let mut buf = vec![0u8; 8 * 512];
        disk.read(0, &mut buf).unwrap();
        for s in 0..8usize {
            let want = if s == 2 || s == 3 { 0xaa } else { s as u8 };
            assert!(
                buf[s * 512..(s + 1) * 512].iter().all(|&b| b == want),
                "sector {s}"
            );
        }
        // A second disk over the same base starts clean.
        let fresh = CowDisk::open(&base, &std::env::temp_dir()).unwrap();
        let mut one = vec![0u8; 512];
        fresh.read(2, &mut one).unwrap();
        assert!(one.iter().all(|&b| b == 2));
        drop((disk, fresh));
        assert_eq!(std::fs::read(&base).unwrap(), before);
        std::fs::remove_file(&base).unwrap();
    }

    #[test]
    fn out_of_range_and_partial_sectors_are_refused() {
        let base = base_image("range", 4);
        let mut disk = CowDisk::open(&base, &std::env::temp_dir()).unwrap();
        let mut buf = vec![0u8; 1024];
        assert!(disk.read(3, &mut buf).is_err());
        assert!(disk.read(u64::MAX, &mut buf).is_err());
        assert!(disk.write(0, &[0; 100]).is_err());
        assert!(disk.write(4, &[0; 512]).is_err());
        assert!(disk.read(2, &mut buf).is_ok());
        std::fs::remove_file(&base).unwrap();
        std::fs::write(&base, [0u8; 100]).unwrap();
        assert!(matches!(
            CowDisk::open(&base, &std::env::temp_dir()),
            Err(DiskError::Size { .. })
        ));
        std::fs::remove_file(&base).unwrap();
    }

    #[test]
    fn changes_since_the_last_call_carry_over_to_another_overlay() {
        let base = base_image("changes", 4096);
        let mut a = CowDisk::open(&base, &std::env::temp_dir()).unwrap();
        a.write(3, &[7u8; 1024]).unwrap();
        a.write(4000, &[9u8; 512]).unwrap();
        let first = a.take_changes().unwrap();
        assert_eq!(
            first
                .iter()
                .map(|r| (r.sector, r.data.len()))
                .collect::<Vec<_>>(),
            vec![(3, 1024), (4000, 512)]
        );
        assert!(a.take_changes().unwrap().is_empty());
        // A long write comes back in runs of at most MAX_RUN_SECTORS.
        a.write(10, &vec![5u8; 3000 * 512]).unwrap();
        let second = a.take_changes().unwrap();
        assert_eq!(second.len(), 2);
        assert_eq!(second[0].data.len(), MAX_RUN_SECTORS as usize * 512);
        // Another disk over the same base, given both sets, reads the same.
        let mut b = CowDisk::open(&base, &std::env::temp_dir()).unwrap();
        b.apply(&first).unwrap();
        b.apply(&second).unwrap();
        assert!(b.take_changes().unwrap().is_empty());
        let (mut x, mut y) = (vec![0u8; 4096 * 512], vec![0u8; 4096 * 512]);
        a.read(0, &mut x).unwrap();
        b.read(0, &mut y).unwrap();
        assert!(x == y);
        // A run beyond the disk is refused.
        let beyond = SectorRun {
            sector: 4096,
            data: vec![0; 512],
        };
        assert!(b.apply(&[beyond]).is_err());
        let _ = std::fs::remove_file(&base);
    }
}
