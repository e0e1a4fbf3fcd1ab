//! What the open-transaction bound sees on MySQL/MariaDB: the transaction list of
//! `SHOW ENGINE INNODB STATUS`, which shows every InnoDB transaction of the server with how
//! long it has been active, but only to a role with the PROCESS privilege (without it the
//! statement is refused). A replica applying its primary's changes (a replication SQL thread
//! in the process list) cannot see the primary's open transactions.
//!
//! Not `information_schema.innodb_trx`: InnoDB serves that table from a copy it refreshes only
//! when nobody has read it for 100 ms (`CACHE_MIN_IDLE_TIME_US`), so while any sessions
//! together read it more often (other shards, a monitoring tool) it keeps listing the
//! transactions of some time ago, and one opened since is missing: the bound would pass it
//! and its rows, committed late, would be lost (seen under the full suite). The status is
//! printed from the live transaction list on every call.
//!
//! Each transaction shows as `ACTIVE n sec`, where n is the server's `time(NULL)` minus the
//! transaction's start, both whole seconds: the start is at least `now - n` for any `now` read
//! before the statement, in whole seconds and truncated, so the bound never lies after the true
//! start. No time zone enters (`innodb_trx.trx_started` is rendered in the server's local
//! zone). A list the server truncated (its output is capped at 1 MB) or a transaction state
//! this parser does not know holds the reads, by name.

use sqlx::mysql::MySqlPool;

use crate::pg::visibility::{Engine, Visibility};

/// The oldest start (Unix seconds) among the transactions of other sessions that `status`
/// (the text of `SHOW ENGINE INNODB STATUS`) lists, given `now_secs` read before it and this
/// session's `own_thread`; `Err` names why the list cannot be trusted.
pub fn oldest_start_secs(status: &str, now_secs: i64, own_thread: u64) -> Result<Option<i64>, String> {
    let Some((_, list)) = status.split_once("\nLIST OF TRANSACTIONS FOR EACH SESSION:\n") else {
        return Err("SHOW ENGINE INNODB STATUS printed no transaction list".to_string());
    };
    if list.contains("...truncated...") {
        return Err(
            "SHOW ENGINE INNODB STATUS truncated its transaction list (its output is capped at 1 MB), so open \
             transactions may be missing from it; the reads wait until the list fits"
                .to_string(),
        );
    }
    let mut oldest: Option<i64> = None;
    // One entry per transaction: its header line, then lines up to the next header; the
    // list ends at the next section's dashed rule.
    let list = list.split("\n--------\n").next().unwrap_or(list);
    for entry in list.split("---TRANSACTION ").skip(1) {
        let header = entry.lines().next().unwrap_or_default();
        let active = if header.contains(", not started") || header.contains("COMMITTED IN MEMORY") {
            continue;
        } else if let Some((_, rest)) = header.split_once(", ACTIVE ") {
            let rest = rest.strip_prefix("(PREPARED) ").unwrap_or(rest);
            rest.split_once(" sec").and_then(|(n, _)| n.trim().parse::<i64>().ok())
        } else {
            None
        };
        let Some(active) = active else {
            return Err(format!(
                "SHOW ENGINE INNODB STATUS lists a transaction in a state the bound cannot date ({header:?}), so \
                 the reads wait until it ends"
            ));
        };
        let thread = entry
            .split_once(" thread id ")
            .and_then(|(_, rest)| rest.split(|c: char| !c.is_ascii_digit()).next())
            .and_then(|id| id.parse::<u64>().ok());
        if thread == Some(own_thread) {
            continue;
        }
        let start = now_secs - active;
        oldest = Some(oldest.map_or(start, |o| o.min(start)));
    }
    Ok(oldest)
}

/// This session's role, thread and clock (whole Unix seconds, read before the status), and
/// the replication threads applying a primary's changes on this server.
const SESSION: &str = "SELECT CAST(CURRENT_USER() AS CHAR), CAST(CONNECTION_ID() AS UNSIGNED), \
     CAST(UNIX_TIMESTAMP() AS SIGNED), (SELECT COUNT(*) FROM information_schema.processlist \
     WHERE command IN ('Slave_SQL', 'Slave_worker', 'Replica_SQL', 'Replica_worker'))";

