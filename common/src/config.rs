//! `tidemark.toml`: the coordinator section and one `[[tasks]]` table per synced table.
//!
//! Unknown keys are errors that name the key; `${ENV_VAR}` is replaced by the variable's value
//! before parsing so that secrets need not sit in the file.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use serde::Deserialize;

use crate::duration::serde_human;

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    // Not `source`: that would make the I/O error the cause too, printed twice in a chain.
    #[error("cannot read config file {path}: {error}")]
    Read { path: String, error: std::io::Error },
    #[error("config error in {path}: environment variable {name} (line {line}) is not set")]
    MissingEnv { path: String, name: String, line: usize },
    #[error("config error in {path} at line {line}: {message}")]
    Parse { path: String, line: usize, message: String },
    #[error("config error in {path}: {message}")]
    Invalid { path: String, message: String },
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    pub coordinator: CoordinatorConfig,
    #[serde(default)]
    pub tasks: Vec<TaskConfig>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CoordinatorConfig {
    /// gRPC address for workers and the admin CLI.
    pub listen: String,
    /// Where worker leases and shard ownership live: `etcd` (default: any number of
    /// coordinator replicas, one elected leader) or `in_process` (this coordinator's memory:
    /// one coordinator only, no etcd; what `tidemark sync` runs).
    #[serde(default)]
    pub leases: LeaseStore,
    /// Required with `leases = "etcd"`.
    #[serde(default)]
    pub etcd_endpoints: Vec<String>,
    /// Key prefix under which leases and ownership live in etcd.
    #[serde(default = "default_etcd_prefix")]
    pub etcd_prefix: String,
    /// Where the control state lives: a PostgreSQL URL (the control database, created if it
    /// does not exist), or `sqlite://PATH` for the embedded store, a file this coordinator
    /// alone uses (with `leases = "in_process"`; what `tidemark sync` runs by default).
    pub control_db: String,
    /// The schema of the control database that holds Tidemark's control tables (created if
    /// it does not exist); default: the role's search path (`public`). Lets the control state
    /// share a database, e.g. the target's.
    #[serde(default)]
    pub control_schema: Option<String>,
    /// object_store URL of the staging store, e.g. `file:///var/tmp/tidemark-staging`.
    pub staging: String,
    #[serde(default = "default_lease_ttl", with = "serde_human")]
    pub lease_ttl: Duration,
    /// Staged objects of committed or abandoned batches, and objects no registered batch
    /// references (torn writes, crashed owners), are deleted once older than this.
    #[serde(default = "default_staging_retention", with = "serde_human")]
    pub staging_retention: Duration,
    /// The control database's history is deleted once older than this: registry rows of
    /// committed and abandoned batches, checkpoint history, late-row records. Staged batches
    /// and every shard's checkpoint are never deleted. Without it, each batch adds about
    /// 1.5 KiB that nothing removes.
    #[serde(default = "default_history_retention", with = "serde_human")]
    pub history_retention: Duration,
    /// The address other replicas, workers and the CLI reach this replica at (shown as the
    /// leader's address); default `http://<listen>` (`https://` with `tls`).
    #[serde(default)]
    pub advertise: Option<String>,
    /// Even out shards per worker by graceful moves.
    #[serde(default)]
    pub balance: bool,
    /// Serve Prometheus metrics on this address (`GET /metrics`); off when unset.
    #[serde(default)]
    pub metrics_listen: Option<SocketAddr>,
    /// OTLP/gRPC collector for traces; default: `OTEL_EXPORTER_OTLP_ENDPOINT`; off when unset.
    #[serde(default)]
    pub otlp_endpoint: Option<String>,
    /// Serve gRPC over TLS (`{ cert, key, client_ca }`, see `tls`); plaintext when unset.
    #[serde(default)]
    pub tls: Option<crate::tls::ServerTls>,
    /// Reach etcd over TLS (`{ ca, cert, key }`) at `https://` endpoints.
    #[serde(default)]
    pub etcd_tls: Option<crate::tls::ClientTls>,
}

