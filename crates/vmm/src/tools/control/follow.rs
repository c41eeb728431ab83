//! Following processes: a program executed (seen entering `execve` at
//! the guest kernel's deterministic point, started at its return to user
//! mode), a followed process forking (both returns of `fork` caught), a
//! thread exiting (the guest kernel's event), and the processes the
//! supervisor follows or lets go.

use devices::control::EventRaiser;
use kvm_bindings::kvm_regs;

use super::engine::{Control, Scope, Supervisor};
use super::tasks::{self, auxv_at_start, ProcessInfo};
use crate::tools::exec::{exec_call, fork_call};
use crate::vm::{Machine, VmError};
use journal::preempt::state::CR3_ROOT;

impl Control {
    /// Follows the process `pid` (its address space `cr3`), which just
    /// started: breakpoints go into it (`add_breakpoint_in`), its threads
    /// are followed, and its end is told.
    pub(crate) fn follow(&mut self, pid: u32, cr3: u64) {
        let mut followed = tasks::Followed {
            cr3,
            ..Default::default()
        };
        followed.threads.insert(pid, false);
        self.tasks.followed.insert(pid, followed);
    }

    /// Stops following the process `pid`: its breakpoints come out at
    /// the next run, unless another process wants them too.
    /// Its address space, if it was followed.
    pub(crate) fn unfollow(&mut self, pid: u32) -> Option<u64> {
        let followed = self.tasks.followed.remove(&pid)?;
        self.breakpoints.drop_space(followed.cr3);
        Some(followed.cr3)
    }

    /// The guest raised an event at the last exit: the guest kernel's
    /// tell of a thread's exit (`kernel_event`); a probe's, nothing.
    pub(crate) fn event_raised(
        &mut self,
        m: &mut Machine,
        raiser: EventRaiser,
        sup: &mut dyn Supervisor,
    ) -> Result<(), VmError> {
        match raiser {
            EventRaiser::Kernel => self.kernel_event(m, sup),
            EventRaiser::ProbeTrap | EventRaiser::ProbePort => Ok(()),
        }
    }

    /// The guest kernel raised an event (the exit's registers name its
    /// buffer): a thread's exit ends its process when it is its last.
    fn kernel_event(&mut self, m: &mut Machine, sup: &mut dyn Supervisor) -> Result<(), VmError> {
        let regs = m.vcpu.synced_regs();
        let cr3 = m.vcpu.sregs()?.cr3;
        let Ok(buffer) = introspect::guest_events::read_buffer(&m.vm.mem, cr3, regs.rsi, false)
        else {
            return Ok(());
        };
        let Ok(event) = events::abi::parse(&buffer, buffer.len()) else {
            return Ok(());
        };
        if let events::abi::Payload::Exit { status } = event.payload {
            let (pid, lwpid) = ((regs.rdi >> 32) as u32, regs.rdi as u32);
            self.thread_exited(m, pid, lwpid, status, sup)?;
        }
        Ok(())
    }

    /// A kernel event: thread `lwpid` of process `pid` exited.
    fn thread_exited(
        &mut self,
        m: &mut Machine,
        pid: u32,
        lwpid: u32,
        status: i32,
        sup: &mut dyn Supervisor,
    ) -> Result<(), VmError> {
        // The switches so far: the thread on the CPU, which a stop at the
        // process's end names, is the one exiting now, not the last one
        // seen before (whose registers may be gone with it).
        self.tasks.follow_switches(&m.vm.mem);
        if self.scope == Scope::Every {
            // A task that dies executing a program never starts it; a
            // child that dies before it runs is never followed.
            self.tasks.execs.retain(|e| e.lwpid != lwpid);
            (self.tasks.forks).retain(|f| f.lwpid != lwpid && f.child != Some(lwpid));
            let Some(followed) = self.tasks.followed.get_mut(&pid) else {
                return self.update_returns(m);
            };
            followed.threads.insert(lwpid, true);
            if followed.threads.values().all(|&exited| exited) {
                self.followed_ended(m, pid, sup)?;
            }
            return Ok(());
        }
        if self.tasks.process.as_ref().is_none_or(|p| p.pid != pid) {
            return Ok(());
        }
        self.tasks.threads.entry(lwpid).or_default().exited = true;
        if !self.tasks.live_threads().is_empty() {
            return Ok(());
        }
        sup.exited(self, m, status)
    }

    /// At a system call's entry (the kernel's deterministic point): if
    /// the task executes a program, and it may be one to tell of, its
    /// return to user mode is watched.
    pub(super) fn look_for_exec(
        &mut self,
        m: &mut Machine,
        cr3: u64,
        sup: &mut dyn Supervisor,
    ) -> Result<(), VmError> {
        if self.tasks.process.is_some() {
            return Ok(());
        }
        let (Some(var), Some((pid, lwpid))) = (self.stack_top_var, self.tasks.current) else {
            return Ok(());
        };
        let Some(call) = exec_call(&m.vm.mem, cr3, var) else {
            return Ok(());
        };
        // A followed process executing a program frees its memory before
        // it returns: its breakpoints come out now, while its page tables
        // are still its own (if the call fails it is no longer followed).
        if self.tasks.followed.contains_key(&pid) {
            self.followed_ended(m, pid, sup)?;
        }
        if self.scope.selects(pid, &call.path) {
            self.tasks.exec_started(tasks::Exec {
                pid,
                lwpid,
                path: call.path,
                returns_to: call.returns_to,
            });
        }
        Ok(())
    }