/// Reads what the bound can see: two statements on one connection.
pub async fn read(pool: &MySqlPool) -> Result<Visibility, sqlx::Error> {
    let mut conn = pool.acquire().await?;
    let (role, own_thread, now_secs, replica_threads): (String, u64, i64, i64) =
        sqlx::query_as(SESSION).fetch_one(&mut *conn).await?;
    let (user, host) = role.rsplit_once('@').unwrap_or((role.as_str(), "%"));
    let role = format!("'{user}'@'{host}'");
    let status = sqlx::query_as::<_, (String, String, String)>("SHOW ENGINE INNODB STATUS")
        .fetch_one(&mut *conn)
        .await;
    let (sees_all_sessions, oldest_start_micros, unreadable) = match status {
        Ok((_, _, status)) => match oldest_start_secs(&status, now_secs, own_thread) {
            Ok(oldest) => (true, oldest.map(|s| s * 1_000_000), None),
            Err(reason) => (true, None, Some(reason)),
        },
        Err(sqlx::Error::Database(e)) if e.message().contains("PROCESS") => (false, None, None),
        Err(e) => return Err(e),
    };
    Ok(Visibility {
        engine: Engine::MySql,
        role,
        sees_all_sessions,
        in_recovery: replica_threads > 0,
        subscriptions: Vec::new(),
        oldest_start_micros,
        unreadable,
    })
}

#[cfg(test)]
mod tests {
    use super::oldest_start_secs;

    /// As MariaDB 10.11 prints it (one writer, one consistent snapshot, one idle session).
    const STATUS: &str = "\n=====================================\n2026-12-03 07:19:29 INNODB MONITOR OUTPUT\n\
        ------------\nTRANSACTIONS\n------------\nTrx id counter 1774\nHistory list length 2\n\
        LIST OF TRANSACTIONS FOR EACH SESSION:\n\
        ---TRANSACTION 1773, ACTIVE 2 sec\n1 lock struct(s), heap size 1128, 0 row lock(s), undo log entries 1\n\
        MariaDB thread id 628, OS thread handle 139840914536128, query id 209490 127.0.0.1 root User sleep\n\
        SELECT SLEEP(3)\n\
        ---TRANSACTION (0x7f2f401c0b80), ACTIVE 7 sec\n0 lock struct(s), heap size 1128, 0 row lock(s)\n\
        MariaDB thread id 626, OS thread handle 131044688438976, query id 209482 127.0.0.1 root User sleep\n\
        SELECT SLEEP(3)\nTrx read view will not see trx with id >= 1769, sees < 1769\n\
        ---TRANSACTION (0x7f2f401c1c80), not started\n0 lock struct(s), heap size 1128, 0 row lock(s)\n\
        --------\nFILE I/O\n--------\nI/O thread 0 state: waiting for completed aio requests (insert buffer thread)\n";

    #[test]
    fn the_oldest_start_is_now_minus_the_longest_activity() {
        assert_eq!(oldest_start_secs(STATUS, 1_000, 1), Ok(Some(993)));
    }

    #[test]
    fn the_own_session_and_idle_sessions_do_not_count() {
        assert_eq!(oldest_start_secs(STATUS, 1_000, 626), Ok(Some(998)));
        let idle = STATUS
            .replace("ACTIVE 2 sec", "not started")
            .replace("ACTIVE 7 sec", "not started");
        assert_eq!(oldest_start_secs(&idle, 1_000, 1), Ok(None));
    }

    #[test]
    fn a_prepared_transaction_is_dated_by_its_activity() {
        let mysql = STATUS
            .replace("ACTIVE 7 sec", "ACTIVE (PREPARED) 30 sec")
            .replace("MariaDB thread", "MySQL thread");
        assert_eq!(oldest_start_secs(&mysql, 1_000, 1), Ok(Some(970)));
    }

    #[test]
    fn a_truncated_list_an_unknown_state_or_no_list_is_named() {
        let truncated = STATUS.replace("---TRANSACTION 1773", "...truncated...\n---TRANSACTION 1773");
        assert!(
            oldest_start_secs(&truncated, 1_000, 1)
                .unwrap_err()
                .contains("truncated")
        );
        let unknown = STATUS.replace("ACTIVE 2 sec", "recovered prepared");
        assert!(
            oldest_start_secs(&unknown, 1_000, 1)
                .unwrap_err()
                .contains("recovered prepared")
        );
        assert!(
            oldest_start_secs("no list", 1_000, 1)
                .unwrap_err()
                .contains("no transaction list")
        );
    }
}
