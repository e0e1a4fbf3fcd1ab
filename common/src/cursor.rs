//! Cursors and shard ranges, and their typed, versioned encoding.
//!
//! A cursor `W = (t, k1..kn)` is compared lexicographically over the cursor time and the full
//! key. `after_key = None` means "before every key at this position", so `(t, None)` selects
//! rows with `cursor >= t` and `(t, Some(k))` rows with `(cursor, key) > (t, k)`.
//!
//! Encoding: JSON `{"encoding_version":1,"epoch":E,"kind":"snapshot"|"incremental",...}` with
//! every key value carrying its SQL type. A reader meeting an `encoding_version` it does not
//! know refuses it ([`CursorError::UnsupportedVersion`]); a future version is introduced by
//! adding a decoder for it here and rewriting stored checkpoints on the next commit.

use serde::{Deserialize, Serialize};

pub const CURSOR_ENCODING_VERSION: u32 = 1;

#[derive(Debug, thiserror::Error)]
pub enum CursorError {
    #[error("cursor encoding version {0} is not supported (this build reads version {CURSOR_ENCODING_VERSION})")]
    UnsupportedVersion(u32),
    #[error("malformed cursor {text:?}: {message}")]
    Malformed { text: String, message: String },
}

/// One key column's value, as text in PostgreSQL's output format, with its SQL type.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct KeyValue {
    #[serde(rename = "type")]
    pub sql_type: String,
    pub value: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Position {
    /// Snapshot phase: paging by key inside the shard's range.
    Snapshot { after_key: Option<Vec<KeyValue>> },
    /// Incremental phase, in cycles. Times are microseconds since the Unix epoch (UTC).
    ///
    /// `floor_micros` is the watermark: every row with a cursor time below it is in the
    /// target; it never moves backwards. A cycle fixes `cycle_high_micros` (the read
    /// window's upper bound, from the source clock and its oldest open transaction) and
    /// pages by `(cursor, key)` from `floor − overlap` up to it; `(t_micros, after_key)` is
    /// the position inside the cycle. When the cycle is done the floor moves up to its high
    /// and `cycle_high_micros` is `None` until the next cycle starts.
    Incremental {
        floor_micros: i64,
        t_micros: i64,
        after_key: Option<Vec<KeyValue>>,
        cycle_high_micros: Option<i64>,
    },
    /// Append-only tasks after their initial scan: paging by key alone.
    Append { after_key: Option<Vec<KeyValue>> },
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Cursor {
    pub encoding_version: u32,
    pub epoch: u64,
    #[serde(flatten)]
    pub position: Position,
}

impl Cursor {
    pub fn new(epoch: u64, position: Position) -> Cursor {
        Cursor {
            encoding_version: CURSOR_ENCODING_VERSION,
            epoch,
            position,
        }
    }

    pub fn snapshot_start(epoch: u64) -> Cursor {
        Cursor::new(epoch, Position::Snapshot { after_key: None })
    }

    pub fn encode(&self) -> String {
        serde_json::to_string(self).expect("cursor serializes")
    }

    pub fn decode(text: &str) -> Result<Cursor, CursorError> {
        let value: serde_json::Value = serde_json::from_str(text).map_err(|e| CursorError::Malformed {
            text: text.to_string(),
            message: e.to_string(),
        })?;
        Cursor::from_value(&value)
    }

    /// [`Cursor::decode`] of JSON already parsed (a `jsonb` column): without printing and
    /// parsing it again, which was half the cost of reading every shard's cursor.
    pub fn from_value(value: &serde_json::Value) -> Result<Cursor, CursorError> {
        let malformed = |message: String| CursorError::Malformed {
            text: value.to_string(),
            message,
        };
        let version = value
            .get("encoding_version")
            .and_then(|v| v.as_u64())
            .ok_or_else(|| malformed("no encoding_version".into()))?;
        if version != u64::from(CURSOR_ENCODING_VERSION) {
            return Err(CursorError::UnsupportedVersion(version as u32));
        }
        Cursor::deserialize(value).map_err(|e| malformed(e.to_string()))
    }

    /// An incremental cursor between cycles, at watermark `floor_micros`.
    pub fn incremental_at(epoch: u64, floor_micros: i64) -> Cursor {
        Cursor::new(
            epoch,
            Position::Incremental {
                floor_micros,
                t_micros: floor_micros,
                after_key: None,
                cycle_high_micros: None,
            },
        )
    }

    /// Past the snapshot: incremental or append.
    pub fn is_incremental(&self) -> bool {
        !matches!(self.position, Position::Snapshot { .. })
    }

    /// The watermark of an incremental cursor.
    pub fn incremental_time(&self) -> Option<i64> {
        match self.position {
            Position::Incremental { floor_micros, .. } => Some(floor_micros),
            Position::Snapshot { .. } | Position::Append { .. } => None,
        }
    }

    /// The last key read by a key-paged cursor (snapshot or append).
    pub fn key_position(&self) -> Option<&[KeyValue]> {
        match &self.position {
            Position::Snapshot { after_key } | Position::Append { after_key } => after_key.as_deref(),
            Position::Incremental { .. } => None,
        }
    }

    /// A short human form: `snapshot after 4711`, `incremental 2026-11-29T10:00:00.123Z / 42`.
    pub fn describe(&self) -> String {
        let keys = |key: &Option<Vec<KeyValue>>| match key {
            None => "start".to_string(),
            Some(values) => values.iter().map(|v| v.value.as_str()).collect::<Vec<_>>().join(","),
        };
        match &self.position {
            Position::Snapshot { after_key } => format!("snapshot after {}", keys(after_key)),
            Position::Append { after_key } => format!("append after {}", keys(after_key)),
            Position::Incremental {
                floor_micros,
                cycle_high_micros: None,
                ..
            } => {
                format!("incremental {}", format_micros(*floor_micros))
            }
            Position::Incremental {
                floor_micros,
                t_micros,
                after_key,
                cycle_high_micros: Some(high),
            } => format!(
                "incremental {} (cycle to {} at {} / {})",
                format_micros(*floor_micros),
                format_micros(*high),
                format_micros(*t_micros),
                keys(after_key)
            ),
        }
    }
}

/// RFC 3339 with milliseconds, UTC: `2026-11-29T10:00:00.123Z`.
pub fn format_micros(micros: i64) -> String {
    let secs = micros.div_euclid(1_000_000);
    let sub_micros = micros.rem_euclid(1_000_000);
    let days = secs.div_euclid(86_400);
    let secs_of_day = secs.rem_euclid(86_400);
    let (year, month, day) = civil_from_days(days);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:03}Z",
        secs_of_day / 3600,
        secs_of_day % 3600 / 60,
        secs_of_day % 60,
        sub_micros / 1000
    )
}

