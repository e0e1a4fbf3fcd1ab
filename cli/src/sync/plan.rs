//! From `tidemark sync`'s flags (or a config file's tasks) to a coordinator config that runs
//! in this process: in-process leases, the control state in the embedded store (a SQLite file
//! in the state directory) unless `--control` names a PostgreSQL database, the staging store
//! in the state directory. Every problem is one line naming the flag.

use std::path::{Path, PathBuf};

use tidemark_common::config::Config;
use tidemark_coordinator::discover::{CursorChoice, Discovered};

use super::SyncArgs;

/// A problem with what the user asked for (exit 2).
#[derive(Debug)]
pub struct Usage(pub String);

fn usage(message: impl Into<String>) -> Usage {
    Usage(message.into())
}

/// What `tidemark sync` runs.
pub struct Plan {
    pub config: Config,
    /// What was found rather than given, one line each.
    pub notes: Vec<String>,
}

/// The engine of a URL, named for the flag it came from.
pub fn check_url(flag: &str, url: &str) -> Result<&'static tidemark_common::engines::Engine, Usage> {
    tidemark_common::engines::of_url(url).map_err(|e| usage(format!("{flag}: {e}")))
}

/// `text` in the characters a task name and a schema allow (lower-case letters, digits, `_`).
fn identifier(text: &str) -> String {
    text.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_lowercase()
            } else {
                '_'
            }
        })
        .collect()
}

/// The task name a table gets: its name, as an identifier.
fn task_name(table: &str) -> String {
    let cleaned = identifier(table.rsplit('.').next().unwrap_or(table));
    if cleaned.is_empty() {
        "sync".to_string()
    } else {
        cleaned
    }
}

/// The control database's schema for a task name: `tidemark_<name>` (one per sync, so two
/// syncs into one target keep their state apart).
pub fn control_schema(name: &str) -> String {
    let mut schema = identifier(&format!("tidemark_{name}"));
    schema.truncate(63);
    schema
}

fn absolute(path: &Path) -> Result<PathBuf, Usage> {
    std::fs::create_dir_all(path).map_err(|e| usage(format!("--state {}: {e}", path.display())))?;
    path.canonicalize()
        .map_err(|e| usage(format!("--state {}: {e}", path.display())))
}

/// Where a sync keeps its control state, from `--control`: by default the embedded store,
/// `<state>/<name>.control.db`; `target` (a PostgreSQL target's database) or a `postgres://`
/// URL: the schema `tidemark_<name>` there; a `sqlite://` URL: that file.
fn control_state(
    control: Option<&str>,
    target: &str,
    name: &str,
    state: &Path,
) -> Result<(String, Option<String>), Usage> {
    let in_postgres = |url: &str, flag: &str| -> Result<(String, Option<String>), Usage> {
        if check_url(flag, url)?.id != "postgres" {
            return Err(usage(format!(
                "{flag} is not PostgreSQL: the control state lives in PostgreSQL or in the embedded store \
                 (leave --control out, or pass --control sqlite://FILE)"
            )));
        }
        Ok((url.to_string(), Some(control_schema(name))))
    };
    match control {
        None => Ok((
            format!("sqlite://{}", state.join(format!("{name}.control.db")).display()),
            None,
        )),
        Some("target") => in_postgres(target, "--target"),
        Some(url) if url.starts_with("sqlite:") => Ok((url.to_string(), None)),
        Some(url) => in_postgres(url, "--control"),
    }
}

/// The coordinator section every `tidemark sync` runs with.
fn coordinator_section(control: &str, schema: Option<&str>, state: &Path) -> toml::Table {
    let mut coordinator = toml::Table::new();
    coordinator.insert("listen".into(), "127.0.0.1:0".into());
    coordinator.insert("leases".into(), "in_process".into());
    coordinator.insert("control_db".into(), control.into());
    if let Some(schema) = schema {
        coordinator.insert("control_schema".into(), schema.into());
    }
    coordinator.insert(
        "staging".into(),
        format!("file://{}", state.join("staging").display()).into(),
    );
    coordinator
}

fn parse(document: toml::Table, origin: &str, env: impl Fn(&str) -> Option<String>) -> Result<Config, Usage> {
    let text = toml::to_string(&document).map_err(|e| usage(format!("{origin}: {e}")))?;
    Config::parse(&text, origin, env).map_err(|e| usage(e.to_string()))
}

/// A config file's tasks, run in this process: its `[coordinator]` section keeps its
/// control database and staging store, and loses what a cluster needs (etcd, TLS, a listen
/// address of its own).
pub fn from_config_file(path: &Path) -> Result<Plan, Usage> {
    let origin = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|e| usage(format!("--config {origin}: {e}")))?;
    let mut document: toml::Table = text
        .parse()
        .map_err(|e: toml::de::Error| usage(format!("--config {origin}: {}", e.message())))?;
    let Some(toml::Value::Table(coordinator)) = document.get_mut("coordinator") else {
        return Err(usage(format!("--config {origin}: no [coordinator] section")));
    };
    for cluster_only in [
        "etcd_endpoints",
        "etcd_tls",
        "etcd_prefix",
        "tls",
        "advertise",
        "balance",
    ] {
        coordinator.remove(cluster_only);
    }
    coordinator.insert("listen".into(), "127.0.0.1:0".into());
    coordinator.insert("leases".into(), "in_process".into());
    let config = parse(document, &origin, |name| std::env::var(name).ok())?;
    if config.tasks.is_empty() {
        return Err(usage(format!("--config {origin}: no [[tasks]]")));
    }
    Ok(Plan {
        config,
        notes: Vec::new(),
    })
}

