//! What the open-transaction bound can see (invariant 11). The bound holds each cycle's
//! `high` below the start of the oldest transaction still open on the source; it is only as
//! good as the view of transactions the source role has. This module reads that view and
//! names what is missing:
//! - a role without `pg_read_all_stats` sees other roles' `xact_start` as NULL;
//! - a hot standby (`pg_is_in_recovery()`) cannot see the primary's transactions;
//! - a table written by logical replication gets rows (and their cursor times) from a
//!   publisher whose transactions are invisible here;
//! - a prepared (two-phase) transaction has no session and no start time at all.
//!
//! Every backend of the source database counts (client backends, background workers,
//! logical replication workers), except autovacuum and WAL senders, which write no rows, and
//! the session asking. Tidemark's other sessions are not singled out: they only read, each
//! page is one statement, and one holds the bound back at most by that statement's duration.
//! No session is ever excluded by its application name.

use super::TableName;

/// One reading of what the bound can see, taken when a cycle starts (worker), at planning
/// and on every watcher round (coordinator).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Visibility {
    /// Whose view it is (the fixes are named in that engine's terms).
    pub engine: Engine,
    /// The source role (`current_user`).
    pub role: String,
    /// Superuser, or holds the privileges of `pg_read_all_stats` (e.g. through `pg_monitor`).
    pub sees_all_sessions: bool,
    pub in_recovery: bool,
    /// Subscriptions that replicate into the source table.
    pub subscriptions: Vec<String>,
    /// Start of the oldest open transaction of another session (microseconds).
    pub oldest_start_micros: Option<i64>,
    /// Why the open transactions cannot be read right now (MySQL/MariaDB: the server
    /// truncated its transaction list, or lists a state the bound cannot date); the bound
    /// holds the reads until they can.
    pub unreadable: Option<String>,
}

/// The engine a [`Visibility`] was read from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Engine {
    Postgres,
    MySql,
}

/// `$1`: the quoted source table. Read before [`PREPARED_TRANSACTIONS`]: a transaction that
/// prepares between the two readings is then seen by the second.
pub const VISIBILITY: &str = "SELECT current_user::text, \
     pg_has_role(current_user, 'pg_read_all_stats', 'USAGE') OR (SELECT rolsuper FROM pg_roles WHERE rolname = current_user), \
     pg_is_in_recovery(), \
     ARRAY(SELECT s.subname::text FROM pg_subscription_rel r JOIN pg_subscription s ON s.oid = r.srsubid \
           WHERE r.srrelid = $1::regclass ORDER BY 1), \
     (SELECT (extract(epoch from min(xact_start)) * 1000000)::bigint FROM pg_stat_activity \
      WHERE xact_start IS NOT NULL AND datname = current_database() AND pid <> pg_backend_pid() \
      AND backend_type NOT IN ('autovacuum worker', 'autovacuum launcher', 'walsender'))";

/// The oldest prepared transaction of the source database: its global id and when it was
/// prepared (microseconds). Its start is unknown (it began before, in a session that may
/// have ended), so no time bound covers it: while one exists, the watermark stays.
pub const PREPARED_TRANSACTIONS: &str = "SELECT gid, (extract(epoch from prepared) * 1000000)::bigint, \
     count(*) OVER ()::bigint FROM pg_prepared_xacts WHERE database = current_database() ORDER BY prepared LIMIT 1";

/// The reason prefix of a pause for a bound that cannot see every writer.
pub const BLIND_BOUND: &str = "open transactions not visible";