/// Days since 1970-01-01 to a proleptic Gregorian date (Howard Hinnant's algorithm).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

/// A shard's key range `[lo, hi)` on the first key column; `None` is unbounded.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardRange {
    pub lo: Option<KeyValue>,
    pub hi: Option<KeyValue>,
}

impl ShardRange {
    pub fn encode(&self) -> String {
        serde_json::to_string(self).expect("range serializes")
    }

    pub fn decode(text: &str) -> Result<ShardRange, CursorError> {
        serde_json::from_str(text).map_err(|e| CursorError::Malformed {
            text: text.to_string(),
            message: e.to_string(),
        })
    }

    pub fn describe(&self) -> String {
        let lo = self.lo.as_ref().map_or("-inf", |v| v.value.as_str());
        let hi = self.hi.as_ref().map_or("+inf", |v| v.value.as_str());
        format!("[{lo}, {hi})")
    }
}

/// Splits the first key column's domain into `shards` ranges. Integer keys split `[min, max]`
/// evenly (the first range is open below, the last open above, so keys outside the planned
/// span still belong to exactly one shard); uuid keys split the 128-bit space by prefix.
pub fn plan_ranges(key_type: &KeyDomain, shards: u32) -> Vec<ShardRange> {
    let shards = shards.max(1) as i128;
    let boundaries: Vec<KeyValue> = match key_type {
        KeyDomain::Integer { sql_type, min, max } => {
            let span = (i128::from(*max) - i128::from(*min) + 1).max(shards);
            let width = (span + shards - 1) / shards;
            (1..shards)
                .map(|i| KeyValue {
                    sql_type: sql_type.clone(),
                    value: (i128::from(*min) + i * width).to_string(),
                })
                .collect()
        }
        KeyDomain::Sampled { sql_type, boundaries } => {
            let mut distinct: Vec<&String> = boundaries.iter().collect();
            distinct.dedup();
            distinct
                .into_iter()
                .map(|value| KeyValue {
                    sql_type: sql_type.clone(),
                    value: value.clone(),
                })
                .collect()
        }
        KeyDomain::Uuid => (1..shards)
            .map(|i| {
                let bound = ((u128::MAX / shards as u128) * i as u128).to_be_bytes();
                KeyValue {
                    sql_type: "uuid".into(),
                    value: uuid::Uuid::from_bytes(bound).hyphenated().to_string(),
                }
            })
            .collect(),
    };
    let mut ranges = Vec::with_capacity(boundaries.len() + 1);
    let mut lo = None;
    for boundary in boundaries {
        ranges.push(ShardRange {
            lo: lo.clone(),
            hi: Some(boundary.clone()),
        });
        lo = Some(boundary);
    }
    ranges.push(ShardRange { lo, hi: None });
    ranges
}

