//! A whole `COPY … TO STDOUT` read on a pooled connection, which goes back to the pool only
//! when the copy completed.
//!
//! sqlx 0.9.1 leaves a connection out of step with its server when a COPY fails before it
//! starts (a `lock_timeout` while DDL holds the table, a dropped column): it returns the error
//! without reading the `ReadyForQuery` that follows it. The same happens when the stream is
//! dropped part way. Back in the pool, every later query on that connection reads the reply
//! of the one before it: an empty result, `no rows returned`, or another statement's rows
//! (`tests/source_semantics.rs` shows it). So such a connection is closed, never reused.

use sqlx::pool::PoolConnection;
use sqlx::postgres::Postgres;

/// A pooled connection that is closed when dropped, unless [`CloseUnlessDone::done`] handed
/// it back first.
struct CloseUnlessDone(Option<PoolConnection<Postgres>>);

impl CloseUnlessDone {
    fn conn(&mut self) -> &mut PoolConnection<Postgres> {
        self.0.as_mut().expect("the connection is held until done")
    }

    fn done(mut self) -> PoolConnection<Postgres> {
        self.0.take().expect("the connection is held until done")
    }
}

impl Drop for CloseUnlessDone {
    fn drop(&mut self) {
        if let Some(conn) = &mut self.0 {
            conn.close_on_drop();
        }
    }
}

/// Runs `statement` (a `COPY … TO STDOUT`) on `conn` and returns everything it wrote, with the
/// connection for the statements that follow on the same session. On an error, or when this
/// future is dropped before the end, the connection is closed instead of returned to the pool.
pub async fn read_all(
    conn: PoolConnection<Postgres>,
    statement: &str,
) -> Result<(bytes::BytesMut, PoolConnection<Postgres>), sqlx::Error> {
    use futures::TryStreamExt;
    let mut held = CloseUnlessDone(Some(conn));
    let mut buffer = bytes::BytesMut::new();
    {
        let mut stream = held.conn().copy_out_raw(statement).await?;
        while let Some(chunk) = stream.try_next().await? {
            buffer.extend_from_slice(&chunk);
        }
    }
    Ok((buffer, held.done()))
}
