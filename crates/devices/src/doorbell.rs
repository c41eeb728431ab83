//! Wakes the vCPU thread while the guest is halted: device threads ring it
//! when they have something (a finished disk request, a received frame)
//! that the VMM may want to make visible.

use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::Duration;

#[derive(Clone, Default)]
pub struct Doorbell(Arc<(Mutex<bool>, Condvar)>);

impl Doorbell {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn ring(&self) {
        let (rung, cond) = &*self.0;
        *rung.lock().unwrap_or_else(PoisonError::into_inner) = true;
        cond.notify_all();
    }

    /// Waits until the bell rings or `timeout` passes; returns whether it
    /// rang (since the last wait).
    pub fn wait(&self, timeout: Duration) -> bool {
        let (rung, cond) = &*self.0;
        let guard = rung.lock().unwrap_or_else(PoisonError::into_inner);
        let (mut guard, _) = cond
            .wait_timeout_while(guard, timeout, |rung| !*rung)
            .unwrap_or_else(PoisonError::into_inner);
        std::mem::take(&mut *guard)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_ring_before_the_wait_is_not_lost() {
        let bell = Doorbell::new();
        bell.ring();
        assert!(bell.wait(Duration::from_secs(5)));
        assert!(!bell.wait(Duration::from_millis(1)));
        let other = bell.clone();
        let t = std::thread::spawn(move || other.ring());
        assert!(bell.wait(Duration::from_secs(5)));
        t.join().unwrap();
    }
}
