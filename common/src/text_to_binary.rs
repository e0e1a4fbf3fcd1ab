//! A value's text, as a PostgreSQL type's input function reads it, in that type's binary
//! `send` form: what lets a source that renders text (MySQL's text protocol) stage its pages as
//! binary COPY for a PostgreSQL target, which then skips parsing numbers, times and uuids.
//!
//! An encoder is exact or refuses: it accepts only the plain rendering a source produces
//! (`-12.50`, `2026-01-01 00:00:00.123`, `t`), and gives the bytes that the type's
//! `receive` function turns into the value its input function makes of the same text. A text
//! it refuses (a zero date, a NUL byte, a boolean of 5) is left to the text format, where the
//! target judges the row as it always did: the caller reads the page as text instead.

/// Days from 0001-01-01 (proleptic Gregorian) to PostgreSQL's epoch, 2000-01-01.
const PG_EPOCH_DAYS: i64 = 730_119;
const MICROS_PER_DAY: i64 = 86_400_000_000;

/// How one field's text becomes its binary form.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FieldEncoder {
    Int2,
    Int4,
    Int8,
    Bool,
    Float4,
    Float8,
    Numeric,
    /// `text`, `character varying(n)`, `character(n)`, `json`: the bytes themselves.
    Text,
    Jsonb,
    /// `bytea` rendered as `\x` and hex digits.
    Bytea,
    Uuid,
    Date,
    Timestamp,
    /// `timestamp with time zone` rendered in UTC with a `+00` suffix.
    TimestampTz,
}

impl FieldEncoder {
    /// The encoder of a type as `format_type` prints it; `None` for a type this module does
    /// not encode (a page with such a field is read as text).
    pub fn for_type(sql_type: &str) -> Option<FieldEncoder> {
        // The type without its modifiers: `timestamp(3) with time zone` is a
        // `timestamp with time zone`, `numeric(12,2)` a `numeric`.
        let base = match (sql_type.find('('), sql_type.find(')')) {
            (Some(open), Some(close)) if open < close => format!("{}{}", &sql_type[..open], &sql_type[close + 1..]),
            _ => sql_type.to_string(),
        };
        Some(match base.as_str() {
            "smallint" => FieldEncoder::Int2,
            "integer" => FieldEncoder::Int4,
            "bigint" => FieldEncoder::Int8,
            "boolean" => FieldEncoder::Bool,
            "real" => FieldEncoder::Float4,
            "double precision" => FieldEncoder::Float8,
            "numeric" => FieldEncoder::Numeric,
            "text" | "character varying" | "character" | "json" => FieldEncoder::Text,
            "jsonb" => FieldEncoder::Jsonb,
            "bytea" => FieldEncoder::Bytea,
            "uuid" => FieldEncoder::Uuid,
            "date" => FieldEncoder::Date,
            "timestamp with time zone" => FieldEncoder::TimestampTz,
            "timestamp without time zone" | "timestamp" => FieldEncoder::Timestamp,
            _ => return None,
        })
    }

