//! Protocol Buffers' wire format, proto3, by hand: what fanout's messages need of it (etcd's
//! gRPC API, OTLP's traces). A message writes its fields with a [`Writer`] in field-number
//! order, leaving out a plain field at its default as protoc's code does (so the bytes are
//! the ones every other proto3 encoder writes), and reads them back one [`Field`] at a time.
//!
//! Reading follows the reference decoders: unknown fields are skipped (groups included), a
//! known field of the wrong wire type, a cut field or a string that is not UTF-8 is an error,
//! a repeated field appends, a plain field read twice keeps the last value, a message field
//! read twice merges, and nesting deeper than [`RECURSION_LIMIT`] is refused.

/// Wire types.
const VARINT: u8 = 0;
const FIXED64: u8 = 1;
const LEN: u8 = 2;
const START_GROUP: u8 = 3;
const END_GROUP: u8 = 4;
const FIXED32: u8 = 5;

/// Messages nested deeper than this are refused (the limit of the reference decoders).
pub const RECURSION_LIMIT: u32 = 100;

/// Why bytes are not the message they were read as.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodeError(pub &'static str);

/// A message of the wire format: its fields written and read.
pub trait Message: Default {
    /// Every field that is not at its default, in field-number order.
    fn encode_fields(&self, out: &mut Writer);

    /// One field read from the wire into this message (a field it does not know is left).
    fn merge_field(&mut self, field: Field<'_>) -> Result<(), DecodeError>;

    /// The message's bytes.
    fn encode_to_vec(&self) -> Vec<u8> {
        let mut out = Writer::default();
        self.encode_fields(&mut out);
        out.buf
    }

    /// The message in `bytes`.
    fn decode(bytes: &[u8]) -> Result<Self, DecodeError> {
        let mut message = Self::default();
        merge(&mut message, bytes, RECURSION_LIMIT)?;
        Ok(message)
    }
}

/// A message being written: each method writes one field (its key, then its value).
#[derive(Debug, Default)]
pub struct Writer {
    buf: Vec<u8>,
}

impl Writer {
    /// A writer whose message goes after `prefix` (a frame's header).
    pub fn after(prefix: Vec<u8>) -> Writer {
        Writer { buf: prefix }
    }

    /// A writer with room for `capacity` bytes.
    pub fn with_capacity(capacity: usize) -> Writer {
        Writer {
            buf: Vec::with_capacity(capacity),
        }
    }

    /// A length-delimited field whose `len` bytes the caller writes next ([`Writer::raw`]),
    /// for a nested message whose size is known before it is written.
    pub fn header(&mut self, field: u32, len: usize) {
        self.key(field, LEN);
        push_varint(&mut self.buf, len as u64);
    }

    /// Room for `additional` more bytes.
    pub fn reserve(&mut self, additional: usize) {
        self.buf.reserve(additional);
    }

    /// Bytes already encoded (what a [`Writer::header`] announced).
    pub fn raw(&mut self, bytes: &[u8]) {
        self.buf.extend_from_slice(bytes);
    }

    pub fn into_bytes(self) -> Vec<u8> {
        self.buf
    }

    /// A varint field, written even at 0 (a oneof member says which one it is).
    pub fn varint(&mut self, field: u32, value: u64) {
        self.key(field, VARINT);
        push_varint(&mut self.buf, value);
    }

    /// A length-delimited field, written even when empty (a oneof member).
    pub fn len_delimited(&mut self, field: u32, value: &[u8]) {
        self.key(field, LEN);
        push_varint(&mut self.buf, value.len() as u64);
        self.buf.extend_from_slice(value);
    }

    /// `int64`, `uint64`: left out at 0.
    pub fn int64(&mut self, field: u32, value: i64) {
        if value != 0 {
            self.varint(field, value as u64);
        }
    }

    /// `int32` (and enums): a negative one takes ten bytes, sign-extended, as in `int64`.
    pub fn int32(&mut self, field: u32, value: i32) {
        self.int64(field, i64::from(value));
    }

    pub fn bool(&mut self, field: u32, value: bool) {
        self.int64(field, i64::from(value));
    }

    /// `bytes`, `string`: left out when empty.
    pub fn bytes(&mut self, field: u32, value: &[u8]) {
        if !value.is_empty() {
            self.len_delimited(field, value);
        }
    }

    pub fn fixed64(&mut self, field: u32, value: u64) {
        if value != 0 {
            self.key(field, FIXED64);
            self.buf.extend_from_slice(&value.to_le_bytes());
        }
    }

