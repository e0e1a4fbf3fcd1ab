//! Test-only crash points: `TIDEMARK_CRASH_AT=<point>:<n>` makes the worker abort (no
//! unwinding, no cleanup: the same as `kill -9` for everything outside the process) the n-th
//! time it passes `<point>`. Unset, a point costs one relaxed load of a `OnceLock`.
//!
//! Points: `after_read`, `after_stage`, `after_register`, `after_apply`, `after_commit`.

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

pub fn point(name: &str) {
    if let Some((point, at)) = target()
        && point == name
        && PASSED.fetch_add(1, Ordering::SeqCst) + 1 == *at
    {
        eprintln!("tidemark-worker: crash point {name} reached (pass {at}); aborting");
        std::process::abort();
    }
}
