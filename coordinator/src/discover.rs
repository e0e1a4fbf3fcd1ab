//! What `tidemark sync` finds out about a source table when the user does not say: its key
//! (the primary key) and its cursor (a NOT NULL timestamp column). The source engine answers
//! the facts (`SourceSide::columns`, `SourceSide::primary_key`); the choice is made here, the
//! same for every engine, from the PostgreSQL types the columns map to.

use tidemark_common::pg::TableName;

use crate::engines;
use crate::error::CoordinatorError;

/// A source table as discovery saw it.
#[derive(Debug, Clone)]
pub struct Discovered {
    /// (name, PostgreSQL type it maps to, NOT NULL), in table order.
    pub columns: Vec<(String, String, bool)>,
    pub primary_key: Vec<String>,
}

/// How the cursor column was chosen, for the line that tells the user.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CursorChoice {
    /// The only NOT NULL timestamp column, or the one named like an update time.
    Found(String),
    /// No NOT NULL timestamp column.
    None { nullable: Vec<String> },
    /// Several, none named like an update time.
    Ambiguous(Vec<String>),
}

/// Names that say "the time this row last changed", most telling first.
const UPDATE_TIME_NAMES: &[&str] = &[
    "updated_at",
    "modified_at",
    "last_modified",
    "last_updated",
    "updated",
    "modified",
    "update_time",
    "modify_time",
    "changed_at",
    "mtime",
];

fn is_timestamp(sql_type: &str) -> bool {
    sql_type.starts_with("timestamp")
}

impl Discovered {
    /// The cursor a user most likely means: the NOT NULL timestamp column named like an update
    /// time, else the only NOT NULL timestamp column.
    pub fn cursor(&self) -> CursorChoice {
        let candidates: Vec<&str> = self
            .columns
            .iter()
            .filter(|(_, sql_type, not_null)| *not_null && is_timestamp(sql_type))
            .map(|(name, _, _)| name.as_str())
            .collect();
        for preferred in UPDATE_TIME_NAMES {
            if let Some(name) = candidates.iter().find(|name| name.eq_ignore_ascii_case(preferred)) {
                return CursorChoice::Found(name.to_string());
            }
        }
        match candidates.as_slice() {
            [only] => CursorChoice::Found(only.to_string()),
            [] => CursorChoice::None {
                nullable: self
                    .columns
                    .iter()
                    .filter(|(_, sql_type, not_null)| !*not_null && is_timestamp(sql_type))
                    .map(|(name, _, _)| name.clone())
                    .collect(),
            },
            several => CursorChoice::Ambiguous(several.iter().map(|name| name.to_string()).collect()),
        }
    }

    pub fn has_column(&self, name: &str) -> bool {
        self.columns.iter().any(|(column, _, _)| column == name)
    }
}

/// Reads the table's columns and primary key; `Ok(None)` when there is no such table.
pub async fn discover(url: &str, table: &str) -> Result<Option<Discovered>, CoordinatorError> {
    const TASK: &str = "sync";
    let table = TableName::parse(table).map_err(|e| CoordinatorError::task_setup(TASK, format!("--table: {e}")))?;
    let side = engines::source_side_of_url(TASK, url)?;
    let source = side.connect_url(TASK, url).await?;
    let Some(columns) = side.columns(&source, TASK, &table).await? else {
        return Ok(None);
    };
    let primary_key = side.primary_key(&source, &table).await?;
    Ok(Some(Discovered {
        columns: columns
            .into_iter()
            .map(|c| (c.column.name, c.column.sql_type, c.not_null))
            .collect(),
        primary_key,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(columns: &[(&str, &str, bool)]) -> Discovered {
        Discovered {
            columns: columns
                .iter()
                .map(|(n, t, nn)| (n.to_string(), t.to_string(), *nn))
                .collect(),
            primary_key: vec!["id".into()],
        }
    }

    #[test]
    fn the_update_time_wins_over_other_timestamps() {
        let t = table(&[
            ("id", "bigint", true),
            ("created_at", "timestamp with time zone", true),
            ("updated_at", "timestamp(3) without time zone", true),
        ]);
        assert_eq!(t.cursor(), CursorChoice::Found("updated_at".into()));
    }

    #[test]
    fn the_only_not_null_timestamp_is_the_cursor() {
        let t = table(&[
            ("id", "bigint", true),
            ("seen", "timestamp with time zone", true),
            ("updated_at", "timestamp with time zone", false),
        ]);
        assert_eq!(t.cursor(), CursorChoice::Found("seen".into()));
    }

    #[test]
    fn nullable_or_several_timestamps_are_named_not_guessed() {
        let t = table(&[
            ("id", "bigint", true),
            ("updated_at", "timestamp with time zone", false),
        ]);
        assert_eq!(
            t.cursor(),
            CursorChoice::None {
                nullable: vec!["updated_at".into()]
            }
        );
        let t = table(&[
            ("a", "timestamp with time zone", true),
            ("b", "timestamp without time zone", true),
            ("note", "text", true),
        ]);
        assert_eq!(t.cursor(), CursorChoice::Ambiguous(vec!["a".into(), "b".into()]));
    }
}
