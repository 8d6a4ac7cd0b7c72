//! JSON as fanout reads and words it, apart from what any one document means: a parsed value
//! ([`Node`]), serde_json's words for a value in its messages ([`kind`]), a visitor that takes
//! only an object ([`OnlyObject`]), a number's text ([`number_text`]), and an object's
//! members or a string's value found in a document's text ([`members`], [`string`]). The
//! configuration, subscription filters, CloudEvents, `delivery.format` and dead letters use
//! them; this module knows none of them.

pub mod kind;
mod members;
mod node;
mod number;
mod only_object;

pub use members::{members, string};
pub use node::Node;
pub use number::number_text;
pub use only_object::OnlyObject;
