//! A PostgreSQL source as the coordinator plans it: connecting, the table's columns, whether
//! the key is unique, the grants the task needs, the key's domain at H0 and the zone a naive
//! cursor is written in.
use std::time::Duration;

use backon::{ExponentialBuilder, Retryable};
use sqlx::Row;
use sqlx::postgres::{PgPool, PgPoolOptions};
use tidemark_common::config::{DeletePolicy, TaskConfig};
use tidemark_common::cursor::{KeyDomain, KeyValue};
use tidemark_common::duration::format_duration;
use tidemark_common::pg::connector::PgReads;
use tidemark_common::pg::deletes::{delete_log_table, truncate_log_table};
use tidemark_common::pg::{self, Column, TableName, connect_options, is_transient, quote_ident};
use tidemark_common::redact::redact_url;
use tidemark_common::source::SourceReads;

use crate::error::CoordinatorError;
use crate::planner::*;

/// Connects to a task database, retrying while it is unreachable.
pub async fn connect_database(task: &str, role: &str, url: &str) -> Result<PgPool, CoordinatorError> {
    let options = connect_options(url, "tidemark-coordinator")
        .map_err(|e| CoordinatorError::task_setup(task, format!("{role} URL: {e}")))?;
    let connect = || async {
        PgPoolOptions::new()
            .max_connections(2)
            .acquire_timeout(Duration::from_secs(10))
            .connect_with(options.clone())
            .await
    };
    connect
        .retry(
            ExponentialBuilder::default()
                .with_max_times(6)
                .with_max_delay(Duration::from_secs(10)),
        )
        .when(is_transient)
        .notify(|error, delay| {
            tracing::warn!(task, role, url = %redact_url(url), %error, ?delay, "database unreachable; retrying");
        })
        .await
        .map_err(|e| CoordinatorError::task_setup(task, format!("cannot connect to {role} {}: {e}", redact_url(url))))
}

pub(crate) async fn introspect(
    pool: &PgPool,
    task: &str,
    role: &str,
    table: &TableName,
) -> Result<Option<Vec<SourceColumn>>, CoordinatorError> {
    let query_error = |e: sqlx::Error| CoordinatorError::task_setup(task, format!("{role} table {table}: {e}"));
    let exists: Option<String> = sqlx::query_scalar("SELECT to_regclass($1)::text")
        .bind(table.quoted())
        .fetch_one(pool)
        .await
        .map_err(query_error)?;
    if exists.is_none() {
        return Ok(None);
    }
    let rows = sqlx::query(pg::COLUMN_TYPES)
        .bind(table.quoted())
        .fetch_all(pool)
        .await
        .map_err(query_error)?;
    Ok(Some(
        rows.into_iter()
            .map(|row| SourceColumn {
                column: Column {
                    name: row.get(0),
                    sql_type: row.get(1),
                },
                not_null: row.get(3),
            })
            .collect(),
    ))
}

/// The table's primary key columns in key order.
pub(crate) async fn primary_key(pool: &PgPool, table: &TableName) -> Result<Vec<String>, CoordinatorError> {
    sqlx::query_scalar(
        "SELECT a.attname::text FROM pg_index i \
         CROSS JOIN LATERAL unnest(i.indkey) WITH ORDINALITY AS k(attnum, position) \
         JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum \
         WHERE i.indrelid = to_regclass($1) AND i.indisprimary ORDER BY k.position",
    )
    .bind(table.quoted())
    .fetch_all(pool)
    .await
    .map_err(CoordinatorError::Source)
}

/// Whether a unique, non-partial index (or the primary key) covers exactly `key`.
pub(crate) async fn key_is_unique(pool: &PgPool, table: &TableName, key: &[String]) -> Result<bool, CoordinatorError> {
    let indexes: Vec<Vec<String>> = sqlx::query_scalar(
        "SELECT array_agg(a.attname::text) FROM pg_index i \
         JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = ANY(i.indkey) \
         WHERE i.indrelid = $1::regclass AND i.indisunique AND i.indpred IS NULL AND i.indexprs IS NULL \
         GROUP BY i.indexrelid",
    )
    .bind(table.quoted())
    .fetch_all(pool)
    .await
    .map_err(|e| CoordinatorError::InvalidRequest(format!("reading the unique indexes of {table}: {e}")))?;
    let mut wanted = key.to_vec();
    wanted.sort();
    Ok(indexes.into_iter().any(|mut columns| {
        columns.sort();
        columns == wanted
    }))
}

