//! Keeps the PostgreSQL control database's planner statistics in step with its tables.
//!
//! The coordinator's statements are prepared once per connection, and after five executions
//! PostgreSQL keeps a generic plan for each. A plan made while `batches` held a few hundred
//! rows reads the whole table (a sequential scan hashed against the group): on a fresh control
//! database under 1,000 workers every registration did so long after the table had grown to
//! 30,000 rows, a quarter of the box's CPU (BENCHMARKS.md, issue 20, session 26). Growth alone
//! never replaces a cached plan; new statistics do (an `ANALYZE` invalidates the plans that
//! read the table, in every session). Autovacuum analyzes eventually, but on a busy server it
//! took minutes. So the leader analyzes each growing control table itself whenever it has
//! doubled since the statistics the planner holds: a handful of times while a table grows
//! from nothing to millions of rows, each a sample of at most 30,000 rows.
//!
//! The embedded SQLite store needs none of this: it re-prepares nothing on growth and its
//! planner prefers the indexes without statistics.

use std::time::Duration;

use crate::checkpoints::ControlDb;
use crate::leader::Leadership;

/// The tables that grow with batches, shards and workers.
const GROWING_TABLES: [&str; 5] = ["batches", "checkpoints", "checkpoint_history", "late_rows", "workers"];

/// How often the leader compares the tables' sizes with their statistics.
const PERIOD: Duration = Duration::from_secs(10);

/// The leader's loop: a check soon after the start, then one per [`PERIOD`].
pub async fn keep_statistics(control: ControlDb, leadership: Leadership) {
    let mut pause = Duration::from_secs(2);
    loop {
        tokio::time::sleep(pause).await;
        pause = PERIOD;
        if !leadership.is_leader() {
            continue;
        }
        match refresh(&control).await {
            Ok(analyzed) if analyzed.is_empty() => {}
            Ok(analyzed) => tracing::debug!(?analyzed, "control tables analyzed: they outgrew their statistics"),
            Err(error) => tracing::warn!(%error, "refreshing the control tables' statistics failed; retrying"),
        }
    }
}

/// Analyzes each growing table that this role owns and that is more than twice as large as
/// the statistics say (counted in pages, at least 8). Returns the tables analyzed.
pub async fn refresh(control: &ControlDb) -> Result<Vec<String>, sqlx::Error> {
    if control.lite().is_some() {
        return Ok(Vec::new());
    }
    let outgrown: Vec<String> = sqlx::query_scalar(
        "SELECT c.relname::text FROM unnest($1::text[]) t(name) JOIN pg_class c ON c.oid = to_regclass(t.name) \
         WHERE pg_has_role(c.relowner, 'USAGE') \
         AND pg_relation_size(c.oid) / current_setting('block_size')::bigint > 2 * greatest(c.relpages, 4) \
         ORDER BY c.relname",
    )
    .bind(GROWING_TABLES)
    .fetch_all(control.pool())
    .await?;
    for table in &outgrown {
        // The names are this module's constants, not input.
        sqlx::query(sqlx::AssertSqlSafe(format!("ANALYZE {table}")))
            .execute(control.pool())
            .await?;
    }
    Ok(outgrown)
}
