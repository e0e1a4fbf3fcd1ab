//! Work in proportion to the shard count runs off the runtime's worker threads. Decoding a
//! read of every shard (50,000 rows with their cursors, or as many owners from the lease
//! store) took a worker for up to 350 ms on a 2-core box: every RPC queued behind it on that
//! worker waited as long (issue 20: the slowest second of a run, commit p99 513 ms, was one
//! such read). On a blocking thread the same work competes for a core like any other thread,
//! and the runtime's workers keep answering.

/// Runs `work` on the blocking pool and returns what it returns; a panic in it resumes here.
pub(crate) async fn run<T: Send + 'static>(work: impl FnOnce() -> T + Send + 'static) -> T {
    match tokio::task::spawn_blocking(work).await {
        Ok(done) => done,
        Err(error) => match error.try_into_panic() {
            Ok(panic) => std::panic::resume_unwind(panic),
            // Only when the runtime shuts down, and then no one waits for this answer.
            Err(error) => panic!("work off the runtime was cancelled: {error}"),
        },
    }
}