/// Refuses, naming the grant, when the source role lacks a privilege on a table.
pub(crate) async fn require_privileges(
    pool: &PgPool,
    task: &str,
    needed: &[(TableName, &str)],
) -> Result<(), CoordinatorError> {
    let setup = |message: String| CoordinatorError::task_setup(task, message);
    for (table, privilege) in needed {
        let (role, held): (String, bool) =
            sqlx::query_as("SELECT current_user::text, has_table_privilege($1::regclass, $2)")
                .bind(table.quoted())
                .bind(*privilege)
                .fetch_one(pool)
                .await
                .map_err(|e| setup(format!("reading the privileges on {table}: {e}")))?;
        if !held {
            return Err(setup(format!(
                "the source role {role} cannot {} {table}: GRANT {privilege} ON {} TO {}",
                privilege.to_lowercase(),
                table.quoted(),
                pg::quote_ident(&role)
            )));
        }
    }
    Ok(())
}

/// [`inspect_source`] for a PostgreSQL source: the key must be unique, the delete log and
/// the grants in place, and the bound must see every writer.
pub(crate) async fn inspect_pg_source(config: &TaskConfig) -> Result<SourceInfo, CoordinatorError> {
    let task = config.name.as_str();
    let setup = |message: String| CoordinatorError::task_setup(task, message);
    let table = TableName::parse(&config.source_table).map_err(|e| setup(format!("source_table: {e}")))?;
    let pool = connect_database(task, "source", &config.source).await?;
    let columns = introspect(&pool, task, "source", &table)
        .await?
        .ok_or_else(|| setup(format!("source table {table} does not exist")))?;
    let version_column = validate_columns(config, &table, &columns)?;
    if !key_is_unique(&pool, &table, &config.key).await? {
        return Err(setup(format!(
            "key ({}) of {table} is not unique: no unique index or primary key covers exactly these columns",
            config.key.join(", ")
        )));
    }
    if let Some(DeletePolicy::TombstoneTable { .. }) = &config.delete_policy {
        for (log, what) in [
            (delete_log_table(&table), "the delete log"),
            (truncate_log_table(&table), "the TRUNCATE log"),
        ] {
            let exists: Option<String> = sqlx::query_scalar("SELECT to_regclass($1)::text")
                .bind(log.quoted())
                .fetch_one(&pool)
                .await
                .map_err(|e| setup(format!("source table {log}: {e}")))?;
            if exists.is_none() {
                return Err(setup(format!(
                    "delete_policy tombstone_table: {what} {log} does not exist; run \
                     `tidemark-coordinator source install --task {task}` (again, after an upgrade)"
                )));
            }
        }
        // The workers read both logs; the coordinator purges the delete log past retention.
        require_privileges(
            &pool,
            task,
            &[
                (delete_log_table(&table), "SELECT"),
                (delete_log_table(&table), "DELETE"),
                (truncate_log_table(&table), "SELECT"),
            ],
        )
        .await?;
    }
    source_info(
        config,
        tidemark_common::pg::connector::source_pool(pool),
        SourceReads::new(PgReads),
        table,
        columns,
        version_column,
    )
    .await
}

