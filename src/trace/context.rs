//! W3C Trace Context (`traceparent`, `tracestate`): reading the sender's, and writing the one
//! each call carries. The rules are the recommendation's (Level 1, with Level 2's flags read
//! as Level 1 reads them): a `traceparent` that breaks one is ignored, the trace restarts, and
//! the `tracestate` that came with it is not read; a valid `tracestate` is passed on as it
//! came, an invalid one is dropped.

/// A `traceparent` read from a request: its trace, the sender's span, whether the sender
/// sampled it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TraceParent {
    pub trace_id: [u8; 16],
    pub parent_id: [u8; 8],
    pub sampled: bool,
}

/// The `sampled` bit of `trace-flags`; the other bits are not passed on (fanout writes
/// version 00, whose other flags it does not set).
const SAMPLED: u8 = 0x01;
/// `00-<32 hex>-<16 hex>-<2 hex>`.
pub const LEN_00: usize = 55;

impl TraceParent {
    /// The header's value, or `None` when it is not a valid `traceparent` of any version.
    pub fn parse(value: &[u8]) -> Option<TraceParent> {
        let value = value.trim_ascii();
        let version = hex_byte(value.get(0..2)?)?;
        // Version ff is invalid; 00 is exactly 55 characters; a later version may carry more
        // after a '-', which this version does not read.
        let fits = match version {
            0xff => false,
            0 => value.len() == LEN_00,
            _ => value.len() == LEN_00 || value.get(LEN_00) == Some(&b'-'),
        };
        if !fits || [2, 35, 52].iter().any(|&i| value.get(i) != Some(&b'-')) {
            return None;
        }
        let trace_id: [u8; 16] = hex_bytes(value.get(3..35)?)?;
        let parent_id: [u8; 8] = hex_bytes(value.get(36..52)?)?;
        let flags = hex_byte(value.get(53..55)?)?;
        if trace_id == [0; 16] || parent_id == [0; 8] {
            return None;
        }
        Some(TraceParent {
            trace_id,
            parent_id,
            sampled: flags & SAMPLED != 0,
        })
    }
}

/// The `traceparent` of a call made from the span `span_id` of trace `trace_id`: version 00,
/// as the header's bytes.
pub fn traceparent(trace_id: &[u8; 16], span_id: &[u8; 8], sampled: bool) -> [u8; LEN_00] {
    let mut out = *b"00-00000000000000000000000000000000-0000000000000000-00";
    // The ids' digits go at 3..35 and 36..52.
    write_hex(out.get_mut(3..35), trace_id);
    write_hex(out.get_mut(36..52), span_id);
    if sampled {
        if let Some(flag) = out.last_mut() {
            *flag = b'1';
        }
    }
    out
}

/// Lowercase hex digits.
const HEX_DIGITS: &[u8; 16] = b"0123456789abcdef";

/// The hex digit of a nibble.
fn digit_of(nibble: u8) -> u8 {
    HEX_DIGITS.get(usize::from(nibble)).copied().unwrap_or(b'0')
}

/// Lowercase hex of `bytes` into `to` (two digits a byte).
fn write_hex(to: Option<&mut [u8]>, bytes: &[u8]) {
    let digit = digit_of;
    for (pair, b) in to.unwrap_or_default().chunks_exact_mut(2).zip(bytes) {
        if let [high, low] = pair {
            *high = digit(b >> 4);
            *low = digit(b & 0x0f);
        }
    }
}

/// Lowercase hex of `bytes` (trace and span ids as the recommendation and OTLP/JSON write them).
pub fn push_hex(out: &mut String, bytes: &[u8]) {
    for b in bytes {
        out.push(char::from(digit_of(b >> 4)));
        out.push(char::from(digit_of(b & 0x0f)));
    }
}

/// The sender's `tracestate` when it has the list's shape (passed on byte for byte), `None`
/// otherwise: printable ASCII, at most 32 members, each `key=value` with a key of 1 to 256
/// lowercase letters, digits and `_ - * / @` (starting with a letter or digit) and a value of
/// 1 to 256 characters without `,` or `=`, not ending in a space. Empty members (`a=1,,b=2`)
/// are allowed, as the grammar allows. Finer rules (a key given twice, the lengths of a
/// `tenant@system` key's parts) are the vendors' to judge: such a list is passed on.
pub fn tracestate(value: &[u8]) -> Option<String> {
    let text = std::str::from_utf8(value).ok()?.trim_matches([' ', '\t']);
    let mut members = 0;
    for member in text.split(',').map(|m| m.trim_matches([' ', '\t'])) {
        if member.is_empty() {
            continue;
        }
        let (key, value) = member.split_once('=')?;
        members += 1;
        if members > 32 || !valid_key(key.as_bytes()) || !valid_value(value.as_bytes()) {
            return None;
        }
    }
    (members > 0).then(|| text.to_string())
}

