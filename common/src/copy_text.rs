//! The staged data format is PostgreSQL's COPY text stream exactly as the source produced it:
//! one row per line, fields separated by tabs, `\N` for NULL, backslash escapes inside fields.
//! The worker only decodes the few fields it needs (the key and the version of a page's last
//! row); the rest of the bytes go to the target's `COPY … FROM STDIN` untouched.

/// Splits a COPY text stream into rows (without their trailing newline).
pub fn rows(data: &[u8]) -> impl Iterator<Item = &[u8]> {
    let mut start = 0;
    memchr::memchr_iter(b'\n', data)
        .chain(std::iter::once(data.len()))
        .map(move |end| {
            let line = &data[start..end];
            start = end + 1;
            line
        })
        .filter(|line| !line.is_empty())
}

/// The raw (still escaped) field at `index`; a raw tab is always a separator because tabs in
/// data are written as `\t`.
pub fn raw_field(row: &[u8], index: usize) -> Option<&[u8]> {
    row.split(|b| *b == b'\t').nth(index)
}

/// Decodes one field: `None` for SQL NULL, otherwise the unescaped text.
pub fn decode_field(raw: &[u8]) -> Result<Option<String>, String> {
    match decode_bytes(raw)? {
        None => Ok(None),
        Some(bytes) => String::from_utf8(bytes)
            .map(Some)
            .map_err(|_| "COPY field is not valid UTF-8".into()),
    }
}

/// [`decode_field`] without the UTF-8 check: the field's bytes.
pub fn decode_bytes(raw: &[u8]) -> Result<Option<Vec<u8>>, String> {
    if raw == b"\\N" {
        return Ok(None);
    }
    let mut out = Vec::with_capacity(raw.len());
    let mut i = 0;
    while i < raw.len() {
        let byte = raw[i];
        if byte != b'\\' {
            out.push(byte);
            i += 1;
            continue;
        }
        let Some(&next) = raw.get(i + 1) else {
            return Err("COPY field ends with a lone backslash".into());
        };
        i += 2;
        match next {
            b'b' => out.push(8),
            b'f' => out.push(12),
            b'n' => out.push(b'\n'),
            b'r' => out.push(b'\r'),
            b't' => out.push(b'\t'),
            b'v' => out.push(11),
            b'0'..=b'7' => {
                let mut value = u32::from(next - b'0');
                let mut digits = 1;
                while digits < 3 && i < raw.len() && (b'0'..=b'7').contains(&raw[i]) {
                    value = value * 8 + u32::from(raw[i] - b'0');
                    i += 1;
                    digits += 1;
                }
                out.push((value & 0xff) as u8);
            }
            b'x' => {
                let mut value = 0u32;
                let mut digits = 0;
                while digits < 2 && i < raw.len() && raw[i].is_ascii_hexdigit() {
                    value = value * 16 + (raw[i] as char).to_digit(16).expect("hex digit");
                    i += 1;
                    digits += 1;
                }
                out.push(value as u8);
            }
            other => out.push(other),
        }
    }
    Ok(Some(out))
}

/// Encodes one field for a COPY text stream: backslash, tab, newline and carriage return
/// escaped (the inverse of [`decode_field`] for text).
pub fn encode_field(text: &str, out: &mut Vec<u8>) {
    encode_bytes(text.as_bytes(), out);
}

/// [`encode_field`] for bytes as a source sent them (a NUL byte passes through, and the
/// target refuses it as a row).
pub fn encode_bytes(text: &[u8], out: &mut Vec<u8>) {
    // Runs without a byte to escape are copied whole (most values are one such run).
    let mut rest = text;
    loop {
        let special = memchr::memchr3(b'\\', b'\t', b'\n', rest);
        let at = match memchr::memchr(b'\r', &rest[..special.unwrap_or(rest.len())]) {
            Some(cr) => cr,
            None => match special {
                Some(at) => at,
                None => break,
            },
        };
        out.extend_from_slice(&rest[..at]);
        out.extend_from_slice(match rest[at] {
            b'\\' => b"\\\\",
            b'\t' => b"\\t",
            b'\n' => b"\\n",
            _ => b"\\r",
        });
        rest = &rest[at + 1..];
    }
    out.extend_from_slice(rest);
}

/// The NULL marker of a COPY text stream.
pub const NULL_FIELD: &[u8] = b"\\N";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decodes_escapes_and_null() {
        let data = b"1\ta\\tb\\\\c\t\\N\n2\tx\\012y\t\\x41\n";
        let all: Vec<&[u8]> = rows(data).collect();
        assert_eq!(all.len(), 2);
        assert_eq!(decode_field(raw_field(all[0], 1).unwrap()).unwrap().unwrap(), "a\tb\\c");
        assert_eq!(decode_field(raw_field(all[0], 2).unwrap()).unwrap(), None);
        assert_eq!(decode_field(raw_field(all[1], 1).unwrap()).unwrap().unwrap(), "x\ny");
        assert_eq!(decode_field(raw_field(all[1], 2).unwrap()).unwrap().unwrap(), "A");
    }

    #[test]
    fn rows_split_at_newlines_and_skip_empty_lines() {
        let all: Vec<&[u8]> = rows(b"a\tb\n\nc\nd").collect();
        assert_eq!(all, vec![&b"a\tb"[..], b"c", b"d"]);
        assert_eq!(rows(b"").count(), 0);
        assert_eq!(rows(b"\n").count(), 0);
    }

    #[test]
    fn encode_escapes_every_special_byte_wherever_it_is() {
        for (text, escaped) in [
            (&b"plain"[..], &b"plain"[..]),
            (b"\r", b"\\r"),
            (b"a\rb\tc\nd\\e", b"a\\rb\\tc\\nd\\\\e"),
            (b"\n\r\t\\", b"\\n\\r\\t\\\\"),
            (b"x\0y", b"x\0y"),
        ] {
            let mut out = Vec::new();
            encode_bytes(text, &mut out);
            assert_eq!(out, escaped, "{text:?}");
        }
    }

    #[test]
    fn encode_round_trips() {
        let text = "a\tb\\c\nd\re";
        let mut out = Vec::new();
        encode_field(text, &mut out);
        assert!(!out.contains(&b'\t') && !out.contains(&b'\n'));
        assert_eq!(decode_field(&out).unwrap().unwrap(), text);
    }
}
