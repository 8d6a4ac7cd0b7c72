//! The part of etcd's v3 gRPC API the store uses (`etcdserverpb` in etcd's
//! `api/etcdserverpb/rpc.proto`, `mvccpb.KeyValue` in `api/mvccpb/kv.proto`), as messages of
//! the wire codec ([`crate::protowire`]) with etcd's field numbers; fields fanout neither
//! sends nor reads are left out (skipped when decoding). And gRPC's framing of one message.

pub use crate::protowire::Message;
use crate::protowire::{merge_member, DecodeError, Field, Writer};

/// `Message` for a message that is one oneof of messages (etcd's `RequestOp` and
/// `ResponseOp`): `$field` holds the member, `[number Variant, ...]` its field numbers.
macro_rules! oneof_message {
    ($message:ident, $field:ident, $oneof:ident, [$($number:literal $member:ident),*]) => {
        impl Message for $message {
            fn encode_fields(&self, out: &mut Writer) {
                match &self.$field {
                    $(Some($oneof::$member(m)) => out.message($number, m),)*
                    None => {}
                }
            }

            fn merge_field(&mut self, field: Field<'_>) -> Result<(), DecodeError> {
                let slot = &mut self.$field;
                match field.number {
                    $($number => merge_member(
                        slot,
                        &field,
                        |r| match r {
                            $oneof::$member(m) => Some(m),
                            _ => None,
                        },
                        $oneof::$member,
                    ),)*
                    _ => Ok(()),
                }
            }
        }
    };
}

/// The calls, as gRPC paths (`/<package>.<service>/<method>`).
pub const TXN_PATH: &str = "/etcdserverpb.KV/Txn";
pub const GRANT_PATH: &str = "/etcdserverpb.Lease/LeaseGrant";

/// `Compare.CompareResult`.
pub const EQUAL: i32 = 0;
pub const LESS: i32 = 2;
/// `Compare.CompareTarget`.
pub const CREATE: i32 = 1;
pub const VALUE: i32 = 3;

#[derive(Debug, Clone, Default, PartialEq)]
pub struct TxnRequest {
    pub compare: Vec<Compare>,
    pub success: Vec<RequestOp>,
    pub failure: Vec<RequestOp>,
}

impl Message for TxnRequest {
    fn encode_fields(&self, out: &mut Writer) {
        self.compare.iter().for_each(|m| out.message(1, m));
        self.success.iter().for_each(|m| out.message(2, m));
        self.failure.iter().for_each(|m| out.message(3, m));
    }

    fn merge_field(&mut self, field: Field<'_>) -> Result<(), DecodeError> {
        match field.number {
            1 => self.compare.push(field.message()?),
            2 => self.success.push(field.message()?),
            3 => self.failure.push(field.message()?),
            _ => {}
        }
        Ok(())
    }
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct Compare {
    pub result: i32,
    pub target: i32,
    pub key: Vec<u8>,
    pub against: Option<Against>,
}

/// `Compare.target_union`, the two kinds fanout compares with.
#[derive(Debug, Clone, PartialEq)]
pub enum Against {
    /// Field 5.
    CreateRevision(i64),
    /// Field 7.
    Value(Vec<u8>),
}

impl Message for Compare {
    fn encode_fields(&self, out: &mut Writer) {
        out.int32(1, self.result);
        out.int32(2, self.target);
        out.bytes(3, &self.key);
        // A oneof member is written even at its default: it says which target it is.
        match &self.against {
            Some(Against::CreateRevision(revision)) => out.varint(5, *revision as u64),
            Some(Against::Value(value)) => out.len_delimited(7, value),
            None => {}
        }
    }

    fn merge_field(&mut self, field: Field<'_>) -> Result<(), DecodeError> {
        match field.number {
            1 => self.result = field.int32()?,
            2 => self.target = field.int32()?,
            3 => self.key = field.bytes()?.to_vec(),
            5 => self.against = Some(Against::CreateRevision(field.int64()?)),
            7 => self.against = Some(Against::Value(field.bytes()?.to_vec())),
            _ => {}
        }
        Ok(())
    }
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct RequestOp {
    pub request: Option<Request>,
}

/// `RequestOp.request`, fields 1 to 4.
#[derive(Debug, Clone, PartialEq)]
pub enum Request {
    Range(RangeRequest),
    Put(PutRequest),
    DeleteRange(DeleteRangeRequest),
    Txn(TxnRequest),
}

oneof_message!(RequestOp, request, Request, [1 Range, 2 Put, 3 DeleteRange, 4 Txn]);

#[derive(Debug, Clone, Default, PartialEq)]
pub struct RangeRequest {
    pub key: Vec<u8>,
}

impl Message for RangeRequest {
    fn encode_fields(&self, out: &mut Writer) {
        out.bytes(1, &self.key);
    }