    /// At a system call's entry: if a thread of a followed process forks,
    /// the returns to user mode are watched for its child's first.
    pub(super) fn look_for_fork(&mut self, m: &Machine, cr3: u64) {
        let (Some(var), Some((pid, lwpid))) = (self.stack_top_var, self.tasks.current) else {
            return;
        };
        if !self.tasks.followed.contains_key(&pid) {
            return;
        }
        if let Some(returns_to) = fork_call(&m.vm.mem, cr3, var) {
            self.tasks.forks.retain(|f| f.lwpid != lwpid);
            self.tasks.forks.push(tasks::Fork {
                pid,
                lwpid,
                cr3: cr3 & CR3_ROOT,
                returns_to,
                child: None,
                child_seen: false,
            });
        }
    }

    /// A return to user mode of task (pid, lwpid) in the address space
    /// `cr3`, with the user registers `user`: the end of a fork's system
    /// call in the parent (with the child's pid) or in the child (with 0,
    /// in its own address space), whose process is followed from here.
    pub(super) fn fork_returns(
        &mut self,
        pid: u32,
        lwpid: u32,
        cr3: u64,
        user: &kvm_regs,
        sup: &mut dyn Supervisor,
    ) {
        let parent = self
            .tasks
            .forks
            .iter()
            .position(|f| (f.pid, f.lwpid) == (pid, lwpid));
        if let Some(at) = parent {
            let fork = &mut self.tasks.forks[at];
            if user.rip != fork.returns_to || fork.child.is_some() {
                // Another return of the parent (an interrupt's, a fault's).
                return;
            }
            let child = user.rax as i64;
            if child <= 0 || fork.child_seen {
                self.tasks.forks.remove(at);
            } else {
                fork.child = Some(child as u32);
            }
            return;
        }
        if user.rax != 0 || self.tasks.followed.contains_key(&pid) {
            return;
        }
        let child = self.tasks.forks.iter().position(|f| {
            !f.child_seen
                && f.returns_to == user.rip
                && f.cr3 != cr3
                && f.child.is_none_or(|c| c == pid)
        });
        let Some(at) = child else {
            return;
        };
        let fork = &mut self.tasks.forks[at];
        fork.child_seen = true;
        let parent = fork.cr3;
        if fork.child.is_some() {
            self.tasks.forks.remove(at);
        }
        self.follow(pid, cr3);
        sup.forked(pid, cr3, parent);
    }

    /// The task that executed a program (`exec`) returned to user mode
    /// (`user`, with system registers `sregs`): unless the call failed,
    /// the program started. Under `Scope::One` it is the process held from
    /// now on (another execution under way is not the one); under
    /// `Scope::Every` a followed process that executed another program
    /// has ended.
    pub(super) fn exec_returned(
        &mut self,
        m: &mut Machine,
        sregs: &kvm_bindings::kvm_sregs,
        user: &kvm_regs,
        exec: tasks::Exec,
        sup: &mut dyn Supervisor,
    ) -> Result<(), VmError> {
        if user.rip == exec.returns_to {
            return Ok(());
        }
        let cr3 = sregs.cr3 & CR3_ROOT;
        // The program's stack holds what the kernel gave it.
        match self.scope {
            Scope::Every => {
                self.followed_ended(m, exec.pid, sup)?;
                let auxv = auxv_at_start(&m.vm.mem, cr3, user.rsp).unwrap_or_default();
                let started = ProcessInfo {
                    pid: exec.pid,
                    cr3,
                    exe: exec.path,
                    auxv,
                };
                sup.started(self, m, &started)
            }
            Scope::One(_) if self.tasks.process.is_none() => {
                self.tasks.execs.clear();
                let auxv = auxv_at_start(&m.vm.mem, cr3, user.rsp).unwrap_or_default();
                self.tasks.process = Some(ProcessInfo {
                    pid: exec.pid,
                    cr3,
                    exe: exec.path,
                    auxv,
                });
                self.tasks.threads.clear();
                self.tasks.threads.entry(exec.lwpid).or_default();
                self.tasks.note_current(
                    &m.vm.mem,
                    sregs.cr3,
                    self.stack_top_var,
                    (sregs.fs.base, sregs.gs.base),
                );
                let this: &Control = self;
                match &this.tasks.process {
                    Some(process) => sup.started(this, m, process),
                    None => Ok(()),
                }
            }
            Scope::One(_) => Ok(()),
        }
    }

    /// A followed process ended (its last thread exited, or it executes
    /// another program): its breakpoints come out (unless another process
    /// wants them too) and the end is told.
    pub(super) fn followed_ended(
        &mut self,
        m: &mut Machine,
        pid: u32,
        sup: &mut dyn Supervisor,
    ) -> Result<(), VmError> {
        let Some(cr3) = self.unfollow(pid) else {
            return Ok(());
        };
        sup.ended(cr3);
        self.sync_breakpoints(m);
        self.update_returns(m)
    }
}
