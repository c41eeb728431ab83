//! Looking into the guest from the host, safely: page-table walks (guest
//! virtual to physical), the events and registers the guest kernel and the
//! probe library leave in guest memory, the pages the guest kernel maps
//! into every process for trampolines and the probe gate, the XSAVE area's
//! layout, and what one user instruction does (decoded from its bytes and
//! registers). Everything read here is the guest's word: nothing is
//! trusted, nothing panics.

pub mod event_ring;
pub mod guest_events;
pub mod gva;
pub mod instructions;
pub mod probe_gate;
pub mod stub_area;
pub mod xstate;
