//! Durations on the command line: `500ms`, `10s`, `1.5s`, `2m`, `1h`, `1m30s`.

use std::time::Duration;

/// The longest duration accepted (one year, as the library's settings).
const MAX: Duration = simba_core::MAX_DURATION;

const HINT: &str = "write a number with a unit: ms, s, m or h (e.g. 500ms, 10s, 1.5s, 2m, 1m30s)";

/// Parses a duration; the error names the value and says what is accepted.
///
/// Used as a clap value parser, so a bad value is a usage error naming the option.
pub(crate) fn parse(text: &str) -> Result<Duration, String> {
    let s = text.trim();
    if s.is_empty() {
        return Err(format!("empty duration; {HINT}"));
    }
    let mut total_ms: u128 = 0;
    let mut rest = s;
    while !rest.is_empty() {
        let num_len = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        let (num, after) = rest.split_at(num_len);
        if num.is_empty() {
            return Err(format!("`{text}` is not a duration; {HINT}"));
        }
        let unit_len = after
            .find(|c: char| !c.is_ascii_alphabetic())
            .unwrap_or(after.len());
        let (unit, after) = after.split_at(unit_len);
        let scale_ms: u128 = match unit {
            "ms" => 1,
            "s" | "sec" | "secs" => 1_000,
            "m" | "min" | "mins" => 60_000,
            "h" | "hr" | "hrs" => 3_600_000,
            "" => return Err(format!("`{text}` has no unit; {HINT}")),
            other => return Err(format!("`{text}` has an unknown unit `{other}`; {HINT}")),
        };
        total_ms = total_ms.saturating_add(scaled(num, scale_ms).ok_or_else(|| {
            format!("`{text}` is not a duration (or not a whole number of milliseconds); {HINT}")
        })?);
        rest = after;
    }
    let ms = u64::try_from(total_ms).unwrap_or(u64::MAX);
    let d = Duration::from_millis(ms);
    if d > MAX {
        return Err(format!("`{text}` is longer than one year"));
    }
    Ok(d)
}

/// Parses a duration of at least one millisecond: for periods and ttls, where zero means
/// nothing. The error names the value and says what is accepted.
pub(crate) fn parse_positive(text: &str) -> Result<Duration, String> {
    let d = parse(text)?;
    if d.is_zero() {
        return Err(format!(
            "`{}` is zero; this option needs at least 1ms (e.g. 250ms, 1s)",
            text.trim()
        ));
    }
    Ok(d)
}

/// `num` (digits, at most one `.`) times `scale_ms`, if the result is whole milliseconds.
fn scaled(num: &str, scale_ms: u128) -> Option<u128> {
    let (int, frac) = match num.split_once('.') {
        Some((i, f)) => (i, f),
        None => (num, ""),
    };
    if (int.is_empty() && frac.is_empty()) || frac.contains('.') || frac.len() > 9 {
        return None;
    }
    let int_v: u128 = if int.is_empty() { 0 } else { int.parse().ok()? };
    let frac_v: u128 = if frac.is_empty() {
        0
    } else {
        frac.parse().ok()?
    };
    let denom = 10u128.pow(u32::try_from(frac.len()).ok()?);
    let frac_ms = frac_v * scale_ms;
    if !frac_ms.is_multiple_of(denom) {
        return None;
    }
    int_v.checked_mul(scale_ms)?.checked_add(frac_ms / denom)
}

/// A short human form: `500ms`, `10s`, `1.5s`, `2m`.
pub(crate) fn show(d: Duration) -> String {
    let ms = d.as_millis();
    if ms == 0 {
        "0s".to_owned()
    } else if ms < 1_000 {
        format!("{ms}ms")
    } else if ms.is_multiple_of(60_000) && ms >= 60_000 {
        format!("{}m", ms / 60_000)
    } else if ms.is_multiple_of(1_000) {
        format!("{}s", ms / 1_000)
    } else {
        let n = format!("{:.3}", d.as_secs_f64());
        format!("{}s", n.trim_end_matches('0'))
    }
}

/// Body of the fuzz target `cli_duration` (see `fuzz/`, which includes this file): any
/// text parses or is refused without panicking, and what parses is shown as a duration that
/// parses back to the same value.
#[cfg(any(test, fuzzing))]
pub(crate) fn fuzz_body(data: &[u8]) {
    let Ok(s) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(d) = parse(s) {
        assert!(d <= MAX, "{s:?} -> {d:?}");
        assert_eq!(parse(&show(d)), Ok(d), "{s:?} -> {d:?} -> {}", show(d));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn corpus_cli_duration() {
        simba_core::fuzzing::replay(env!("CARGO_MANIFEST_DIR"), "cli_duration", fuzz_body);
    }

    #[test]
    fn accepts_common_forms() {
        let ms = |v| Ok(Duration::from_millis(v));
        assert_eq!(parse("500ms"), ms(500));
        assert_eq!(parse("10s"), ms(10_000));
        assert_eq!(parse("1.5s"), ms(1_500));
        assert_eq!(parse("2m"), ms(120_000));
        assert_eq!(parse("1h"), ms(3_600_000));
        assert_eq!(parse("1m30s"), ms(90_000));
        assert_eq!(parse(" 0s "), ms(0));
        assert_eq!(parse(".25s"), ms(250));
    }

    #[test]
    fn rejects_with_the_value_named() {
        for bad in [
            "", "10", "ten", "10x", "1.2.3s", "0.5ms", "s", "10s5", "-1s", "9999h",
        ] {
            let e = parse(bad).expect_err(bad);
            assert!(
                e.contains(bad.trim()) || bad.trim().is_empty(),
                "{bad}: {e}"
            );
        }
        assert!(parse("10").expect_err("no unit").contains("no unit"));
    }

    #[test]
    fn positive_refuses_zero_naming_it_and_the_least_allowed() {
        for zero in ["0s", "0ms", " 0m "] {
            let e = parse_positive(zero).expect_err(zero);
            assert!(
                e.contains(&format!("`{}`", zero.trim())) && e.contains("at least 1ms"),
                "{zero}: {e}"
            );
        }
        assert_eq!(parse_positive("1ms"), Ok(Duration::from_millis(1)));
        assert!(
            parse_positive("10")
                .expect_err("no unit")
                .contains("no unit")
        );
    }

    #[test]
    fn shows_short_forms() {
        assert_eq!(show(Duration::from_millis(500)), "500ms");
        assert_eq!(show(Duration::from_secs(10)), "10s");
        assert_eq!(show(Duration::from_millis(1_500)), "1.5s");
        assert_eq!(show(Duration::from_secs(120)), "2m");
    }
}
