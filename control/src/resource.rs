//! An xDS resource: a protobuf message packed as an `Any`, as the server serves it.

use envoy_types::pb::google::protobuf::Any;
use prost::{Message, Name};

pub fn any<M: Message + Name>(message: &M) -> Any {
    Any {
        type_url: M::type_url(),
        value: message.encode_to_vec(),
    }
}