    pub fn fixed32(&mut self, field: u32, value: u32) {
        if value != 0 {
            self.key(field, FIXED32);
            self.buf.extend_from_slice(&value.to_le_bytes());
        }
    }

    /// A message field (an element of a repeated one, a present optional one, a oneof
    /// member): always written, empty or not.
    pub fn message(&mut self, field: u32, message: &impl Message) {
        let start = self.begin(field);
        message.encode_fields(self);
        self.end(start);
    }

    fn key(&mut self, field: u32, wire_type: u8) {
        push_varint(&mut self.buf, u64::from(field) << 3 | u64::from(wire_type));
    }

    /// A nested message's key and a one-byte room for its length, which goes there once its
    /// bytes are written.
    fn begin(&mut self, field: u32) -> usize {
        self.key(field, LEN);
        self.buf.push(0);
        self.buf.len()
    }

    /// The length of the message begun at `start`: in its one byte when under 128, else the
    /// room grows to the varint's size (the message's bytes move, once).
    fn end(&mut self, start: usize) {
        let len = self.buf.len().saturating_sub(start) as u64;
        let mut varint = [0u8; 10];
        let mut n = 0;
        let mut value = len;
        while let Some(byte) = varint.get_mut(n) {
            n += 1;
            if value < 0x80 {
                *byte = value as u8;
                break;
            }
            *byte = (value as u8) | 0x80;
            value >>= 7;
        }
        let Some(room) = start.checked_sub(1) else {
            return;
        };
        let (first, rest) = varint.split_at(1);
        if let (Some(slot), Some(first)) = (self.buf.get_mut(room), first.first()) {
            *slot = *first;
        }
        if n > 1 {
            let rest = rest.get(..n - 1).unwrap_or_default();
            self.buf.splice(start..start, rest.iter().copied());
        }
    }
}

/// How many bytes `value` takes as a varint.
pub fn varint_len(value: u64) -> usize {
    let bits = 64 - (value | 1).leading_zeros() as usize;
    bits.div_ceil(7)
}

/// `value` as a base-128 varint, low group first.
pub fn push_varint(out: &mut Vec<u8>, mut value: u64) {
    while value >= 0x80 {
        out.push((value as u8) | 0x80);
        value >>= 7;
    }
    out.push(value as u8);
}

/// One field read from the wire: its number and value, and how deep a message it holds may
/// nest.
#[derive(Debug, Clone, Copy)]
pub struct Field<'a> {
    pub number: u32,
    value: WireValue<'a>,
    depth_left: u32,
}

#[derive(Debug, Clone, Copy)]
enum WireValue<'a> {
    Varint(u64),
    Fixed64(u64),
    Len(&'a [u8]),
    Fixed32(u32),
    /// Skipped.
    Group,
}

const WRONG_TYPE: DecodeError = DecodeError("a field of the wrong wire type");

impl<'a> Field<'a> {
    pub fn uint64(&self) -> Result<u64, DecodeError> {
        match self.value {
            WireValue::Varint(v) => Ok(v),
            _ => Err(WRONG_TYPE),
        }
    }

    pub fn int64(&self) -> Result<i64, DecodeError> {
        self.uint64().map(|v| v as i64)
    }

    /// `int32` and enums: the low 32 bits, as the reference decoders keep them.
    pub fn int32(&self) -> Result<i32, DecodeError> {
        self.uint64().map(|v| v as i32)
    }

    pub fn bool(&self) -> Result<bool, DecodeError> {
        self.uint64().map(|v| v != 0)
    }

    pub fn fixed64(&self) -> Result<u64, DecodeError> {
        match self.value {
            WireValue::Fixed64(v) => Ok(v),
            _ => Err(WRONG_TYPE),
        }
    }

    pub fn fixed32(&self) -> Result<u32, DecodeError> {
        match self.value {
            WireValue::Fixed32(v) => Ok(v),
            _ => Err(WRONG_TYPE),
        }
    }

    pub fn bytes(&self) -> Result<&'a [u8], DecodeError> {
        match self.value {
            WireValue::Len(v) => Ok(v),
            _ => Err(WRONG_TYPE),
        }
    }

    pub fn string(&self) -> Result<String, DecodeError> {
        let bytes = self.bytes()?;
        std::str::from_utf8(bytes)
            .map(str::to_string)
            .map_err(|_| DecodeError("a string that is not UTF-8"))
    }

    /// A message field merged into `into` (a fresh default for a repeated one).
    pub fn merge_into(&self, into: &mut impl Message) -> Result<(), DecodeError> {
        let depth_left = self.depth_left.checked_sub(1).ok_or(TOO_DEEP)?;
        merge(into, self.bytes()?, depth_left)
    }

    /// A message field read on its own (an element of a repeated one, a oneof member).
    pub fn message<M: Message>(&self) -> Result<M, DecodeError> {
        let mut message = M::default();
        self.merge_into(&mut message)?;
        Ok(message)
    }
}