/// One table from the flags; `table` is what discovery found (`None`: no such table).
pub fn from_flags(args: &SyncArgs, table: Option<&Discovered>) -> Result<Plan, Usage> {
    let (Some(source), Some(table_name), Some(target)) = (&args.source, &args.table, &args.target) else {
        return Err(usage("--source, --table and --target are required (or --config FILE)"));
    };
    let Some(table) = table else {
        return Err(usage(format!("--table {table_name}: no such table in the source")));
    };
    let mut notes = Vec::new();
    let key = if args.key.is_empty() {
        if table.primary_key.is_empty() {
            return Err(usage(format!(
                "{table_name} has no primary key: pass --key COLUMN[,COLUMN…] (unique and NOT NULL)"
            )));
        }
        notes.push(format!("key: {} (the primary key)", table.primary_key.join(", ")));
        table.primary_key.clone()
    } else {
        args.key.clone()
    };
    for column in &key {
        if !table.has_column(column) {
            return Err(usage(format!("--key {column}: {table_name} has no such column")));
        }
    }
    let cursor = match args.mode.as_str() {
        "upsert" => Some(match &args.cursor {
            Some(cursor) if table.has_column(cursor) => cursor.clone(),
            Some(cursor) => {
                return Err(usage(format!("--cursor {cursor}: {table_name} has no such column")));
            }
            None => match table.cursor() {
                CursorChoice::Found(cursor) => {
                    notes.push(format!("cursor: {cursor} (a NOT NULL timestamp column)"));
                    cursor
                }
                CursorChoice::None { nullable } => {
                    let hint = if nullable.is_empty() {
                        String::new()
                    } else {
                        format!(" ({} may be NULL)", nullable.join(", "))
                    };
                    return Err(usage(format!(
                        "{table_name} has no NOT NULL timestamp column to follow changes by{hint}: \
                         pass --cursor COLUMN, or --mode append for a table rows are only added to"
                    )));
                }
                CursorChoice::Ambiguous(several) => {
                    return Err(usage(format!(
                        "{table_name} has several NOT NULL timestamp columns ({}): pass --cursor with the one \
                         every change sets",
                        several.join(", ")
                    )));
                }
            },
        }),
        "append" => {
            if args.cursor.is_some() {
                return Err(usage("--cursor goes with --mode upsert: append mode follows the key"));
            }
            None
        }
        _ => {
            return Err(usage(
                "--mode accumulate needs group_by and aggregates: write them in a task and pass --config FILE",
            ));
        }
    };
    let name = args.name.clone().unwrap_or_else(|| task_name(table_name));
    let state = absolute(&args.state)?;
    let (control, schema) = control_state(args.control.as_deref(), target, &name, &state)?;

    let mut task = toml::Table::new();
    task.insert("name".into(), name.clone().into());
    task.insert("source".into(), source.clone().into());
    task.insert("source_table".into(), table_name.clone().into());
    task.insert("target".into(), target.clone().into());
    task.insert(
        "target_table".into(),
        args.target_table.clone().unwrap_or_else(|| table_name.clone()).into(),
    );
    task.insert(
        "key".into(),
        toml::Value::Array(key.into_iter().map(toml::Value::from).collect()),
    );
    task.insert("mode".into(), args.mode.clone().into());
    if let Some(cursor) = cursor {
        task.insert("cursor_column".into(), cursor.into());
    }
    if let Some(shards) = args.shards {
        task.insert("shards".into(), i64::from(shards).into());
    }
    let mut document = toml::Table::new();
    document.insert(
        "coordinator".into(),
        coordinator_section(&control, schema.as_deref(), &state).into(),
    );
    document.insert("tasks".into(), toml::Value::Array(vec![toml::Value::Table(task)]));
    // Nothing the user typed is an environment reference here.
    let config = parse(document, "tidemark sync", |_| None)?;
    Ok(Plan { config, notes })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_become_task_names_and_schemas() {
        assert_eq!(task_name("public.Items-2026"), "items_2026");
        assert_eq!(control_schema("items_2026"), "tidemark_items_2026");
        assert_eq!(control_schema(&"x".repeat(80)).len(), 63);
    }

    #[test]
    fn the_control_state_is_embedded_unless_asked_for_elsewhere() {
        let state = Path::new("/var/tmp/sync");
        let pg = "postgres://loader@warehouse/dw";
        let my = "mysql://loader@warehouse/dw";
        assert_eq!(
            control_state(None, my, "items", state).unwrap(),
            ("sqlite:///var/tmp/sync/items.control.db".into(), None)
        );
        assert_eq!(
            control_state(Some("target"), pg, "items", state).unwrap(),
            (pg.into(), Some("tidemark_items".into()))
        );
        assert_eq!(
            control_state(Some("postgres://c@h/ctl"), my, "items", state).unwrap(),
            ("postgres://c@h/ctl".into(), Some("tidemark_items".into()))
        );
        assert_eq!(
            control_state(Some("sqlite://x.db"), pg, "items", state).unwrap(),
            ("sqlite://x.db".into(), None)
        );
        let refused = control_state(Some("target"), my, "items", state).unwrap_err().0;
        assert!(refused.starts_with("--target is not PostgreSQL"), "{refused}");
        let refused = control_state(Some(my), pg, "items", state).unwrap_err().0;
        assert!(refused.starts_with("--control is not PostgreSQL"), "{refused}");
    }
}
