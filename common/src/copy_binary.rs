//! PostgreSQL's binary COPY stream: a 19-byte header, then one tuple per row (a 16-bit field
//! count, then per field a 32-bit length, -1 for NULL, and that many bytes in the type's
//! `send` form), then a 16-bit -1 trailer. All integers are big-endian.
//!
//! Like the text format, the stream is staged exactly as the source produced it. The worker
//! only finds row boundaries and decodes the few fields it needs (a page's last key, its
//! cursor time, a dead letter's key); everything else goes to the target's
//! `COPY … FROM STDIN (FORMAT binary)` untouched.

/// `PGCOPY\n\377\r\n\0`, flags 0, header extension length 0.
pub const HEADER: [u8; 19] = *b"PGCOPY\n\xff\r\n\0\0\0\0\0\0\0\0\0";
/// The field count -1 that ends the stream.
pub const TRAILER: [u8; 2] = [0xff, 0xff];

/// Key types whose binary form [`decode_text`] turns into the text the type's input function
/// reads back.
pub fn decodable(sql_type: &str) -> bool {
    matches!(
        sql_type,
        "smallint" | "integer" | "bigint" | "uuid" | "text" | "boolean"
    ) || sql_type.starts_with("character varying")
        || sql_type.starts_with("character(")
        || sql_type == "character"
}

/// The rows of a stream, each a complete tuple (field count and fields), without header and
/// trailer. An empty input is a stream of no rows.
pub fn rows(data: &[u8]) -> Result<Vec<&[u8]>, String> {
    if data.is_empty() {
        return Ok(Vec::new());
    }
    let body = body(data)?;
    let mut rows = Vec::new();
    let mut at = 0;
    while at < body.len() {
        let len = row_len(&body[at..])?;
        rows.push(&body[at..at + len]);
        at += len;
    }
    Ok(rows)
}

/// The tuples between header and trailer. The header's extension area is skipped; a stream
/// with OIDs (flag bit 16) is refused, as COPY without `WITH OIDS` never writes one.
fn body(data: &[u8]) -> Result<&[u8], String> {
    if data.len() < HEADER.len() + TRAILER.len() || data[..11] != HEADER[..11] {
        return Err("binary COPY stream has no PGCOPY header".into());
    }
    let flags = u32::from_be_bytes(data[11..15].try_into().expect("4 bytes"));
    if flags & (1 << 16) != 0 {
        return Err("binary COPY stream carries OIDs".into());
    }
    let extension = u32::from_be_bytes(data[15..19].try_into().expect("4 bytes")) as usize;
    let start = 19 + extension;
    if data.len() < start + TRAILER.len() || data[data.len() - 2..] != TRAILER {
        return Err("binary COPY stream is truncated (no trailer)".into());
    }
    Ok(&data[start..data.len() - 2])
}

/// Length in bytes of the tuple at the start of `data`.
fn row_len(data: &[u8]) -> Result<usize, String> {
    let truncated = || "binary COPY tuple is truncated".to_string();
    let count = i16::from_be_bytes(data.get(..2).ok_or_else(truncated)?.try_into().expect("2 bytes"));
    if count < 0 {
        return Err("binary COPY stream has data after its trailer".into());
    }
    let mut at = 2;
    for _ in 0..count {
        let len = i32::from_be_bytes(data.get(at..at + 4).ok_or_else(truncated)?.try_into().expect("4 bytes"));
        at += 4;
        if len > 0 {
            at += len as usize;
        } else if len < -1 {
            return Err(format!("binary COPY field has length {len}"));
        }
        if at > data.len() {
            return Err(truncated());
        }
    }
    Ok(at)
}

/// The field at `index` of one tuple: `None` past the last field, `Some(None)` for NULL.
pub fn field(row: &[u8], index: usize) -> Option<Option<&[u8]>> {
    let count = i16::from_be_bytes(row.get(..2)?.try_into().ok()?);
    if index >= count.max(0) as usize {
        return None;
    }
    let mut at = 2;
    for i in 0..=index {
        let len = i32::from_be_bytes(row.get(at..at + 4)?.try_into().ok()?);
        at += 4;
        if len < 0 {
            if i == index {
                return Some(None);
            }
            continue;
        }
        let end = at + len as usize;
        if i == index {
            return row.get(at..end).map(Some);
        }
        at = end;
    }
    None
}

/// A complete stream of the given tuples.
pub fn stream<'a>(rows: impl IntoIterator<Item = &'a [u8]>) -> Vec<u8> {
    let mut out = HEADER.to_vec();
    for row in rows {
        out.extend_from_slice(row);
    }
    out.extend_from_slice(&TRAILER);
    out
}

/// Two streams as one: the first's header and tuples, the second's tuples and trailer.
pub fn concat(first: &[u8], second: &[u8]) -> Result<Vec<u8>, String> {
    match (first.is_empty(), second.is_empty()) {
        (true, _) => return Ok(second.to_vec()),
        (_, true) => return Ok(first.to_vec()),
        _ => {}
    }
    let (a, b) = (body(first)?, body(second)?);
    let mut out = Vec::with_capacity(HEADER.len() + a.len() + b.len() + TRAILER.len());
    out.extend_from_slice(&HEADER);
    out.extend_from_slice(a);
    out.extend_from_slice(b);
    out.extend_from_slice(&TRAILER);
    Ok(out)
}

