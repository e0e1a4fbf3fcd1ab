//! Crash points for the chaos and recovery suites.
//!
//! With the `crash-points` feature, `TIDEMARK_CRASH_AT=<point>:<n>` makes the process raise
//! SIGKILL on itself the n-th time it passes `<point>`: no unwinding, no destructors, no
//! flushing, exactly what `kill -9` does. Without the feature (release builds of the
//! binaries) every function here is an empty inline function.
//!
//! Worker points, in protocol order: `after_read`, `mid_data` (half the data object is left at
//! its final path, as a non-atomic store would), `after_data` (data object, no manifest),
//! `after_stage` (manifest written, not registered), `after_register`, `in_apply` (inside the
//! target transaction, rows upserted, not committed), `after_apply` (target committed, commit
//! RPC not sent), `after_commit` (commit acknowledged). Coordinator points:
//! `commit_before_reply` (checkpoint committed, reply not sent), `swap_before_control` (an
//! epoch switch done in the target, not yet in the control database), `swap_mid_target`
//! (MySQL/MariaDB: the tables renamed, the fence row not yet moved).
//!
//! `TIDEMARK_STOP_AT=<point>:<n>` instead freezes the worker (SIGSTOP) there: `before_commit`
//! (target committed, checkpoint not) or `in_apply` (inside the target transaction, holding
//! row locks): a zombie at the worst moments.

#[cfg(feature = "crash-points")]
mod enabled {
    use std::sync::OnceLock;
    use std::sync::atomic::{AtomicU64, Ordering};

    static TARGET: OnceLock<Option<(String, u64)>> = OnceLock::new();
    static PASSED: AtomicU64 = AtomicU64::new(0);

    fn target() -> &'static Option<(String, u64)> {
        TARGET.get_or_init(|| {
            let value = std::env::var("TIDEMARK_CRASH_AT").ok()?;
            let (point, count) = value.split_once(':')?;
            Some((point.to_string(), count.parse().ok()?))
        })
    }

    /// Counts a pass of `name`; true when this pass is the one to crash at.
    pub fn armed(name: &str) -> bool {
        matches!(target(), Some((point, at)) if point == name && PASSED.fetch_add(1, Ordering::SeqCst) + 1 == *at)
    }

    static STOP_TARGET: OnceLock<Option<(String, u64)>> = OnceLock::new();
    static STOP_PASSED: AtomicU64 = AtomicU64::new(0);

    /// `TIDEMARK_STOP_AT=<point>:<n>`: the process SIGSTOPs itself the n-th time it passes
    /// `<point>`; whoever sends SIGCONT later wakes a zombie at exactly that step.
    pub fn stop_point(name: &str) {
        let target = STOP_TARGET.get_or_init(|| {
            let value = std::env::var("TIDEMARK_STOP_AT").ok()?;
            let (point, count) = value.split_once(':')?;
            Some((point.to_string(), count.parse().ok()?))
        });
        if matches!(target, Some((point, at)) if point == name && STOP_PASSED.fetch_add(1, Ordering::SeqCst) + 1 == *at)
        {
            eprintln!("stop point {name} reached: SIGSTOP");
            // SAFETY: kill(2) on our own pid has no memory-safety preconditions.
            unsafe {
                libc::kill(libc::getpid(), libc::SIGSTOP);
            }
            eprintln!("stop point {name}: continued");
        }
    }

    pub fn kill(name: &str) -> ! {
        eprintln!("crash point {name} reached: SIGKILL");
        // SAFETY: kill(2) on our own pid has no memory-safety preconditions.
        unsafe {
            libc::kill(libc::getpid(), libc::SIGKILL);
        }
        unreachable!("SIGKILL is not delivered asynchronously to ourselves");
    }
}

/// Crashes here if this pass is the configured one.
#[inline]
pub fn point(name: &str) {
    #[cfg(feature = "crash-points")]
    if enabled::armed(name) {
        enabled::kill(name);
    }
    #[cfg(not(feature = "crash-points"))]
    let _ = name;
}

/// True when this pass of `name` is the one to crash at; the caller does its partial work
/// and then calls [`kill`].
#[inline]
pub fn armed(name: &str) -> bool {
    #[cfg(feature = "crash-points")]
    return enabled::armed(name);
    #[cfg(not(feature = "crash-points"))]
    {
        let _ = name;
        false
    }
}

/// Freezes the whole process here (SIGSTOP) if this pass is the configured stop point.
#[inline]
pub fn stop_point(name: &str) {
    #[cfg(feature = "crash-points")]
    enabled::stop_point(name);
    #[cfg(not(feature = "crash-points"))]
    let _ = name;
}

#[inline]
pub fn kill(name: &str) {
    #[cfg(feature = "crash-points")]
    enabled::kill(name);
    #[cfg(not(feature = "crash-points"))]
    let _ = name;
}
