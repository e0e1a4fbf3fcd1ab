//! How long a periodic read of every shard waits before it runs again. Such reads (the
//! gauges, the shard operations, the claim queue's free shards) cost time in proportion to the
//! shard count, not to the work: at a fixed period, 50,000 shards made them most of what the
//! control database did (BENCHMARKS.md, issue 20). Each waits its base period, or
//! [`FACTOR`] times as long as its last round took, whichever is longer: together they then
//! take at most a bounded share of the control database and the coordinator, and at a large
//! shard count their views age in proportion (at 50,000 shards, where a read takes about a
//! second on a 2-core box, a gauge refreshed about every 20 s instead of 2 s).

use std::time::Duration;

/// A round is followed by at least this many times its own duration of rest: at most
/// 1 / (1 + FACTOR) of the time is spent reading. With 9 (a tenth) the three loops' reads
/// still set the tail of every other call at 50,000 shards: heartbeat p99 650–820 ms and a
/// dead worker's shards reacquired after up to 16.7 s; with 19, 232–456 ms and 12.8–13.6 s
/// (BENCHMARKS.md, issue 20, session 26).
pub(crate) const FACTOR: u32 = 19;

/// The wait after a round that took `took`, for a loop whose period is `base`.
pub(crate) fn wait_after(base: Duration, took: Duration) -> Duration {
    base.max(took * FACTOR)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_quick_round_keeps_the_base_period_and_a_slow_one_rests_longer() {
        let base = Duration::from_secs(2);
        assert_eq!(wait_after(base, Duration::from_millis(30)), base);
        assert_eq!(
            wait_after(base, Duration::from_millis(400)),
            Duration::from_millis(7_600)
        );
        assert_eq!(wait_after(Duration::ZERO, Duration::ZERO), Duration::ZERO);
    }
}
