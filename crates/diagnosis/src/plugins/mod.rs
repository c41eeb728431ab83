//! The built-in diagnosis tools, each a [`Plugin`] in a folder of its own
//! with the analysis only it uses. A new tool is one more folder here and
//! one line in [`registry`].

use crate::plugin::Plugin;

pub mod deadlock;
pub mod locks;
pub mod memory;
pub mod probes;
pub mod profile;
pub mod threads;
pub mod timeline;

/// Every built-in plugin with its default options, in the order `insight`
/// lists them.
pub fn registry() -> Vec<Box<dyn Plugin>> {
    vec![
        Box::new(locks::Locks::new(locks::LocksOptions::default())),
        Box::new(deadlock::Deadlock::new()),
        Box::new(profile::Profile::new(profile::ProfileOptions::default())),
        Box::new(threads::Threads::new()),
        Box::new(memory::Memory::new()),
        Box::new(probes::Probes::new()),
        Box::new(timeline::Timeline::new(None)),
    ]
}

/// The built-in plugin called `name`, with its default options.
pub fn by_name(name: &str) -> Option<Box<dyn Plugin>> {
    registry().into_iter().find(|p| p.name() == name)
}