/// What the planner knows of the first key column.
#[derive(Debug, Clone)]
pub enum KeyDomain {
    Integer {
        sql_type: String,
        min: i64,
        max: i64,
    },
    Uuid,
    /// Any other ordered type (text, varchar, numeric, dates…): ranges split at quantiles
    /// sampled from the table, in the column's own ordering (collation included).
    Sampled {
        sql_type: String,
        boundaries: Vec<String>,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The control database tells a caught-up shard by its stored cursor's `kind` without
    /// decoding it (`ControlDb::running_shards`): any kind but `snapshot` is incremental.
    #[test]
    fn only_the_snapshot_kind_is_not_incremental() {
        for position in [
            Position::Snapshot { after_key: None },
            Position::Incremental {
                floor_micros: 1,
                t_micros: 1,
                after_key: None,
                cycle_high_micros: None,
            },
            Position::Append { after_key: None },
        ] {
            let cursor = Cursor::new(1, position);
            let stored: serde_json::Value = serde_json::from_str(&cursor.encode()).unwrap();
            assert_eq!(stored["kind"] != "snapshot", cursor.is_incremental(), "{stored}");
        }
    }

    #[test]
    fn cursor_round_trips_and_rejects_unknown_versions() {
        let cursor = Cursor::new(
            3,
            Position::Incremental {
                floor_micros: 1_700_000_000_000_000,
                t_micros: 1_700_000_000_123_456,
                after_key: Some(vec![KeyValue {
                    sql_type: "bigint".into(),
                    value: "42".into(),
                }]),
                cycle_high_micros: Some(1_700_000_001_000_000),
            },
        );
        let text = cursor.encode();
        assert_eq!(Cursor::decode(&text).unwrap(), cursor);
        let future = text.replace("\"encoding_version\":1", "\"encoding_version\":9");
        assert!(matches!(
            Cursor::decode(&future),
            Err(CursorError::UnsupportedVersion(9))
        ));
    }

    #[test]
    fn integer_ranges_cover_everything_once() {
        let ranges = plan_ranges(
            &KeyDomain::Integer {
                sql_type: "bigint".into(),
                min: 1,
                max: 200_000,
            },
            8,
        );
        assert_eq!(ranges.len(), 8);
        assert_eq!(ranges[0].lo, None);
        assert_eq!(ranges[7].hi, None);
        assert_eq!(ranges[0].hi.as_ref().unwrap().value, "25001");
        for pair in ranges.windows(2) {
            assert_eq!(pair[0].hi, pair[1].lo);
        }
    }

    #[test]
    fn sampled_ranges_drop_repeated_boundaries() {
        let boundaries = ["b", "b", "m", "t"].map(String::from).to_vec();
        let ranges = plan_ranges(
            &KeyDomain::Sampled {
                sql_type: "text".into(),
                boundaries,
            },
            5,
        );
        let his: Vec<_> = ranges.iter().map(|r| r.hi.as_ref().map(|v| v.value.clone())).collect();
        assert_eq!(his, vec![Some("b".into()), Some("m".into()), Some("t".into()), None]);
    }

    #[test]
    fn uuid_ranges_are_ordered_prefixes() {
        let ranges = plan_ranges(&KeyDomain::Uuid, 4);
        let bounds: Vec<_> = ranges.iter().filter_map(|r| r.hi.clone()).map(|v| v.value).collect();
        assert_eq!(bounds.len(), 3);
        assert!(bounds[0].starts_with("3fffffff") && bounds[1].starts_with("7fffffff"));
        let mut sorted = bounds.clone();
        sorted.sort();
        assert_eq!(sorted, bounds);
    }

    #[test]
    fn formats_rfc3339_millis() {
        assert_eq!(format_micros(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(format_micros(1_700_000_000_123_456), "2023-11-14T22:13:20.123Z");
        assert_eq!(format_micros(-1_000), "1969-12-31T23:59:59.999Z");
    }
}
