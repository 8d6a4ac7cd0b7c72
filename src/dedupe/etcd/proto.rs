//! The part of etcd's v3 gRPC API the store uses (`etcdserverpb` in etcd's
//! `api/etcdserverpb/rpc.proto`, `mvccpb.KeyValue` in `api/mvccpb/kv.proto`), as prost
//! messages with etcd's field numbers; fields fanout neither sends nor reads are left out
//! (prost skips unknown fields when decoding). And gRPC's framing of one message.

use prost::Message;

/// The calls, as gRPC paths (`/<package>.<service>/<method>`).
pub const TXN_PATH: &str = "/etcdserverpb.KV/Txn";
pub const GRANT_PATH: &str = "/etcdserverpb.Lease/LeaseGrant";

/// `Compare.CompareResult`.
pub const EQUAL: i32 = 0;
pub const LESS: i32 = 2;
/// `Compare.CompareTarget`.
pub const CREATE: i32 = 1;
pub const VALUE: i32 = 3;

#[derive(Clone, PartialEq, Message)]
pub struct TxnRequest {
    #[prost(message, repeated, tag = "1")]
    pub compare: Vec<Compare>,
    #[prost(message, repeated, tag = "2")]
    pub success: Vec<RequestOp>,
    #[prost(message, repeated, tag = "3")]
    pub failure: Vec<RequestOp>,
}

#[derive(Clone, PartialEq, Message)]
pub struct Compare {
    #[prost(int32, tag = "1")]
    pub result: i32,
    #[prost(int32, tag = "2")]
    pub target: i32,
    #[prost(bytes = "vec", tag = "3")]
    pub key: Vec<u8>,
    #[prost(oneof = "Against", tags = "5, 7")]
    pub against: Option<Against>,
}

/// `Compare.target_union`, the two kinds fanout compares with.
#[derive(Clone, PartialEq, prost::Oneof)]
pub enum Against {
    #[prost(int64, tag = "5")]
    CreateRevision(i64),
    #[prost(bytes, tag = "7")]
    Value(Vec<u8>),
}

#[derive(Clone, PartialEq, Message)]
pub struct RequestOp {
    #[prost(oneof = "Request", tags = "1, 2, 3, 4")]
    pub request: Option<Request>,
}

#[derive(Clone, PartialEq, prost::Oneof)]
pub enum Request {
    #[prost(message, tag = "1")]
    Range(RangeRequest),
    #[prost(message, tag = "2")]
    Put(PutRequest),
    #[prost(message, tag = "3")]
    DeleteRange(DeleteRangeRequest),
    #[prost(message, tag = "4")]
    Txn(TxnRequest),
}

#[derive(Clone, PartialEq, Message)]
pub struct RangeRequest {
    #[prost(bytes = "vec", tag = "1")]
    pub key: Vec<u8>,
}

#[derive(Clone, PartialEq, Message)]
pub struct PutRequest {
    #[prost(bytes = "vec", tag = "1")]
    pub key: Vec<u8>,
    #[prost(bytes = "vec", tag = "2")]
    pub value: Vec<u8>,
    #[prost(int64, tag = "3")]
    pub lease: i64,
}

#[derive(Clone, PartialEq, Message)]
pub struct DeleteRangeRequest {
    #[prost(bytes = "vec", tag = "1")]
    pub key: Vec<u8>,
}

#[derive(Clone, PartialEq, Message)]
pub struct TxnResponse {
    #[prost(message, optional, tag = "1")]
    pub header: Option<ResponseHeader>,
    #[prost(bool, tag = "2")]
    pub succeeded: bool,
    #[prost(message, repeated, tag = "3")]
    pub responses: Vec<ResponseOp>,
}

/// Read only to tell that etcd applied the request.
#[derive(Clone, PartialEq, Message)]
pub struct ResponseHeader {
    #[prost(int64, tag = "3")]
    pub revision: i64,
}

#[derive(Clone, PartialEq, Message)]
pub struct ResponseOp {
    #[prost(oneof = "Response", tags = "1, 2, 3, 4")]
    pub response: Option<Response>,
}