/// Where worker leases and shard ownership live (`coordinator.leases`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LeaseStore {
    #[default]
    Etcd,
    InProcess,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TaskConfig {
    pub name: String,
    pub source: String,
    pub source_table: String,
    pub target: String,
    pub target_table: String,
    pub key: Vec<String>,
    /// `upsert` (default): snapshot, then changes by `(cursor_column, key)`.
    /// `append`: rows are only ever inserted; pages by key alone.
    #[serde(default)]
    pub mode: TaskMode,
    /// NOT NULL timestamp column; required in `upsert` mode, absent in `append` mode.
    #[serde(default)]
    pub cursor_column: Option<String>,
    /// The zone a `timestamp without time zone` cursor's values are written in (e.g.
    /// `Europe/Berlin`); default: the source's TimeZone for the task's role and database.
    #[serde(default)]
    pub cursor_time_zone: Option<String>,
    /// Which value orders versions of one row in the target (see [`VersionConfig`]).
    #[serde(default)]
    pub version: VersionConfig,
    #[serde(default = "default_shards")]
    pub shards: u32,
    #[serde(default = "default_page_size")]
    pub page_size: u32,
    #[serde(default = "default_safety_delay", with = "serde_human")]
    pub safety_delay: Duration,
    #[serde(default = "default_poll_interval", with = "serde_human")]
    pub poll_interval: Duration,
    /// Every incremental cycle re-reads this much before the committed watermark, to catch
    /// rows that became visible late (clock skew, precision, long transactions when the
    /// open-transaction bound is off).
    #[serde(default = "default_overlap", with = "serde_human")]
    pub overlap: Duration,
    /// Hold the read window below the start of the oldest transaction still open on the
    /// source (PostgreSQL `pg_stat_activity`; needs `pg_read_all_stats`, e.g. `pg_monitor`).
    #[serde(default = "default_true")]
    pub open_transaction_bound: bool,
    /// How far the source clock may step back before the task pauses with
    /// `clock moved backwards`. At most `overlap` (the default), so that a step back within
    /// tolerance is re-read by the overlap.
    #[serde(default, with = "serde_human_option")]
    pub clock_tolerance: Option<Duration>,
    /// How deletions in the source reach the target (see [`DeletePolicy`]); none by default.
    #[serde(default)]
    pub delete_policy: Option<DeletePolicy>,
    /// What a deletion does in the target: `hard` (default) removes the row, `soft` keeps it
    /// with `_tidemark_deleted = true`. Either way the tombstone's version is kept.
    #[serde(default)]
    pub target_deletes: TargetDeletes,
    /// Run a reconciliation this often (none by default).
    #[serde(default, with = "serde_human_option")]
    pub reconcile_every: Option<Duration>,
    /// Scheduled reconciliations compare rows whose cursor time lies within this window of
    /// now; unset: the whole table.
    #[serde(default, with = "serde_human_option")]
    pub reconcile_window: Option<Duration>,
    /// What reconciliation compares per key: `content` (default: the version and every
    /// column, so drift at an equal version is found) or `versions` (cheaper).
    #[serde(default)]
    pub reconcile_compare: ReconcileCompare,
    /// What a change of the source table's columns does: `pause` (default: `schema changed
    /// … reinitialization required`) or `evolve`: a column added without a value for the
    /// rows already there (nullable, no default, not generated) is added to the target and
    /// the live epoch, and the rows changed since the change are read again; every other
    /// change still pauses by name. Upsert mode only.
    #[serde(default)]
    pub schema_changes: SchemaChanges,
    /// When a new epoch (`tasks reinit`), built beside the live table and validated, becomes
    /// the live one: `auto` (default) at once after its validation, `manual` on `tasks
    /// switch`.
    #[serde(default)]
    pub switch: SwitchMode,
    /// How long a replaced epoch's table is kept after a switch, for `tasks rollback`; then it
    /// is dropped.
    #[serde(default = "default_epoch_retention", with = "serde_human")]
    pub epoch_retention: Duration,
    /// Clauses of the source contract the operator relies on; the coordinator refuses to
    /// start a task whose configuration cannot deliver one (see `contract`).
    #[serde(default)]
    pub contract: ContractClaims,
    /// A SQL predicate on the source rows (`append` and `accumulate` modes), e.g. `type = 5`.
    #[serde(default)]
    pub filter: Option<String>,
    /// `accumulate` mode: explode a JSON path of a source column into elements,
    /// e.g. `{ explode = "$.apps[*].name", from = "event", as = "app_name" }`.
    #[serde(default)]
    pub transform: Option<crate::transform::Explode>,
    /// `accumulate` mode: the target columns that key the running totals.
    #[serde(default)]
    pub group_by: Vec<String>,
    /// `accumulate` mode: target column = `count`, `sum(col)`, `min(col)` or `max(col)`.
    #[serde(default)]
    pub aggregates: std::collections::BTreeMap<String, String>,
    /// A dead letter whose retries failed this many times becomes FAILED.
    #[serde(default = "default_max_retries")]
    pub max_retries: u32,
    /// When the target rejects more than this share of a batch's rows (a batch of at least
    /// [`crate::dead_letters::MIN_ROWS_FOR_RATIO`] rows), the rows are not dead-lettered: that is a
    /// target problem (a new constraint, a narrowed column), and the task pauses with
    /// `target rejects rows`. 1.0 dead-letters whatever the target rejects.
    #[serde(default = "default_max_dead_letter_ratio")]
    pub max_dead_letter_ratio: f64,
    /// A shard whose runs end this many times in a row with the same error that retrying
    /// cannot fix pauses its task with that error (0: retry forever).
    #[serde(default = "default_max_batch_failures")]
    pub max_batch_failures: u32,
}

/// `delete_policy = { kind = "soft", column = "deleted_at" }`: the source marks deleted rows
/// (a timestamp that is set, or a boolean that is true) and bumps the cursor column.
/// `{ kind = "tombstone_table", retention = "7d" }`: a trigger-fed delete log on the source
/// (`source install`), purged after the retention.
/// `{ kind = "reconcile" }`: the source records nothing; reconciliation finds deletions.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum DeletePolicy {
    Soft {
        column: String,
    },
    TombstoneTable {
        #[serde(default = "default_tombstone_retention", with = "serde_human")]
        retention: Duration,
    },
    Reconcile {},
}

/// What a reconciliation compares per key (see `TaskConfig::reconcile_compare`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ReconcileCompare {
    #[default]
    Content,
    Versions,
}

impl ReconcileCompare {
    pub fn as_str(&self) -> &'static str {
        match self {
            ReconcileCompare::Content => "content",
            ReconcileCompare::Versions => "versions",
        }
    }

    pub fn parse(text: &str) -> Result<ReconcileCompare, String> {
        match text {
            "content" => Ok(ReconcileCompare::Content),
            "versions" => Ok(ReconcileCompare::Versions),
            other => Err(format!("compare {other:?} is not \"content\" or \"versions\"")),
        }
    }
}

/// When a validated epoch becomes live (see `TaskConfig::switch`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SwitchMode {
    #[default]
    Auto,
    Manual,
}

fn default_epoch_retention() -> Duration {
    Duration::from_secs(24 * 3600)
}

/// What a change of the source's columns does (see `TaskConfig::schema_changes`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SchemaChanges {
    #[default]
    Pause,
    Evolve,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TargetDeletes {
    #[default]
    Hard,
    Soft,
}

