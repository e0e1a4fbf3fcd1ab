//! The rows a shard applied lately, one per key, so that a cycle's overlap re-read stages
//! only what changed.
//!
//! Each incremental cycle reads again the last `overlap` below its watermark, to catch rows
//! that committed late or whose clock stepped back. Most of those rows are byte for byte what
//! the shard applied a cycle before, and applying them again changes nothing (the versioned
//! upsert keeps the target's row); but they were staged, registered, copied and compared
//! again, every cycle. After a burst of updates each cycle re-applied the whole burst.
//!
//! A re-read row is left out of the batch when its staged bytes (every column, the version,
//! the cursor time and the delete flag) equal the last row this shard run applied for its key
//! in a committed batch. The target holds that row or a newer version of the key, so applying
//! it again would change nothing. Anything else is staged: a row not seen, a changed one (the
//! same key and time with other values), a key whose last applied row was another, a key seen
//! twice in one page. Rows of a batch that sent any row to the dead letters are not
//! remembered, and a repair forgets everything. The memory is bounded: rows are forgotten
//! once the overlap can no longer reach them, and at most [`MAX_KEYS`] keys are kept.

use std::collections::hash_map::{DefaultHasher, Entry};
use std::collections::{HashMap, HashSet};
use std::hash::{Hash, Hasher};

use sha2::{Digest, Sha256};
use tidemark_common::copy_format::CopyFormat;

/// Keys remembered per shard at most (about 40 bytes each): a burst larger than this is
/// partly applied again, as before.
pub const MAX_KEYS: usize = 50_000;

/// A row's staged bytes, as the first 128 bits of their SHA-256.
type RowDigest = [u8; 16];

#[derive(Debug, Default)]
pub struct RecentRows {
    /// Key digest → (the high of the cycle that read the row, the row's digest).
    by_key: HashMap<u64, (i64, RowDigest)>,
}

/// A page with the rows already applied left out, and what to remember once it commits.
#[derive(Debug)]
pub struct Filtered {
    /// `None`: every row is kept, the page's stream is unchanged.
    pub data: Option<Vec<u8>>,
    pub kept: u64,
    pub skipped: u64,
    remember: Remember,
}

#[derive(Debug, Default)]
struct Remember {
    high_micros: i64,
    rows: Vec<(u64, RowDigest)>,
    /// Keys seen more than once in the page: their last applied row is not known here.
    ambiguous: Vec<u64>,
}

impl RecentRows {
    /// Leaves out the rows of an incremental page (read in the cycle whose high is
    /// `high_micros`) that equal what this shard last applied for their key. `key_positions`:
    /// the key's fields in a staged row.
    pub fn filter(
        &self,
        format: CopyFormat,
        data: &[u8],
        key_positions: &[usize],
        high_micros: i64,
    ) -> Result<Filtered, String> {
        let rows = format.rows(data)?;
        let mut keys = Vec::with_capacity(rows.len());
        let mut seen = HashSet::with_capacity(rows.len());
        let mut ambiguous = HashSet::new();
        for row in &rows {
            let key = key_digest(format, row, key_positions)?;
            if !seen.insert(key) {
                ambiguous.insert(key);
            }
            keys.push(key);
        }
        let mut kept = Vec::with_capacity(rows.len());
        let mut remember = Vec::with_capacity(rows.len());
        for (row, key) in rows.iter().zip(keys) {
            if ambiguous.contains(&key) {
                kept.push(*row);
                continue;
            }
            let digest = row_digest(row);
            if self.by_key.get(&key).is_some_and(|(_, last)| *last == digest) {
                continue;
            }
            kept.push(*row);
            remember.push((key, digest));
        }
        let skipped = (rows.len() - kept.len()) as u64;
        Ok(Filtered {
            data: (skipped > 0).then(|| format.join(kept.iter().copied())),
            kept: kept.len() as u64,
            skipped,
            remember: Remember {
                high_micros,
                rows: remember,
                ambiguous: ambiguous.into_iter().collect(),
            },
        })
    }