    fn merge_field(&mut self, field: Field<'_>) -> Result<(), DecodeError> {
        if field.number == 1 {
            self.key = field.bytes()?.to_vec();
        }
        Ok(())
    }
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct PutRequest {
    pub key: Vec<u8>,
    pub value: Vec<u8>,
    pub lease: i64,
}

impl Message for PutRequest {
    fn encode_fields(&self, out: &mut Writer) {
        out.bytes(1, &self.key);
        out.bytes(2, &self.value);
        out.int64(3, self.lease);
    }

    fn merge_field(&mut self, field: Field<'_>) -> Result<(), DecodeError> {
        match field.number {
            1 => self.key = field.bytes()?.to_vec(),
            2 => self.value = field.bytes()?.to_vec(),
            3 => self.lease = field.int64()?,
            _ => {}
        }
        Ok(())
    }
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct DeleteRangeRequest {
    pub key: Vec<u8>,
}

impl Message for DeleteRangeRequest {
    fn encode_fields(&self, out: &mut Writer) {
        out.bytes(1, &self.key);
    }

    fn merge_field(&mut self, field: Field<'_>) -> Result<(), DecodeError> {
        if field.number == 1 {
            self.key = field.bytes()?.to_vec();
        }
        Ok(())
    }
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct TxnResponse {
    pub header: Option<ResponseHeader>,
    pub succeeded: bool,
    pub responses: Vec<ResponseOp>,
}

impl Message for TxnResponse {
    fn encode_fields(&self, out: &mut Writer) {
        if let Some(header) = &self.header {
            out.message(1, header);
        }
        out.bool(2, self.succeeded);
        self.responses.iter().for_each(|m| out.message(3, m));
    }

    fn merge_field(&mut self, field: Field<'_>) -> Result<(), DecodeError> {
        match field.number {
            1 => field.merge_into(self.header.get_or_insert_with(ResponseHeader::default))?,
            2 => self.succeeded = field.bool()?,
            3 => self.responses.push(field.message()?),
            _ => {}
        }
        Ok(())
    }
}

/// Read only to tell that etcd applied the request.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ResponseHeader {
    pub revision: i64,
}

impl Message for ResponseHeader {
    fn encode_fields(&self, out: &mut Writer) {
        out.int64(3, self.revision);
    }

    fn merge_field(&mut self, field: Field<'_>) -> Result<(), DecodeError> {
        if field.number == 3 {
            self.revision = field.int64()?;
        }
        Ok(())
    }
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct ResponseOp {
    pub response: Option<Response>,
}

/// `ResponseOp.response`, fields 1 to 4.
#[derive(Debug, Clone, PartialEq)]
pub enum Response {
    Range(RangeResponse),
    Put(Empty),
    DeleteRange(Empty),
    Txn(TxnResponse),
}

oneof_message!(ResponseOp, response, Response, [1 Range, 2 Put, 3 DeleteRange, 4 Txn]);

/// A response whose fields fanout does not read (`PutResponse`, `DeleteRangeResponse`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Empty {}

impl Message for Empty {
    fn encode_fields(&self, _: &mut Writer) {}

    fn merge_field(&mut self, _: Field<'_>) -> Result<(), DecodeError> {
        Ok(())
    }
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct RangeResponse {
    pub kvs: Vec<KeyValue>,
}

impl Message for RangeResponse {
    fn encode_fields(&self, out: &mut Writer) {
        self.kvs.iter().for_each(|m| out.message(2, m));
    }

    fn merge_field(&mut self, field: Field<'_>) -> Result<(), DecodeError> {
        if field.number == 2 {
            self.kvs.push(field.message()?);
        }
        Ok(())
    }
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct KeyValue {
    pub key: Vec<u8>,
    pub value: Vec<u8>,
}

impl Message for KeyValue {
    fn encode_fields(&self, out: &mut Writer) {
        out.bytes(1, &self.key);
        out.bytes(5, &self.value);
    }