/// What the operator claims of the source contract (seed 001's five clauses). Unset claims
/// are not checked; the derived contract is shown by `status` either way.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ContractClaims {
    /// Any of `inserts`, `updates`, `deletes`.
    #[serde(default)]
    pub coverage: Vec<String>,
    /// How long a stopped consumer may stay away and still resume from its checkpoint.
    #[serde(default, with = "serde_human_option")]
    pub retention: Option<Duration>,
    /// `page` (each page is one consistent read) or `table` (the whole table read from one
    /// snapshot, which Tidemark does not provide).
    #[serde(default)]
    pub consistency: Option<String>,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TaskMode {
    #[default]
    Upsert,
    Append,
    /// Append-only reading (like `append`) whose rows are transformed and folded into running
    /// totals in the target (`transform`, `group_by`, `aggregates`).
    Accumulate,
}

impl TaskMode {
    pub fn as_str(&self) -> &'static str {
        match self {
            TaskMode::Upsert => "upsert",
            TaskMode::Append => "append",
            TaskMode::Accumulate => "accumulate",
        }
    }

    /// Rows are only ever inserted and read by key alone (append and accumulate).
    pub fn appends(&self) -> bool {
        matches!(self, TaskMode::Append | TaskMode::Accumulate)
    }
}

impl TaskConfig {
    /// The accumulate spec of an `accumulate` task (validated with the config).
    pub fn accumulate_spec(&self) -> Result<Option<crate::transform::AccumulateSpec>, String> {
        if self.mode != TaskMode::Accumulate {
            return Ok(None);
        }
        let aggregates = self
            .aggregates
            .iter()
            .map(|(name, text)| crate::transform::Aggregate::parse(name, text))
            .collect::<Result<Vec<_>, String>>()?;
        Ok(Some(crate::transform::AccumulateSpec {
            explode: self.transform.clone(),
            group_by: self.group_by.clone(),
            aggregates,
        }))
    }
}

/// `version = "cursor"` (default): the cursor time in microseconds, the weakest choice: a
/// row rewritten with an older cursor time loses to the value already in the target.
/// `version = { column = "row_version" }`: a monotone integer business version.
/// `version = "trigger"`: the `tidemark_row_version` column that
/// `tidemark-coordinator source install` adds, fed by a global sequence on every insert
/// and update, so it is monotone per key across clock rollback and delete/re-insert.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum VersionConfig {
    #[default]
    Cursor,
    Column(String),
    Trigger,
}

/// The column the `trigger` version mode adds to a source table.
pub const TRIGGER_VERSION_COLUMN: &str = "tidemark_row_version";

impl<'de> Deserialize<'de> for VersionConfig {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(deny_unknown_fields)]
        struct ColumnOnly {
            column: String,
        }
        let value = toml::Value::deserialize(deserializer)?;
        match value {
            toml::Value::String(name) if name == "cursor" => Ok(VersionConfig::Cursor),
            toml::Value::String(name) if name == "trigger" => Ok(VersionConfig::Trigger),
            toml::Value::Table(_) => {
                let ColumnOnly { column } = value.try_into().map_err(serde::de::Error::custom)?;
                Ok(VersionConfig::Column(column))
            }
            other => Err(serde::de::Error::custom(format!(
                "version {other} is not one of \"cursor\", \"trigger\" or {{ column = \"...\" }}"
            ))),
        }
    }
}

impl TaskConfig {
    /// The effective clock tolerance: as configured, else the overlap.
    pub fn clock_tolerance(&self) -> Duration {
        self.clock_tolerance.unwrap_or(self.overlap)
    }
}

fn default_etcd_prefix() -> String {
    "/tidemark".to_string()
}
fn default_max_batch_failures() -> u32 {
    5
}
fn default_lease_ttl() -> Duration {
    Duration::from_secs(10)
}
fn default_staging_retention() -> Duration {
    Duration::from_secs(3600)
}
fn default_history_retention() -> Duration {
    Duration::from_secs(7 * 86_400)
}
fn default_shards() -> u32 {
    8
}
fn default_max_dead_letter_ratio() -> f64 {
    0.5
}
fn default_page_size() -> u32 {
    5000
}
fn default_safety_delay() -> Duration {
    Duration::from_secs(5)
}
fn default_poll_interval() -> Duration {
    Duration::from_secs(1)
}
fn default_overlap() -> Duration {
    Duration::from_secs(10)
}
fn default_tombstone_retention() -> Duration {
    Duration::from_secs(7 * 86_400)
}
fn default_max_retries() -> u32 {
    3
}

fn default_true() -> bool {
    true
}

mod serde_human_option {
    use serde::{Deserialize, Deserializer};
    use std::time::Duration;

    pub fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Option<Duration>, D::Error> {
        let text = Option::<String>::deserialize(deserializer)?;
        text.map(|t| crate::duration::parse_duration(&t).map_err(serde::de::Error::custom))
            .transpose()
    }
}

