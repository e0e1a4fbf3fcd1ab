//! The target boundary: the database a task writes into, whatever engine serves it (named by
//! the URL's scheme, as a source is; see [`crate::engines`]). Each engine implements
//! [`Target`] in its own folder; the worker's apply transaction is the worker's own (its
//! `apply/` folder), keyed by the same engine.

use std::any::Any;
use std::fmt::Debug;
use std::ops::Deref;
use std::sync::Arc;

use crate::engines::Engine;
use crate::pg::{ColumnTypes, TableName, TableSql};
use crate::reconcile_reads::SideReads;

/// One engine's target.
#[async_trait::async_trait]
pub trait Target: Send + Sync + Debug {
    fn engine(&self) -> &'static Engine;

    /// For the engine's own code (its coordinator and worker folders) to reach its pool.
    fn as_any(&self) -> &dyn Any;

    /// The table's column types where the engine takes binary batches (PostgreSQL).
    async fn binary_column_types(&self, table: &TableName) -> Result<Option<ColumnTypes>, sqlx::Error>;

    /// The task's live epoch in the target (its epoch fence); `None` before the first.
    /// A newer epoch's batches and reads go to its own table (see [`TableSql::routed`]).
    async fn live_epoch(&self, task: &str) -> Result<Option<u64>, sqlx::Error>;

    /// What reconciliation reads of this side.
    fn reconcile_reads<'a>(&'a self, sql: &'a TableSql) -> Box<dyn SideReads + 'a>;

    async fn close(&self);
}

/// A connection pool to a target, of whichever engine.
#[derive(Debug, Clone)]
pub struct TargetPool(Arc<dyn Target>);

impl TargetPool {
    pub fn new(target: impl Target + 'static) -> TargetPool {
        TargetPool(Arc::new(target))
    }

    /// A lazily connecting pool to the target at `url`, of the engine its scheme names; no
    /// session holds a lock or an idle transaction longer than `guard`.
    pub fn connect_lazy(
        url: &str,
        application_name: &str,
        max_connections: u32,
        guard: std::time::Duration,
    ) -> Result<TargetPool, String> {
        let engine = crate::engines::of_url(url)?;
        let connect = engine
            .target
            .ok_or_else(|| format!("{} is a source only: it cannot be a target", engine.name))?;
        connect(url, application_name, max_connections, guard)
    }

    /// The engine's own target type, for that engine's code.
    pub fn downcast<T: 'static>(&self) -> Option<&T> {
        self.0.as_any().downcast_ref()
    }
}

impl Deref for TargetPool {
    type Target = dyn Target;

    fn deref(&self) -> &(dyn Target + 'static) {
        &*self.0
    }
}