    fn merge_field(&mut self, field: Field<'_>) -> Result<(), DecodeError> {
        match field.number {
            1 => self.key = field.bytes()?.to_vec(),
            5 => self.value = field.bytes()?.to_vec(),
            _ => {}
        }
        Ok(())
    }
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct LeaseGrantRequest {
    pub ttl: i64,
}

impl Message for LeaseGrantRequest {
    fn encode_fields(&self, out: &mut Writer) {
        out.int64(1, self.ttl);
    }

    fn merge_field(&mut self, field: Field<'_>) -> Result<(), DecodeError> {
        if field.number == 1 {
            self.ttl = field.int64()?;
        }
        Ok(())
    }
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct LeaseGrantResponse {
    pub id: i64,
    pub ttl: i64,
    pub error: String,
}

impl Message for LeaseGrantResponse {
    fn encode_fields(&self, out: &mut Writer) {
        out.int64(2, self.id);
        out.int64(3, self.ttl);
        out.bytes(4, self.error.as_bytes());
    }

    fn merge_field(&mut self, field: Field<'_>) -> Result<(), DecodeError> {
        match field.number {
            2 => self.id = field.int64()?,
            3 => self.ttl = field.int64()?,
            4 => self.error = field.string()?,
            _ => {}
        }
        Ok(())
    }
}

/// One gRPC message on the wire: a byte saying it is not compressed, its length (4 bytes,
/// big-endian), the message.
pub fn frame(message: &impl Message) -> Vec<u8> {
    let mut out = Writer::after(vec![0; 5]);
    message.encode_fields(&mut out);
    let mut out = out.into_bytes();
    let len = u32::try_from(out.len().saturating_sub(5)).unwrap_or(u32::MAX);
    if let Some(prefix) = out.get_mut(1..5) {
        prefix.copy_from_slice(&len.to_be_bytes());
    }
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

    /// etcd's messages as prost derives them (the codec before this one): the reference.
    mod reference {
        #[derive(Clone, PartialEq, prost::Message)]
        pub struct TxnRequest {
            #[prost(message, repeated, tag = "1")]
            pub compare: Vec<Compare>,
            #[prost(message, repeated, tag = "2")]
            pub success: Vec<RequestOp>,
            #[prost(message, repeated, tag = "3")]
            pub failure: Vec<RequestOp>,
        }

        #[derive(Clone, PartialEq, prost::Message)]
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

        #[derive(Clone, PartialEq, prost::Message)]
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

        #[derive(Clone, PartialEq, prost::Message)]
        pub struct RangeRequest {
            #[prost(bytes = "vec", tag = "1")]
            pub key: Vec<u8>,
        }

        #[derive(Clone, PartialEq, prost::Message)]
        pub struct PutRequest {
            #[prost(bytes = "vec", tag = "1")]
            pub key: Vec<u8>,
            #[prost(bytes = "vec", tag = "2")]
            pub value: Vec<u8>,
            #[prost(int64, tag = "3")]
            pub lease: i64,
        }

        #[derive(Clone, PartialEq, prost::Message)]
        pub struct DeleteRangeRequest {
            #[prost(bytes = "vec", tag = "1")]
            pub key: Vec<u8>,
        }

        #[derive(Clone, PartialEq, prost::Message)]
        pub struct TxnResponse {
            #[prost(message, optional, tag = "1")]
            pub header: Option<ResponseHeader>,
            #[prost(bool, tag = "2")]
            pub succeeded: bool,
            #[prost(message, repeated, tag = "3")]
            pub responses: Vec<ResponseOp>,
        }

        /// Read only to tell that etcd applied the request.
        #[derive(Clone, PartialEq, prost::Message)]
        pub struct ResponseHeader {
            #[prost(int64, tag = "3")]
            pub revision: i64,
        }

        #[derive(Clone, PartialEq, prost::Message)]
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
        #[derive(Clone, PartialEq, prost::Message)]
        pub struct Empty {}

        #[derive(Clone, PartialEq, prost::Message)]
        pub struct RangeResponse {
            #[prost(message, repeated, tag = "2")]
            pub kvs: Vec<KeyValue>,
        }

        #[derive(Clone, PartialEq, prost::Message)]
        pub struct KeyValue {
            #[prost(bytes = "vec", tag = "1")]
            pub key: Vec<u8>,
            #[prost(bytes = "vec", tag = "5")]
            pub value: Vec<u8>,
        }

        #[derive(Clone, PartialEq, prost::Message)]
        pub struct LeaseGrantRequest {
            #[prost(int64, tag = "1")]
            pub ttl: i64,
        }

        #[derive(Clone, PartialEq, prost::Message)]
        pub struct LeaseGrantResponse {
            #[prost(int64, tag = "2")]
            pub id: i64,
            #[prost(int64, tag = "3")]
            pub ttl: i64,
            #[prost(string, tag = "4")]
            pub error: String,
        }
    }

    fn bytes(rng: &mut fastrand::Rng) -> Vec<u8> {
        (0..rng.choice([0, 1, 3, 200]).unwrap_or(0))
            .map(|_| rng.u8(..))
            .collect()
    }

    fn int(rng: &mut fastrand::Rng) -> i64 {
        [0, 1, -1, i64::MAX, i64::MIN, rng.i64(..)][rng.usize(..6)]
    }

    fn txn_request(rng: &mut fastrand::Rng, depth: u32) -> TxnRequest {
        let compare = |rng: &mut fastrand::Rng| Compare {
            result: rng.choice([EQUAL, LESS, -1, 7]).unwrap_or(0),
            target: rng.choice([0, CREATE, VALUE]).unwrap_or(0),
            key: bytes(rng),
            against: match rng.u8(..3) {
                0 => None,
                1 => Some(Against::CreateRevision(int(rng))),
                _ => Some(Against::Value(bytes(rng))),
            },
        };
        let op = |rng: &mut fastrand::Rng| RequestOp {
            request: match rng.u8(..5) {
                0 => None,
                1 => Some(Request::Range(RangeRequest { key: bytes(rng) })),
                2 => Some(Request::Put(PutRequest {
                    key: bytes(rng),
                    value: bytes(rng),
                    lease: int(rng),
                })),
                3 => Some(Request::DeleteRange(DeleteRangeRequest { key: bytes(rng) })),
                _ if depth > 0 => Some(Request::Txn(txn_request(rng, depth - 1))),
                _ => None,
            },
        };
        TxnRequest {
            compare: (0..rng.usize(..3)).map(|_| compare(rng)).collect(),
            success: (0..rng.usize(..4)).map(|_| op(rng)).collect(),
            failure: (0..rng.usize(..3)).map(|_| op(rng)).collect(),
        }
    }

    fn txn_response(rng: &mut fastrand::Rng, depth: u32) -> TxnResponse {
        let op = |rng: &mut fastrand::Rng| ResponseOp {
            response: match rng.u8(..5) {
                0 => None,
                1 => Some(Response::Range(RangeResponse {
                    kvs: (0..rng.usize(..3))
                        .map(|_| KeyValue {
                            key: bytes(rng),
                            value: bytes(rng),
                        })
                        .collect(),
                })),
                2 => Some(Response::Put(Empty {})),
                3 => Some(Response::DeleteRange(Empty {})),
                _ if depth > 0 => Some(Response::Txn(txn_response(rng, depth - 1))),
                _ => None,
            },
        };
        TxnResponse {
            header: rng.bool().then(|| ResponseHeader { revision: int(rng) }),
            succeeded: rng.bool(),
            responses: (0..rng.usize(..4)).map(|_| op(rng)).collect(),
        }
    }

    /// `bytes` read by prost as `R` and written again; `None` when prost refuses them.
    fn prost_reads<R: prost::Message + Default>(bytes: &[u8]) -> Option<Vec<u8>> {
        R::decode(bytes).ok().map(|r| r.encode_to_vec())
    }

    /// `bytes` read by this codec as `M` and written again.
    fn reads<M: Message>(bytes: &[u8]) -> Option<Vec<u8>> {
        M::decode(bytes).ok().map(|m| m.encode_to_vec())
    }

    /// Each change keeps the bytes a protobuf message's bytes often enough to reach deep.
    fn mutate(rng: &mut fastrand::Rng, bytes: &mut Vec<u8>) {
        let at = rng.usize(..=bytes.len());
        match rng.u8(..4) {
            0 => bytes.truncate(at),
            1 if at < bytes.len() => bytes[at] = rng.u8(..),
            2 => bytes.insert(at, rng.u8(..)),
            _ => {
                let mut field = Vec::new();
                crate::protowire::push_varint(
                    &mut field,
                    u64::from(rng.u32(1..9) << 3 | rng.u32(..6)),
                );
                crate::protowire::push_varint(&mut field, rng.u64(..40));
                bytes.splice(at..at, field).for_each(drop);
            }
        }
    }

    /// Every message fanout writes is written byte for byte as prost wrote it (prost reads
    /// the bytes and writes the same ones again), and read back as it was.
    #[test]
    fn requests_are_the_bytes_prost_wrote() {
        let mut rng = fastrand::Rng::with_seed(1);
        for _ in 0..2000 {
            let txn = txn_request(&mut rng, 2);
            let bytes = txn.encode_to_vec();
            assert_eq!(
                prost_reads::<reference::TxnRequest>(&bytes).as_ref(),
                Some(&bytes)
            );
            assert_eq!(TxnRequest::decode(&bytes).as_ref(), Ok(&txn));
            let grant = LeaseGrantRequest { ttl: int(&mut rng) };
            let bytes = grant.encode_to_vec();
            assert_eq!(
                prost_reads::<reference::LeaseGrantRequest>(&bytes).as_ref(),
                Some(&bytes)
            );
            assert_eq!(LeaseGrantRequest::decode(&bytes), Ok(grant));
        }
    }

    /// What etcd answers, and any change of it: read or refused as prost did, and read as
    /// the same message.
    #[test]
    fn answers_are_read_as_prost_read_them() {
        let mut rng = fastrand::Rng::with_seed(2);
        for case in 0..20_000 {
            let mut txn = txn_response(&mut rng, 2).encode_to_vec();
            assert_eq!(
                prost_reads::<reference::TxnResponse>(&txn).as_ref(),
                Some(&txn)
            );
            let mut grant = LeaseGrantResponse {
                id: int(&mut rng),
                ttl: int(&mut rng),
                error: ["", "etcdserver: too many requests", "\u{e9}"][case % 3].into(),
            }
            .encode_to_vec();
            assert_eq!(
                prost_reads::<reference::LeaseGrantResponse>(&grant).as_ref(),
                Some(&grant)
            );
            for _ in 0..rng.usize(..4) {
                mutate(&mut rng, &mut txn);
                mutate(&mut rng, &mut grant);
            }
            assert_eq!(
                reads::<TxnResponse>(&txn),
                prost_reads::<reference::TxnResponse>(&txn),
                "case {case}: {txn:02x?}"
            );
            assert_eq!(
                reads::<LeaseGrantResponse>(&grant),
                prost_reads::<reference::LeaseGrantResponse>(&grant),
                "case {case}: {grant:02x?}"
            );
            // And what fanout writes, changed, read as prost read it (the tests read them).
            let mut request = txn_request(&mut rng, 1).encode_to_vec();
            mutate(&mut rng, &mut request);
            assert_eq!(
                reads::<TxnRequest>(&request),
                prost_reads::<reference::TxnRequest>(&request),
                "case {case}: {request:02x?}"
            );
        }
        // A oneof member given twice: the same kind merges, another replaces, as in prost.
        let op = |field: u8, key: u8| [field << 3 | 2, 4, 0x12, 2, 0x0a, key];
        for (first, second) in [(1, 1), (1, 4), (4, 4), (2, 3)] {
            let bytes: Vec<u8> = op(first, b'a')
                .into_iter()
                .chain(op(second, b'b'))
                .collect();
            assert_eq!(
                reads::<ResponseOp>(&bytes),
                prost_reads::<reference::ResponseOp>(&bytes),
                "{bytes:02x?}"
            );
        }
    }

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
        let txn = TxnRequest {
            success: vec![RequestOp::default(); 100],
            ..TxnRequest::default()
        };
        let framed = frame(&txn);
        assert_eq!(
            framed[..5],
            [0, 0, 0, 0, 200],
            "100 empty ops, two bytes each"
        );
        assert_eq!(unframe(&framed), Ok(&txn.encode_to_vec()[..]));
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
