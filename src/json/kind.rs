//! serde_json's words for a JSON value in its messages (`invalid type: integer `7`, expected
//! a string`), written here: serde's own `Display` for them formats floats with core's float
//! formatting, which would then stay in the module whatever else is done.

use std::fmt::Display;

use super::number_text;

pub fn null() -> String {
    "null".to_string()
}
pub fn bool(v: bool) -> String {
    format!("boolean `{v}`")
}
pub fn integer(v: impl Display) -> String {
    format!("integer `{v}`")
}
/// As serde_json writes it (`1.5`, `2.0`, `1e300`).
pub fn float(v: f64) -> String {
    match serde_json::Number::from_f64(v) {
        Some(number) => format!("floating point `{number}`"),
        None => format!("floating point `{}`", number_text(v)),
    }
}
pub fn string(v: &str) -> String {
    format!("string {v:?}")
}
pub fn sequence() -> String {
    "sequence".to_string()
}
pub fn map() -> String {
    "map".to_string()
}
pub fn invalid_type(kind: &str, expected: impl Display) -> String {
    format!("invalid type: {kind}, expected {expected}")
}
pub fn invalid_value(kind: &str, expected: impl Display) -> String {
    format!("invalid value: {kind}, expected {expected}")
}