    /// Remembers a committed page's rows. `clean`: none of its rows went to the dead letters;
    /// otherwise its keys are forgotten.
    pub fn committed(&mut self, filtered: Filtered, clean: bool) {
        let Remember {
            high_micros,
            rows,
            ambiguous,
        } = filtered.remember;
        for key in ambiguous {
            self.by_key.remove(&key);
        }
        for (key, digest) in rows {
            if !clean {
                self.by_key.remove(&key);
                continue;
            }
            let room = self.by_key.len() < MAX_KEYS;
            match self.by_key.entry(key) {
                Entry::Occupied(mut entry) => {
                    entry.insert((high_micros, digest));
                }
                Entry::Vacant(entry) if room => {
                    entry.insert((high_micros, digest));
                }
                Entry::Vacant(_) => {}
            }
        }
    }

    /// Forgets the rows read in cycles whose high is at or below `micros`: the overlap re-read
    /// of a cycle starting there no longer reaches them.
    pub fn forget_below(&mut self, micros: i64) {
        self.by_key.retain(|_, (high, _)| *high > micros);
    }

    /// Forgets every row (a repair wrote the target, or the run's reads changed).
    pub fn clear(&mut self) {
        self.by_key.clear();
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.by_key.len()
    }
}

/// The key's raw fields, hashed. Two keys that collide only share a slot: a row is left out
/// only when its whole digest, which includes the key, matches.
fn key_digest(format: CopyFormat, row: &[u8], key_positions: &[usize]) -> Result<u64, String> {
    let mut hasher = DefaultHasher::new();
    for &index in key_positions {
        let field = format
            .raw_field(row, index)
            .ok_or_else(|| format!("a staged row has no key field {index}"))?;
        field.hash(&mut hasher);
    }
    Ok(hasher.finish())
}