impl Config {
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let display = path.display().to_string();
        let raw = std::fs::read_to_string(path).map_err(|error| ConfigError::Read {
            path: display.clone(),
            error,
        })?;
        Self::parse(&raw, &display, |name| std::env::var(name).ok())
    }

    /// Parses config text; `lookup_env` resolves `${NAME}` references.
    pub fn parse(raw: &str, path: &str, lookup_env: impl Fn(&str) -> Option<String>) -> Result<Config, ConfigError> {
        let text = interpolate_env(raw, path, lookup_env)?;
        let mut config: Config = toml::from_str(&text).map_err(|err| {
            let line = err
                .span()
                .map(|span| text[..span.start.min(text.len())].matches('\n').count() + 1)
                .unwrap_or(0);
            ConfigError::Parse {
                path: path.to_string(),
                line,
                message: err.message().replace('\n', " "),
            }
        })?;
        config.resolve_source_tables(path)?;
        config.validate(path)?;
        Ok(config)
    }

    /// A MySQL table is `database.table`; a bare `table` is in the URL's database (see
    /// [`crate::engines::Engine::url_database`]).
    fn resolve_source_tables(&mut self, path: &str) -> Result<(), ConfigError> {
        let url_database = |url: &str| crate::engines::of_url(url).ok().and_then(|engine| engine.url_database);
        for task in &mut self.tasks {
            let Some(url_database) = url_database(&task.target) else {
                continue;
            };
            if task.target_table.contains('.') {
                continue;
            }
            let database = url_database(&task.target).ok_or_else(|| ConfigError::Invalid {
                path: path.to_string(),
                message: format!(
                    "task {}: target_table {:?} names no database and the target URL has none: write `database.table`",
                    task.name, task.target_table
                ),
            })?;
            task.target_table = format!("{database}.{}", task.target_table);
        }
        for task in &mut self.tasks {
            let Some(url_database) = url_database(&task.source) else {
                continue;
            };
            if task.source_table.contains('.') {
                continue;
            }
            let database = url_database(&task.source).ok_or_else(|| ConfigError::Invalid {
                path: path.to_string(),
                message: format!(
                    "task {}: source_table {:?} names no database and the source URL has none: write `database.table`",
                    task.name, task.source_table
                ),
            })?;
            task.source_table = format!("{database}.{}", task.source_table);
        }
        for task in &mut self.tasks {
            // What `tasks reinit` and a bare `reconcile` compare: versions, the only
            // comparison a MySQL side offers (a configured reconciliation must say so).
            let reconciles =
                task.reconcile_every.is_some() || matches!(task.delete_policy, Some(DeletePolicy::Reconcile {}));
            if !hash_content(task) && !reconciles {
                task.reconcile_compare = ReconcileCompare::Versions;
            }
        }
        Ok(())
    }

    fn validate(&self, path: &str) -> Result<(), ConfigError> {
        let invalid = |message: String| ConfigError::Invalid {
            path: path.to_string(),
            message,
        };
        self.coordinator.listen.parse::<SocketAddr>().map_err(|_| {
            invalid(format!(
                "coordinator.listen {:?} is not HOST:PORT",
                self.coordinator.listen
            ))
        })?;
        match self.coordinator.leases {
            LeaseStore::Etcd if self.coordinator.etcd_endpoints.is_empty() => {
                return Err(invalid(
                    "coordinator.etcd_endpoints is empty (leases = \"in_process\" runs one coordinator without etcd)"
                        .into(),
                ));
            }
            LeaseStore::InProcess if !self.coordinator.etcd_endpoints.is_empty() => {
                return Err(invalid(
                    "coordinator.etcd_endpoints goes with leases = \"etcd\", not \"in_process\"".into(),
                ));
            }
            _ => {}
        }
        if self.coordinator.control_db.starts_with("sqlite:") {
            if self.coordinator.leases == LeaseStore::Etcd {
                return Err(invalid(
                    "coordinator.control_db is sqlite://, a file one coordinator uses: it goes with \
                     leases = \"in_process\" (replicas with etcd leases share a PostgreSQL control_db)"
                        .into(),
                ));
            }
            if self.coordinator.control_schema.is_some() {
                return Err(invalid(
                    "coordinator.control_schema applies to a PostgreSQL control_db, not to sqlite://".into(),
                ));
            }
        }
        if let Some(schema) = &self.coordinator.control_schema {
            let valid = !schema.is_empty()
                && schema.len() <= 63
                && schema.starts_with(|c: char| c.is_ascii_lowercase() || c == '_')
                && schema
                    .chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
            if !valid {
                return Err(invalid(format!(
                    "coordinator.control_schema {schema:?} is not a lower-case identifier (a-z, 0-9, _)"
                )));
            }
        }
        let https = self
            .coordinator
            .etcd_endpoints
            .iter()
            .filter(|e| e.starts_with("https://"))
            .count();
        if https > 0 && https < self.coordinator.etcd_endpoints.len() {
            return Err(invalid(
                "coordinator.etcd_endpoints mixes https:// and plaintext endpoints".into(),
            ));
        }
        if (https > 0) != self.coordinator.etcd_tls.is_some() {
            return Err(invalid(
                "coordinator.etcd_tls goes with https:// etcd_endpoints: set both or neither".into(),
            ));
        }
        if self.coordinator.lease_ttl < Duration::from_secs(2) {
            return Err(invalid("coordinator.lease_ttl must be at least 2s".into()));
        }
        let mut names = HashSet::new();
        for task in &self.tasks {
            let name = &task.name;
            if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-') {
                return Err(invalid(format!(
                    "task name {name:?} must be non-empty and use only letters, digits, '_' and '-'"
                )));
            }
            if !names.insert(name.clone()) {
                return Err(invalid(format!("task {name:?} is defined twice")));
            }
            if task.key.is_empty() {
                return Err(invalid(format!("task {name}: key must name at least one column")));
            }
            if task.shards == 0 || task.shards > 4096 {
                return Err(invalid(format!("task {name}: shards must be between 1 and 4096")));
            }
            if !(task.max_dead_letter_ratio > 0.0 && task.max_dead_letter_ratio <= 1.0) {
                return Err(invalid(format!(
                    "task {name}: max_dead_letter_ratio must be above 0 and at most 1, not {}",
                    task.max_dead_letter_ratio
                )));
            }
            // Across engines, content is compared where every column's type has a portable
            // hash: the coordinator checks the table's columns at start.
            crate::engines::of_url(&task.source).map_err(|e| invalid(format!("task {name}: source: {e}")))?;
            crate::engines::of_url(&task.target).map_err(|e| invalid(format!("task {name}: target: {e}")))?;
            if task.page_size == 0 {
                return Err(invalid(format!("task {name}: page_size must be at least 1")));
            }
            if task.schema_changes == SchemaChanges::Evolve && task.mode != TaskMode::Upsert {
                return Err(invalid(format!(
                    "task {name}: schema_changes = \"evolve\" needs mode = \"upsert\" ({} reads each row once, so \
                     rows read before a column was added would never be read again with it)",
                    task.mode.as_str()
                )));
            }
            if task.poll_interval.is_zero() {
                return Err(invalid(format!("task {name}: poll_interval must be positive")));
            }
            match (task.mode, &task.cursor_column) {
                (TaskMode::Upsert, None) => {
                    return Err(invalid(format!(
                        "task {name}: cursor_column is required in upsert mode"
                    )));
                }
                (TaskMode::Append | TaskMode::Accumulate, Some(_)) => {
                    return Err(invalid(format!(
                        "task {name}: {} mode pages by key alone; remove cursor_column",
                        task.mode.as_str()
                    )));
                }
                (TaskMode::Append | TaskMode::Accumulate, _) if task.key.len() != 1 => {
                    return Err(invalid(format!(
                        "task {name}: {} mode needs a single integer key column",
                        task.mode.as_str()
                    )));
                }
                (TaskMode::Append | TaskMode::Accumulate, _) if task.version != VersionConfig::Cursor => {
                    return Err(invalid(format!(
                        "task {name}: {} mode versions rows by key; remove version",
                        task.mode.as_str()
                    )));
                }
                _ => {}
            }
            if let Some(DeletePolicy::TombstoneTable { retention }) = &task.delete_policy
                && *retention <= task.overlap + task.safety_delay
            {
                return Err(invalid(format!(
                    "task {name}: delete_policy.retention must exceed overlap + safety_delay, or deletes are purged before they are read"
                )));
            }
            if task.mode.appends() && (task.delete_policy.is_some() || task.reconcile_every.is_some()) {
                return Err(invalid(format!(
                    "task {name}: {} mode reads inserts only; remove delete_policy and reconcile_every",
                    task.mode.as_str()
                )));
            }
            if task.filter.is_some() && !task.mode.appends() {
                return Err(invalid(format!(
                    "task {name}: filter is for append and accumulate modes (an upsert target could not \
                     learn that a row left the filter)"
                )));
            }
            let accumulates = task.mode == TaskMode::Accumulate;
            if !accumulates && (task.transform.is_some() || !task.group_by.is_empty() || !task.aggregates.is_empty()) {
                return Err(invalid(format!(
                    "task {name}: transform, group_by and aggregates need mode = \"accumulate\""
                )));
            }
            if accumulates {
                if task.group_by.is_empty() || task.aggregates.is_empty() {
                    return Err(invalid(format!(
                        "task {name}: accumulate mode needs group_by and aggregates"
                    )));
                }
                let spec = task
                    .accumulate_spec()
                    .map_err(|e| invalid(format!("task {name}: {e}")))?
                    .expect("accumulate mode");
                if let Some(explode) = &spec.explode {
                    crate::transform::JsonPath::parse(&explode.path)
                        .map_err(|e| invalid(format!("task {name}: transform.explode: {e}")))?;
                }
                if let Some(clash) = spec.aggregates.iter().find(|a| spec.group_by.contains(&a.name)) {
                    return Err(invalid(format!(
                        "task {name}: aggregate {:?} is also a group_by column",
                        clash.name
                    )));
                }
            }
            if task.reconcile_every.is_some_and(|every| every.is_zero()) {
                return Err(invalid(format!("task {name}: reconcile_every must be positive")));
            }
            crate::contract::check_claims(task).map_err(|e| invalid(format!("task {name}: {e}")))?;
            if task.clock_tolerance() > task.overlap {
                return Err(invalid(format!(
                    "task {name}: clock_tolerance must not exceed overlap, or a clock step back within tolerance could skip rows"
                )));
            }
        }
        Ok(())
    }
}