    /// Appends the field (its 32-bit length, then its bytes) to a tuple; `Err` names why the
    /// text has no exact binary form here, and `out` is then to be dropped.
    pub fn encode(self, text: &[u8], out: &mut Vec<u8>) -> Result<(), String> {
        let at = out.len();
        out.extend_from_slice(&[0; 4]);
        match self {
            FieldEncoder::Int2 => {
                out.extend_from_slice(&i16::try_from(integer(text)?).map_err(|_| range(text))?.to_be_bytes())
            }
            FieldEncoder::Int4 => {
                out.extend_from_slice(&i32::try_from(integer(text)?).map_err(|_| range(text))?.to_be_bytes())
            }
            FieldEncoder::Int8 => out.extend_from_slice(&integer(text)?.to_be_bytes()),
            FieldEncoder::Bool => out.push(match text {
                b"t" => 1,
                b"f" => 0,
                _ => return Err(format!("{:?} is not t or f", lossy(text))),
            }),
            FieldEncoder::Float4 => {
                let value: f32 = float(text)?.parse().map_err(|_| range(text))?;
                if !(value.is_normal() || (value == 0.0 && zero(text))) {
                    return Err(range(text));
                }
                out.extend_from_slice(&value.to_be_bytes());
            }
            FieldEncoder::Float8 => {
                let value: f64 = float(text)?.parse().map_err(|_| range(text))?;
                if !(value.is_normal() || (value == 0.0 && zero(text))) {
                    return Err(range(text));
                }
                out.extend_from_slice(&value.to_be_bytes());
            }
            FieldEncoder::Numeric => numeric(text, out)?,
            FieldEncoder::Text => out.extend_from_slice(utf8(text)?.as_bytes()),
            FieldEncoder::Jsonb => {
                out.push(1);
                out.extend_from_slice(utf8(text)?.as_bytes());
            }
            FieldEncoder::Bytea => {
                let hex = text
                    .strip_prefix(b"\\x")
                    .ok_or_else(|| format!("{:?} is not \\x hex", lossy(text)))?;
                out.extend_from_slice(&hex::decode(hex).map_err(|e| format!("bytea hex: {e}"))?);
            }
            FieldEncoder::Uuid => out.extend_from_slice(&uuid(text)?),
            FieldEncoder::Date => {
                let (days, rest) = date(text)?;
                if !rest.is_empty() {
                    return Err(format!("{:?} is not a date", lossy(text)));
                }
                out.extend_from_slice(&i32::try_from(days).map_err(|_| range(text))?.to_be_bytes());
            }
            FieldEncoder::Timestamp => out.extend_from_slice(&timestamp(text)?.to_be_bytes()),
            FieldEncoder::TimestampTz => {
                let utc = text
                    .strip_suffix(b"+00")
                    .ok_or_else(|| format!("{:?} is not a UTC time", lossy(text)))?;
                out.extend_from_slice(&timestamp(utc)?.to_be_bytes());
            }
        }
        let len = (out.len() - at - 4) as i32;
        out[at..at + 4].copy_from_slice(&len.to_be_bytes());
        Ok(())
    }
}

fn lossy(text: &[u8]) -> String {
    String::from_utf8_lossy(&text[..text.len().min(40)]).into_owned()
}

fn range(text: &[u8]) -> String {
    format!("{:?} is out of the type's range", lossy(text))
}

/// Text that PostgreSQL's text input would take: valid UTF-8 without a NUL byte (which the
/// target refuses: its row goes the text way, to be judged and dead-lettered there).
fn utf8(text: &[u8]) -> Result<&str, String> {
    if text.contains(&0) {
        return Err("text holds a NUL byte".into());
    }
    std::str::from_utf8(text).map_err(|_| "text is not valid UTF-8".into())
}

/// `-?[0-9]+`, as an i64.
fn integer(text: &[u8]) -> Result<i64, String> {
    let digits = text.strip_prefix(b"-").unwrap_or(text);
    if digits.is_empty() || digits.len() > 19 || !digits.iter().all(u8::is_ascii_digit) {
        return Err(format!("{:?} is not an integer", lossy(text)));
    }
    let mut value: i128 = 0;
    for &d in digits {
        value = value * 10 + i128::from(d - b'0');
    }
    if text.starts_with(b"-") {
        value = -value;
    }
    i64::try_from(value).map_err(|_| range(text))
}

/// A finite decimal or exponent rendering (no `inf`, `nan` or spaces), for Rust's correctly
/// rounded parse, as `strtod` rounds it.
fn float(text: &[u8]) -> Result<&str, String> {
    let plain = !text.is_empty()
        && text.iter().any(u8::is_ascii_digit)
        && text
            .iter()
            .all(|b| b.is_ascii_digit() || matches!(b, b'-' | b'+' | b'.' | b'e' | b'E'));
    if !plain {
        return Err(format!("{:?} is not a finite number", lossy(text)));
    }
    Ok(std::str::from_utf8(text).expect("ASCII"))
}

/// Whether a number's rendering is zero itself (no nonzero digit before its exponent), as
/// opposed to a value too small for the type, which PostgreSQL refuses as out of range (and
/// so does a subnormal one here: it is left to the text format).
fn zero(text: &[u8]) -> bool {
    let mantissa = text.split(|&b| b == b'e' || b == b'E').next().unwrap_or(text);
    mantissa.iter().all(|&b| !(b'1'..=b'9').contains(&b))
}