impl Visibility {
    /// What keeps the bound from seeing every writer of `table`, as one sentence that names
    /// the fix; `None` when it sees them all.
    pub fn blind_spot(&self, table: &TableName) -> Option<String> {
        let role = &self.role;
        let problem = if !self.sees_all_sessions && self.engine == Engine::MySql {
            format!(
                "the source role {role} cannot read InnoDB's transaction list (SHOW ENGINE INNODB STATUS), so rows other sessions commit \
                 late could fall below the watermark unseen: GRANT PROCESS ON *.* TO {role}"
            )
        } else if self.in_recovery && self.engine == Engine::MySql {
            "the source is a replica (a replication SQL thread runs), which cannot see the transactions open on its \
             primary: read from the primary"
                .to_string()
        } else if !self.sees_all_sessions {
            format!(
                "the source role {role} cannot see other roles' transactions (pg_stat_activity shows their start as \
                 NULL), so rows they commit late could fall below the watermark unseen: \
                 GRANT pg_read_all_stats TO {role}"
            )
        } else if self.in_recovery {
            "the source is a hot standby (pg_is_in_recovery()), which cannot see the transactions open on its \
             primary: read from the primary"
                .to_string()
        } else if !self.subscriptions.is_empty() {
            format!(
                "{table} is written by logical replication (subscription {}), whose rows carry the publisher's \
                 cursor times while the publisher's open transactions are invisible here: read from the publisher",
                self.subscriptions.join(", ")
            )
        } else {
            return None;
        };
        Some(format!(
            "{BLIND_BOUND}: {problem}; or set open_transaction_bound = false, which reduces the late-commit \
             guarantee to the overlap window"
        ))
    }
}

/// The oldest prepared transaction of the source database: gid, prepared at
/// (microseconds) and how many there are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PreparedTransaction {
    pub gid: String,
    pub prepared_micros: i64,
    pub count: i64,
}

/// Reads what the bound can see of `table`'s writers, then the oldest prepared transaction
/// (in that order: see [`VISIBILITY`]).
pub async fn read(
    source: &sqlx::PgPool,
    table: &TableName,
) -> Result<(Visibility, Option<PreparedTransaction>), sqlx::Error> {
    use sqlx::Row;
    let row = sqlx::query(VISIBILITY).bind(table.quoted()).fetch_one(source).await?;
    let visibility = Visibility {
        engine: Engine::Postgres,
        role: row.get(0),
        sees_all_sessions: row.get::<Option<bool>, _>(1).unwrap_or(false),
        in_recovery: row.get(2),
        subscriptions: row.get(3),
        oldest_start_micros: row.get(4),
        unreadable: None,
    };
    let prepared = sqlx::query(PREPARED_TRANSACTIONS)
        .fetch_optional(source)
        .await?
        .map(|row| PreparedTransaction {
            gid: row.get(0),
            prepared_micros: row.get(1),
            count: row.get(2),
        });
    Ok((visibility, prepared))
}

/// A prepared transaction holding the watermark, as `status` shows it.
pub fn prepared_hold(prepared: &PreparedTransaction) -> String {
    let PreparedTransaction { gid, count, .. } = prepared;
    let at = crate::cursor::format_micros(prepared.prepared_micros);
    let others = if *count > 1 {
        format!(" (and {} more)", count - 1)
    } else {
        String::new()
    };
    format!(
        "prepared transaction '{gid}' (prepared at {at}){others} holds the watermark: its start is unknown, so \
         nothing past the watermark is read until it is committed or rolled back (COMMIT PREPARED / ROLLBACK PREPARED)"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seeing() -> Visibility {
        Visibility {
            engine: Engine::Postgres,
            role: "app_reader".into(),
            sees_all_sessions: true,
            in_recovery: false,
            subscriptions: Vec::new(),
            oldest_start_micros: None,
            unreadable: None,
        }
    }

    #[test]
    fn each_blind_spot_names_its_fix() {
        let table = TableName::parse("public.items").unwrap();
        assert_eq!(seeing().blind_spot(&table), None);
        let no_stats = Visibility {
            sees_all_sessions: false,
            ..seeing()
        };
        let reason = no_stats.blind_spot(&table).unwrap();
        assert!(reason.starts_with(BLIND_BOUND), "{reason}");
        assert!(reason.contains("GRANT pg_read_all_stats TO app_reader"), "{reason}");
        let standby = Visibility {
            in_recovery: true,
            ..seeing()
        };
        assert!(standby.blind_spot(&table).unwrap().contains("hot standby"));
        let subscriber = Visibility {
            subscriptions: vec!["orders_sub".into()],
            ..seeing()
        };
        assert!(
            subscriber
                .blind_spot(&table)
                .unwrap()
                .contains("subscription orders_sub")
        );
    }

    #[test]
    fn no_session_is_excluded_by_name() {
        assert!(!VISIBILITY.contains("application_name"));
        assert!(VISIBILITY.contains("pid <> pg_backend_pid()"));
        // Background and logical replication workers count; only non-writers are left out.
        assert!(!VISIBILITY.contains("'client backend'"));
    }
}
