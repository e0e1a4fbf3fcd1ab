//! How far an append-only read (append and accumulate modes, by key) may go. With a sequence
//! key and concurrent writers, a transaction can hold a low id while higher ids commit; a read
//! that passed them would never see the low one. So the read stops at the largest key that no
//! open transaction can still add below.
//!
//! The rule: sample `(at, max)`, the largest visible key and the source clock just after the
//! sampling statement's snapshot. Every key up to `max` was allocated before `at` (a sequence
//! hands out increasing values), so the transactions that allocated them started before
//! `at`. When every transaction still open started after `at`, none of them holds a key up to
//! `max`: reading up to `max` is safe. The bound for a read is therefore the newest sample
//! taken before the oldest open transaction started, or the newest sample when none is open.
//! A key sequence with `CACHE` above 1 hands values out of order between sessions and breaks
//! the rule (the README says so).

use std::collections::VecDeque;

/// Samples kept; a shard samples once per read cycle, so this spans many cycles.
const MAX_SAMPLES: usize = 64;

/// One sample: the source clock after the snapshot (microseconds) and the largest visible key
/// (`None`: the table was empty).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sample {
    pub at_micros: i64,
    pub max_key: Option<i64>,
}

#[derive(Debug, Default, Clone)]
pub struct IdTail {
    samples: VecDeque<Sample>,
}

impl IdTail {
    pub fn record(&mut self, sample: Sample) {
        if self.samples.len() == MAX_SAMPLES {
            self.samples.pop_front();
        }
        self.samples.push_back(sample);
    }

    /// The largest key a read may reach, given the start of the oldest transaction open now
    /// (read after the newest sample). `None`: no sample is safe yet (hold). `Some(None)`: the
    /// table held no key then.
    pub fn safe_bound(&mut self, oldest_open_micros: Option<i64>) -> Option<Option<i64>> {
        let usable = |s: &Sample| oldest_open_micros.is_none_or(|oldest| s.at_micros < oldest);
        let index = self.samples.iter().rposition(usable)?;
        // Older samples can never be needed again: the oldest open transaction only gets younger.
        self.samples.drain(..index);
        self.samples.front().map(|s| s.max_key)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(at_micros: i64, max_key: i64) -> Sample {
        Sample {
            at_micros,
            max_key: Some(max_key),
        }
    }

    #[test]
    fn without_open_transactions_the_newest_sample_bounds_the_read() {
        let mut tail = IdTail::default();
        tail.record(sample(10, 100));
        tail.record(sample(20, 150));
        assert_eq!(tail.safe_bound(None), Some(Some(150)));
    }

    #[test]
    fn an_open_transaction_holds_the_bound_at_the_last_sample_before_it_began() {
        let mut tail = IdTail::default();
        tail.record(sample(10, 100));
        tail.record(sample(20, 150));
        tail.record(sample(30, 170));
        // A transaction open since 25 may hold a key above 150 (allocated after 20).
        assert_eq!(tail.safe_bound(Some(25)), Some(Some(150)));
        // One open since before every sample: nothing is safe yet.
        assert_eq!(tail.safe_bound(Some(5)), None);
        // It ends; the next oldest began at 31.
        assert_eq!(tail.safe_bound(Some(31)), Some(Some(170)));
    }

    #[test]
    fn a_transaction_that_began_at_the_sample_instant_is_not_trusted() {
        let mut tail = IdTail::default();
        tail.record(sample(20, 150));
        assert_eq!(tail.safe_bound(Some(20)), None);
    }

    #[test]
    fn samples_are_bounded() {
        let mut tail = IdTail::default();
        for i in 0..200 {
            tail.record(sample(i, i));
        }
        assert_eq!(tail.samples.len(), MAX_SAMPLES);
        assert_eq!(tail.safe_bound(Some(150)), Some(Some(149)));
    }
}