/// `-?[0-9]+(\.[0-9]+)?` as `numeric_send` writes it: digit count, weight (in base-10000
/// digits before the point, minus one), sign, display scale, then base-10000 digits without
/// leading or trailing zero digits.
fn numeric(text: &[u8], out: &mut Vec<u8>) -> Result<(), String> {
    let negative = text.starts_with(b"-");
    let unsigned = text.strip_prefix(b"-").unwrap_or(text);
    let (int, frac) = match unsigned.iter().position(|&b| b == b'.') {
        Some(point) => (&unsigned[..point], &unsigned[point + 1..]),
        None => (unsigned, &b""[..]),
    };
    let digits_only = |part: &[u8]| part.iter().all(u8::is_ascii_digit);
    if int.is_empty() || !digits_only(int) || !digits_only(frac) || (unsigned.len() > int.len() && frac.is_empty()) {
        return Err(format!("{:?} is not a decimal", lossy(text)));
    }
    if int.len() > 4 * 8192 || frac.len() > 16383 {
        return Err(range(text));
    }
    let int = &int[int.iter().position(|&b| b != b'0').unwrap_or(int.len())..];
    // Base-10000 digits: the integer part grouped from the point leftwards, the fraction
    // from the point rightwards (padded with zeros).
    let group = |chunk: &[u8]| chunk.iter().fold(0i16, |acc, d| acc * 10 + i16::from(d - b'0'));
    let lead = int.len() % 4;
    let mut groups: Vec<i16> = Vec::with_capacity(int.len() / 4 + frac.len() / 4 + 2);
    if lead > 0 {
        groups.push(group(&int[..lead]));
    }
    groups.extend(int[lead..].chunks(4).map(group));
    let mut weight = groups.len() as i32 - 1;
    for chunk in frac.chunks(4) {
        let mut value = group(chunk);
        for _ in chunk.len()..4 {
            value *= 10;
        }
        groups.push(value);
    }
    let first = groups.iter().position(|&g| g != 0);
    let (digits, sign) = match first {
        None => {
            weight = 0;
            (&groups[..0], 0x0000u16)
        }
        Some(first) => {
            weight -= first as i32;
            let last = groups.iter().rposition(|&g| g != 0).expect("a nonzero digit");
            (&groups[first..=last], if negative { 0x4000 } else { 0x0000 })
        }
    };
    out.extend_from_slice(&(digits.len() as i16).to_be_bytes());
    out.extend_from_slice(&(weight as i16).to_be_bytes());
    out.extend_from_slice(&sign.to_be_bytes());
    out.extend_from_slice(&(frac.len() as i16).to_be_bytes());
    for digit in digits {
        out.extend_from_slice(&digit.to_be_bytes());
    }
    Ok(())
}

fn uuid(text: &[u8]) -> Result<[u8; 16], String> {
    let bad = || format!("{:?} is not a uuid", lossy(text));
    if text.len() != 36 || [8, 13, 18, 23].iter().any(|&i| text[i] != b'-') {
        return Err(bad());
    }
    let hex: Vec<u8> = text.iter().copied().filter(|&b| b != b'-').collect();
    let mut bytes = [0u8; 16];
    hex::decode_to_slice(&hex, &mut bytes).map_err(|_| bad())?;
    Ok(bytes)
}

/// `n` ASCII digits as a number.
fn fixed_digits(text: &[u8]) -> Option<i64> {
    text.iter().try_fold(0i64, |acc, &d| {
        d.is_ascii_digit().then(|| acc * 10 + i64::from(d - b'0'))
    })
}

/// `YYYY-MM-DD` at the start of `text`: days since 2000-01-01, and the rest of the text.
fn date(text: &[u8]) -> Result<(i64, &[u8]), String> {
    let bad = || format!("{:?} is not a date of years 1 to 9999", lossy(text));
    if text.len() < 10 || text[4] != b'-' || text[7] != b'-' {
        return Err(bad());
    }
    let year = fixed_digits(&text[..4]).ok_or_else(bad)?;
    let month = fixed_digits(&text[5..7]).ok_or_else(bad)?;
    let day = fixed_digits(&text[8..10]).ok_or_else(bad)?;
    let leap = (year % 4 == 0 && year % 100 != 0) || year % 400 == 0;
    let month_days = match month {
        1 | 3 | 5 | 7 | 8 | 10 | 12 => 31,
        4 | 6 | 9 | 11 => 30,
        2 if leap => 29,
        2 => 28,
        _ => return Err(bad()),
    };
    if year < 1 || day < 1 || day > month_days {
        return Err(bad());
    }
    Ok((days_from_civil(year, month, day) - PG_EPOCH_DAYS, &text[10..]))
}

/// Days from 0001-01-01 to the given proleptic Gregorian date.
fn days_from_civil(year: i64, month: i64, day: i64) -> i64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (month + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    // Days since 0000-03-01, then moved to 0001-01-01 (306 days later).
    era * 146_097 + doe - 306
}

