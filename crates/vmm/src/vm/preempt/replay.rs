//! Replaying asynchronous points: the trampoline in place after the exit
//! before one, its candidates checked, the interrupt delivered there.

use std::time::Duration;

use super::{Candidate, Patch};
use crate::vm::{kvm_err, Vm, VmError};
use journal::preempt::guest_code::{build_stub, code_around, trampoline_entries};
use journal::preempt::state::{self, PageSet, UserState};
use journal::preempt::{site, trampoline, AsyncPoint};

/// What a probe gate exit, or a single step of a traced process, may add
/// to a search's time: a user-mode exit costs 30-45 us on these hosts,
/// and the event's capture (or the step's logging) a few more.
const GATE_EXIT_ALLOWANCE: Duration = Duration::from_micros(200);

/// A point replay is looking for.
pub(super) struct Search {
    pub(super) point: AsyncPoint,
    pub(super) patch: Patch,
    /// Passes over the position with the recorded registers (and words).
    candidates: u64,
    /// Those whose extended state or memory differed.
    rejected: u64,
    /// How the last rejected candidate differed, for the report.
    last_rejection: Vec<String>,
    /// The instructions the trampoline moved into its code page: (address
    /// there, original address, original bytes), for a traced process.
    pub(super) moved: Vec<(u64, u64, Vec<u8>)>,
    /// Probe gate exits and traced steps since the search began: replay's
    /// alone, each a round trip the recording did not make.
    pub(super) gate_exits: u64,
}

impl Search {
    /// How long the search may take: the recording got there in
    /// `run_ns`; replay is slower only by the false hits' few nanoseconds,
    /// so three times that (and two seconds for a loaded host) means the
    /// state will never come.
    fn bound(&self) -> Duration {
        Duration::from_nanos(self.point.run_ns.saturating_mul(3))
            + Duration::from_secs(2)
            + GATE_EXIT_ALLOWANCE.saturating_mul(self.gate_exits.min(u32::MAX as u64) as u32)
    }

    /// What the search has seen, for a report that it failed.
    pub(super) fn progress(&self) -> String {
        let mut text = format!(
            "the trampoline for the asynchronous point at {:#x} saw the recorded registers {} \
             time{} and rejected {}",
            self.point.state.rip,
            self.candidates,
            if self.candidates == 1 { "" } else { "s" },
            self.rejected
        );
        if !self.last_rejection.is_empty() {
            text += &format!(" (the last differed in {})", self.last_rejection.join(", "));
        }
        text
    }
}

impl Vm {
    /// Replay, at a delivery point: if the log's next entry is an
    /// asynchronous point, puts the trampoline in place to find it.
    pub(in crate::vm) fn arm_async_point(&mut self) -> Result<(), VmError> {
        if self.preempt.search.is_some() {
            return Ok(());
        }
        let Some(point) = self.journal.replay_async_point()? else {
            return Ok(());
        };
        let (cr3, rip) = (point.state.cr3, point.state.rip);
        let (code, before) = code_around(&self.mem, &point.code_pages, rip);
        let site = match site::choose(rip, &code, &before) {
            Ok(s) => s,
            Err(why) => {
                let why = format!("the recorded position cannot be patched: {why}");
                return Err(self.journal.async_point_missed(why).into());
            }
        };
        let words: &[(u64, u64)] = if self.preempt.registers_only {
            &[]
        } else {
            &point.state.words
        };
        let addrs: Vec<u64> = words.iter().map(|w| w.0).collect();
        let values: Vec<u64> = words.iter().map(|w| w.1).collect();
        let (stub, jump) = match build_stub(&site, point.stub, &addrs) {
            Ok(s) => s,
            Err(why) => {
                let why = format!("no trampoline for the recorded position: {why}");
                return Err(self.journal.async_point_missed(why).into());
            }
        };

        let displaced = AsyncPoint::pages_at(point.stub).code + stub.displaced_at;
        let moved = site
            .relocated_layout(displaced)
            .unwrap_or_default()
            .into_iter()
            .map(|(at, ip, len)| {
                let from = (ip - rip) as usize;
                (
                    at,
                    ip,
                    code.get(from..from + len).unwrap_or_default().to_vec(),
                )
            })
            .collect();
        let data = trampoline::data_page(&point.state.kvm_regs(), &values);
        let code_pages = point.code_pages.clone();
        let patch = match self.install(cr3, &code_pages, rip, point.stub, &stub, Some(data), jump) {
            Ok(p) => p,
            Err(why) => return Err(self.journal.async_point_missed(why).into()),
        };
        self.preempt.search = Some(Search {
            point,
            patch,
            candidates: 0,
            rejected: 0,
            last_rejection: Vec::new(),
            moved,
            gate_exits: 0,
        });
        Ok(())
    }

