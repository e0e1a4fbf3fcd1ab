//! Human durations in config files: `500ms`, `10s`, `5m`, `2h`, `7d`.

use std::time::Duration;

/// Parses a duration such as `10s`. A bare number is rejected: the unit is part of the value.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    let split_at = text
        .find(|c: char| !c.is_ascii_digit())
        .ok_or_else(|| format!("duration {text:?} has no unit (use ms, s, m, h or d)"))?;
    let (number, unit) = text.split_at(split_at);
    let number: u64 = number
        .parse()
        .map_err(|_| format!("duration {text:?} does not start with a whole number"))?;
    let millis_per_unit = match unit {
        "ms" => 1,
        "s" => 1_000,
        "m" => 60_000,
        "h" => 3_600_000,
        "d" => 86_400_000,
        other => {
            return Err(format!(
                "duration {text:?} has unknown unit {other:?} (use ms, s, m, h or d)"
            ));
        }
    };
    number
        .checked_mul(millis_per_unit)
        .map(Duration::from_millis)
        .ok_or_else(|| format!("duration {text:?} is too large"))
}

/// Serde adapter for `Duration` fields written as human durations.
/// The shortest exact form: `7d`, `90s`, `1500ms`.
pub fn format_duration(duration: Duration) -> String {
    let millis = duration.as_millis();
    for (unit, size) in [("d", 86_400_000), ("h", 3_600_000), ("m", 60_000), ("s", 1_000)] {
        if millis >= size && millis.is_multiple_of(size) {
            return format!("{}{unit}", millis / size);
        }
    }
    format!("{millis}ms")
}

pub mod serde_human {
    use serde::{Deserialize, Deserializer};
    use std::time::Duration;

    pub fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Duration, D::Error> {
        let text = String::deserialize(deserializer)?;
        super::parse_duration(&text).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_units_and_rejects_bare_numbers() {
        assert_eq!(parse_duration("500ms").unwrap(), Duration::from_millis(500));
        assert_eq!(parse_duration("10s").unwrap(), Duration::from_secs(10));
        assert_eq!(parse_duration("5m").unwrap(), Duration::from_secs(300));
        assert_eq!(parse_duration("7d").unwrap(), Duration::from_secs(7 * 86_400));
        assert!(parse_duration("10").unwrap_err().contains("no unit"));
        assert!(parse_duration("10y").unwrap_err().contains("unknown unit"));
    }
}
