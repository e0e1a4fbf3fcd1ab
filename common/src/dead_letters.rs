//! Dead letters (invariant 9): a row that cannot be decoded, transformed or written goes to
//! the target's `tidemark_dead_letters` table in the same transaction that applies the rest of
//! its batch, so a bad row never blocks its shard and is never dropped silently.
//!
//! Status: `INIT` (written by a batch) → `PROCESSING` (claimed by a retry run) → `RESOLVED`
//! (applied, in the same transaction as its data) or back to `RETRY`, and `FAILED` after
//! `max_retries` failed retries. An operator may mark a row `RESOLVED` by hand.

use crate::copy_format::CopyFormat;
use crate::copy_text;
use crate::pg::TableSql;
use crate::transform::RowError;

pub const TABLE: &str = "tidemark_dead_letters";
/// Removes a task's letters (`$1`): an accumulate task's reinit reads every row again.
pub const DELETE_TASK_LETTERS: &str = "DELETE FROM tidemark_dead_letters WHERE task = $1";
pub const STATUSES: [&str; 5] = ["INIT", "RETRY", "PROCESSING", "RESOLVED", "FAILED"];
/// A status filter as an operator typed it: one of [`STATUSES`], or none.
pub fn check_status(status: Option<&str>) -> Result<(), String> {
    match status {
        Some(status) if !STATUSES.contains(&status) => Err(format!(
            "unknown status {status:?} (use one of {})",
            STATUSES.join(", ")
        )),
        _ => Ok(()),
    }
}

/// A PROCESSING claim older than this belongs to a retry run that died; another may take it.
pub const STALE_CLAIM_SECS: i64 = 300;

/// Batches smaller than this are too small to tell bad rows from a target problem: whatever
/// the target rejects of them goes to the dead letters.
pub const MIN_ROWS_FOR_RATIO: usize = 20;

/// How many of a batch's `rows` may go to the dead letters under the task's
/// `max_dead_letter_ratio`; more means the target, not the rows, is at fault. A ratio of 0
/// (a coordinator that predates the setting) or of 1 sets no limit.
pub fn limit(rows: usize, max_ratio: f64) -> usize {
    if rows < MIN_ROWS_FOR_RATIO || max_ratio <= 0.0 || max_ratio >= 1.0 {
        rows
    } else {
        (rows as f64 * max_ratio).floor() as usize
    }
}

/// Rows of a failing batch probed one by one before its bisection, to tell a target problem
/// from bad rows without isolating every rejected row.
pub const SAMPLE_ROWS: usize = 32;

/// How many of `sample` rows drawn from a batch must be rejected to conclude that the target
/// rejects more than `share` of the batch: the smallest k with P(X ≥ k) ≤ 0.001 for
/// X ~ Binomial(sample, share). `sample + 1` when no count is that unlikely.
pub fn decisive_rejections(sample: usize, share: f64) -> usize {
    const FALSE_ALARM: f64 = 0.001;
    let share = share.clamp(0.0, 1.0);
    if share < 1e-6 {
        // (Next to) no rejection is allowed: one decides. (Also keeps share^sample above 0.)
        return 1;
    }
    // P(X = k), from k = sample down, by the ratio of consecutive terms.
    let mut term = share.powi(sample as i32);
    let mut tail = 0.0;
    for k in (0..=sample).rev() {
        tail += term;
        if tail > FALSE_ALARM {
            return k + 1;
        }
        if k > 0 {
            term *= (k as f64 / (sample - k + 1) as f64) * ((1.0 - share) / share);
        }
    }
    0
}

/// The layout of a dead letter's payload: the row as its batch staged it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    /// Only the target's columns (key-ordered pages), else the staged layout with cursor time
    /// (and delete flag).
    pub target_layout: bool,
    /// A reconciliation's repair row (carries the expected target version last).
    pub repair: bool,
    /// The row's COPY format: a text line, or a binary tuple.
    pub format: CopyFormat,
}

impl Layout {
    /// `target` or `staged`, then `+repair` and `+binary` where they apply.
    pub fn name(&self) -> String {
        let mut name = if self.target_layout { "target" } else { "staged" }.to_string();
        if self.repair {
            name.push_str("+repair");
        }
        if self.format == CopyFormat::Binary {
            name.push_str("+binary");
        }
        name
    }

    pub fn parse(text: &str) -> Result<Layout, String> {
        let unknown = || format!("unknown payload layout {text:?}");
        let mut parts = text.split('+');
        let target_layout = match parts.next() {
            Some("target") => true,
            Some("staged") => false,
            _ => return Err(unknown()),
        };
        let mut layout = Layout {
            target_layout,
            repair: false,
            format: CopyFormat::Text,
        };
        for part in parts {
            match part {
                "repair" if !layout.repair => layout.repair = true,
                "binary" if layout.format == CopyFormat::Text => layout.format = CopyFormat::Binary,
                _ => return Err(unknown()),
            }
        }
        Ok(layout)
    }

    /// A COPY stream of one stored payload, ready for `COPY … FROM STDIN`.
    pub fn stream(&self, payload: &[u8]) -> Vec<u8> {
        self.format.join([payload])
    }
}