/// Replaces `${NAME}` with the variable's value. Comment lines are left alone.
fn interpolate_env(raw: &str, path: &str, lookup_env: impl Fn(&str) -> Option<String>) -> Result<String, ConfigError> {
    let mut out = String::with_capacity(raw.len());
    for (index, line) in raw.split_inclusive('\n').enumerate() {
        if line.trim_start().starts_with('#') {
            out.push_str(line);
            continue;
        }
        let mut rest = line;
        while let Some(start) = rest.find("${") {
            out.push_str(&rest[..start]);
            let after = &rest[start + 2..];
            let Some(end) = after.find('}') else {
                out.push_str(&rest[start..]);
                rest = "";
                break;
            };
            let name = &after[..end];
            let value = lookup_env(name).ok_or_else(|| ConfigError::MissingEnv {
                path: path.to_string(),
                name: name.to_string(),
                line: index + 1,
            })?;
            out.push_str(&value);
            rest = &after[end + 1..];
        }
        out.push_str(rest);
    }
    Ok(out)
}

/// Whether both of a task's engines hash every column's content alike (see
/// [`crate::engines::Engine::hashes_content`]); a URL of no known engine counts as yes (it is
/// refused by name in validation).
pub fn hash_content(task: &TaskConfig) -> bool {
    [&task.source, &task.target]
        .iter()
        .all(|url| crate::engines::of_url(url).map_or(true, |engine| engine.hashes_content))
}

#[cfg(test)]
mod tests {
    use super::*;

    const MINIMAL: &str = r#"
[coordinator]
listen = "127.0.0.1:7400"
etcd_endpoints = ["http://127.0.0.1:2379"]
control_db = "postgres://postgres:${PGPASS}@127.0.0.1:5432/tidemark"
staging = "file:///var/tmp/tidemark-staging"

[[tasks]]
name = "items"
source = "postgres://postgres@127.0.0.1:5432/app"
source_table = "public.items"
target = "postgres://postgres@127.0.0.1:5432/warehouse"
target_table = "public.items"
key = ["id"]
cursor_column = "updated_at"
"#;

    fn env(name: &str) -> Option<String> {
        (name == "PGPASS").then(|| "hunter2".to_string())
    }