/// The first key's domain (how shards split it) and H0's largest key, on PostgreSQL.
pub(crate) async fn pg_key_domain(
    pool: &PgPool,
    source_info: &SourceInfo,
    config: &TaskConfig,
) -> Result<(KeyDomain, Option<KeyValue>), CoordinatorError> {
    let table = &source_info.table;
    let first_key_type = source_info.first_key_type.as_str();
    let reading = |e: sqlx::Error| {
        CoordinatorError::task_setup(&config.name, format!("reading the start bound from {table}: {e}"))
    };
    let first_key = quote_ident(&config.key[0]);
    let (domain, h0_max_key) = if first_key_type == "uuid" {
        // uuid keys split by prefix and need no bounds (and PostgreSQL has no min(uuid)).
        (KeyDomain::Uuid, None)
    } else if is_integer_type(first_key_type) {
        let query = format!(
            "SELECT min({first_key})::text, max({first_key})::text FROM {}",
            table.quoted()
        );
        let row = sqlx::query(sqlx::AssertSqlSafe(query))
            .fetch_one(pool)
            .await
            .map_err(reading)?;
        let parse = |text: Option<String>| text.and_then(|t| t.parse::<i64>().ok());
        let min = parse(row.get(0));
        let mut max = parse(row.get(1));
        if config.mode.appends() && config.open_transaction_bound {
            // Keys are read once, in order: the snapshot stops below any key a transaction
            // still open may add (see `id_tail`).
            max = settled_max_key(&source_info.pool, &source_info.reads, config, table).await?;
        }
        integer_domain(first_key_type, min, max)
    } else {
        // Other ordered types: boundaries at sampled quantiles (one sorted pass at planning).
        let fractions: Vec<String> = (1..config.shards)
            .map(|i| format!("{}", f64::from(i) / f64::from(config.shards)))
            .collect();
        let query = format!(
            "SELECT (percentile_disc(ARRAY[{}]::float8[]) WITHIN GROUP (ORDER BY {first_key}))::text[], max({first_key})::text FROM {}",
            if fractions.is_empty() {
                "0.5".to_string()
            } else {
                fractions.join(", ")
            },
            table.quoted()
        );
        let row = sqlx::query(sqlx::AssertSqlSafe(query))
            .fetch_one(pool)
            .await
            .map_err(reading)?;
        let boundaries: Option<Vec<String>> = row.get(0);
        let boundaries = if config.shards > 1 {
            boundaries.unwrap_or_default()
        } else {
            Vec::new()
        };
        let max: Option<String> = row.get(1);
        let h0_max = max.map(|value| KeyValue {
            sql_type: first_key_type.to_string(),
            value,
        });
        (
            KeyDomain::Sampled {
                sql_type: first_key_type.to_string(),
                boundaries,
            },
            h0_max,
        )
    };
    Ok((domain, h0_max_key))
}

/// The zone a naive cursor is read in for a new epoch (see `pg::cursor_zone`). Refused when
/// the zone's clocks go back (daylight saving time) by more than the overlap: the local times
/// of the repeated hour would fall below the watermark.
pub(crate) async fn naive_cursor_zone(
    source: &PgPool,
    config: &TaskConfig,
    cursor: &str,
) -> Result<String, CoordinatorError> {
    let setup = |message: String| CoordinatorError::task_setup(&config.name, message);
    let zone = pg::cursor_zone::resolve(source, config.cursor_time_zone.as_deref(), cursor)
        .await
        .map_err(setup)?;
    let shift = pg::cursor_zone::offset_shift_seconds(source, &zone.name)
        .await
        .map_err(|e| setup(format!("reading the offsets of time zone {}: {e}", zone.name)))?;
    if shift > 0 && (config.overlap.as_secs() as i64) < shift {
        return Err(setup(format!(
            "cursor_column {cursor:?} is timestamp without time zone written in {} ({}), whose clocks go back {}              when daylight saving time ends: rows written in the repeated hour would fall below the watermark.              Convert the column (ALTER TABLE … ALTER COLUMN {} TYPE timestamptz USING {} AT TIME ZONE '{}'), or              set overlap to at least {}",
            zone.name,
            zone.learned_from,
            format_duration(Duration::from_secs(shift as u64)),
            pg::quote_ident(cursor),
            pg::quote_ident(cursor),
            zone.name,
            format_duration(Duration::from_secs(shift as u64)),
        )));
    }
    tracing::info!(task = %config.name, cursor, zone = %zone.name, from = %zone.learned_from,
        "naive cursor values are read as local times of this zone");
    Ok(zone.name)
}

/// `pg_class.reltuples`: the planner's row estimate (negative when never analyzed).
pub(crate) async fn estimated_rows(pool: &PgPool, table: &TableName) -> Result<Option<i64>, sqlx::Error> {
    sqlx::query_scalar("SELECT reltuples::bigint FROM pg_class WHERE oid = $1::regclass")
        .bind(table.quoted())
        .fetch_optional(pool)
        .await
}
