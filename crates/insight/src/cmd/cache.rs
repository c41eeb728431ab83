//! `insight cache`: the boot snapshots insight keeps so that runs need
//! not boot the guest kernel.

use std::process::ExitCode;

use anyhow::Result;

use crate::status::human_bytes;

#[derive(clap::Args)]
pub struct CacheArgs {
    #[command(subcommand)]
    action: Option<CacheAction>,
}

#[derive(clap::Subcommand)]
enum CacheAction {
    /// List the cached boot snapshots, most recently used first (the
    /// default).
    List,
    /// Remove every cached boot snapshot: the next run of each image
    /// boots once and takes it again. Traces keep their own copies.
    Clear,
}

pub fn cache(args: CacheArgs) -> Result<ExitCode> {
    let dir = vmm::snapshot_cache::cache_dir();
    match args.action.unwrap_or(CacheAction::List) {
        CacheAction::List => {
            let cached = vmm::snapshot_cache::list(&dir)?;
            println!(
                "{}: {} boot snapshot{}, {} (at most {} kept)",
                dir.display(),
                cached.len(),
                if cached.len() == 1 { "" } else { "s" },
                human_bytes(cached.iter().map(|c| c.bytes).sum()),
                vmm::snapshot_cache::MAX_CACHED
            );
            for c in &cached {
                let used = c
                    .used
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_secs());
                let name = c.path.file_name().unwrap_or_default().to_string_lossy();
                println!(
                    "  {name}  {:>9}  used {} UTC",
                    human_bytes(c.bytes),
                    super::ls::utc(used)
                );
            }
        }
        CacheAction::Clear => {
            let removed = vmm::snapshot_cache::clear(&dir)?;
            println!(
                "insight: removed {removed} boot snapshot{} from {}",
                if removed == 1 { "" } else { "s" },
                dir.display()
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}
