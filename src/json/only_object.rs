//! A visitor that takes only a JSON object, refusing anything else in serde_json's words.

use std::fmt;

use serde::de::{self, MapAccess, Visitor};

use super::kind;

/// `V`, offered only a JSON object: anything else is refused with serde_json's words, made
/// here (see [`super::kind`]). serde_json's own refusal (`deserialize_map` on a non-object)
/// would go through serde's.
pub struct OnlyObject<V>(pub V);

impl<V> OnlyObject<V> {
    fn refuse<E: de::Error>(&self, what: String) -> E
    where
        Self: de::Expected,
    {
        E::custom(kind::invalid_type(&what, self as &dyn de::Expected))
    }
}

impl<'de, V: Visitor<'de>> Visitor<'de> for OnlyObject<V> {
    type Value = V::Value;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        self.0.expecting(f)
    }
    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<V::Value, A::Error> {
        self.0.visit_map(map)
    }
    fn visit_unit<E: de::Error>(self) -> Result<V::Value, E> {
        Err(self.refuse(kind::null()))
    }
    fn visit_bool<E: de::Error>(self, v: bool) -> Result<V::Value, E> {
        Err(self.refuse(kind::bool(v)))
    }
    fn visit_i64<E: de::Error>(self, v: i64) -> Result<V::Value, E> {
        Err(self.refuse(kind::integer(v)))
    }
    fn visit_u64<E: de::Error>(self, v: u64) -> Result<V::Value, E> {
        Err(self.refuse(kind::integer(v)))
    }
    fn visit_f64<E: de::Error>(self, v: f64) -> Result<V::Value, E> {
        Err(self.refuse(kind::float(v)))
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<V::Value, E> {
        Err(self.refuse(kind::string(v)))
    }
    fn visit_seq<A: de::SeqAccess<'de>>(self, _seq: A) -> Result<V::Value, A::Error> {
        Err(self.refuse(kind::sequence()))
    }
}