fn row_digest(row: &[u8]) -> RowDigest {
    let digest = Sha256::digest(row);
    digest[..16].try_into().expect("SHA-256 has 32 bytes")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn page(format: CopyFormat, rows: &[&str]) -> Vec<u8> {
        match format {
            CopyFormat::Text => format.join(rows.iter().map(|r| r.as_bytes())),
            CopyFormat::Binary => {
                let tuples: Vec<Vec<u8>> = rows.iter().map(|r| binary_tuple(r)).collect();
                format.join(tuples.iter().map(|t| t.as_slice()))
            }
        }
    }

    /// A tuple of the tab-separated fields as text bytes (`\N` for NULL).
    fn binary_tuple(row: &str) -> Vec<u8> {
        let fields: Vec<&str> = row.split('\t').collect();
        let mut out = (fields.len() as i16).to_be_bytes().to_vec();
        for field in fields {
            if field == "\\N" {
                out.extend_from_slice(&(-1i32).to_be_bytes());
            } else {
                out.extend_from_slice(&(field.len() as i32).to_be_bytes());
                out.extend_from_slice(field.as_bytes());
            }
        }
        out
    }

    fn kept_rows(format: CopyFormat, original: &[u8], filtered: &Filtered) -> Vec<Vec<u8>> {
        let data = filtered.data.as_deref().unwrap_or(original);
        format.rows(data).unwrap().into_iter().map(|r| r.to_vec()).collect()
    }

    #[test]
    fn a_row_is_left_out_only_when_it_equals_the_last_one_applied_for_its_key() {
        for format in [CopyFormat::Text, CopyFormat::Binary] {
            let mut recent = RecentRows::default();
            let first = page(format, &["1\ta\t100", "2\tb\t100", "3\tc\t100"]);
            let filtered = recent.filter(format, &first, &[0], 1_000).unwrap();
            assert_eq!((filtered.kept, filtered.skipped), (3, 0));
            assert!(filtered.data.is_none(), "nothing left out: the stream is kept as read");
            recent.committed(filtered, true);

            // The overlap re-reads 1 unchanged, 2 changed at the same time, 3 at a newer
            // time, and 4 for the first time.
            let second = page(format, &["1\ta\t100", "2\tB\t100", "3\tc\t101", "4\td\t101"]);
            let filtered = recent.filter(format, &second, &[0], 2_000).unwrap();
            assert_eq!((filtered.kept, filtered.skipped), (3, 1));
            let kept = kept_rows(format, &second, &filtered);
            assert_eq!(
                kept,
                kept_rows(
                    format,
                    &page(format, &["2\tB\t100", "3\tc\t101", "4\td\t101"]),
                    &filtered_none()
                )
            );
            recent.committed(filtered, true);

            // 2 went back to its first value: that is not what was applied last for 2.
            let third = page(format, &["1\ta\t100", "2\tb\t100", "3\tc\t101", "4\td\t101"]);
            let filtered = recent.filter(format, &third, &[0], 3_000).unwrap();
            assert_eq!((filtered.kept, filtered.skipped), (1, 3), "{format:?}");
            assert_eq!(
                kept_rows(format, &third, &filtered),
                vec![row_bytes(format, "2\tb\t100")]
            );
        }
    }

    fn filtered_none() -> Filtered {
        Filtered {
            data: None,
            kept: 0,
            skipped: 0,
            remember: Remember::default(),
        }
    }

    fn row_bytes(format: CopyFormat, row: &str) -> Vec<u8> {
        format.rows(&page(format, &[row])).unwrap()[0].to_vec()
    }

    #[test]
    fn a_key_twice_in_a_page_is_kept_and_forgotten() {
        let format = CopyFormat::Text;
        let mut recent = RecentRows::default();
        let filtered = recent
            .filter(format, &page(format, &["1\ta\t100\tf"]), &[0], 1_000)
            .unwrap();
        recent.committed(filtered, true);
        // A row and its delete-log entry in one page: both staged, the key forgotten.
        let both = page(format, &["1\ta\t100\tf", "1\t\\N\t102\tt"]);
        let filtered = recent.filter(format, &both, &[0], 2_000).unwrap();
        assert_eq!((filtered.kept, filtered.skipped), (2, 0));
        recent.committed(filtered, true);
        assert_eq!(recent.len(), 0);
        let again = recent
            .filter(format, &page(format, &["1\ta\t100\tf"]), &[0], 3_000)
            .unwrap();
        assert_eq!(again.skipped, 0);
    }

    #[test]
    fn a_batch_with_dead_letters_an_uncommitted_page_and_a_repair_are_not_remembered() {
        let format = CopyFormat::Text;
        let rows = page(format, &["1\ta\t100", "2\tb\t100"]);
        let mut recent = RecentRows::default();
        let filtered = recent.filter(format, &rows, &[0], 1_000).unwrap();
        recent.committed(filtered, false);
        assert_eq!(recent.filter(format, &rows, &[0], 2_000).unwrap().skipped, 0);

        // Filtered but never committed (the batch failed): nothing remembered.
        let _dropped = recent.filter(format, &rows, &[0], 2_000).unwrap();
        assert_eq!(recent.filter(format, &rows, &[0], 2_000).unwrap().skipped, 0);

        let filtered = recent.filter(format, &rows, &[0], 2_000).unwrap();
        recent.committed(filtered, true);
        assert_eq!(recent.filter(format, &rows, &[0], 3_000).unwrap().skipped, 2);
        recent.clear();
        assert_eq!(recent.filter(format, &rows, &[0], 3_000).unwrap().skipped, 0);
    }

    #[test]
    fn rows_are_forgotten_once_the_overlap_cannot_reach_them_and_the_keys_are_bounded() {
        let format = CopyFormat::Text;
        let mut recent = RecentRows::default();
        let early = page(format, &["1\ta\t100"]);
        let filtered = recent.filter(format, &early, &[0], 1_000).unwrap();
        recent.committed(filtered, true);
        let late = page(format, &["2\tb\t1500"]);
        let filtered = recent.filter(format, &late, &[0], 2_000).unwrap();
        recent.committed(filtered, true);
        recent.forget_below(1_000);
        assert_eq!(recent.filter(format, &early, &[0], 3_000).unwrap().skipped, 0);
        assert_eq!(recent.filter(format, &late, &[0], 3_000).unwrap().skipped, 1);

        let many: Vec<String> = (0..MAX_KEYS + 10).map(|k| format!("{k}\tx\t1")).collect();
        let many: Vec<&str> = many.iter().map(String::as_str).collect();
        let filtered = recent.filter(format, &page(format, &many), &[0], 4_000).unwrap();
        recent.committed(filtered, true);
        assert_eq!(recent.len(), MAX_KEYS);
    }

    #[test]
    fn a_composite_key_is_read_from_each_of_its_fields() {
        let format = CopyFormat::Binary;
        let mut recent = RecentRows::default();
        let first = page(format, &["1\t1\ta", "1\t2\tb"]);
        let filtered = recent.filter(format, &first, &[0, 1], 1_000).unwrap();
        assert_eq!(filtered.skipped, 0, "two keys, not one key twice");
        recent.committed(filtered, true);
        assert_eq!(recent.len(), 2);
        let filtered = recent.filter(format, &first, &[0, 1], 2_000).unwrap();
        assert_eq!(filtered.skipped, 2);
    }
}