    #[test]
    fn in_process_leases_need_no_etcd_and_refuse_its_endpoints() {
        let etcdless = MINIMAL.replace("etcd_endpoints = [\"http://127.0.0.1:2379\"]", "");
        let error = Config::parse(&etcdless, "t.toml", env).unwrap_err().to_string();
        assert!(error.contains("coordinator.etcd_endpoints is empty"), "{error}");
        let local = etcdless.replace(
            "[coordinator]",
            "[coordinator]\nleases = \"in_process\"\ncontrol_schema = \"tidemark_items\"",
        );
        let config = Config::parse(&local, "t.toml", env).unwrap();
        assert_eq!(config.coordinator.leases, LeaseStore::InProcess);
        assert_eq!(config.coordinator.control_schema.as_deref(), Some("tidemark_items"));
        let both = MINIMAL.replace("[coordinator]", "[coordinator]\nleases = \"in_process\"");
        let error = Config::parse(&both, "t.toml", env).unwrap_err().to_string();
        assert!(error.contains("etcd_endpoints goes with leases = \"etcd\""), "{error}");
        let bad_schema = local.replace("tidemark_items", "Tidemark-Items");
        let error = Config::parse(&bad_schema, "t.toml", env).unwrap_err().to_string();
        assert!(
            error.contains("control_schema \"Tidemark-Items\" is not a lower-case identifier"),
            "{error}"
        );
    }

    #[test]
    fn a_sqlite_control_store_serves_one_coordinator() {
        let etcdless = MINIMAL.replace("etcd_endpoints = [\"http://127.0.0.1:2379\"]", "");
        let sqlite = etcdless.replace(
            "control_db = \"postgres://postgres:${PGPASS}@127.0.0.1:5432/tidemark\"",
            "control_db = \"sqlite://.tidemark/control.db\"\nleases = \"in_process\"",
        );
        let config = Config::parse(&sqlite, "t.toml", env).unwrap();
        assert_eq!(config.coordinator.control_db, "sqlite://.tidemark/control.db");
        let with_etcd = MINIMAL.replace(
            "control_db = \"postgres://postgres:${PGPASS}@127.0.0.1:5432/tidemark\"",
            "control_db = \"sqlite://.tidemark/control.db\"",
        );
        let error = Config::parse(&with_etcd, "t.toml", env).unwrap_err().to_string();
        assert!(
            error.contains("control_db is sqlite://, a file one coordinator uses"),
            "{error}"
        );
        let with_schema = sqlite.replace("[coordinator]", "[coordinator]\ncontrol_schema = \"tidemark_items\"");
        let error = Config::parse(&with_schema, "t.toml", env).unwrap_err().to_string();
        assert!(
            error.contains("control_schema applies to a PostgreSQL control_db"),
            "{error}"
        );
    }

    #[test]
    fn defaults_and_env_interpolation() {
        let config = Config::parse(MINIMAL, "t.toml", env).unwrap();
        assert_eq!(
            config.coordinator.control_db,
            "postgres://postgres:hunter2@127.0.0.1:5432/tidemark"
        );
        assert_eq!(config.coordinator.lease_ttl, Duration::from_secs(10));
        let task = &config.tasks[0];
        assert_eq!((task.shards, task.page_size), (8, 5000));
        assert_eq!(task.safety_delay, Duration::from_secs(5));
        assert_eq!(
            (task.mode, task.overlap, task.open_transaction_bound),
            (TaskMode::Upsert, Duration::from_secs(10), true)
        );
        assert_eq!(task.clock_tolerance(), task.overlap);
        assert_eq!(task.version, VersionConfig::Cursor);
    }

    #[test]
    fn epochs_switch_automatically_and_are_retained_a_day() {
        let config = Config::parse(MINIMAL, "t.toml", env).unwrap();
        assert_eq!(config.tasks[0].switch, SwitchMode::Auto);
        assert_eq!(config.tasks[0].epoch_retention, Duration::from_secs(86_400));
        let text = MINIMAL.replace(
            "cursor_column = \"updated_at\"\n",
            "cursor_column = \"updated_at\"\nswitch = \"manual\"\nepoch_retention = \"2h\"\n",
        );
        let config = Config::parse(&text, "t.toml", env).unwrap();
        assert_eq!(config.tasks[0].switch, SwitchMode::Manual);
        assert_eq!(config.tasks[0].epoch_retention, Duration::from_secs(7_200));
        let text = MINIMAL.replace(
            "cursor_column = \"updated_at\"\n",
            "cursor_column = \"updated_at\"\nswitch = \"now\"\n",
        );
        let error = Config::parse(&text, "t.toml", env).unwrap_err().to_string();
        assert!(
            error.contains("unknown variant `now`, expected `auto` or `manual`"),
            "{error}"
        );
    }

