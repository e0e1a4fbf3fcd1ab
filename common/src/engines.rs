//! The registry of database engines: one line per engine. An engine is a folder (`pg/`,
//! `mysql/`) whose `connector.rs` implements the boundary, [`Source`](crate::source::Source)
//! and [`Target`](crate::target::Target), and declares what it can do; everything else
//! (the worker's pipeline and apply, reconciliation, the coordinator's planning) asks the
//! boundary and never names a driver. The coordinator and the worker keep their own engine
//! folders and registries for what only they do (inspection, target setup, the apply
//! transaction), keyed by [`Engine::id`].

use std::time::Duration;

use crate::source::SourcePool;
use crate::target::TargetPool;

/// Opens a lazily connecting pool: `(url, application_name, max_connections, guard)`.
pub type Connect<Pool> = fn(&str, &str, u32, Duration) -> Result<Pool, String>;

/// A database engine: its names, URL schemes, capabilities and how to reach it.
#[derive(Debug)]
pub struct Engine {
    /// The registry key (`postgres`, `mysql`).
    pub id: &'static str,
    /// The name errors use.
    pub name: &'static str,
    /// URL schemes, without `://`.
    pub schemes: &'static [&'static str],
    /// A reconciliation hashes every column's row text natively on this engine (PostgreSQL
    /// with PostgreSQL); otherwise both sides hash the portable canonical text of each
    /// column (see `reconcile_reads::PortableKind`), for the types it covers.
    pub hashes_content: bool,
    /// The database a table named without one is in, from the URL (MySQL's `…/db`):
    /// `Some(f)` where the engine has one, and `f(url)` is `None` when the URL names none.
    pub url_database: Option<fn(&str) -> Option<String>>,
    /// Whether retrying can fix a driver error: a connection, a restart, a deadlock, a
    /// lock a stopped zombie still holds.
    pub retry_fixes: fn(&sqlx::Error) -> bool,
    /// The condition name of an error one row's values caused (a value the column type
    /// rejects, an overflow, a NUL character, a constraint), for this engine's errors;
    /// `None` for another engine's error or one not about a row.
    pub row_error_class: fn(&dyn sqlx::error::DatabaseError) -> Option<String>,
    /// A lazily connecting source pool: `(url, application_name, max_connections, guard)`.
    pub source: Connect<SourcePool>,
    /// A lazily connecting target pool, with the same arguments; `None` for an engine that
    /// is only a source.
    pub target: Option<Connect<TargetPool>>,
}

impl PartialEq for Engine {
    fn eq(&self, other: &Engine) -> bool {
        self.id == other.id
    }
}

/// Every engine, one line each.
pub static ENGINES: &[&Engine] = &[&crate::pg::connector::ENGINE, &crate::mysql::connector::ENGINE];

/// Whether retrying can fix a driver error, whichever engine raised it.
pub fn retry_fixes(error: &sqlx::Error) -> bool {
    ENGINES.iter().any(|engine| (engine.retry_fixes)(error))
}

/// The engine a database URL names by its scheme.
pub fn of_url(url: &str) -> Result<&'static Engine, String> {
    let scheme = url.split_once("://").map_or("", |(scheme, _)| scheme);
    ENGINES
        .iter()
        .copied()
        .find(|engine| engine.schemes.contains(&scheme))
        .ok_or_else(|| {
            let known: Vec<String> = ENGINES
                .iter()
                .flat_map(|engine| engine.schemes.iter().map(|s| format!("{s}://")))
                .collect();
            format!("unknown database URL scheme {scheme:?}: use {}", known.join(", "))
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schemes_name_their_engines() {
        assert_eq!(of_url("postgres://h/db").unwrap().id, "postgres");
        assert_eq!(of_url("postgresql://h/db").unwrap().id, "postgres");
        assert_eq!(of_url("mysql://h/db").unwrap().id, "mysql");
        assert_eq!(of_url("mariadb://h/db").unwrap().id, "mysql");
        let error = of_url("oracle://h/db").unwrap_err();
        assert!(error.contains("\"oracle\""), "{error}");
        assert!(error.contains("postgres://") && error.contains("mariadb://"), "{error}");
    }
}
