//! The two COPY formats a batch can be staged in, behind one set of operations: split into
//! rows, join rows back into a stream, read one field, and the `COPY` option that names it.
//!
//! Binary is the fast path: no text rendering and parsing of numbers, times and uuids on
//! either side. It needs the stage and target column types to equal the source's (a binary
//! `json` value is not a binary `jsonb` one), so a task whose types differ reads text.

use crate::{copy_binary, copy_text};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CopyFormat {
    #[default]
    Text,
    Binary,
}

/// The manifest's `data_format` of a text stream (before compression).
pub const DATA_FORMAT_PG_COPY_TEXT: &str = "pg_copy_text";
/// The manifest's `data_format` of a binary stream (before compression).
pub const DATA_FORMAT_PG_COPY_BINARY: &str = "pg_copy_binary";

impl CopyFormat {
    /// `text` or `binary`: as metrics and traces label a batch.
    pub fn name(self) -> &'static str {
        match self {
            CopyFormat::Text => "text",
            CopyFormat::Binary => "binary",
        }
    }

    /// The `COPY` option that selects the format, with its leading space.
    pub fn copy_option(self) -> &'static str {
        match self {
            CopyFormat::Text => "",
            CopyFormat::Binary => " (FORMAT binary)",
        }
    }

    /// The manifest's name for an uncompressed stream in this format.
    pub fn data_format(self) -> &'static str {
        match self {
            CopyFormat::Text => DATA_FORMAT_PG_COPY_TEXT,
            CopyFormat::Binary => DATA_FORMAT_PG_COPY_BINARY,
        }
    }

    /// The format a manifest's `data_format` names (`+lz4` is the object's compression).
    pub fn from_data_format(name: &str) -> Result<CopyFormat, String> {
        match name.strip_suffix("+lz4").unwrap_or(name) {
            DATA_FORMAT_PG_COPY_TEXT => Ok(CopyFormat::Text),
            DATA_FORMAT_PG_COPY_BINARY => Ok(CopyFormat::Binary),
            other => Err(format!("unknown staged data format {other:?}")),
        }
    }

    /// The rows of a stream (text: lines without their newline; binary: whole tuples).
    pub fn rows(self, data: &[u8]) -> Result<Vec<&[u8]>, String> {
        match self {
            CopyFormat::Text => Ok(copy_text::rows(data).collect()),
            CopyFormat::Binary => copy_binary::rows(data),
        }
    }

    /// A complete stream of the given rows.
    pub fn join<'a>(self, rows: impl IntoIterator<Item = &'a [u8]>) -> Vec<u8> {
        match self {
            CopyFormat::Text => {
                let mut out = Vec::new();
                for row in rows {
                    out.extend_from_slice(row);
                    out.push(b'\n');
                }
                out
            }
            CopyFormat::Binary => copy_binary::stream(rows),
        }
    }

    /// Two streams as one, the first's rows first.
    pub fn concat(self, first: &[u8], second: &[u8]) -> Result<Vec<u8>, String> {
        match self {
            CopyFormat::Text => Ok([first, second].concat()),
            CopyFormat::Binary => copy_binary::concat(first, second),
        }
    }

    /// Field `index` of a row as staged, undecoded (text: still escaped; binary: the value's
    /// `send` form), to compare rather than read: `None` past the last field, `Some(None)` for
    /// NULL.
    pub fn raw_field(self, row: &[u8], index: usize) -> Option<Option<&[u8]>> {
        match self {
            CopyFormat::Text => copy_text::raw_field(row, index).map(|raw| (raw != b"\\N").then_some(raw)),
            CopyFormat::Binary => copy_binary::field(row, index),
        }
    }

    /// Field `index` of a row as text (`None`: NULL), decoded as `sql_type` in binary.
    pub fn field_text(self, row: &[u8], index: usize, sql_type: &str) -> Result<Option<String>, String> {
        match self {
            CopyFormat::Text => {
                let raw = copy_text::raw_field(row, index).ok_or_else(|| format!("row has no field {index}"))?;
                copy_text::decode_field(raw)
            }
            CopyFormat::Binary => match copy_binary::field(row, index) {
                None => Err(format!("row has no field {index}")),
                Some(None) => Ok(None),
                Some(Some(bytes)) => copy_binary::decode_text(sql_type, bytes).map(Some),
            },
        }
    }

    /// A `bigint` field (`None`: NULL).
    pub fn field_i64(self, row: &[u8], index: usize) -> Result<Option<i64>, String> {
        match self {
            CopyFormat::Text => match self.field_text(row, index, "bigint")? {
                None => Ok(None),
                Some(text) => text
                    .parse()
                    .map(Some)
                    .map_err(|_| format!("field {index} ({text:?}) is not an integer")),
            },
            CopyFormat::Binary => match copy_binary::field(row, index) {
                None => Err(format!("row has no field {index}")),
                Some(None) => Ok(None),
                Some(Some(bytes)) => copy_binary::decode_i64(bytes).map(Some),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn data_format_names_round_trip() {
        for format in [CopyFormat::Text, CopyFormat::Binary] {
            assert_eq!(CopyFormat::from_data_format(format.data_format()).unwrap(), format);
            let compressed = format!("{}+lz4", format.data_format());
            assert_eq!(CopyFormat::from_data_format(&compressed).unwrap(), format);
        }
        assert!(CopyFormat::from_data_format("csv").is_err());
    }

    #[test]
    fn text_rows_join_and_read() {
        let data = CopyFormat::Text.join([&b"1\ta"[..], &b"2\t\\N"[..]]);
        assert_eq!(data, b"1\ta\n2\t\\N\n");
        let rows = CopyFormat::Text.rows(&data).unwrap();
        assert_eq!(CopyFormat::Text.field_i64(rows[1], 0).unwrap(), Some(2));
        assert_eq!(CopyFormat::Text.field_text(rows[1], 1, "text").unwrap(), None);
        assert!(CopyFormat::Text.field_text(rows[1], 2, "text").is_err());
    }
}