/// `YYYY-MM-DD HH:MM:SS[.f{1,6}]` of a date that exists in years 1 to 9999: microseconds
/// since 2000-01-01 00:00:00.
pub fn timestamp_micros(text: &[u8]) -> Result<i64, String> {
    timestamp(text)
}

fn timestamp(text: &[u8]) -> Result<i64, String> {
    let bad = || format!("{:?} is not a time of years 1 to 9999", lossy(text));
    let (days, rest) = date(text)?;
    if rest.len() < 9 || rest[0] != b' ' || rest[3] != b':' || rest[6] != b':' {
        return Err(bad());
    }
    let hour = fixed_digits(&rest[1..3]).ok_or_else(bad)?;
    let minute = fixed_digits(&rest[4..6]).ok_or_else(bad)?;
    let second = fixed_digits(&rest[7..9]).ok_or_else(bad)?;
    if hour > 23 || minute > 59 || second > 59 {
        return Err(bad());
    }
    let fraction = match &rest[9..] {
        [] => 0,
        [b'.', digits @ ..] if (1..=6).contains(&digits.len()) => {
            fixed_digits(digits).ok_or_else(bad)? * 10i64.pow(6 - digits.len() as u32)
        }
        _ => return Err(bad()),
    };
    Ok(days * MICROS_PER_DAY + ((hour * 60 + minute) * 60 + second) * 1_000_000 + fraction)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn encode(sql_type: &str, text: &str) -> Result<Vec<u8>, String> {
        let mut out = Vec::new();
        FieldEncoder::for_type(sql_type)
            .unwrap_or_else(|| panic!("no encoder for {sql_type}"))
            .encode(text.as_bytes(), &mut out)?;
        let len = i32::from_be_bytes(out[..4].try_into().unwrap()) as usize;
        assert_eq!(len, out.len() - 4, "length prefix of {text}");
        Ok(out[4..].to_vec())
    }

    fn numeric_parts(bytes: &[u8]) -> (i16, i16, u16, i16, Vec<i16>) {
        let word = |i: usize| i16::from_be_bytes([bytes[2 * i], bytes[2 * i + 1]]);
        let ndigits = word(0);
        let digits = (0..ndigits as usize).map(|i| word(4 + i)).collect();
        (ndigits, word(1), word(2) as u16, word(3), digits)
    }

    #[test]
    fn integers_floats_and_booleans() {
        assert_eq!(
            encode("bigint", "-9223372036854775808").unwrap(),
            i64::MIN.to_be_bytes()
        );
        assert_eq!(encode("integer", "2147483647").unwrap(), i32::MAX.to_be_bytes());
        assert_eq!(encode("smallint", "-5").unwrap(), (-5i16).to_be_bytes());
        assert!(encode("smallint", "40000").is_err());
        assert!(encode("bigint", "9223372036854775808").is_err());
        assert!(encode("integer", "1.5").is_err() && encode("integer", "").is_err() && encode("integer", "-").is_err());
        assert_eq!(encode("double precision", "1e20").unwrap(), 1e20f64.to_be_bytes());
        assert_eq!(encode("real", "0.1").unwrap(), 0.1f32.to_be_bytes());
        assert!(encode("double precision", "inf").is_err() && encode("real", "NaN").is_err());
        assert!(
            encode("real", "1e39").is_err()
                && encode("real", "1e-40").is_err()
                && encode("double precision", "1e-320").is_err()
        );
        assert_eq!(encode("double precision", "-0").unwrap(), (-0.0f64).to_be_bytes());
        assert_eq!(encode("real", "0e5").unwrap(), 0.0f32.to_be_bytes());
        assert_eq!(
            FieldEncoder::for_type("timestamp with time zone"),
            Some(FieldEncoder::TimestampTz)
        );
        assert_eq!(
            FieldEncoder::for_type("timestamp(6) without time zone"),
            Some(FieldEncoder::Timestamp)
        );
        assert_eq!(FieldEncoder::for_type("character varying"), Some(FieldEncoder::Text));
        assert_eq!(encode("boolean", "t").unwrap(), [1]);
        assert_eq!(encode("boolean", "f").unwrap(), [0]);
        assert!(encode("boolean", "5").is_err());
    }

    #[test]
    fn numerics_in_base_ten_thousand() {
        // 12345.678 = 1|2345.6780: weight 1, display scale 3.
        assert_eq!(
            numeric_parts(&encode("numeric(12,3)", "12345.678").unwrap()),
            (3, 1, 0, 3, vec![1, 2345, 6780])
        );
        assert_eq!(
            numeric_parts(&encode("numeric", "-0.0001").unwrap()),
            (1, -1, 0x4000, 4, vec![1])
        );
        assert_eq!(
            numeric_parts(&encode("numeric(12,2)", "0.00").unwrap()),
            (0, 0, 0, 2, vec![])
        );
        assert_eq!(
            numeric_parts(&encode("numeric(12,2)", "-0.00").unwrap()),
            (0, 0, 0, 2, vec![])
        );
        assert_eq!(
            numeric_parts(&encode("numeric(20,0)", "18446744073709551615").unwrap()),
            (5, 4, 0, 0, vec![1844, 6744, 737, 955, 1615])
        );
        assert_eq!(
            numeric_parts(&encode("numeric", "100000000").unwrap()),
            (1, 2, 0, 0, vec![1])
        );
        assert_eq!(
            numeric_parts(&encode("numeric", "000120.5").unwrap()),
            (2, 0, 0, 1, vec![120, 5000])
        );
        for bad in ["1.", ".5", "1e5", "", "-", "1.2.3", " 1"] {
            assert!(encode("numeric", bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn dates_and_times_count_from_two_thousand() {
        assert_eq!(encode("date", "2000-01-01").unwrap(), 0i32.to_be_bytes());
        assert_eq!(encode("date", "1999-12-31").unwrap(), (-1i32).to_be_bytes());
        assert_eq!(encode("date", "2024-02-29").unwrap(), 8825i32.to_be_bytes());
        assert_eq!(encode("date", "0001-01-01").unwrap(), (-730_119i32).to_be_bytes());
        for bad in ["0000-00-00", "2023-02-29", "2024-13-01", "2024-1-01", "2024-01-01x"] {
            assert!(encode("date", bad).is_err(), "{bad}");
        }
        // 2026-01-01 is 9497 days after 2000-01-01.
        let micros = 9497 * MICROS_PER_DAY + 3_723_000_000 + 123_000;
        assert_eq!(
            encode("timestamp(3) with time zone", "2026-01-01 01:02:03.123+00").unwrap(),
            micros.to_be_bytes()
        );
        assert_eq!(
            encode("timestamp(6) without time zone", "2026-01-01 01:02:03.000123").unwrap(),
            (micros - 123_000 + 123).to_be_bytes()
        );
        assert_eq!(
            encode("timestamp(0) without time zone", "1000-01-01 00:00:00").unwrap(),
            ((days_from_civil(1000, 1, 1) - PG_EPOCH_DAYS) * MICROS_PER_DAY).to_be_bytes()
        );
        for bad in [
            "0000-00-00 00:00:00",
            "2026-01-01 24:00:00",
            "2026-01-01 00:00:00.",
            "2026-01-01 00:00:00.1234567",
            "2026-01-01T00:00:00",
        ] {
            assert!(encode("timestamp(6) without time zone", bad).is_err(), "{bad}");
        }
        assert!(encode("timestamp(3) with time zone", "2026-01-01 00:00:00").is_err());
    }

    #[test]
    fn text_uuids_bytes_and_json() {
        assert_eq!(encode("character varying(10)", "é\t\\").unwrap(), "é\t\\".as_bytes());
        assert_eq!(encode("character(36)", "x").unwrap(), b"x");
        assert!(encode("text", "a\0b").is_err());
        assert!(FieldEncoder::Text.encode(&[0xff, 0xfe], &mut Vec::new()).is_err());
        assert_eq!(
            encode("uuid", "12345678-9abc-def0-0123-456789abcdef").unwrap(),
            [
                0x12, 0x34, 0x56, 0x78, 0x9a, 0xbc, 0xde, 0xf0, 0x01, 0x23, 0x45, 0x67, 0x89, 0xab, 0xcd, 0xef
            ]
        );
        assert!(encode("uuid", "123456789abcdef00123456789abcdef").is_err());
        assert_eq!(encode("bytea", "\\x00ff41").unwrap(), [0, 255, 0x41]);
        assert!(encode("bytea", "00ff").is_err());
        assert_eq!(encode("jsonb", "{\"a\": 1}").unwrap(), b"\x01{\"a\": 1}");
        for unsupported in ["interval", "bit(3)", "inet", "integer[]", "time without time zone"] {
            assert_eq!(FieldEncoder::for_type(unsupported), None, "{unsupported}");
        }
    }
}