    /// Replay: the trampoline found the recorded registers (`regs`);
    /// whether the rest of the state is the recorded one.
    pub(in crate::vm) fn async_candidate(
        &mut self,
        regs: &kvm_bindings::kvm_regs,
    ) -> Result<Candidate, VmError> {
        self.preempt.stats.candidates += 1;
        let sregs = self.vcpu.get_sregs().map_err(kvm_err("GET_SREGS"))?;
        let Some(search) = &self.preempt.search else {
            return Ok(Candidate::NotOurs);
        };
        let logged = &search.point.state;
        let mut found = UserState {
            cr3: sregs.cr3 & state::CR3_ROOT,
            rip: logged.rip,
            // A traced process runs with the trap flag, which the
            // recording never set.
            rflags: regs.rflags & !state::RF & !self.expansion_flags(),
            gprs: state::gprs(regs),
            fs_base: sregs.fs.base,
            gs_base: sregs.gs.base,
            xstate: logged.xstate,
            words: logged.words.clone(),
            pages: PageSet::default(),
            memory: logged.memory,
        };
        if !self.preempt.registers_only {
            found.words = logged
                .words
                .iter()
                .map(|&(at, v)| (at, self.user_word(logged.cr3, at).unwrap_or(!v)))
                .collect();
            if logged.differences(&found).is_empty() {
                let xsave = self.vcpu.get_xsave().map_err(kvm_err("GET_XSAVE"))?;
                let cpu: Vec<u8> = xsave.region.iter().flat_map(|w| w.to_le_bytes()).collect();
                found.xstate = state::xstate_digest(&cpu, &self.xsave_layout);
                let entries =
                    trampoline_entries(&self.mem, logged.cr3, search.point.stub, &logged.words);
                found.memory =
                    state::memory_digest(&self.mem, &logged.pages, &search.patch.saved, &entries);
            }
        }
        let differences = logged.differences(&found);
        if let Some(search) = &mut self.preempt.search {
            search.candidates += 1;
        }
        if !differences.is_empty() {
            self.preempt.stats.rejected += 1;
            if let Some(search) = &mut self.preempt.search {
                search.rejected += 1;
                search.last_rejection = differences;
            }
            return Ok(Candidate::Passed);
        }
        let Some(search) = self.preempt.search.take() else {
            return Ok(Candidate::NotOurs);
        };
        self.complete_trampoline_exit(&search.patch)?;
        self.preempt.stats.points += 1;
        self.preempt.stats.busy_ns += search.patch.started.elapsed().as_nanos() as u64;
        self.journal.replay_async_point_reached()?;
        Ok(Candidate::Reached)
    }

    /// Replay: a search that has gone on far longer than the recording
    /// took to get there will not succeed.
    pub(in crate::vm) fn check_search_time(&mut self) -> Result<(), VmError> {
        let Some(search) = &self.preempt.search else {
            return Ok(());
        };
        if search.patch.started.elapsed() <= search.bound() {
            return Ok(());
        }
        let why = format!(
            "the recorded state was not reached within {:.1} s (the recording got there {:.3} s \
             after the exit); {}",
            search.bound().as_secs_f64(),
            search.point.run_ns as f64 / 1e9,
            search.progress()
        );
        Err(self.journal.async_point_missed(why).into())
    }
}
