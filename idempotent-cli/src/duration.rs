//! Durations on the command line: a number and a unit (`500ms`, `30s`, `10m`, `2h`, `7d`).

use std::time::Duration;

/// Parses `500ms`, `30s`, `10m`, `2h` or `7d`.
pub(crate) fn parse_duration(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    let split = text.find(|c: char| !c.is_ascii_digit()).unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let n: u64 = number
        .parse()
        .map_err(|_| format!("`{text}` is not a duration: write a number and a unit, as 30s, 10m, 2h or 7d"))?;
    let unit_secs = match unit {
        "ms" => return Ok(Duration::from_millis(n)),
        "s" => 1,
        "m" => 60,
        "h" => 60 * 60,
        "d" => 24 * 60 * 60,
        _ => return Err(format!("`{text}` has no known unit: use ms, s, m, h or d (as 30s, 10m, 2h, 7d)")),
    };
    n.checked_mul(unit_secs).map(Duration::from_secs).ok_or_else(|| format!("`{text}` is too long a duration"))
}

/// A duration as the tables print it: its largest whole unit (`3m`, `2h`, `0s`).
pub(crate) fn short(d: Duration) -> String {
    let s = d.as_secs();
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m", s / 60),
        3600..86400 => format!("{}h", s / 3600),
        _ => format!("{}d", s / 86400),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn units() {
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("30s"), Ok(Duration::from_secs(30)));
        assert_eq!(parse_duration("10m"), Ok(Duration::from_secs(600)));
        assert_eq!(parse_duration("2h"), Ok(Duration::from_secs(7200)));
        assert_eq!(parse_duration("7d"), Ok(Duration::from_secs(7 * 86400)));
        assert!(parse_duration("7").unwrap_err().contains("unit"));
        assert!(parse_duration("ten minutes").unwrap_err().contains("number and a unit"));
        assert!(parse_duration("99999999999999999999d").is_err());
        assert_eq!(short(Duration::from_secs(7200)), "2h");
        assert_eq!(short(Duration::from_secs(59)), "59s");
    }
}