/// A oneof's message member read into `slot`: merged into the member there when it is this
/// one (`this` finds it), replacing it otherwise (`make` wraps the message read).
pub fn merge_member<O, M: Message>(
    slot: &mut Option<O>,
    field: &Field<'_>,
    this: fn(&mut O) -> Option<&mut M>,
    make: fn(M) -> O,
) -> Result<(), DecodeError> {
    if let Some(member) = slot.as_mut().and_then(this) {
        return field.merge_into(member);
    }
    *slot = Some(make(field.message()?));
    Ok(())
}

/// Every field of `bytes` merged into `message`.
fn merge(message: &mut impl Message, mut bytes: &[u8], depth_left: u32) -> Result<(), DecodeError> {
    while !bytes.is_empty() {
        message.merge_field(next_field(&mut bytes, depth_left)?)?;
    }
    Ok(())
}

/// The field at the start of `bytes`, which it consumes. A group is skipped whole (no
/// message fanout reads has one: as a known field it is of the wrong wire type).
fn next_field<'a>(bytes: &mut &'a [u8], depth_left: u32) -> Result<Field<'a>, DecodeError> {
    let (number, wire_type) = read_key(bytes)?;
    let value = match wire_type {
        VARINT => WireValue::Varint(read_varint(bytes)?),
        FIXED64 => WireValue::Fixed64(u64::from_le_bytes(take_array(bytes)?)),
        LEN => {
            let len = usize::try_from(read_varint(bytes)?).map_err(|_| CUT)?;
            let (value, rest) = bytes.split_at_checked(len).ok_or(CUT)?;
            *bytes = rest;
            WireValue::Len(value)
        }
        FIXED32 => WireValue::Fixed32(u32::from_le_bytes(take_array(bytes)?)),
        START_GROUP if depth_left == 0 => return Err(TOO_DEEP),
        START_GROUP => {
            skip_group(bytes, number, depth_left)?;
            WireValue::Group
        }
        _ => return Err(DecodeError("an unexpected end of group")),
    };
    Ok(Field {
        number,
        value,
        depth_left,
    })
}

const CUT: DecodeError = DecodeError("a cut message");
const TOO_DEEP: DecodeError = DecodeError("messages nested too deep");

/// A field's number and wire type.
fn read_key(bytes: &mut &[u8]) -> Result<(u32, u8), DecodeError> {
    let key = u32::try_from(read_varint(bytes)?).map_err(|_| DecodeError("a key too large"))?;
    let wire_type = (key & 7) as u8;
    if wire_type > FIXED32 {
        return Err(DecodeError("an unknown wire type"));
    }
    if key >> 3 == 0 {
        return Err(DecodeError("field number 0"));
    }
    Ok((key >> 3, wire_type))
}

/// Past the group `number` just opened: to its end-group key, over what it holds. Each
/// group nested counts as a message nested.
fn skip_group(bytes: &mut &[u8], number: u32, depth_left: u32) -> Result<(), DecodeError> {
    let mut open = vec![number];
    while let Some(&innermost) = open.last() {
        let (field, wire_type) = read_key(bytes)?;
        if wire_type != END_GROUP && open.len() >= depth_left as usize {
            return Err(TOO_DEEP);
        }
        match wire_type {
            START_GROUP => open.push(field),
            END_GROUP if field == innermost => {
                open.pop();
            }
            END_GROUP => return Err(DecodeError("an unexpected end of group")),
            VARINT => drop(read_varint(bytes)?),
            FIXED64 => drop(take_array::<8>(bytes)?),
            FIXED32 => drop(take_array::<4>(bytes)?),
            _ => {
                let len = usize::try_from(read_varint(bytes)?).map_err(|_| CUT)?;
                *bytes = bytes.get(len..).ok_or(CUT)?;
            }
        }
    }
    Ok(())
}

fn read_varint(bytes: &mut &[u8]) -> Result<u64, DecodeError> {
    let mut value = 0u64;
    for shift in (0..70).step_by(7) {
        let (&byte, rest) = bytes.split_first().ok_or(CUT)?;
        *bytes = rest;
        // The tenth byte holds the last bit of 64.
        if shift == 63 && byte > 1 {
            return Err(DecodeError("a varint too long"));
        }
        value |= u64::from(byte & 0x7f) << shift;
        if byte < 0x80 {
            return Ok(value);
        }
    }
    Err(DecodeError("a varint too long"))
}

