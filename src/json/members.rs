//! A JSON object's members found in its text, and a JSON string's value: for a reader that
//! passes values on as their exact text rather than parsing them into a tree.

use std::borrow::Cow;

use serde::de::IgnoredAny;

use super::Node;

/// A JSON string's value, from one JSON value's text; `None` when it is another value.
///
/// Read as a [`Node`], whose reader the configuration uses too (one serde_json instance for
/// both), not `from_slice::<String>`: serde_json's refusal of a non-string words it through
/// serde's `Unexpected`, whose `Display` formats floats (bench/README.md: module size).
pub fn string(raw: &str) -> Option<String> {
    if !raw.starts_with('"') {
        return None;
    }
    match serde_json::from_slice::<Node>(raw.as_bytes()) {
        Ok(Node::Str(text)) => Some(text),
        _ => None,
    }
}

/// A JSON object's members in order: each name (borrowed when it has no escapes) and its
/// value's exact text. serde_json validates the whole body first (`from_slice::<IgnoredAny>`,
/// the reader `delivery.format` uses too); this walk then only finds where each member is, on
/// text known to be valid JSON, without serde_json's `RawValue` (bench/README.md: module
/// size). `Err`: the body is not one JSON object, in words for the sender.
pub fn members(body: &[u8]) -> Result<Vec<(Cow<'_, str>, &str)>, String> {
    let not_object = |why: &str| format!("the body is not one JSON object: {why}");
    let text = std::str::from_utf8(body).map_err(|_| not_object("it is not UTF-8"))?;
    serde_json::from_slice::<IgnoredAny>(body).map_err(|e| not_object(&e.to_string()))?;
    let mut scan = Scan { text, at: 0 };
    scan.space();
    if scan.peek() != Some(b'{') {
        return Err(not_object("it is another JSON value"));
    }
    scan.at += 1;
    let mut members = Vec::new();
    loop {
        scan.space();
        if scan.peek() != Some(b'"') {
            break; // `}`: the body is valid JSON
        }
        let key = scan.value();
        let name = match key.get(1..key.len().saturating_sub(1)) {
            Some(inner) if !inner.contains('\\') => Cow::Borrowed(inner),
            _ => Cow::Owned(string(key).ok_or_else(|| not_object("a name is no string"))?),
        };
        scan.space();
        scan.at += 1; // `:`
        scan.space();
        members.push((name, scan.value()));
        scan.space();
        if scan.peek() == Some(b',') {
            scan.at += 1;
        }
    }
    Ok(members)
}

/// A cursor over text that is valid JSON.
struct Scan<'t> {
    text: &'t str,
    at: usize,
}

impl<'t> Scan<'t> {
    fn peek(&self) -> Option<u8> {
        self.text.as_bytes().get(self.at).copied()
    }

    fn space(&mut self) {
        while matches!(self.peek(), Some(b' ' | b'\t' | b'\n' | b'\r')) {
            self.at += 1;
        }
    }

    /// The exact text of the value that starts here; the cursor moves past it.
    fn value(&mut self) -> &'t str {
        let start = self.at;
        let mut depth = 0usize;
        let mut in_string = false;
        let mut escaped = false;
        while let Some(b) = self.peek() {
            if in_string {
                self.at += 1;
                match (escaped, b) {
                    (true, _) => escaped = false,
                    (false, b'\\') => escaped = true,
                    (false, b'"') => {
                        in_string = false;
                        if depth == 0 {
                            break;
                        }
                    }
                    _ => {}
                }
                continue;
            }
            match b {
                b'"' => in_string = true,
                b'{' | b'[' => depth += 1,
                b'}' | b']' if depth == 0 => break,
                b'}' | b']' => {
                    depth -= 1;
                    if depth == 0 {
                        self.at += 1;
                        break;
                    }
                }
                b',' | b' ' | b'\t' | b'\n' | b'\r' | b':' if depth == 0 => break,
                _ => {}
            }
            self.at += 1;
        }
        self.text.get(start..self.at).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn members_are_found_with_their_exact_text() {
        let body = br#" { "a" : "x\"}{[,\\" , "b\u0063":{"n":[1,{"m":"]"}],"e":{}}, "c":-1.5e3,
            "d":[ ] ,"t":true,"z":null}  "#;
        let found = members(body).unwrap();
        let found: Vec<(&str, &str)> = found.iter().map(|(n, v)| (n.as_ref(), *v)).collect();
        assert_eq!(
            found,
            [
                ("a", r#""x\"}{[,\\""#),
                ("bc", r#"{"n":[1,{"m":"]"}],"e":{}}"#),
                ("c", "-1.5e3"),
                ("d", "[ ]"),
                ("t", "true"),
                ("z", "null"),
            ]
        );
        assert_eq!(members(b"{}").unwrap(), []);
        assert_eq!(members(b" {\n} ").unwrap(), []);
        for body in [&b"[1]"[..], b"\"x\"", b"{\"a\":1", b"{\"a\":\"\xff\"}", b""] {
            let error = members(body).unwrap_err();
            assert!(
                error.starts_with("the body is not one JSON object: "),
                "{error}"
            );
        }
    }
}