/// One row bound for the dead letters.
#[derive(Debug, Clone)]
pub struct DeadLetter {
    pub key: String,
    pub payload: Vec<u8>,
    pub error: RowError,
}

impl DeadLetter {
    /// `key K: class: message`, for errors and logs.
    pub fn describe(&self) -> String {
        format!("key {}: {}: {}", self.key, self.error.class, self.error.message)
    }
}

/// The key of a staged row as dead letters store it: the value of a single key column, a JSON
/// array of the values of a composite key.
pub fn row_key(sql: &TableSql, format: CopyFormat, row: &[u8]) -> String {
    let values: Vec<String> = sql
        .key_positions()
        .into_iter()
        .zip(sql.key_types())
        .map(|(i, sql_type)| match format.field_text(row, i, &sql_type) {
            Ok(Some(text)) => text,
            Ok(None) => "NULL".to_string(),
            // Undecodable: the raw field, so that two such keys stay apart.
            Err(_) => match format {
                CopyFormat::Text => copy_text::raw_field(row, i).map(|raw| String::from_utf8_lossy(raw).into_owned()),
                CopyFormat::Binary => crate::copy_binary::field(row, i).flatten().map(hex::encode),
            }
            .unwrap_or_default(),
        })
        .collect();
    match values.as_slice() {
        [one] => one.clone(),
        _ => serde_json::to_string(&values).expect("strings serialize"),
    }
}

/// The condition name of a database error that one row's values caused (a value the column
/// type rejects, an overflow, a NUL character, a constraint), or `None` when the error is not
/// about a row (connection, permissions, schema) and retrying the batch is the answer.
pub fn row_error_class(error: &sqlx::Error) -> Option<String> {
    let sqlx::Error::Database(db) = error else {
        return None;
    };
    crate::engines::ENGINES
        .iter()
        .find_map(|engine| (engine.row_error_class)(db.as_ref()))
}

/// The row error a database error stands for (its class and message), if it is one.
pub fn as_row_error(error: &sqlx::Error) -> Option<RowError> {
    let class = row_error_class(error)?;
    let message = match error {
        sqlx::Error::Database(db) => db.message().to_string(),
        other => other.to_string(),
    };
    Some(RowError { class, message })
}

/// A batch's dead letters one per key, the last one kept, in key order: what a target's
/// dead-letter table takes (a key already there takes the new letter and starts over).
pub fn latest_per_key(letters: &[DeadLetter]) -> Vec<(&str, &DeadLetter)> {
    let mut by_key = std::collections::BTreeMap::new();
    for letter in letters {
        by_key.insert(letter.key.as_str(), letter);
    }
    by_key.into_iter().collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts_round_trip() {
        for target_layout in [false, true] {
            for repair in [false, true] {
                for format in [CopyFormat::Text, CopyFormat::Binary] {
                    let layout = Layout {
                        target_layout,
                        repair,
                        format,
                    };
                    assert_eq!(Layout::parse(&layout.name()).unwrap(), layout);
                }
            }
        }
        assert_eq!(Layout::parse("staged+repair").unwrap().format, CopyFormat::Text);
        for bad in ["binary", "target+binary+binary", "staged+lz4", ""] {
            assert!(Layout::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn the_limit_applies_to_batches_of_twenty_rows_or_more() {
        assert_eq!(limit(19, 0.5), 19);
        assert_eq!(limit(20, 0.5), 10);
        assert_eq!(limit(1001, 0.5), 500);
        assert_eq!(limit(1000, 0.01), 10);
        assert_eq!(limit(1000, 1.0), 1000);
        assert_eq!(limit(1000, 0.0), 1000, "unset by an older coordinator: no limit");
    }

    /// The binomial tail, term by term, for checking [`decisive_rejections`].
    fn tail(n: usize, p: f64, k: usize) -> f64 {
        let choose = |n: usize, k: usize| (0..k).fold(1.0, |c, i| c * (n - i) as f64 / (i + 1) as f64);
        (k..=n)
            .map(|j| choose(n, j) * p.powi(j as i32) * (1.0 - p).powi((n - j) as i32))
            .sum()
    }

    #[test]
    fn decisive_rejections_is_the_smallest_count_with_a_tail_of_one_in_a_thousand() {
        for share in [0.01, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99] {
            let k = decisive_rejections(SAMPLE_ROWS, share);
            assert!(k <= SAMPLE_ROWS + 1, "{share}: {k}");
            if k <= SAMPLE_ROWS {
                assert!(tail(SAMPLE_ROWS, share, k) <= 0.001, "{share}: {k}");
            }
            assert!(tail(SAMPLE_ROWS, share, k - 1) > 0.001, "{share}: {k} is the smallest");
        }
        assert_eq!(decisive_rejections(32, 0.5), 26);
        assert_eq!(decisive_rejections(32, 0.0), 1, "no rejection allowed: one decides");
        assert_eq!(decisive_rejections(32, 0.99), 33, "never decisive");
        // A target rejecting 90% of rows is caught by the sample 93% of the time.
        assert!(tail(32, 0.9, decisive_rejections(32, 0.5)) > 0.9);
    }
}