fn take_array<const N: usize>(bytes: &mut &[u8]) -> Result<[u8; N], DecodeError> {
    let (head, rest) = bytes.split_first_chunk::<N>().ok_or(CUT)?;
    *bytes = rest;
    Ok(*head)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One of each kind of field, and the same message derived by prost: the reference.
    #[derive(Debug, Default, PartialEq)]
    struct Mine {
        int: i64,
        small: i32,
        flag: bool,
        text: String,
        fixed: u64,
        fixed_small: u32,
        inner: Option<Box<Mine>>,
        many: Vec<Mine>,
    }

    impl Message for Mine {
        fn encode_fields(&self, out: &mut Writer) {
            out.int64(1, self.int);
            out.int32(2, self.small);
            out.bool(3, self.flag);
            out.bytes(4, self.text.as_bytes());
            out.fixed64(5, self.fixed);
            out.fixed32(6, self.fixed_small);
            if let Some(inner) = &self.inner {
                out.message(7, inner.as_ref());
            }
            self.many.iter().for_each(|m| out.message(8, m));
        }

        fn merge_field(&mut self, field: Field<'_>) -> Result<(), DecodeError> {
            match field.number {
                1 => self.int = field.int64()?,
                2 => self.small = field.int32()?,
                3 => self.flag = field.bool()?,
                4 => self.text = field.string()?,
                5 => self.fixed = field.fixed64()?,
                6 => self.fixed_small = field.fixed32()?,
                7 => field.merge_into(self.inner.get_or_insert_with(Box::default).as_mut())?,
                8 => self.many.push(field.message()?),
                _ => {}
            }
            Ok(())
        }
    }

    #[derive(Clone, PartialEq, prost::Message)]
    struct Reference {
        #[prost(int64, tag = "1")]
        int: i64,
        #[prost(int32, tag = "2")]
        small: i32,
        #[prost(bool, tag = "3")]
        flag: bool,
        #[prost(string, tag = "4")]
        text: String,
        #[prost(fixed64, tag = "5")]
        fixed: u64,
        #[prost(fixed32, tag = "6")]
        fixed_small: u32,
        #[prost(message, optional, boxed, tag = "7")]
        inner: Option<Box<Reference>>,
        #[prost(message, repeated, tag = "8")]
        many: Vec<Reference>,
    }

    fn random(rng: &mut fastrand::Rng, depth: u32) -> Mine {
        let int = match rng.u8(..4) {
            0 => 0,
            1 => rng.i64(..),
            2 => rng.i64(-300..300),
            _ => i64::MIN,
        };
        let text: String = (0..rng.usize(..4))
            .map(|_| rng.choice(['a', 'é', '\0', '€']).unwrap_or('a'))
            .collect();
        Mine {
            int,
            small: [0, 1, -1, i32::MIN, i32::MAX, rng.i32(..)][rng.usize(..6)],
            flag: rng.bool(),
            text,
            fixed: [0, 1, u64::MAX, rng.u64(..)][rng.usize(..4)],
            fixed_small: rng.choice([0, 7, u32::MAX]).unwrap_or(0),
            inner: (depth > 0 && rng.bool()).then(|| Box::new(random(rng, depth - 1))),
            many: (0..rng.usize(..3).min(depth as usize))
                .map(|_| random(rng, depth - 1))
                .collect(),
        }
    }

    /// What prost makes of `bytes`, written again by prost; `None` when it refuses them.
    fn prost_reads(bytes: &[u8]) -> Option<Vec<u8>> {
        use prost::Message as _;
        Reference::decode(bytes).ok().map(|r| r.encode_to_vec())
    }

    #[test]
    fn varint_len_is_the_length_push_varint_writes() {
        let mut values: Vec<u64> = (0..64).flat_map(|b| [1u64 << b, (1u64 << b) - 1]).collect();
        values.extend([0, u64::MAX, 127, 128, 16_383, 16_384]);
        for value in values {
            let mut out = Vec::new();
            push_varint(&mut out, value);
            assert_eq!(varint_len(value), out.len(), "{value}");
        }
    }

    #[test]
    fn every_kind_of_field_is_written_as_prost_writes_it_and_read_back() {
        let mut rng = fastrand::Rng::with_seed(37);
        for _ in 0..3000 {
            let mine = random(&mut rng, 3);
            let bytes = mine.encode_to_vec();
            assert_eq!(prost_reads(&bytes).as_ref(), Some(&bytes), "{mine:?}");
            assert_eq!(Mine::decode(&bytes), Ok(mine));
        }
    }

    /// Cut, altered and made-up bytes: accepted and refused as prost does, and read as it
    /// reads them (the message prost reads is the one this codec reads, written again).
    #[test]
    fn any_bytes_are_read_or_refused_as_prost_does() {
        let mut rng = fastrand::Rng::with_seed(3737);
        for case in 0..20_000 {
            let mut bytes = random(&mut rng, 3).encode_to_vec();
            for _ in 0..rng.usize(1..4) {
                let at = rng.usize(..=bytes.len());
                match rng.u8(..5) {
                    0 => bytes.truncate(at),
                    1 if at < bytes.len() => bytes[at] = rng.u8(..),
                    2 => bytes.insert(at, rng.u8(..)),
                    3 => bytes
                        .splice(at..at, [rng.u8(..), rng.u8(..), rng.u8(..)])
                        .for_each(drop),
                    _ => {
                        let key = (rng.u32(1..12) << 3) | rng.u32(..6);
                        let mut field = Vec::new();
                        push_varint(&mut field, u64::from(key));
                        push_varint(&mut field, rng.u64(..300));
                        bytes.splice(at..at, field).for_each(drop);
                    }
                }
            }
            let ours = Mine::decode(&bytes).map(|m| m.encode_to_vec()).ok();
            assert_eq!(ours, prost_reads(&bytes), "case {case}: {bytes:02x?}");
        }
    }

    #[test]
    fn varints_at_their_limits() {
        for (value, want) in [
            (0u64, &[0u8][..]),
            (127, &[0x7f]),
            (128, &[0x80, 1]),
            (300, &[0xac, 2]),
            (
                u64::MAX,
                &[0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 1],
            ),
        ] {
            let mut out = Vec::new();
            push_varint(&mut out, value);
            assert_eq!(out, want);
            assert_eq!(read_varint(&mut &out[..]), Ok(value));
        }
        let eleven = [0x80; 10].iter().chain(&[0]).copied().collect::<Vec<_>>();
        let tenth_too_big = [0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 2];
        for bad in [&[][..], &[0x80], &eleven, &tenth_too_big] {
            assert!(read_varint(&mut &bad[..]).is_err(), "{bad:02x?}");
            let mut field = vec![0x08];
            field.extend_from_slice(bad);
            assert_eq!(prost_reads(&field), None);
            assert!(Mine::decode(&field).is_err());
        }
    }

    #[test]
    fn groups_are_skipped_and_must_close_as_prost_says() {
        // Field 9 as a group holding a varint and a nested group 10, then field 1 = 5.
        let ok = [0x4b, 0x08, 1, 0x53, 0x54, 0x4c, 0x08, 5];
        assert_eq!(Mine::decode(&ok).map(|m| m.int), Ok(5));
        assert!(prost_reads(&ok).is_some());
        for bad in [
            &[0x4b, 0x08, 1][..],    // never closed
            &[0x4b, 0x54, 0x4c][..], // closed by another number
            &[0x4c][..],             // an end with no start
            &[0x0b, 0x0c][..],       // a known field as a group
            &[0x0e, 0][..],          // wire type 6
            &[0x00, 0][..],          // field number 0
        ] {
            assert!(Mine::decode(bad).is_err(), "{bad:02x?}");
            assert_eq!(prost_reads(bad), None, "{bad:02x?}");
        }
    }

    /// Nested messages and groups: as deep as prost reads, and no deeper.
    #[test]
    fn nesting_stops_where_prost_stops() {
        for depth in [98, 99, 100, 101] {
            let mut mine = Mine {
                int: 1,
                ..Mine::default()
            };
            for _ in 0..depth {
                mine = Mine {
                    inner: Some(Box::new(mine)),
                    ..Mine::default()
                };
            }
            let bytes = mine.encode_to_vec();
            let ours = Mine::decode(&bytes).map(|m| m.encode_to_vec()).ok();
            assert_eq!(ours, prost_reads(&bytes), "{depth} messages deep");
            let mut groups = vec![0x4b; depth];
            groups.extend([0x08, 1]);
            groups.extend(vec![0x4c; depth]);
            let ours = Mine::decode(&groups).map(|m| m.encode_to_vec()).ok();
            assert_eq!(ours, prost_reads(&groups), "{depth} groups deep");
        }
    }
}
