//! The user stacks of some events, kept while a plugin reads the database:
//! each distinct stack once, so that a long run whose lock calls come from
//! a few places costs a map entry per event, not a stack.

use std::collections::HashMap;

#[derive(Default)]
pub struct EventStacks {
    ids: HashMap<Vec<u64>, usize>,
    stacks: Vec<Vec<u64>>,
    of: HashMap<u64, usize>,
}

impl EventStacks {
    /// The stack of event `seq`: return addresses, innermost first.
    pub fn add(&mut self, seq: u64, frames: &[u64]) {
        let next = self.stacks.len();
        let id = *self.ids.entry(frames.to_vec()).or_insert(next);
        if id == next {
            self.stacks.push(frames.to_vec());
        }
        self.of.insert(seq, id);
    }

    /// The stack of event `seq`, if it had one.
    pub fn get(&self, seq: u64) -> Option<&[u64]> {
        self.of.get(&seq).map(|&id| self.stacks[id].as_slice())
    }

    /// How many distinct stacks are kept.
    pub fn distinct(&self) -> usize {
        self.stacks.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_each_distinct_stack_once() {
        let mut s = EventStacks::default();
        s.add(1, &[1, 2]);
        s.add(2, &[3]);
        s.add(3, &[1, 2]);
        assert_eq!(s.distinct(), 2);
        assert_eq!(s.get(3), Some(&[1u64, 2][..]));
        assert_eq!(s.get(2), Some(&[3u64][..]));
        assert_eq!(s.get(4), None);
    }
}