    #[test]
    fn schema_changes_evolve_only_in_upsert_mode() {
        let with = |lines: &str| {
            let text = MINIMAL.replace("cursor_column = \"updated_at\"\n", &format!("{lines}\n"));
            Config::parse(&text, "t.toml", env)
        };
        let config = Config::parse(MINIMAL, "t.toml", env).unwrap();
        assert_eq!(config.tasks[0].schema_changes, SchemaChanges::Pause);
        let config = with("cursor_column = \"updated_at\"\nschema_changes = \"evolve\"").unwrap();
        assert_eq!(config.tasks[0].schema_changes, SchemaChanges::Evolve);
        let error = with("mode = \"append\"\nschema_changes = \"evolve\"")
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("schema_changes = \"evolve\" needs mode = \"upsert\""),
            "{error}"
        );
        let error = with("cursor_column = \"updated_at\"\nschema_changes = \"adapt\"")
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("unknown variant `adapt`, expected `pause` or `evolve`"),
            "{error}"
        );
    }

    #[test]
    fn mysql_sources_resolve_their_database_and_refuse_what_they_lack() {
        let mysql = |source: &str, table: &str, extra: &str| {
            let text = MINIMAL
                .replace(
                    "source = \"postgres://postgres@127.0.0.1:5432/app\"",
                    &format!("source = \"{source}\""),
                )
                .replace(
                    "source_table = \"public.items\"",
                    &format!("source_table = \"{table}\"\n{extra}"),
                );
            Config::parse(&text, "t.toml", env)
        };
        let config = mysql("mariadb://reader@127.0.0.1:3306/shop", "items", "").unwrap();
        assert_eq!(config.tasks[0].source_table, "shop.items");
        let config = mysql("mysql://reader@127.0.0.1:3306/shop", "other.items", "").unwrap();
        assert_eq!(config.tasks[0].source_table, "other.items");
        let error = mysql("mysql://reader@127.0.0.1:3306", "items", "")
            .unwrap_err()
            .to_string();
        assert!(error.contains("write `database.table`"), "{error}");
        let config = mysql(
            "mysql://reader@127.0.0.1:3306/shop",
            "items",
            "delete_policy = { kind = \"tombstone_table\", retention = \"1h\" }",
        )
        .unwrap();
        assert!(matches!(
            config.tasks[0].delete_policy,
            Some(DeletePolicy::TombstoneTable { .. })
        ));
        let config = mysql("mysql://reader@127.0.0.1:3306/shop", "items", "version = \"trigger\"").unwrap();
        assert_eq!(config.tasks[0].version, VersionConfig::Trigger);
        // A configured reconciliation keeps comparing content; the coordinator checks at
        // start that every column has a portable hash.
        let config = mysql("mysql://r@h/shop", "items", "delete_policy = { kind = \"reconcile\" }").unwrap();
        assert_eq!(config.tasks[0].reconcile_compare, ReconcileCompare::Content);
        let config = mysql("mysql://r@h/shop", "items", "").unwrap();
        assert_eq!(config.tasks[0].reconcile_compare, ReconcileCompare::Versions);
        let config = mysql(
            "mysql://r@h/shop",
            "items",
            "delete_policy = { kind = \"reconcile\" }\nreconcile_compare = \"versions\"",
        )
        .unwrap();
        assert_eq!(config.tasks[0].reconcile_compare, ReconcileCompare::Versions);
        let error = mysql("sqlserver://x/y", "items", "").unwrap_err().to_string();
        assert!(error.contains("unknown database URL scheme \"sqlserver\""), "{error}");
    }

    #[test]
    fn tls_settings_and_their_rules() {
        let with = |endpoints: &str, lines: &str| {
            let text = MINIMAL
                .replace("[\"http://127.0.0.1:2379\"]", endpoints)
                .replace("staging = ", &format!("{lines}\nstaging = "));
            Config::parse(&text, "t.toml", env)
        };
        let config = with(
            "[\"https://10.0.0.1:2379\"]",
            "etcd_tls = { ca = \"ca.pem\", cert = \"c.pem\", key = \"c.key\" }\n\
             tls = { cert = \"s.pem\", key = \"s.key\", client_ca = \"ca.pem\" }",
        )
        .unwrap();
        let etcd = config.coordinator.etcd_tls.unwrap();
        assert_eq!(etcd.ca.unwrap().to_str(), Some("ca.pem"));
        assert_eq!(
            config.coordinator.tls.unwrap().client_ca.unwrap().to_str(),
            Some("ca.pem")
        );
        for (endpoints, lines, expected) in [
            (
                "[\"https://10.0.0.1:2379\"]",
                "",
                "etcd_tls goes with https:// etcd_endpoints",
            ),
            (
                "[\"http://10.0.0.1:2379\"]",
                "etcd_tls = { ca = \"ca.pem\" }",
                "etcd_tls goes with https://",
            ),
            (
                "[\"https://10.0.0.1:2379\", \"http://10.0.0.2:2379\"]",
                "etcd_tls = { ca = \"ca.pem\" }",
                "mixes https:// and plaintext",
            ),
            (
                "[\"https://10.0.0.1:2379\"]",
                "etcd_tls = { cafile = \"ca.pem\" }",
                "cafile",
            ),
            ("[\"http://10.0.0.1:2379\"]", "tls = { cert = \"s.pem\" }", "key"),
        ] {
            let err = with(endpoints, lines).unwrap_err().to_string();
            assert!(err.contains(expected), "{lines}: {err}");
        }
    }

    #[test]
    fn version_forms_and_mode_rules() {
        let with = |line: &str| {
            MINIMAL.replace(
                "cursor_column = \"updated_at\"",
                &format!("cursor_column = \"updated_at\"\n{line}"),
            )
        };
        let parse = |line: &str| Config::parse(&with(line), "t.toml", env);
        assert_eq!(
            parse("version = \"trigger\"").unwrap().tasks[0].version,
            VersionConfig::Trigger
        );
        assert_eq!(
            parse("version = { column = \"row_version\" }").unwrap().tasks[0].version,
            VersionConfig::Column("row_version".into())
        );
        assert!(
            parse("version = \"sometimes\"")
                .unwrap_err()
                .to_string()
                .contains("sometimes")
        );
        assert!(
            parse("version = { colum = \"x\" }")
                .unwrap_err()
                .to_string()
                .contains("colum")
        );
        let err = parse("mode = \"append\"").unwrap_err().to_string();
        assert!(err.contains("remove cursor_column"), "{err}");
        let err = parse("clock_tolerance = \"1m\"").unwrap_err().to_string();
        assert!(err.contains("clock_tolerance must not exceed overlap"), "{err}");
        assert_eq!(parse("").unwrap().tasks[0].max_dead_letter_ratio, 0.5);
        assert_eq!(
            parse("max_dead_letter_ratio = 1.0").unwrap().tasks[0].max_dead_letter_ratio,
            1.0
        );
        for bad in ["0.0", "1.5", "-0.1", "nan"] {
            let err = parse(&format!("max_dead_letter_ratio = {bad}"))
                .unwrap_err()
                .to_string();
            assert!(
                err.contains("max_dead_letter_ratio must be above 0 and at most 1"),
                "{bad}: {err}"
            );
        }
    }

    #[test]
    fn accumulate_mode_rules() {
        let accumulate = |lines: &str| {
            let text = MINIMAL.replace(
                "cursor_column = \"updated_at\"",
                &format!("mode = \"accumulate\"\n{lines}"),
            );
            Config::parse(&text, "t.toml", env)
        };
        let good = "transform = { explode = \"$.apps[*].name\", from = \"event\", as = \"app\" }\n\
                    group_by = [\"app\"]\naggregates = { n = \"count\", total = \"sum(amount)\" }\nfilter = \"type = 5\"";
        let config = accumulate(good).unwrap();
        let spec = config.tasks[0].accumulate_spec().unwrap().unwrap();
        assert_eq!(spec.aggregates.len(), 2);
        assert_eq!(spec.explode.unwrap().as_column, "app");
        let err = accumulate("group_by = [\"app\"]").unwrap_err().to_string();
        assert!(err.contains("accumulate mode needs group_by and aggregates"), "{err}");
        let err = accumulate(&good.replace("sum(amount)", "avg(amount)"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("aggregate \"total\" = \"avg(amount)\""), "{err}");
        let err = accumulate(&good.replace("$.apps", "apps")).unwrap_err().to_string();
        assert!(
            err.contains("transform.explode") && err.contains("must start with $"),
            "{err}"
        );
        let err = accumulate(&good.replace("as = ", "into = ")).unwrap_err().to_string();
        assert!(err.contains("unknown field `into`"), "{err}");
        let upsert = |line: &str| {
            let text = MINIMAL.replace(
                "cursor_column = \"updated_at\"",
                &format!("cursor_column = \"updated_at\"\n{line}"),
            );
            Config::parse(&text, "t.toml", env)
        };
        let err = upsert("filter = \"type = 5\"").unwrap_err().to_string();
        assert!(err.contains("filter is for append and accumulate modes"), "{err}");
        let err = upsert("group_by = [\"a\"]").unwrap_err().to_string();
        assert!(err.contains("need mode = \"accumulate\""), "{err}");
    }

    #[test]
    fn delete_policies_and_contract_claims() {
        let with = |lines: &str| {
            MINIMAL.replace(
                "cursor_column = \"updated_at\"",
                &format!("cursor_column = \"updated_at\"\n{lines}"),
            )
        };
        let parse = |lines: &str| Config::parse(&with(lines), "t.toml", env);
        let task =
            &parse("delete_policy = { kind = \"tombstone_table\", retention = \"2d\" }\ntarget_deletes = \"soft\"")
                .unwrap()
                .tasks[0];
        assert_eq!(
            task.delete_policy,
            Some(DeletePolicy::TombstoneTable {
                retention: Duration::from_secs(2 * 86_400)
            })
        );
        assert_eq!(task.target_deletes, TargetDeletes::Soft);
        let contract = crate::contract::derive(task);
        assert!(
            contract.coverage.deletes && contract.retention.starts_with("2d"),
            "{contract:?}"
        );

        // Claiming deletes without a delete policy names the clause.
        let err = parse("contract = { coverage = [\"inserts\", \"updates\", \"deletes\"] }")
            .unwrap_err()
            .to_string();
        assert!(err.contains("contract clause coverage claims deletes"), "{err}");
        assert!(parse("delete_policy = { kind = \"reconcile\" }\ncontract = { coverage = [\"deletes\"] }").is_ok());
        let err = parse(
            "delete_policy = { kind = \"tombstone_table\", retention = \"1d\" }\ncontract = { retention = \"7d\" }",
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("contract clause retention claims 7d"), "{err}");
        let err = parse("contract = { consistency = \"table\" }").unwrap_err().to_string();
        assert!(err.contains("contract clause consistency"), "{err}");
        let err = parse("delete_policy = { kind = \"tombstone_table\" }\nversion = { column = \"v\" }")
            .unwrap_err()
            .to_string();
        assert!(err.contains("contract clause coverage"), "{err}");
        let err = parse("delete_policy = { kind = \"erase\" }").unwrap_err().to_string();
        assert!(err.contains("erase"), "{err}");
        let err = parse("delete_policy = { kind = \"tombstone_table\", retention = \"5s\" }")
            .unwrap_err()
            .to_string();
        assert!(err.contains("retention must exceed"), "{err}");
    }

    #[test]
    fn deploy_config_parses() {
        let text = include_str!("../../deploy/tidemark.toml");
        let config = Config::parse(text, "deploy/tidemark.toml", |_| Some("secret".to_string())).unwrap();
        assert!(config.coordinator.metrics_listen.is_some() && config.coordinator.balance);
        assert_eq!(config.tasks.len(), 1);
    }

    #[test]
    fn unknown_key_is_named_with_its_line() {
        let text = MINIMAL.replace("cursor_column", "shardz = 3\ncursor_column");
        let err = Config::parse(&text, "t.toml", env).unwrap_err().to_string();
        assert!(err.contains("unknown field `shardz`"), "{err}");
        assert!(err.contains("line 15"), "{err}");
    }

    #[test]
    fn missing_env_var_is_named() {
        let err = Config::parse(MINIMAL, "t.toml", |_| None).unwrap_err().to_string();
        assert!(err.contains("PGPASS"), "{err}");
    }

    #[test]
    fn bad_duration_is_named() {
        let text = MINIMAL.replace(
            "cursor_column = \"updated_at\"",
            "cursor_column = \"updated_at\"\nsafety_delay = \"5\"",
        );
        let err = Config::parse(&text, "t.toml", env).unwrap_err().to_string();
        assert!(err.contains("no unit"), "{err}");
    }
}
