//! Knative's durations (ISO 8601: `PT0.2S`, `PT1M`, `PT1H30M`, `P1D`, `P1M`) in whole
//! milliseconds, as fanout takes them, with what Knative's own parser would have made of them.

/// A duration in milliseconds, rounded to the nearest; years and months as Knative's duration
/// parser (rickb777/date) counts them. `Err`: what is wrong, for the field's message.
pub(super) struct Parsed {
    pub ms: u32,
    /// Knative's parser keeps one decimal of each number: what it made of the value, when
    /// that differs from `ms`.
    pub knative_ms: Option<u64>,
}

impl Parsed {
    /// The warning for a duration Knative reads otherwise (`value`, as written).
    pub fn unlike_knative(&self, value: &serde_json::Value) -> Option<String> {
        let knative = self.knative_ms?;
        Some(format!(
            "'{}': Knative's duration parser keeps one decimal of each number, so Knative used \
             {knative} ms; fanout uses {} ms",
            value.as_str().unwrap_or_default(),
            self.ms
        ))
    }
}

const DAY_MS: f64 = 86_400_000.0;
/// Years, months, weeks, days (before `T`); hours, minutes, seconds (after it).
const DATE_UNITS: [(char, f64); 4] = [
    ('Y', 365.2425 * DAY_MS),
    ('M', 30.436875 * DAY_MS),
    ('W', 7.0 * DAY_MS),
    ('D', DAY_MS),
];
const TIME_UNITS: [(char, f64); 3] = [('H', 3_600_000.0), ('M', 60_000.0), ('S', 1000.0)];
const EXAMPLE: &str = "e.g. PT0.2S, PT1M, PT1H30M or P1D";

/// `value` (a JSON value of a DeliverySpec) in milliseconds; zero only with `allow_zero`.
pub(super) fn parse(value: &serde_json::Value, allow_zero: bool) -> Result<Parsed, String> {
    let Some(text) = value.as_str() else {
        return Err(format!(
            "{value} is not an ISO-8601 duration string ({EXAMPLE})"
        ));
    };
    let not = || format!("'{text}' is not an ISO-8601 duration ({EXAMPLE})");
    let (negative, rest) = match text.as_bytes().first() {
        Some(b'-') => (true, text.get(1..).unwrap_or_default()),
        Some(b'+') => (false, text.get(1..).unwrap_or_default()),
        _ => (false, text),
    };
    let rest = rest.strip_prefix('P').ok_or_else(not)?;
    let rest = if rest == "0" { "0D" } else { rest };
    let (date, time) = match rest.split_once('T') {
        Some((date, time)) => (date, Some(time)),
        None => (rest, None),
    };
    let mut exact = 0f64;
    let mut as_knative = 0f64;
    let mut named = false;
    for (part, units) in [
        (date, &DATE_UNITS[..]),
        (time.unwrap_or(""), &TIME_UNITS[..]),
    ] {
        let (e, k, n) = amounts(part, units).ok_or_else(not)?;
        exact += e;
        as_knative += k;
        named |= n;
    }
    if !named || time.is_some_and(str::is_empty) {
        return Err(format!(
            "'{text}' is not an ISO-8601 duration: it names no amount ({EXAMPLE})"
        ));
    }
    if negative {
        return Err(format!("'{text}': must not be negative"));
    }
    let ms = (exact + 0.5).floor();
    if ms > f64::from(u32::MAX) {
        return Err(format!(
            "'{text}' is {ms} ms: fanout takes at most {} ms (about 49 days)",
            u32::MAX
        ));
    }
    if ms == 0.0 && !allow_zero {
        return Err(format!("'{text}': must be more than 0"));
    }
    let knative = (as_knative + 0.5).floor();
    Ok(Parsed {
        ms: ms as u32,
        knative_ms: (knative != ms).then_some(knative as u64),
    })
}

/// The numbers of one part (`1DT` before `T`, `1H30M` after it) in `units`' order: (exact
/// ms, ms with one decimal per number as Knative keeps them, whether any was named); None
/// when the part is malformed.
fn amounts(part: &str, units: &[(char, f64)]) -> Option<(f64, f64, bool)> {
    let (mut exact, mut knative, mut named) = (0f64, 0f64, false);
    let mut number = String::new();
    let mut next = 0;
    for c in part.chars() {
        if c.is_ascii_digit() || c == '.' || c == ',' {
            number.push(if c == ',' { '.' } else { c });
            continue;
        }
        let at = units.iter().skip(next).position(|(u, _)| *u == c)? + next;
        let (_, unit) = units.get(at)?;
        let (whole, decimals) = number.split_once('.').unwrap_or((&number, ""));
        let whole_ok = !whole.is_empty() && whole.bytes().all(|b| b.is_ascii_digit());
        let decimals_ok = number.find('.').is_none()
            || (!decimals.is_empty() && decimals.bytes().all(|b| b.is_ascii_digit()));
        if !whole_ok || !decimals_ok {
            return None;
        }
        exact += number.parse::<f64>().ok()? * unit;
        let first = decimals.get(..1).unwrap_or("0");
        knative += format!("{whole}.{first}").parse::<f64>().ok()? * unit;
        number.clear();
        next = at + 1;
        named = true;
    }
    number.is_empty().then_some((exact, knative, named))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn durations_as_knative_writes_them() {
        let ms = |d: &str| parse(&json!(d), true).map(|p| p.ms);
        assert_eq!(ms("PT0.2S"), Ok(200));
        assert_eq!(ms("PT0,5S"), Ok(500));
        assert_eq!(ms("PT1H30M"), Ok(5_400_000));
        assert_eq!(ms("P1DT2H"), Ok(93_600_000));
        assert_eq!(ms("P1M"), Ok(2_629_746_000));
        assert_eq!(ms("+PT3S"), Ok(3000));
        assert_eq!(ms("P0"), Ok(0));
        assert_eq!(ms("P1D"), Ok(86_400_000));
        assert!(ms("PT").is_err() && ms("1s").is_err() && ms("PT1S1M").is_err());
        assert_eq!(
            parse(&json!("PT0.25S"), true).unwrap().knative_ms,
            Some(200)
        );
        for (bad, why) in [
            ("3s", "is not an ISO-8601 duration"),
            ("PT", "names no amount"),
            ("P", "names no amount"),
            ("P1H", "is not an ISO-8601 duration"),
            ("PT1.S", "is not an ISO-8601 duration"),
            ("PT1H1H", "is not an ISO-8601 duration"),
            ("-PT1S", "must not be negative"),
            ("P50D", "at most 4294967295 ms"),
        ] {
            let err = parse(&json!(bad), true).err().unwrap_or_default();
            assert!(err.contains(why), "{bad}: {err}");
        }
        assert!(parse(&json!("PT0S"), false).is_err());
        assert!(parse(&json!(5), true).is_err());
    }
}