fn valid_key(key: &[u8]) -> bool {
    key.len() <= 256
        && key
            .first()
            .is_some_and(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
        && key
            .iter()
            .all(|&b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"_-*/@".contains(&b))
        && key.last() != Some(&b'@')
}

fn valid_value(value: &[u8]) -> bool {
    (1..=256).contains(&value.len())
        && value
            .iter()
            .all(|&b| (0x20..=0x7e).contains(&b) && b != b',' && b != b'=')
        && value.last() != Some(&b' ')
}

fn hex_digit(b: u8) -> Option<u8> {
    // Lowercase only: the recommendation makes uppercase hex invalid.
    match b {
        b'0'..=b'9' => Some(b - b'0'),
        b'a'..=b'f' => Some(b - b'a' + 10),
        _ => None,
    }
}

fn hex_byte(pair: &[u8]) -> Option<u8> {
    match pair {
        [hi, lo] => Some(hex_digit(*hi)? << 4 | hex_digit(*lo)?),
        _ => None,
    }
}

fn hex_bytes<const N: usize>(text: &[u8]) -> Option<[u8; N]> {
    let mut out = [0u8; N];
    if text.len() != 2 * N {
        return None;
    }
    for (byte, pair) in out.iter_mut().zip(text.chunks_exact(2)) {
        *byte = hex_byte(pair)?;
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    const VALID: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn a_valid_traceparent_is_read() {
        let parent = TraceParent::parse(VALID.as_bytes()).unwrap();
        assert_eq!(
            parent.trace_id,
            [
                0x4b, 0xf9, 0x2f, 0x35, 0x77, 0xb3, 0x4d, 0xa6, 0xa3, 0xce, 0x92, 0x9d, 0x0e, 0x0e,
                0x47, 0x36
            ]
        );
        assert_eq!(
            parent.parent_id,
            [0x00, 0xf0, 0x67, 0xaa, 0x0b, 0xa9, 0x02, 0xb7]
        );
        assert!(parent.sampled);
        let unsampled = TraceParent::parse(
            &VALID.as_bytes()[..53]
                .iter()
                .chain(b"00")
                .copied()
                .collect::<Vec<_>>(),
        )
        .unwrap();
        assert!(!unsampled.sampled);
        // Level 2's random-trace-id flag (0x02) and any other flag: only bit 0 is sampled.
        for (flags, sampled) in [("02", false), ("03", true), ("ff", true), ("fe", false)] {
            let value = format!("{}{flags}", &VALID[..53]);
            assert_eq!(
                TraceParent::parse(value.as_bytes()).map(|p| p.sampled),
                Some(sampled),
                "{value}"
            );
        }
        // The whitespace HTTP allows around a value.
        assert!(TraceParent::parse(format!(" {VALID}\t").as_bytes()).is_some());
    }

    #[test]
    fn an_invalid_traceparent_is_none() {
        let cases = [
            "",
            "00",
            // Uppercase hex.
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00F067AA0BA902B7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0A",
            // All-zero ids.
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            // Version ff, a version that is not hex.
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "0g-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            // Version 00 with anything after it.
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01x",
            // Short fields, wrong separators.
            "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b701",
            "00_4bf92f3577b34da6a3ce929d0e0e4736_00f067aa0ba902b7_01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-1",
            // A later version must still separate what follows with '-'.
            "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01x",
        ];
        for case in cases {
            assert_eq!(TraceParent::parse(case.as_bytes()), None, "{case:?}");
        }
    }

    #[test]
    fn a_later_version_is_read_as_version_00() {
        for value in [
            "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "cc-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-what-comes-next",
        ] {
            let parent = TraceParent::parse(value.as_bytes()).unwrap();
            assert!(parent.sampled);
            assert_eq!(
                traceparent(&parent.trace_id, &parent.parent_id, true),
                format!("00{}", &value[2..55]).as_bytes(),
            );
        }
    }

    #[test]
    fn traceparent_is_written_as_version_00() {
        let parent = TraceParent::parse(VALID.as_bytes()).unwrap();
        assert_eq!(
            traceparent(&parent.trace_id, &parent.parent_id, true),
            VALID.as_bytes()
        );
        let span = [1, 2, 3, 4, 5, 6, 7, 0xff];
        assert_eq!(
            &traceparent(&parent.trace_id, &span, false),
            b"00-4bf92f3577b34da6a3ce929d0e0e4736-01020304050607ff-00"
        );
    }

    #[test]
    fn a_valid_tracestate_is_passed_on_as_it_came() {
        for value in [
            "congo=t61rcWkgMzE",
            "rojo=00f067aa0ba902b7,congo=t61rcWkgMzE",
            "rojo=00f067aa0ba902b7 , congo=t61rcWkgMzE",
            "a=1,,b=2",
            "tenant1@vendor=x",
            "1tenant@vendor=x",
            "a_b-c*d/e=value with spaces",
            // Finer rules are not checked: passed on.
            "a=1,a=2",
            "tenant@toolongsystemid=x",
        ] {
            assert_eq!(
                tracestate(value.as_bytes()).as_deref(),
                Some(value),
                "{value}"
            );
        }
        assert_eq!(tracestate(b" a=1 ").as_deref(), Some("a=1"));
        let max: Vec<String> = (0..32).map(|i| format!("k{i}=v")).collect();
        assert!(tracestate(max.join(",").as_bytes()).is_some());
    }

    #[test]
    fn an_invalid_tracestate_is_dropped() {
        let too_many: Vec<String> = (0..33).map(|i| format!("k{i}=v")).collect();
        let long_key = format!("{}=v", "k".repeat(257));
        let long_value = format!("k={}", "v".repeat(257));
        for value in [
            "",
            " ",
            "novalue",
            "=nokey",
            ",",
            "Upper=1",
            "_a=1",
            "a=tab\tinside",
            "a=b=c",
            "a= ",
            "@vendor=x",
            "tenant@=x",
            "a=\u{e9}",
            too_many.join(",").as_str(),
            long_key.as_str(),
            long_value.as_str(),
        ] {
            assert_eq!(tracestate(value.as_bytes()), None, "{value:?}");
        }
        assert_eq!(tracestate(b"a=\xff"), None);
    }
}
