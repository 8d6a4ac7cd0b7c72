//! A number's text as attribute values and messages show it.

/// `v` as f64's `Display` writes it (`1.5`, `2` for `2.0`, `1000` for `1e3`, `0.0000001`,
/// never an exponent), made from the shortest digits serde_json writes (zmij): `Display`
/// itself would keep core's float formatting in the module for this one use
/// (bench/README.md, "Size"). One difference: a value exactly halfway between two shortest
/// texts (16 or 17 digits) ends in the even digit (`1055564202423516.2`), where `Display`
/// rounds up (`…516.3`); both read back as the same f64.
pub fn number_text(v: f64) -> String {
    let Some(number) = serde_json::Number::from_f64(v) else {
        // Not from JSON (it has no NaN or infinity): Display's words for them.
        return if v.is_nan() {
            "NaN".to_string()
        } else if v > 0.0 {
            "inf".to_string()
        } else {
            "-inf".to_string()
        };
    };
    // serde_json's form: `-`, digits with a `.` (`1.5`, `2.0`), maybe `e` and an exponent
    // (`1e16`, `1.5e-7`).
    let json = number.to_string();
    let (sign, unsigned) = match json.strip_prefix('-') {
        Some(rest) => ("-", rest),
        None => ("", json.as_str()),
    };
    let (mantissa, exponent) = match unsigned.split_once('e') {
        Some((mantissa, exponent)) => (mantissa, exponent.parse::<i64>().unwrap_or(0)),
        None => (unsigned, 0),
    };
    let (whole, fraction) = mantissa.split_once('.').unwrap_or((mantissa, ""));
    // The digits, and where the decimal point goes among them.
    let digits = format!("{whole}{fraction}");
    let leading = digits.len() - digits.trim_start_matches('0').len();
    let digits = digits.trim_matches('0');
    let point = whole.len() as i64 + exponent - leading as i64;
    let mut text = String::from(sign);
    if digits.is_empty() {
        text.push('0');
    } else if point <= 0 {
        text.push_str("0.");
        text.extend(std::iter::repeat_n('0', point.unsigned_abs() as usize));
        text.push_str(digits);
    } else if point as usize >= digits.len() {
        text.push_str(digits);
        text.extend(std::iter::repeat_n('0', point as usize - digits.len()));
    } else {
        let (before, after) = digits.split_at(point as usize);
        text.push_str(before);
        text.push('.');
        text.push_str(after);
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    /// [`number_text`] against `Display`, on chosen and random values.
    #[test]
    fn number_text_is_f64_display() {
        let mut values = vec![
            0.0,
            -0.0,
            1.5,
            2.0,
            1e3,
            0.1,
            1e-7,
            1.5e-7,
            123456.789,
            1e15,
            1e16,
            1e22,
            1e23,
            1.2345e20,
            1e300,
            5e-324,
            f64::MAX,
            f64::MIN_POSITIVE,
            f64::NAN,
            f64::INFINITY,
            f64::NEG_INFINITY,
        ];
        // Every exponent and sign, random mantissas; integers.
        let mut rng = fastrand::Rng::with_seed(18);
        values.extend((0..20_000).map(|_| f64::from_bits(rng.u64(..))));
        values.extend((0..20_000).map(|_| (rng.f64() - 0.5) * 10f64.powi(rng.i32(-20..25))));
        values.extend((0..2_000).map(|_| rng.i64(..) as f64));
        let mut ties = 0;
        for v in values {
            let (ours, display) = (number_text(v), v.to_string());
            if ours == display {
                continue;
            }
            // The one difference: a value exactly halfway between two shortest texts, where
            // zmij ends in the even digit and Display rounds up. Both read back as `v`.
            let (last, display_last) = (
                ours.as_bytes()[ours.len() - 1],
                display.as_bytes()[display.len() - 1],
            );
            assert_eq!(ours.parse::<f64>(), Ok(v), "{ours} for {display}");
            assert_eq!(ours.len(), display.len(), "{ours} for {display}");
            assert_eq!(
                ours[..ours.len() - 1],
                display[..display.len() - 1],
                "{ours} for {display}"
            );
            assert!(
                last % 2 == 0 && display_last == last + 1,
                "{ours} for {display}"
            );
            ties += 1;
        }
        assert!(ties < 100, "{ties} ties");
    }
}
