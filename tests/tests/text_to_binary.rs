//! The worker's text-to-binary encoders against PostgreSQL's own input functions: for every
//! value the encoder takes, binary COPY of its bytes stores exactly what text COPY of the same
//! text stores, or both refuse the row. A text the encoder refuses goes the text way.

use sqlx::Row;
use tidemark_common::copy_binary;
use tidemark_common::copy_text;
use tidemark_common::text_to_binary::FieldEncoder;
use tidemark_tests::TestDb;

/// Values a source renders, per PostgreSQL type: plain ones, limits, and ones PostgreSQL
/// refuses.
fn cases() -> Vec<(&'static str, Vec<String>)> {
    let mut numerics: Vec<String> = [
        "0",
        "-0",
        "0.00",
        "-0.50",
        "1",
        "-1",
        "10000",
        "9999.9999",
        "0.0001",
        "-0.00001",
        "123456789012345678901234567890.123456789012345678901234567890",
        "18446744073709551615",
        "000042.4200",
        "99999999999999999999999999999999999.999999999999999999999999999999",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    // A spread of scales and signs.
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    for _ in 0..200 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let int = x % 10u64.pow((x % 15) as u32 + 1);
        let frac_digits = (x >> 40) % 9;
        let frac = (x >> 8) % 10u64.pow(frac_digits as u32);
        let sign = if x & 1 == 1 { "-" } else { "" };
        numerics.push(if frac_digits == 0 {
            format!("{sign}{int}")
        } else {
            format!("{sign}{int}.{frac:0width$}", width = frac_digits as usize)
        });
    }
    let strings = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    vec![
        ("numeric", numerics),
        (
            "numeric(12,2)",
            strings(&[
                "0.00",
                "-1234567890.12",
                "1.5",
                "1.005",
                "9999999999.99",
                "99999999999.99",
            ]),
        ),
        ("numeric(20,0)", strings(&["18446744073709551615", "0", "1"])),
        ("smallint", strings(&["0", "-32768", "32767", "32768", "1.0", "x"])),
        ("integer", strings(&["2147483647", "-2147483648", "2147483648"])),
        (
            "bigint",
            strings(&[
                "9223372036854775807",
                "-9223372036854775808",
                "9223372036854775808",
                "007",
            ]),
        ),
        ("boolean", strings(&["t", "f", "5", "true"])),
        (
            "real",
            strings(&[
                "0",
                "-0",
                "0.1",
                "3.4028235e38",
                "1e39",
                "1.17549435e-38",
                "1e-40",
                "1e-50",
                "-123.456",
            ]),
        ),
        (
            "double precision",
            strings(&[
                "0",
                "0.1",
                "1.7976931348623157e308",
                "1e309",
                "2.2250738585072014e-308",
                "5e-324",
                "1e20",
                "-1.5e-7",
            ]),
        ),
        (
            "timestamp(6) without time zone",
            strings(&[
                "2024-02-29 23:59:59.999999",
                "1000-01-01 00:00:00",
                "9999-12-31 23:59:59.999999",
                "1970-01-01 00:00:00.5",
                "0000-00-00 00:00:00",
                "2023-02-29 00:00:00",
                "2024-03-01 10:00:00.123456",
            ]),
        ),
        (
            "timestamp(0) without time zone",
            strings(&["2026-01-01 12:34:56", "1999-12-31 23:59:59"]),
        ),
        (
            "timestamp(3) with time zone",
            strings(&[
                "2026-01-01 00:00:00.123+00",
                "1970-01-01 00:00:00+00",
                "2038-01-19 03:14:07.999+00",
                "0000-00-00 00:00:00+00",
            ]),
        ),
        (
            "date",
            strings(&[
                "2000-01-01",
                "1000-01-01",
                "9999-12-31",
                "2024-02-29",
                "0000-00-00",
                "2023-02-29",
            ]),
        ),
        (
            "uuid",
            strings(&[
                "00000000-0000-0000-0000-000000000000",
                "12345678-9abc-def0-0123-456789abcdef",
                "not-a-uuid",
            ]),
        ),
        ("bytea", strings(&["\\x", "\\x00ff10", "\\x0"])),
        (
            "text",
            strings(&[
                "",
                "plain",
                "tab\there",
                "new\nline",
                "back\\slash",
                "\u{1F980} crab",
                "nul\0byte",
            ]),
        ),
        (
            "character varying(5)",
            strings(&["abc", "abcde", "abcdef", "é\u{1F980}"]),
        ),
        ("character(3)", strings(&["a", "abc", "ab ", "abcd"])),
        (
            "jsonb",
            strings(&["{\"a\": [1, 2.50, null]}", "[]", "{bad", "\"\\u0000\""]),
        ),
        ("json", strings(&["{\"a\":  1}", "{bad"])),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn encoders_store_what_the_text_input_stores_and_refuse_what_it_refuses() {
    let db = TestDb::create("text_to_binary").await;
    let (mut checked, mut both_refused, mut refused) = (0, 0, 0);
    let mut conn = db.pool.acquire().await.unwrap();
    // Hundreds of one-row commits: none needs to wait for the disk.
    sqlx::raw_sql("SET synchronous_commit = off")
        .execute(&mut *conn)
        .await
        .unwrap();
    for (sql_type, values) in cases() {
        let encoder = FieldEncoder::for_type(sql_type).unwrap_or_else(|| panic!("no encoder for {sql_type}"));
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "DROP TABLE IF EXISTS via_text, via_binary; CREATE TABLE via_text (v {sql_type}); \
             CREATE TABLE via_binary (v {sql_type})"
        )))
        .execute(&mut *conn)
        .await
        .unwrap();
        for (i, text) in values.iter().enumerate() {
            sqlx::raw_sql("DELETE FROM via_text; DELETE FROM via_binary")
                .execute(&mut *conn)
                .await
                .unwrap();
            let mut line = Vec::new();
            copy_text::encode_bytes(text.as_bytes(), &mut line);
            line.push(b'\n');
            let by_text = async {
                let mut copy = conn.copy_in_raw("COPY via_text FROM STDIN").await?;
                copy.send(line.as_slice()).await?;
                copy.finish().await
            }
            .await;
            let mut tuple = 1i16.to_be_bytes().to_vec();
            if encoder.encode(text.as_bytes(), &mut tuple).is_err() {
                // Refused: the page goes as text, where PostgreSQL judges the row as always.
                refused += 1;
                continue;
            }
            let stream = copy_binary::stream([tuple.as_slice()]);
            let by_binary = async {
                let mut copy = conn.copy_in_raw("COPY via_binary FROM STDIN (FORMAT binary)").await?;
                copy.send(stream.as_slice()).await?;
                copy.finish().await
            }
            .await;
            match (&by_text, &by_binary) {
                // A value the column refuses (too long, out of its precision, bad JSON) is
                // refused in either format: the row is dead-lettered either way.
                (Err(_), Err(_)) => both_refused += 1,
                (Ok(_), Ok(_)) => {
                    // `json` has no equality: its text is compared.
                    let equal = if sql_type == "json" {
                        "t.v::text IS NOT DISTINCT FROM b.v::text"
                    } else {
                        "t.v IS NOT DISTINCT FROM b.v"
                    };
                    let row = sqlx::query(sqlx::AssertSqlSafe(format!(
                        "SELECT {equal}, t.v::text, b.v::text FROM via_text t, via_binary b"
                    )))
                    .fetch_one(&mut *conn)
                    .await
                    .unwrap();
                    let (same, as_text, as_binary): (bool, Option<String>, Option<String>) =
                        (row.get(0), row.get(1), row.get(2));
                    assert!(
                        same && as_text == as_binary,
                        "{sql_type} case {i} {text:?}: text stored {as_text:?}, binary {as_binary:?}"
                    );
                    checked += 1;
                }
                _ => panic!("{sql_type} case {i} {text:?}: as text {by_text:?}, as binary {by_binary:?}"),
            }
        }
    }
    eprintln!("{checked} values stored alike, {both_refused} refused by both formats, {refused} left to text");
    assert!(checked > 250, "only {checked} values compared");
}