#[derive(Clone, PartialEq, prost::Oneof)]
pub enum Response {
    #[prost(message, tag = "1")]
    Range(RangeResponse),
    #[prost(message, tag = "2")]
    Put(Empty),
    #[prost(message, tag = "3")]
    DeleteRange(Empty),
    #[prost(message, tag = "4")]
    Txn(TxnResponse),
}

/// A response whose fields fanout does not read (`PutResponse`, `DeleteRangeResponse`).
#[derive(Clone, PartialEq, Message)]
pub struct Empty {}

#[derive(Clone, PartialEq, Message)]
pub struct RangeResponse {
    #[prost(message, repeated, tag = "2")]
    pub kvs: Vec<KeyValue>,
}

#[derive(Clone, PartialEq, Message)]
pub struct KeyValue {
    #[prost(bytes = "vec", tag = "1")]
    pub key: Vec<u8>,
    #[prost(bytes = "vec", tag = "5")]
    pub value: Vec<u8>,
}

#[derive(Clone, PartialEq, Message)]
pub struct LeaseGrantRequest {
    #[prost(int64, tag = "1")]
    pub ttl: i64,
}

#[derive(Clone, PartialEq, Message)]
pub struct LeaseGrantResponse {
    #[prost(int64, tag = "2")]
    pub id: i64,
    #[prost(int64, tag = "3")]
    pub ttl: i64,
    #[prost(string, tag = "4")]
    pub error: String,
}

/// One gRPC message on the wire: a byte saying it is not compressed, its length (4 bytes,
/// big-endian), the message.
pub fn frame(message: &impl Message) -> Vec<u8> {
    let len = message.encoded_len();
    let mut out = Vec::with_capacity(5 + len);
    out.push(0);
    out.extend_from_slice(&u32::try_from(len).unwrap_or(u32::MAX).to_be_bytes());
    // Encoding into a Vec grows it: it cannot run out of room.
    let _ = message.encode(&mut out);
    out
}

/// The message a gRPC answer's body carries: exactly one, uncompressed (fanout asks for no
/// compression).
pub fn unframe(body: &[u8]) -> Result<&[u8], &'static str> {
    let Some((&compressed, rest)) = body.split_first() else {
        return Err("an empty body");
    };
    if compressed != 0 {
        return Err("a compressed message");
    }
    let (len, message) = rest.split_at_checked(4).ok_or("a cut message")?;
    let mut be = [0u8; 4];
    be.copy_from_slice(len);
    let len = usize::try_from(u32::from_be_bytes(be)).map_err(|_| "a message too long")?;
    if message.len() != len {
        return Err("a message of the wrong length");
    }
    Ok(message)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_frame_is_the_message_after_its_length() {
        let grant = LeaseGrantRequest { ttl: 67 };
        let framed = frame(&grant);
        assert_eq!(framed, [0, 0, 0, 0, 2, 0x08, 67]);
        assert_eq!(unframe(&framed), Ok(&[0x08, 67][..]));
        assert_eq!(
            LeaseGrantRequest::decode(unframe(&framed).unwrap()).unwrap(),
            grant
        );
        assert_eq!(unframe(&[]), Err("an empty body"));
        assert_eq!(unframe(&[1, 0, 0, 0, 0]), Err("a compressed message"));
        assert_eq!(unframe(&[0, 0, 0]), Err("a cut message"));
        assert_eq!(
            unframe(&[0, 0, 0, 0, 3, 1]),
            Err("a message of the wrong length")
        );
    }

    #[test]
    fn a_compare_with_create_revision_0_keeps_its_field() {
        // proto3 leaves out a plain field at its default; a oneof member is always written,
        // so etcd sees which target the compare is against.
        let compare = Compare {
            result: EQUAL,
            target: CREATE,
            key: b"k".to_vec(),
            against: Some(Against::CreateRevision(0)),
        };
        assert_eq!(compare.encode_to_vec(), [0x10, 1, 0x1a, 1, b'k', 0x28, 0]);
    }
}