/// A field's value as the text its type's input function reads (for the types
/// [`decodable`] accepts).
pub fn decode_text(sql_type: &str, bytes: &[u8]) -> Result<String, String> {
    let wrong = || format!("binary {sql_type} field has {} bytes", bytes.len());
    Ok(match sql_type {
        "smallint" => i16::from_be_bytes(bytes.try_into().map_err(|_| wrong())?).to_string(),
        "integer" => i32::from_be_bytes(bytes.try_into().map_err(|_| wrong())?).to_string(),
        "bigint" => decode_i64(bytes)?.to_string(),
        "boolean" => match bytes {
            [0] => "f".to_string(),
            [_] => "t".to_string(),
            _ => return Err(wrong()),
        },
        "uuid" => {
            let b: [u8; 16] = bytes.try_into().map_err(|_| wrong())?;
            let hex = hex::encode(b);
            format!(
                "{}-{}-{}-{}-{}",
                &hex[..8],
                &hex[8..12],
                &hex[12..16],
                &hex[16..20],
                &hex[20..]
            )
        }
        _ if decodable(sql_type) => {
            String::from_utf8(bytes.to_vec()).map_err(|_| format!("binary {sql_type} field is not valid UTF-8"))?
        }
        _ => return Err(format!("no binary decoder for type {sql_type}")),
    })
}

/// A `bigint` field (versions and cursor times).
pub fn decode_i64(bytes: &[u8]) -> Result<i64, String> {
    Ok(i64::from_be_bytes(bytes.try_into().map_err(|_| {
        format!("binary bigint field has {} bytes", bytes.len())
    })?))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tuple(fields: &[Option<&[u8]>]) -> Vec<u8> {
        let mut out = (fields.len() as i16).to_be_bytes().to_vec();
        for field in fields {
            match field {
                None => out.extend_from_slice(&(-1i32).to_be_bytes()),
                Some(bytes) => {
                    out.extend_from_slice(&(bytes.len() as i32).to_be_bytes());
                    out.extend_from_slice(bytes);
                }
            }
        }
        out
    }

    #[test]
    fn splits_rows_and_reads_fields() {
        let one = tuple(&[Some(&7i64.to_be_bytes()), None, Some(b"x\ny\tz")]);
        let two = tuple(&[Some(&(-3i64).to_be_bytes()), Some(b""), None]);
        let data = stream([one.as_slice(), two.as_slice()]);
        let all = rows(&data).unwrap();
        assert_eq!(all, vec![one.as_slice(), two.as_slice()]);
        assert_eq!(decode_text("bigint", field(all[0], 0).unwrap().unwrap()).unwrap(), "7");
        assert_eq!(field(all[0], 1), Some(None));
        assert_eq!(field(all[0], 2), Some(Some(&b"x\ny\tz"[..])));
        assert_eq!(field(all[0], 3), None);
        assert_eq!(decode_i64(field(all[1], 0).unwrap().unwrap()).unwrap(), -3);
        assert_eq!(field(all[1], 1), Some(Some(&b""[..])));
        assert!(rows(b"").unwrap().is_empty());
        assert!(rows(&stream([])).unwrap().is_empty());
    }

    #[test]
    fn refuses_truncated_and_foreign_streams() {
        let one = tuple(&[Some(b"abc")]);
        let data = stream([one.as_slice()]);
        assert!(rows(&data[..data.len() - 3]).is_err());
        assert!(rows(b"1\tabc\n").is_err());
        let mut cut = HEADER.to_vec();
        cut.extend_from_slice(&one[..5]);
        cut.extend_from_slice(&TRAILER);
        assert!(rows(&cut).is_err());
    }

    #[test]
    fn concatenates_streams() {
        let one = tuple(&[Some(b"a")]);
        let two = tuple(&[Some(b"b")]);
        let joined = concat(&stream([one.as_slice()]), &stream([two.as_slice()])).unwrap();
        assert_eq!(joined, stream([one.as_slice(), two.as_slice()]));
        assert_eq!(
            concat(b"", &stream([two.as_slice()])).unwrap(),
            stream([two.as_slice()])
        );
    }

    #[test]
    fn decodes_key_types_as_their_text() {
        let uuid = [
            0x12, 0x34, 0x56, 0x78, 0x9a, 0xbc, 0xde, 0xf0, 0x01, 0x23, 0x45, 0x67, 0x89, 0xab, 0xcd, 0xef,
        ];
        assert_eq!(
            decode_text("uuid", &uuid).unwrap(),
            "12345678-9abc-def0-0123-456789abcdef"
        );
        assert_eq!(decode_text("integer", &(-5i32).to_be_bytes()).unwrap(), "-5");
        assert_eq!(decode_text("smallint", &300i16.to_be_bytes()).unwrap(), "300");
        assert_eq!(decode_text("character varying(20)", "é".as_bytes()).unwrap(), "é");
        assert!(decode_text("integer", &[1, 2]).is_err());
        assert!(decode_text("numeric", &[0; 8]).is_err());
        assert!(decodable("character(3)") && !decodable("numeric") && !decodable("timestamp with time zone"));
    }
}
