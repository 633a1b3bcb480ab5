//! Canonical JSON (RFC 8785, JCS) of any `Serialize` value, with exact integers.
//!
//! Keys hash the canonical form of a payload, so two payloads that mean the same thing must give the
//! same bytes, and two that differ must not. [`to_canonical_vec`] writes JCS directly from serde:
//!
//! - object members are sorted by their UTF-16 code units (RFC 8785 §3.2.3), so member order (a
//!   `HashMap`'s iteration order, a struct's field order) never changes the bytes; duplicate member
//!   names are an error;
//! - strings are escaped as JCS says and otherwise written as given: no Unicode normalization, so
//!   `"é"` (U+00E9) and `"e\u{301}"` are different payloads;
//! - floating-point numbers use the ECMAScript number formatting JCS requires (through `ryu-js`);
//!   `NaN` and `±Infinity` are rejected with [`CanonicalError::NonFinite`] — serde_json would
//!   silently write `null`, which would make every non-finite amount the same payload;
//! - integers are written exactly, in decimal. This is the one place where we depart from JCS, which
//!   formats every number as an IEEE double and so maps 2^53 + 1 onto 2^53: two different amounts
//!   must never share a key. For integers with magnitude up to 2^53 the output is JCS byte for byte.
//!   "Integer" means what serde hands over as an integer (`u64`, `i128`, …) and, in
//!   [`canonicalize_json`], a JSON number written without a fraction or exponent. A number written
//!   as `9007199254740993.0` or `9.007199254740993e15` is a double, as JCS says, and rounds like
//!   one; and a `serde_json::Value` parsed without serde_json's `arbitrary_precision` feature has
//!   already rounded integers beyond 64 bits before we see them;
//! - nesting deeper than [`MAX_DEPTH`] is rejected with [`CanonicalError::TooDeep`];
//! - map keys must be strings (or unit enum variants, written as their name); an integer or
//!   composite map key is rejected with [`CanonicalError::NonStringKey`].
//!
//! No crate on crates.io met all of these: `serde_jcs` and `serde_json_canonicalizer` follow JCS's
//! double formatting for integers (losing precision above 2^53), and going through
//! `serde_json::Value` turns NaN into `null`. Hence this serializer.
//!
//! ```
//! use idempotent_core::canonical::to_canonical_vec;
//! use serde_json::json;
//!
//! let a = to_canonical_vec(&json!({"b": 1, "a": [true, null, 1.5e30]})).unwrap();
//! assert_eq!(a, br#"{"a":[true,null,1.5e+30],"b":1}"#);
//! assert!(to_canonical_vec(&f64::NAN).is_err());
//! ```

use std::borrow::Cow;
use std::fmt::Display;
use std::ops::Range;

use serde::Serialize;
use serde::ser::{self, Impossible};

/// The deepest nesting of arrays and objects [`to_canonical_vec`] accepts.
pub const MAX_DEPTH: usize = 128;

/// Why a value has no canonical JSON form.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum CanonicalError {
    /// A float was NaN or infinite; JSON cannot represent it.
    #[error(
        "payload contains the non-finite number {0}; JSON has no representation for NaN or \
         infinity, so it cannot be part of an idempotency key (pass it as a string, or reject it \
         before the call)"
    )]
    NonFinite(f64),
    /// Arrays and objects were nested deeper than [`MAX_DEPTH`].
    #[error(
        "payload is nested deeper than {max} levels; flatten it or leave the deep part out of \
         the key with skip(...)"
    )]
    TooDeep {
        /// The limit that was exceeded.
        max: usize,
    },
    /// A map key was not a string.
    #[error(
        "payload has a map whose keys are {kind}, not strings; JSON object keys must be strings \
         (convert the keys, e.g. to a BTreeMap<String, _>)"
    )]
    NonStringKey {
        /// What the key was.
        kind: &'static str,
    },
    /// The same member name appeared twice in one object.
    #[error("payload has the object member {0:?} twice; canonical JSON needs unique member names")]
    DuplicateKey(String),
    /// The value's `Serialize` implementation failed.
    #[error("payload could not be serialized: {0}")]
    Custom(String),
}

impl ser::Error for CanonicalError {
    fn custom<T: Display>(msg: T) -> Self {
        CanonicalError::Custom(msg.to_string())
    }
}

/// Serializes `value` to canonical JSON (see the [module docs](self)).
pub fn to_canonical_vec<T: Serialize + ?Sized>(value: &T) -> Result<Vec<u8>, CanonicalError> {
    let mut out = Vec::with_capacity(128);
    write_canonical(&mut out, value)?;
    Ok(out)
}

/// Appends the canonical JSON of `value` to `out`. On error, `out` is left as it was.
pub fn write_canonical<T: Serialize + ?Sized>(out: &mut Vec<u8>, value: &T) -> Result<(), CanonicalError> {
    let mut spare = Spare::take();
    let res = write_with(out, value, &mut spare);
    spare.give_back();
    res
}

/// Hands the canonical JSON of `value` to `f`, from a buffer this thread keeps for it: unlike
/// [`to_canonical_vec`], nothing is allocated once the thread's buffers have grown to fit (what
/// the key derivation of every step call needs: the canonical bytes are only hashed).
///
/// ```
/// use idempotent_core::canonical::with_canonical;
///
/// let len = with_canonical(&serde_json::json!({"b": 1, "a": [true, null]}), |json| {
///     assert_eq!(json, br#"{"a":[true,null],"b":1}"#);
///     json.len()
/// })
/// .unwrap();
/// assert_eq!(len, 23);
/// ```
pub fn with_canonical<T: Serialize + ?Sized, R>(value: &T, f: impl FnOnce(&[u8]) -> R) -> Result<R, CanonicalError> {
    let mut spare = Spare::take();
    let mut out = std::mem::take(&mut spare.out);
    out.clear();
    let res = write_with(&mut out, value, &mut spare).map(|()| f(&out));
    spare.out = out;
    spare.give_back();
    res
}

fn write_with<T: Serialize + ?Sized>(out: &mut Vec<u8>, value: &T, spare: &mut Spare) -> Result<(), CanonicalError> {
    let start = out.len();
    let mut members = std::mem::take(&mut spare.members);
    members.clear();
    // Room for the members of typical payloads (a struct and a nested one) in one allocation.
    members.reserve(16);
    let mut ser = Canonicalizer { out, depth: 0, scratch: std::mem::take(&mut spare.scratch), members };
    let res = value.serialize(&mut ser);
    if res.is_err() {
        ser.out.truncate(start);
    }
    spare.scratch = ser.scratch;
    spare.members = ser.members;
    res
}

/// The buffers canonicalizing needs besides its output, kept by each thread between calls so
/// that a call allocates nothing once they have grown to fit its payloads.
///
/// A call takes them out of the thread's slot and puts them back when it is done, so a call
/// made inside another (a `Serialize` impl that canonicalizes something itself) just starts
/// from empty buffers. Buffers that grew past [`Spare::KEEP`] bytes are not kept.
#[derive(Default)]
struct Spare {
    out: Vec<u8>,
    scratch: Vec<u8>,
    members: Vec<Member>,
}

thread_local! {
    static SPARE: std::cell::Cell<Option<Box<Spare>>> = const { std::cell::Cell::new(None) };
}

impl Spare {
    /// The most a kept buffer may hold: payloads larger than this are rare, and a thread should
    /// not keep their buffers for good.
    const KEEP: usize = 64 << 10;

    fn take() -> Box<Spare> {
        SPARE.try_with(|slot| slot.take()).ok().flatten().unwrap_or_default()
    }

    fn give_back(mut self: Box<Self>) {
        if self.out.capacity() > Self::KEEP {
            self.out = Vec::new();
        }
        if self.scratch.capacity() > Self::KEEP {
            self.scratch = Vec::new();
        }
        if self.members.capacity() * std::mem::size_of::<Member>() > Self::KEEP {
            self.members = Vec::new();
        }
        // Owned member names were dropped as their objects ended; only the capacity is kept.
        self.members.clear();
        let _ = SPARE.try_with(|slot| slot.set(Some(self)));
    }
}

/// Canonicalizes a JSON document given as bytes (for example an HTTP request body).
///
/// Unlike parsing into `serde_json::Value`, integers of any size keep their exact digits, so
/// `{"amount": 18446744073709551617}` and `{"amount": 18446744073709551616}` stay different.
/// Fractions and exponents are read as IEEE doubles and written in JCS form, as RFC 8785 says.
pub fn canonicalize_json(input: &[u8]) -> Result<Vec<u8>, JsonError> {
    let mut spare = Spare::take();
    let (out, res) = parse_with(input, Vec::new(), &mut spare);
    spare.give_back();
    res.map(|()| out)
}

/// Hands the canonical form of the JSON document `input` (see [`canonicalize_json`]) to `f`,
/// from a buffer this thread keeps for it, like [`with_canonical`]: what the HTTP layer's body
/// fingerprint needs, without allocating once the thread's buffers have grown to fit.
///
/// ```
/// use idempotent_core::canonical::with_canonical_json;
///
/// let same = with_canonical_json(b"{ \"b\": 1, \"a\": 2 }", |json| json == br#"{"a":2,"b":1}"#);
/// assert_eq!(same, Ok(true));
/// assert!(with_canonical_json(b"{oops", |_| ()).is_err());
/// ```
pub fn with_canonical_json<R>(input: &[u8], f: impl FnOnce(&[u8]) -> R) -> Result<R, JsonError> {
    let mut spare = Spare::take();
    let (out, res) = parse_with(input, std::mem::take(&mut spare.out), &mut spare);
    let res = res.map(|()| f(&out));
    spare.out = out;
    spare.give_back();
    res
}

/// Parses `input` into `out` (cleared first), with the spare buffers for reordering members;
/// gives `out` back whatever the outcome, so its allocation can be kept.
fn parse_with(input: &[u8], mut out: Vec<u8>, spare: &mut Spare) -> (Vec<u8>, Result<(), JsonError>) {
    out.clear();
    // JSON text is UTF-8 (RFC 8259): checked once here, so that the parser slices strings out
    // of a `&str` at ASCII delimiters instead of checking each one.
    let text = match std::str::from_utf8(input) {
        Ok(text) => text,
        Err(e) => return (out, Err(JsonError { offset: e.valid_up_to(), reason: "not valid UTF-8" })),
    };
    out.reserve(input.len());
    let mut p = JsonParser {
        text,
        s: input,
        i: 0,
        out,
        scratch: std::mem::take(&mut spare.scratch),
        members: relabel(std::mem::take(&mut spare.members)),
    };
    p.members.reserve(16);
    p.skip_ws();
    let res = p.value(0).and_then(|()| {
        p.skip_ws();
        if p.i == p.s.len() { Ok(()) } else { Err(p.err("trailing characters after the JSON value")) }
    });
    spare.scratch = p.scratch;
    spare.members = relabel(p.members);
    (p.out, res)
}

/// An emptied vector of members, as members of another lifetime: the parser's member names
/// borrow from its input, the kept buffer's cannot. Collecting an empty `vec::IntoIter` into a
/// vector of a type with the same layout reuses its allocation (std's in-place collection).
fn relabel<'a, 'b>(mut v: Vec<(Cow<'a, str>, Range<usize>)>) -> Vec<(Cow<'b, str>, Range<usize>)> {
    v.clear();
    v.into_iter().map(|(name, range)| (Cow::Owned(name.into_owned()), range)).collect()
}

/// Why [`canonicalize_json`] refused its input.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid JSON at byte {offset}: {reason}")]
pub struct JsonError {
    /// Byte offset into the input.
    pub offset: usize,
    /// What was wrong there.
    pub reason: &'static str,
}

struct Canonicalizer<'a> {
    out: &'a mut Vec<u8>,
    depth: usize,
    /// Where an object's members are copied while they are put in order; kept across objects so
    /// that reordering does not allocate once per object.
    scratch: Vec<u8>,
    /// The members of every object being written, innermost last: each object owns the part
    /// from its `base` on, and gives it back when it is finished. One vector for the whole
    /// value instead of one per object.
    members: Vec<Member>,
}

/// An object member's name and the byte range of `"name":value` in the output (without commas).
/// Struct field names are `&'static str`, so only map keys are owned.
type Member = (Cow<'static, str>, Range<usize>);

impl Canonicalizer<'_> {
    fn enter(&mut self) -> Result<(), CanonicalError> {
        self.depth += 1;
        if self.depth > MAX_DEPTH {
            return Err(CanonicalError::TooDeep { max: MAX_DEPTH });
        }
        Ok(())
    }

    fn int<I: itoa::Integer>(&mut self, v: I) {
        self.out.extend_from_slice(itoa::Buffer::new().format(v).as_bytes());
    }

    fn float(&mut self, v: f64) -> Result<(), CanonicalError> {
        write_f64(self.out, v)
    }

    fn begin_object(&mut self, len: usize) -> Result<ObjectState, CanonicalError> {
        self.enter()?;
        self.out.push(b'{');
        self.members.reserve(len);
        Ok(ObjectState { start: self.out.len(), base: self.members.len(), key: None })
    }
}

fn write_f64(out: &mut Vec<u8>, v: f64) -> Result<(), CanonicalError> {
    if !v.is_finite() {
        return Err(CanonicalError::NonFinite(v));
    }
    out.extend_from_slice(ryu_js::Buffer::new().format_finite(v).as_bytes());
    Ok(())
}

/// Writes `s` as a JSON string literal with the escaping RFC 8785 §3.2.2.2 prescribes.
pub(crate) fn write_str(out: &mut Vec<u8>, s: &str) {
    out.reserve(s.len() + 2);
    out.push(b'"');
    let bytes = s.as_bytes();
    let mut run = 0;
    for (i, &b) in bytes.iter().enumerate() {
        // Almost every byte is written as is; testing for that first keeps the loop to three
        // well-predicted comparisons instead of a jump table per byte.
        if b >= 0x20 && b != b'"' && b != b'\\' {
            continue;
        }
        let esc: &[u8] = match b {
            b'"' => b"\\\"",
            b'\\' => b"\\\\",
            0x08 => b"\\b",
            0x09 => b"\\t",
            0x0a => b"\\n",
            0x0c => b"\\f",
            0x0d => b"\\r",
            0x00..=0x1f => b"",
            _ => continue,
        };
        out.extend_from_slice(&bytes[run..i]);
        if esc.is_empty() {
            const HEX: &[u8; 16] = b"0123456789abcdef";
            out.extend_from_slice(&[b'\\', b'u', b'0', b'0', HEX[(b >> 4) as usize], HEX[(b & 0xf) as usize]]);
        } else {
            out.extend_from_slice(esc);
        }
        run = i + 1;
    }
    out.extend_from_slice(&bytes[run..]);
    out.push(b'"');
}

/// One object being written: its members are written in arrival order, then reordered at the end.
struct ObjectState {
    /// Offset just after the `{`.
    start: usize,
    /// Where this object's members, in arrival order, start in `Canonicalizer::members`.
    base: usize,
    /// The name whose value comes next (maps give keys and values in separate calls).
    key: Option<String>,
}

fn utf16_cmp(a: &str, b: &str) -> std::cmp::Ordering {
    // UTF-8 byte order equals code point order, which differs from UTF-16 order only when one side
    // has a code point at or above U+E000 where the other has a surrogate pair. Names are short
    // and mostly ASCII, so compare bytes: where the first difference is between two ASCII bytes,
    // the equal prefix before it ends on a character boundary and that difference decides in
    // UTF-16 too. When one name is a prefix of the other, the shorter sorts first either way.
    let (x, y) = (a.as_bytes(), b.as_bytes());
    match x.iter().zip(y).position(|(p, q)| p != q) {
        None => x.len().cmp(&y.len()),
        Some(i) if x[i].is_ascii() && y[i].is_ascii() => x[i].cmp(&y[i]),
        Some(_) => a.encode_utf16().cmp(b.encode_utf16()),
    }
}

impl ObjectState {
    fn member<T: Serialize + ?Sized>(
        &mut self,
        ser: &mut Canonicalizer<'_>,
        name: Cow<'static, str>,
        value: &T,
    ) -> Result<(), CanonicalError> {
        if ser.members.len() > self.base {
            ser.out.push(b',');
        }
        let begin = ser.out.len();
        write_str(ser.out, &name);
        ser.out.push(b':');
        value.serialize(&mut *ser)?;
        ser.members.push((name, begin..ser.out.len()));
        Ok(())
    }

    fn finish(self, ser: &mut Canonicalizer<'_>) -> Result<(), CanonicalError> {
        // Inner objects are finished before this one, so its members are the last ones and the
        // scratch buffer is free.
        order_members(ser.out, &mut ser.scratch, self.start, &mut ser.members[self.base..])
            .map_err(|name| CanonicalError::DuplicateKey(name.to_owned()))?;
        ser.members.truncate(self.base);
        ser.out.push(b'}');
        ser.depth -= 1;
        Ok(())
    }
}

/// Puts one object's members in canonical order, for the serializer and the JSON parser alike.
///
/// `out[start..]` holds the members as written, in arrival order and separated by commas;
/// `members` holds their names and their ranges in `out`. Members out of order are rewritten
/// through `scratch`. A name that appears twice is an error (returned, with `out` unchanged).
fn order_members<'m>(
    out: &mut Vec<u8>,
    scratch: &mut Vec<u8>,
    start: usize,
    members: &'m mut [(Cow<'_, str>, Range<usize>)],
) -> Result<(), &'m str> {
    if members.windows(2).all(|w| utf16_cmp(&w[0].0, &w[1].0).is_lt()) {
        return Ok(());
    }
    members.sort_unstable_by(|a, b| utf16_cmp(&a.0, &b.0));
    if let Some(w) = members.windows(2).find(|w| w[0].0 == w[1].0) {
        return Err(&w[0].0);
    }
    scratch.clear();
    scratch.extend_from_slice(&out[start..]);
    out.truncate(start);
    for (i, (_, range)) in members.iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        out.extend_from_slice(&scratch[range.start - start..range.end - start]);
    }
    Ok(())
}

/// Serializes a map key, which must be a string.
struct KeySerializer;

macro_rules! reject_key {
    ($($fn:ident($($ty:ty)?) => $kind:literal),* $(,)?) => {
        $(fn $fn(self $(, _: $ty)?) -> Result<String, CanonicalError> {
            Err(CanonicalError::NonStringKey { kind: $kind })
        })*
    };
}

impl ser::Serializer for KeySerializer {
    type Ok = String;
    type Error = CanonicalError;
    type SerializeSeq = Impossible<String, CanonicalError>;
    type SerializeTuple = Impossible<String, CanonicalError>;
    type SerializeTupleStruct = Impossible<String, CanonicalError>;
    type SerializeTupleVariant = Impossible<String, CanonicalError>;
    type SerializeMap = Impossible<String, CanonicalError>;
    type SerializeStruct = Impossible<String, CanonicalError>;
    type SerializeStructVariant = Impossible<String, CanonicalError>;

    fn serialize_str(self, v: &str) -> Result<String, CanonicalError> {
        Ok(v.to_owned())
    }
    fn serialize_char(self, v: char) -> Result<String, CanonicalError> {
        Ok(v.to_string())
    }
    fn serialize_unit_variant(self, _: &'static str, _: u32, variant: &'static str) -> Result<String, CanonicalError> {
        Ok(variant.to_owned())
    }
    fn serialize_newtype_struct<T: Serialize + ?Sized>(
        self,
        _: &'static str,
        value: &T,
    ) -> Result<String, CanonicalError> {
        value.serialize(self)
    }
    reject_key! {
        serialize_bool(bool) => "booleans",
        serialize_i8(i8) => "integers", serialize_i16(i16) => "integers",
        serialize_i32(i32) => "integers", serialize_i64(i64) => "integers",
        serialize_i128(i128) => "integers",
        serialize_u8(u8) => "integers", serialize_u16(u16) => "integers",
        serialize_u32(u32) => "integers", serialize_u64(u64) => "integers",
        serialize_u128(u128) => "integers",
        serialize_f32(f32) => "floats", serialize_f64(f64) => "floats",
        serialize_bytes(&[u8]) => "byte strings",
        serialize_none() => "options", serialize_unit() => "unit values",
        serialize_unit_struct(&'static str) => "unit structs",
    }
    fn serialize_some<T: Serialize + ?Sized>(self, _: &T) -> Result<String, CanonicalError> {
        Err(CanonicalError::NonStringKey { kind: "options" })
    }
    fn serialize_newtype_variant<T: Serialize + ?Sized>(
        self,
        _: &'static str,
        _: u32,
        _: &'static str,
        _: &T,
    ) -> Result<String, CanonicalError> {
        Err(CanonicalError::NonStringKey { kind: "enum variants with data" })
    }
    fn serialize_seq(self, _: Option<usize>) -> Result<Self::SerializeSeq, CanonicalError> {
        Err(CanonicalError::NonStringKey { kind: "sequences" })
    }
    fn serialize_tuple(self, _: usize) -> Result<Self::SerializeTuple, CanonicalError> {
        Err(CanonicalError::NonStringKey { kind: "tuples" })
    }
    fn serialize_tuple_struct(self, _: &'static str, _: usize) -> Result<Self::SerializeTupleStruct, CanonicalError> {
        Err(CanonicalError::NonStringKey { kind: "tuple structs" })
    }
    fn serialize_tuple_variant(
        self,
        _: &'static str,
        _: u32,
        _: &'static str,
        _: usize,
    ) -> Result<Self::SerializeTupleVariant, CanonicalError> {
        Err(CanonicalError::NonStringKey { kind: "enum variants with data" })
    }
    fn serialize_map(self, _: Option<usize>) -> Result<Self::SerializeMap, CanonicalError> {
        Err(CanonicalError::NonStringKey { kind: "maps" })
    }
    fn serialize_struct(self, _: &'static str, _: usize) -> Result<Self::SerializeStruct, CanonicalError> {
        Err(CanonicalError::NonStringKey { kind: "structs" })
    }
    fn serialize_struct_variant(
        self,
        _: &'static str,
        _: u32,
        _: &'static str,
        _: usize,
    ) -> Result<Self::SerializeStructVariant, CanonicalError> {
        Err(CanonicalError::NonStringKey { kind: "enum variants with data" })
    }
}

/// Serializes sequences, tuples and their variants as JSON arrays.
struct ArrayState<'s, 'a> {
    ser: &'s mut Canonicalizer<'a>,
    first: bool,
    /// For tuple variants: the array sits inside `{"Variant": ...}`, closed with `]}`.
    in_variant: bool,
}

impl ArrayState<'_, '_> {
    fn element<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), CanonicalError> {
        if !self.first {
            self.ser.out.push(b',');
        }
        self.first = false;
        value.serialize(&mut *self.ser)
    }

    fn close(self) -> Result<(), CanonicalError> {
        self.ser.out.push(b']');
        self.ser.depth -= 1;
        if self.in_variant {
            self.ser.out.push(b'}');
            self.ser.depth -= 1;
        }
        Ok(())
    }
}

impl ser::SerializeSeq for ArrayState<'_, '_> {
    type Ok = ();
    type Error = CanonicalError;
    fn serialize_element<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), CanonicalError> {
        self.element(value)
    }
    fn end(self) -> Result<(), CanonicalError> {
        self.close()
    }
}

impl ser::SerializeTuple for ArrayState<'_, '_> {
    type Ok = ();
    type Error = CanonicalError;
    fn serialize_element<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), CanonicalError> {
        self.element(value)
    }
    fn end(self) -> Result<(), CanonicalError> {
        self.close()
    }
}

impl ser::SerializeTupleStruct for ArrayState<'_, '_> {
    type Ok = ();
    type Error = CanonicalError;
    fn serialize_field<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), CanonicalError> {
        self.element(value)
    }
    fn end(self) -> Result<(), CanonicalError> {
        self.close()
    }
}

impl ser::SerializeTupleVariant for ArrayState<'_, '_> {
    type Ok = ();
    type Error = CanonicalError;
    fn serialize_field<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), CanonicalError> {
        self.element(value)
    }
    fn end(self) -> Result<(), CanonicalError> {
        self.close()
    }
}

/// Serializes maps, structs and struct variants as JSON objects.
struct MapState<'s, 'a> {
    ser: &'s mut Canonicalizer<'a>,
    obj: ObjectState,
    /// For struct variants: the object sits inside `{"Variant": ...}`, closed with `}}`.
    in_variant: bool,
}

impl MapState<'_, '_> {
    fn close(self) -> Result<(), CanonicalError> {
        let MapState { ser, obj, in_variant } = self;
        obj.finish(ser)?;
        if in_variant {
            ser.out.push(b'}');
            ser.depth -= 1;
        }
        Ok(())
    }
}

impl ser::SerializeMap for MapState<'_, '_> {
    type Ok = ();
    type Error = CanonicalError;
    fn serialize_key<T: Serialize + ?Sized>(&mut self, key: &T) -> Result<(), CanonicalError> {
        self.obj.key = Some(key.serialize(KeySerializer)?);
        Ok(())
    }
    fn serialize_value<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), CanonicalError> {
        let key =
            self.obj.key.take().ok_or_else(|| CanonicalError::Custom("map value serialized before its key".into()))?;
        self.obj.member(self.ser, Cow::Owned(key), value)
    }
    fn end(self) -> Result<(), CanonicalError> {
        self.close()
    }
}

impl ser::SerializeStruct for MapState<'_, '_> {
    type Ok = ();
    type Error = CanonicalError;
    fn serialize_field<T: Serialize + ?Sized>(&mut self, key: &'static str, value: &T) -> Result<(), CanonicalError> {
        self.obj.member(self.ser, Cow::Borrowed(key), value)
    }
    fn end(self) -> Result<(), CanonicalError> {
        self.close()
    }
}

impl ser::SerializeStructVariant for MapState<'_, '_> {
    type Ok = ();
    type Error = CanonicalError;
    fn serialize_field<T: Serialize + ?Sized>(&mut self, key: &'static str, value: &T) -> Result<(), CanonicalError> {
        self.obj.member(self.ser, Cow::Borrowed(key), value)
    }
    fn end(self) -> Result<(), CanonicalError> {
        self.close()
    }
}

impl<'s, 'a> ser::Serializer for &'s mut Canonicalizer<'a> {
    type Ok = ();
    type Error = CanonicalError;
    type SerializeSeq = ArrayState<'s, 'a>;
    type SerializeTuple = ArrayState<'s, 'a>;
    type SerializeTupleStruct = ArrayState<'s, 'a>;
    type SerializeTupleVariant = ArrayState<'s, 'a>;
    type SerializeMap = MapState<'s, 'a>;
    type SerializeStruct = MapState<'s, 'a>;
    type SerializeStructVariant = MapState<'s, 'a>;

    fn serialize_bool(self, v: bool) -> Result<(), CanonicalError> {
        self.out.extend_from_slice(if v { b"true" } else { b"false" });
        Ok(())
    }
    fn serialize_i8(self, v: i8) -> Result<(), CanonicalError> {
        self.int(v);
        Ok(())
    }
    fn serialize_i16(self, v: i16) -> Result<(), CanonicalError> {
        self.int(v);
        Ok(())
    }
    fn serialize_i32(self, v: i32) -> Result<(), CanonicalError> {
        self.int(v);
        Ok(())
    }
    fn serialize_i64(self, v: i64) -> Result<(), CanonicalError> {
        self.int(v);
        Ok(())
    }
    fn serialize_i128(self, v: i128) -> Result<(), CanonicalError> {
        self.int(v);
        Ok(())
    }
    fn serialize_u8(self, v: u8) -> Result<(), CanonicalError> {
        self.int(v);
        Ok(())
    }
    fn serialize_u16(self, v: u16) -> Result<(), CanonicalError> {
        self.int(v);
        Ok(())
    }
    fn serialize_u32(self, v: u32) -> Result<(), CanonicalError> {
        self.int(v);
        Ok(())
    }
    fn serialize_u64(self, v: u64) -> Result<(), CanonicalError> {
        self.int(v);
        Ok(())
    }
    fn serialize_u128(self, v: u128) -> Result<(), CanonicalError> {
        self.int(v);
        Ok(())
    }
    fn serialize_f32(self, v: f32) -> Result<(), CanonicalError> {
        self.float(f64::from(v))
    }
    fn serialize_f64(self, v: f64) -> Result<(), CanonicalError> {
        self.float(v)
    }
    fn serialize_char(self, v: char) -> Result<(), CanonicalError> {
        write_str(self.out, v.encode_utf8(&mut [0; 4]));
        Ok(())
    }
    fn serialize_str(self, v: &str) -> Result<(), CanonicalError> {
        write_str(self.out, v);
        Ok(())
    }
    fn serialize_bytes(self, v: &[u8]) -> Result<(), CanonicalError> {
        use ser::SerializeSeq;
        let mut seq = self.serialize_seq(Some(v.len()))?;
        for b in v {
            seq.serialize_element(b)?;
        }
        seq.end()
    }
    fn serialize_none(self) -> Result<(), CanonicalError> {
        self.serialize_unit()
    }
    fn serialize_some<T: Serialize + ?Sized>(self, value: &T) -> Result<(), CanonicalError> {
        value.serialize(self)
    }
    fn serialize_unit(self) -> Result<(), CanonicalError> {
        self.out.extend_from_slice(b"null");
        Ok(())
    }
    fn serialize_unit_struct(self, _: &'static str) -> Result<(), CanonicalError> {
        self.serialize_unit()
    }
    fn serialize_unit_variant(self, _: &'static str, _: u32, variant: &'static str) -> Result<(), CanonicalError> {
        self.serialize_str(variant)
    }
    fn serialize_newtype_struct<T: Serialize + ?Sized>(self, _: &'static str, value: &T) -> Result<(), CanonicalError> {
        value.serialize(self)
    }
    fn serialize_newtype_variant<T: Serialize + ?Sized>(
        self,
        _: &'static str,
        _: u32,
        variant: &'static str,
        value: &T,
    ) -> Result<(), CanonicalError> {
        let mut obj = self.begin_object(1)?;
        obj.member(self, Cow::Borrowed(variant), value)?;
        obj.finish(self)
    }
    fn serialize_seq(self, _: Option<usize>) -> Result<Self::SerializeSeq, CanonicalError> {
        self.enter()?;
        self.out.push(b'[');
        Ok(ArrayState { ser: self, first: true, in_variant: false })
    }
    fn serialize_tuple(self, len: usize) -> Result<Self::SerializeTuple, CanonicalError> {
        self.serialize_seq(Some(len))
    }
    fn serialize_tuple_struct(self, _: &'static str, len: usize) -> Result<Self::SerializeTupleStruct, CanonicalError> {
        self.serialize_seq(Some(len))
    }
    fn serialize_tuple_variant(
        self,
        _: &'static str,
        _: u32,
        variant: &'static str,
        _: usize,
    ) -> Result<Self::SerializeTupleVariant, CanonicalError> {
        self.enter()?;
        self.out.push(b'{');
        write_str(self.out, variant);
        self.out.extend_from_slice(b":[");
        self.enter()?;
        Ok(ArrayState { ser: self, first: true, in_variant: true })
    }
    fn serialize_map(self, len: Option<usize>) -> Result<Self::SerializeMap, CanonicalError> {
        // The hint comes from the value's `Serialize` impl; a small cap keeps a wrong one harmless.
        let obj = self.begin_object(len.unwrap_or(0).min(64))?;
        Ok(MapState { ser: self, obj, in_variant: false })
    }
    fn serialize_struct(self, _: &'static str, len: usize) -> Result<Self::SerializeStruct, CanonicalError> {
        self.serialize_map(Some(len))
    }
    fn serialize_struct_variant(
        self,
        _: &'static str,
        _: u32,
        variant: &'static str,
        len: usize,
    ) -> Result<Self::SerializeStructVariant, CanonicalError> {
        self.enter()?;
        self.out.push(b'{');
        write_str(self.out, variant);
        self.out.push(b':');
        let obj = self.begin_object(len.min(64))?;
        Ok(MapState { ser: self, obj, in_variant: true })
    }
}

/// The length of the longest prefix of `s` without a `"`, `\\` or control character (the bytes
/// that end a string literal's plain run), checked eight bytes at a time.
fn plain_len(s: &[u8]) -> usize {
    const ONES: u64 = 0x0101_0101_0101_0101;
    const HIGH: u64 = ONES * 0x80;
    let mut words = s.chunks_exact(8);
    let mut skipped = 0;
    for word in words.by_ref() {
        let mut bytes = [0; 8];
        bytes.copy_from_slice(word);
        let v = u64::from_le_bytes(bytes);
        // A byte's high bit is set in `x.wrapping_sub(ONES * n) & !x` where a byte of `x` is
        // below `n` (and only in words that have such a byte): the usual zero-byte test.
        let (quote, backslash) = (v ^ (ONES * u64::from(b'"')), v ^ (ONES * u64::from(b'\\')));
        let stop = (quote.wrapping_sub(ONES) & !quote)
            | (backslash.wrapping_sub(ONES) & !backslash)
            | (v.wrapping_sub(ONES * 0x20) & !v);
        if stop & HIGH != 0 {
            break;
        }
        skipped += 8;
    }
    let tail = &s[skipped..];
    skipped + tail.iter().position(|&b| b == b'"' || b == b'\\' || b < 0x20).unwrap_or(tail.len())
}

/// A small JSON parser that writes the canonical form as it reads (see [`canonicalize_json`]).
struct JsonParser<'a> {
    /// The input, known to be UTF-8.
    text: &'a str,
    /// `text` as bytes.
    s: &'a [u8],
    i: usize,
    out: Vec<u8>,
    /// Where an object's members are copied while they are put in order (see `ObjectState`).
    scratch: Vec<u8>,
    /// The members of every object being read, innermost last (see `Canonicalizer::members`).
    members: Vec<(Cow<'a, str>, Range<usize>)>,
}

impl<'a> JsonParser<'a> {
    fn err(&self, reason: &'static str) -> JsonError {
        JsonError { offset: self.i, reason }
    }

    fn skip_ws(&mut self) {
        while let Some(b' ' | b'\t' | b'\n' | b'\r') = self.s.get(self.i) {
            self.i += 1;
        }
    }

    fn literal(&mut self, word: &'static [u8]) -> Result<(), JsonError> {
        if self.s[self.i..].starts_with(word) {
            self.i += word.len();
            self.out.extend_from_slice(word);
            Ok(())
        } else {
            Err(self.err("expected a JSON value"))
        }
    }

    /// Reads one value inside `depth` enclosing arrays and objects.
    fn value(&mut self, depth: usize) -> Result<(), JsonError> {
        // The same limit as the serializer's: at most MAX_DEPTH nested arrays and objects.
        if depth >= MAX_DEPTH && matches!(self.s.get(self.i), Some(b'{' | b'[')) {
            return Err(self.err("nested deeper than the canonical JSON limit (128)"));
        }
        match self.s.get(self.i) {
            Some(b'{') => self.object(depth),
            Some(b'[') => self.array(depth),
            Some(b'"') => {
                // A string without escapes is copied as is (the input was checked for UTF-8).
                if let Some(run) = self.plain_string()? {
                    self.write_plain(run);
                } else {
                    let s = self.string()?;
                    write_str(&mut self.out, &s);
                }
                Ok(())
            }
            Some(b't') => self.literal(b"true"),
            Some(b'f') => self.literal(b"false"),
            Some(b'n') => self.literal(b"null"),
            Some(b'-' | b'0'..=b'9') => self.number(),
            Some(_) => Err(self.err("expected a JSON value")),
            None => Err(self.err("unexpected end of input")),
        }
    }

    fn array(&mut self, depth: usize) -> Result<(), JsonError> {
        self.i += 1;
        self.out.push(b'[');
        self.skip_ws();
        if self.s.get(self.i) == Some(&b']') {
            self.i += 1;
            self.out.push(b']');
            return Ok(());
        }
        loop {
            self.skip_ws();
            self.value(depth + 1)?;
            self.skip_ws();
            match self.s.get(self.i) {
                Some(b',') => {
                    self.i += 1;
                    self.out.push(b',');
                }
                Some(b']') => {
                    self.i += 1;
                    self.out.push(b']');
                    return Ok(());
                }
                _ => return Err(self.err("expected ',' or ']' in array")),
            }
        }
    }

    fn object(&mut self, depth: usize) -> Result<(), JsonError> {
        self.i += 1;
        self.out.push(b'{');
        let start = self.out.len();
        let base = self.members.len();
        self.skip_ws();
        if self.s.get(self.i) == Some(&b'}') {
            self.i += 1;
            self.out.push(b'}');
            return Ok(());
        }
        loop {
            self.skip_ws();
            if self.s.get(self.i) != Some(&b'"') {
                return Err(self.err("expected a string member name"));
            }
            let name = self.string()?;
            self.skip_ws();
            if self.s.get(self.i) != Some(&b':') {
                return Err(self.err("expected ':' after member name"));
            }
            self.i += 1;
            self.skip_ws();
            if self.members.len() > base {
                self.out.push(b',');
            }
            let begin = self.out.len();
            match &name {
                Cow::Borrowed(text) => self.write_plain(text),
                Cow::Owned(text) => write_str(&mut self.out, text),
            }
            self.out.push(b':');
            self.value(depth + 1)?;
            self.members.push((name, begin..self.out.len()));
            self.skip_ws();
            match self.s.get(self.i) {
                Some(b',') => self.i += 1,
                Some(b'}') => {
                    self.i += 1;
                    break;
                }
                _ => return Err(self.err("expected ',' or '}' in object")),
            }
        }
        if order_members(&mut self.out, &mut self.scratch, start, &mut self.members[base..]).is_err() {
            return Err(JsonError { offset: self.i, reason: "an object has the same member name twice" });
        }
        self.members.truncate(base);
        self.out.push(b'}');
        Ok(())
    }

    /// Writes the text of a string without escapes (see [`plain_string`](Self::plain_string)):
    /// it holds no byte that needs escaping, so it is copied as is.
    fn write_plain(&mut self, run: &str) {
        self.out.reserve(run.len() + 2);
        self.out.push(b'"');
        self.out.extend_from_slice(run.as_bytes());
        self.out.push(b'"');
    }

    /// Reads a string literal without escapes (the cursor on its opening quote) and returns its
    /// text: it holds no `"`, `\\` or control character. `None`, with the cursor left where it
    /// was, when the literal has an escape or a control character.
    fn plain_string(&mut self) -> Result<Option<&'a str>, JsonError> {
        let s: &'a [u8] = self.s;
        let first = self.i + 1;
        let end = first + plain_len(&s[first..]);
        if s.get(end) != Some(&b'"') {
            return Ok(None);
        }
        // Both ends are next to ASCII quotes, so on character boundaries: `get` cannot fail.
        let run = self.text.get(first..end).ok_or_else(|| self.err("string is not valid UTF-8"))?;
        self.i = end + 1;
        Ok(Some(run))
    }

    fn hex4(&mut self) -> Result<u16, JsonError> {
        if self.s.len() < self.i + 4 {
            return Err(self.err("short \\u escape"));
        }
        // Four hex digits exactly (`from_str_radix` alone would also take a sign).
        let digits = self.text.get(self.i..self.i + 4).filter(|d| d.bytes().all(|b| b.is_ascii_hexdigit()));
        let v = digits.and_then(|d| u16::from_str_radix(d, 16).ok()).ok_or_else(|| self.err("bad \\u escape"))?;
        self.i += 4;
        Ok(v)
    }

    /// Reads a string literal (the cursor on its opening quote) and returns its value, borrowed
    /// from the input when it has no escapes (the common case).
    fn string(&mut self) -> Result<Cow<'a, str>, JsonError> {
        let first = self.i + 1;
        if let Some(run) = self.plain_string()? {
            return Ok(Cow::Borrowed(run));
        }
        self.i = first;
        let mut buf = String::new();
        loop {
            let run = self.i;
            self.i += plain_len(&self.s[self.i..]);
            // From after a quote or an escape to a quote, a backslash or a control character (or
            // the end): character boundaries, so `get` cannot fail.
            buf.push_str(self.text.get(run..self.i).ok_or_else(|| self.err("string is not valid UTF-8"))?);
            match self.s.get(self.i) {
                Some(b'"') => {
                    self.i += 1;
                    return Ok(Cow::Owned(buf));
                }
                Some(b'\\') => {
                    self.i += 1;
                    let c = *self.s.get(self.i).ok_or_else(|| self.err("unexpected end of input"))?;
                    self.i += 1;
                    let ch = match c {
                        b'"' => '"',
                        b'\\' => '\\',
                        b'/' => '/',
                        b'b' => '\u{8}',
                        b'f' => '\u{c}',
                        b'n' => '\n',
                        b'r' => '\r',
                        b't' => '\t',
                        b'u' => {
                            let hi = self.hex4()?;
                            if (0xd800..0xdc00).contains(&hi) {
                                if self.s.get(self.i..self.i + 2) != Some(b"\\u") {
                                    return Err(self.err("lone surrogate in \\u escape"));
                                }
                                self.i += 2;
                                let lo = self.hex4()?;
                                if !(0xdc00..0xe000).contains(&lo) {
                                    return Err(self.err("lone surrogate in \\u escape"));
                                }
                                let cp = 0x10000 + ((u32::from(hi) - 0xd800) << 10) + (u32::from(lo) - 0xdc00);
                                char::from_u32(cp).ok_or_else(|| self.err("bad \\u escape"))?
                            } else {
                                char::from_u32(u32::from(hi)).ok_or_else(|| self.err("lone surrogate in \\u escape"))?
                            }
                        }
                        _ => return Err(self.err("unknown escape in string")),
                    };
                    buf.push(ch);
                }
                Some(_) => return Err(self.err("control character in string")),
                None => return Err(self.err("unterminated string")),
            }
        }
    }

    fn number(&mut self) -> Result<(), JsonError> {
        let start = self.i;
        let digits = |p: &mut Self| {
            let from = p.i;
            while let Some(b'0'..=b'9') = p.s.get(p.i) {
                p.i += 1;
            }
            p.i - from
        };
        let negative = self.s[self.i] == b'-';
        if negative {
            self.i += 1;
        }
        let int_start = self.i;
        let n = digits(self);
        if n == 0 || (n > 1 && self.s[int_start] == b'0') {
            return Err(self.err("malformed number"));
        }
        let int_end = self.i;
        let mut integral = true;
        if self.s.get(self.i) == Some(&b'.') {
            self.i += 1;
            integral = false;
            if digits(self) == 0 {
                return Err(self.err("malformed number"));
            }
        }
        if let Some(b'e' | b'E') = self.s.get(self.i) {
            self.i += 1;
            integral = false;
            if let Some(b'+' | b'-') = self.s.get(self.i) {
                self.i += 1;
            }
            if digits(self) == 0 {
                return Err(self.err("malformed number"));
            }
        }
        if integral {
            // Exact digits: the integer part has no leading zeros, so only "-0" needs normalizing.
            let zero = &self.s[int_start..int_end] == b"0";
            if negative && !zero {
                self.out.push(b'-');
            }
            self.out.extend_from_slice(&self.s[int_start..int_end]);
            return Ok(());
        }
        let text = self.text.get(start..self.i).ok_or_else(|| self.err("malformed number"))?;
        let v: f64 = text.parse().map_err(|_| self.err("malformed number"))?;
        write_f64(&mut self.out, v).map_err(|_| self.err("number out of the range of a double"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use std::collections::{BTreeMap, HashMap};

    fn canon<T: Serialize + ?Sized>(v: &T) -> String {
        String::from_utf8(to_canonical_vec(v).unwrap()).unwrap()
    }

    /// RFC 8785 appendix B: IEEE 754 doubles and their JCS serialization.
    #[test]
    fn rfc8785_number_vectors() {
        let vectors: &[(u64, &str)] = &[
            (0x0000000000000000, "0"),
            (0x8000000000000000, "0"),
            (0x0000000000000001, "5e-324"),
            (0x8000000000000001, "-5e-324"),
            (0x7fefffffffffffff, "1.7976931348623157e+308"),
            (0xffefffffffffffff, "-1.7976931348623157e+308"),
            (0x4340000000000000, "9007199254740992"),
            (0xc340000000000000, "-9007199254740992"),
            (0x4430000000000000, "295147905179352830000"),
            (0x44b52d02c7e14af5, "9.999999999999997e+22"),
            (0x44b52d02c7e14af6, "1e+23"),
            (0x44b52d02c7e14af7, "1.0000000000000001e+23"),
            (0x444b1ae4d6e2ef4e, "999999999999999700000"),
            (0x444b1ae4d6e2ef4f, "999999999999999900000"),
            (0x444b1ae4d6e2ef50, "1e+21"),
            (0x3eb0c6f7a0b5ed8c, "9.999999999999997e-7"),
            (0x3eb0c6f7a0b5ed8d, "0.000001"),
            (0x41b3de4355555553, "333333333.3333332"),
            (0x41b3de4355555554, "333333333.33333325"),
            (0x41b3de4355555555, "333333333.3333333"),
            (0x41b3de4355555556, "333333333.3333334"),
            (0x41b3de4355555557, "333333333.33333343"),
            (0xbecbf647612f3696, "-0.0000033333333333333333"),
            (0x43143ff3c1cb0959, "1424953923781206.2"),
        ];
        for &(bits, want) in vectors {
            assert_eq!(canon(&f64::from_bits(bits)), want, "bits {bits:#018x}");
        }
        for bits in [0x7fffffffffffffffu64, 0x7ff0000000000000, 0xfff0000000000000] {
            assert!(matches!(to_canonical_vec(&f64::from_bits(bits)), Err(CanonicalError::NonFinite(_))));
        }
    }

    /// RFC 8785 §3.2.2 / appendix: the "sample" object and its canonical form.
    #[test]
    fn rfc8785_sample_object() {
        let input = r#"{
          "numbers": [333333333.33333329, 1E30, 4.50, 2e-3, 0.000000000000000000000000001],
          "string": "\u20ac$\u000F\u000aA'\u0042\u0022\u005c\\\"\/",
          "literals": [null, true, false]
        }"#;
        let want = r#"{"literals":[null,true,false],"numbers":[333333333.3333333,1e+30,4.5,0.002,1e-27],"string":"€$\u000f\nA'B\"\\\\\"/"}"#;
        let value: serde_json::Value = serde_json::from_str(input).unwrap();
        assert_eq!(canon(&value), want);
        assert_eq!(String::from_utf8(canonicalize_json(input.as_bytes()).unwrap()).unwrap(), want);
    }

    /// RFC 8785 §3.2.3: members sorted by UTF-16 code units, not by code points.
    #[test]
    fn rfc8785_sorting_vector() {
        let input = r#"{
          "\u20ac": "Euro Sign",
          "\r": "Carriage Return",
          "\ufb33": "Hebrew Letter Dalet With Dagesh",
          "1": "One",
          "\ud83d\ude00": "Emoji: Grinning Face",
          "\u0080": "Control",
          "\u00f6": "Latin Small Letter O With Diaeresis"
        }"#;
        let order = [
            "Carriage Return",
            "One",
            "Control",
            "Latin Small Letter O With Diaeresis",
            "Euro Sign",
            "Emoji: Grinning Face",
            "Hebrew Letter Dalet With Dagesh",
        ];
        let value: serde_json::Value = serde_json::from_str(input).unwrap();
        for out in [canon(&value), String::from_utf8(canonicalize_json(input.as_bytes()).unwrap()).unwrap()] {
            let mut last = 0;
            for name in order {
                let at = out.find(name).unwrap();
                assert!(at > last, "{name} out of order in {out}");
                last = at;
            }
        }
    }

    #[test]
    fn member_order_does_not_matter() {
        let mut a = HashMap::new();
        let mut b = BTreeMap::new();
        for i in 0..50 {
            a.insert(format!("k{i}"), i);
        }
        for i in (0..50).rev() {
            b.insert(format!("k{i}"), i);
        }
        assert_eq!(canon(&a), canon(&b));

        #[derive(Serialize)]
        struct S1 {
            z: u8,
            a: u8,
        }
        #[derive(Serialize)]
        struct S2 {
            a: u8,
            z: u8,
        }
        assert_eq!(canon(&S1 { z: 1, a: 2 }), canon(&S2 { a: 2, z: 1 }));
        assert_eq!(canon(&S1 { z: 1, a: 2 }), r#"{"a":2,"z":1}"#);
    }

    #[test]
    fn integers_are_exact() {
        let big = (1u64 << 53) + 1;
        assert_eq!(canon(&big), "9007199254740993");
        assert_ne!(canon(&big), canon(&(1u64 << 53)));
        assert_eq!(canon(&u64::MAX), "18446744073709551615");
        assert_eq!(canon(&i64::MIN), "-9223372036854775808");
        assert_eq!(canon(&u128::MAX), "340282366920938463463374607431768211455");
        // serde_json's Value keeps u64 exact too.
        assert_eq!(canon(&json!({"n": big})), r#"{"n":9007199254740993}"#);
        // The byte canonicalizer keeps any integer exact, even beyond u64.
        assert_eq!(canonicalize_json(b"[18446744073709551617,-0,-12]").unwrap(), b"[18446744073709551617,0,-12]");
        assert_ne!(
            canonicalize_json(b"18446744073709551617").unwrap(),
            canonicalize_json(b"18446744073709551616").unwrap()
        );
    }

    #[test]
    fn non_finite_is_rejected() {
        for v in [f64::NAN, f64::INFINITY, f64::NEG_INFINITY] {
            let err = to_canonical_vec(&std::collections::BTreeMap::from([("amount", v)])).unwrap_err();
            assert!(matches!(err, CanonicalError::NonFinite(_)), "{err}");
            assert!(err.to_string().contains("non-finite"));
        }
        assert!(to_canonical_vec(&vec![1.0f32, f32::NAN]).is_err());
        // Nothing half-written is left behind.
        let mut out = b"prefix".to_vec();
        assert!(write_canonical(&mut out, &(1, f64::NAN)).is_err());
        assert_eq!(out, b"prefix");
    }

    #[test]
    fn deep_nesting_is_an_error_not_a_stack_overflow() {
        let mut v = json!(1);
        for _ in 0..(MAX_DEPTH + 10) {
            v = json!([v]);
        }
        assert_eq!(to_canonical_vec(&v), Err(CanonicalError::TooDeep { max: MAX_DEPTH }));
        let mut ok = json!(1);
        for _ in 0..MAX_DEPTH {
            ok = json!({"a": ok});
        }
        assert!(to_canonical_vec(&ok).is_ok());
        let deep = "[".repeat(100_000);
        assert!(canonicalize_json(deep.as_bytes()).is_err());
        // Both canonicalizers draw the line at the same depth.
        let at_limit = format!("{}1{}", "[".repeat(MAX_DEPTH), "]".repeat(MAX_DEPTH));
        let value: serde_json::Value = {
            let mut v = json!(1);
            for _ in 0..MAX_DEPTH {
                v = json!([v]);
            }
            v
        };
        assert_eq!(to_canonical_vec(&value).unwrap(), at_limit.as_bytes());
        assert_eq!(canonicalize_json(at_limit.as_bytes()).unwrap(), at_limit.as_bytes());
        let over = format!("[{at_limit}]");
        assert!(canonicalize_json(over.as_bytes()).is_err());
    }

    #[test]
    fn non_string_map_keys_are_rejected() {
        let mut m = HashMap::new();
        m.insert(1u32, "a");
        let err = to_canonical_vec(&m).unwrap_err();
        assert_eq!(err, CanonicalError::NonStringKey { kind: "integers" });
        assert!(err.to_string().contains("keys are integers"));
    }

    #[test]
    fn relabeling_members_keeps_their_allocation() {
        let mut members: Vec<Member> = Vec::with_capacity(32);
        members.push((Cow::Borrowed("a"), 0..1));
        let ptr = members.as_ptr() as usize;
        let parser_members: Vec<(Cow<'_, str>, Range<usize>)> = relabel(members);
        assert!(parser_members.is_empty());
        assert_eq!(parser_members.capacity(), 32);
        assert_eq!(parser_members.as_ptr() as usize, ptr, "the buffer is reused, not reallocated");
    }

    #[test]
    fn reused_buffers_never_leak_into_the_next_result() {
        let long =
            serde_json::json!({"z": "a long value that fills the buffer", "y": [1, 2, 3], "x": {"b": 1, "a": 2}});
        let short = serde_json::json!({"b": 1, "a": 0});
        for _ in 0..3 {
            assert_eq!(with_canonical(&long, <[u8]>::to_vec).unwrap(), to_canonical_vec(&long).unwrap());
            assert_eq!(with_canonical(&short, <[u8]>::to_vec).unwrap(), br#"{"a":0,"b":1}"#);
            // A failed parse in between leaves nothing behind either.
            assert!(with_canonical_json(br#"{"b": 1, "b": 2}"#, |_| ()).is_err());
            assert_eq!(with_canonical_json(br#"{"b":1,"a":0}"#, <[u8]>::to_vec).unwrap(), br#"{"a":0,"b":1}"#);
        }
        // A call nested inside another (here, from the closure) gets buffers of its own.
        let nested = with_canonical(&long, |outer| {
            let inner = with_canonical(&short, <[u8]>::to_vec).unwrap();
            (outer.to_vec(), inner)
        })
        .unwrap();
        assert_eq!(nested, (to_canonical_vec(&long).unwrap(), br#"{"a":0,"b":1}"#.to_vec()));
    }

    #[test]
    fn strings_are_not_normalized_and_escaped_per_jcs() {
        assert_ne!(canon("\u{e9}"), canon("e\u{301}"));
        assert_eq!(canon("a\u{1}\u{1f}\u{7f}\u{2028}"), "\"a\\u0001\\u001f\u{7f}\u{2028}\"");
        assert_eq!(canon("tab\there"), r#""tab\there""#);
    }

    #[test]
    fn enums_and_options_follow_serde_json_shapes() {
        #[derive(Serialize)]
        enum E {
            Unit,
            New(u8),
            Tuple(u8, u8),
            Struct { b: u8, a: u8 },
        }
        assert_eq!(canon(&E::Unit), r#""Unit""#);
        assert_eq!(canon(&E::New(1)), r#"{"New":1}"#);
        assert_eq!(canon(&E::Tuple(1, 2)), r#"{"Tuple":[1,2]}"#);
        assert_eq!(canon(&E::Struct { b: 1, a: 2 }), r#"{"Struct":{"a":2,"b":1}}"#);
        assert_eq!(canon(&(None::<u8>, Some(2), ())), "[null,2,null]");
        for v in [json!([1, {"b": [1.5, "x"], "a": null}]), json!({})] {
            assert_eq!(to_canonical_vec(&v).unwrap(), canonicalize_json(v.to_string().as_bytes()).unwrap());
        }
    }

    #[test]
    fn duplicate_members_are_rejected() {
        assert!(canonicalize_json(br#"{"a":1,"a":2}"#).is_err());
        struct Dup;
        impl Serialize for Dup {
            fn serialize<S: ser::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                use ser::SerializeMap;
                let mut m = s.serialize_map(None)?;
                m.serialize_entry("b", &1)?;
                m.serialize_entry("a", &1)?;
                m.serialize_entry("b", &2)?;
                m.end()
            }
        }
        assert_eq!(to_canonical_vec(&Dup), Err(CanonicalError::DuplicateKey("b".into())));
    }

    /// Objects inside objects and arrays, each out of order: every object is sorted on its own
    /// (members of all open objects share one vector), by the serializer and the parser alike.
    #[test]
    fn nested_objects_are_ordered_each_on_their_own() {
        #[derive(Serialize)]
        struct Outer {
            z: Z,
            m: u8,
            a: A,
        }
        #[derive(Serialize)]
        struct Z {
            y: u8,
            b: (D, F),
            a: u8,
        }
        #[derive(Serialize)]
        struct D {
            d: u8,
            c: u8,
        }
        #[derive(Serialize)]
        struct F {
            f: H,
        }
        #[derive(Serialize)]
        struct H {
            h: u8,
            g: u8,
        }
        #[derive(Serialize)]
        struct A {
            q: u8,
            p: P,
        }
        #[derive(Serialize)]
        struct P {
            s: u8,
            r: u8,
        }
        let expected =
            r#"{"a":{"p":{"r":2,"s":1},"q":1},"m":2,"z":{"a":3,"b":[{"c":2,"d":1},{"f":{"g":2,"h":1}}],"y":1}}"#;
        let value = Outer {
            z: Z { y: 1, b: (D { d: 1, c: 2 }, F { f: H { h: 1, g: 2 } }), a: 3 },
            m: 2,
            a: A { q: 1, p: P { s: 1, r: 2 } },
        };
        assert_eq!(canon(&value), expected);
        let text =
            br#"{"z":{"y":1,"b":[{"d":1,"c":2},{"f":{"h":1,"g":2}}],"a":3},"m":2,"a":{"q":1,"p":{"s":1,"r":2}}}"#;
        assert_eq!(canonicalize_json(text).unwrap(), expected.as_bytes());
    }

    #[test]
    fn malformed_json_bytes_are_rejected() {
        for bad in [&b"{"[..], b"[1,]", b"01", b"1.", b"\"\\ud800\"", b"nul", b"{\"a\" 1}", b"1 2", b"\"a\x01\""] {
            assert!(canonicalize_json(bad).is_err(), "{:?}", String::from_utf8_lossy(bad));
        }
    }

    #[test]
    fn escapes_take_four_hex_digits_exactly() {
        assert_eq!(canonicalize_json(br#""\u00e9\u0041""#).unwrap(), "\"\u{e9}A\"".as_bytes());
        for bad in [&br#""\u+0e9""#[..], br#""\u-0e9""#, br#""\u 0e9""#, br#""\u0e""#, b"\"\\u00\xc3\xa9\""] {
            let err = canonicalize_json(bad).unwrap_err();
            assert!(err.reason.contains("\\u escape"), "{:?}: {err}", String::from_utf8_lossy(bad));
        }
    }

    #[test]
    fn input_that_is_not_utf8_is_refused_where_it_goes_wrong() {
        for (bad, offset) in [(&b"{\"a\xff\":1}"[..], 3), (b"[\"ok\",\"\xc3\"]", 7), (b"[1,\xe9]", 3)] {
            let err = canonicalize_json(bad).unwrap_err();
            assert_eq!((err.offset, err.reason), (offset, "not valid UTF-8"), "{:?}", String::from_utf8_lossy(bad));
        }
        // Multi-byte text in names and values is kept as given.
        assert_eq!(
            canonicalize_json("{\"\u{e9}\":\"\u{1F600}\"}".as_bytes()).unwrap(),
            "{\"\u{e9}\":\"\u{1F600}\"}".as_bytes()
        );
    }

    proptest::proptest! {
        #[test]
        fn canonical_json_round_trips_through_serde_json(
            v in proptest::collection::btree_map("[a-z\u{e9}\u{1F600}\"\\\\]{0,6}", proptest::prelude::any::<(i64, bool, Option<u32>)>(), 0..8),
            f in proptest::num::f64::NORMAL,
        ) {
            let value = (v, f);
            let bytes = to_canonical_vec(&value).unwrap();
            let parsed: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
            proptest::prop_assert_eq!(to_canonical_vec(&parsed).unwrap(), bytes.clone());
            proptest::prop_assert_eq!(canonicalize_json(&bytes).unwrap(), bytes);
        }

        /// The byte-wise shortcut in `utf16_cmp` agrees with comparing UTF-16 code units, also
        /// for names that share a prefix and mix ASCII, BMP code points above U+E000 and pairs.
        #[test]
        fn member_order_matches_utf16_code_units(a in "[ab\u{e9}\u{ff61}\u{1F600}]{0,5}", b in "[ab\u{e9}\u{ff61}\u{1F600}]{0,5}") {
            proptest::prop_assert_eq!(utf16_cmp(&a, &b), a.encode_utf16().cmp(b.encode_utf16()));
        }
    }

    #[test]
    fn plain_runs_end_at_the_first_byte_that_ends_a_literal() {
        for stop in [b'"', b'\\', 0x00, 0x1f] {
            for at in 0..20 {
                let mut text = vec![b'a'; 20];
                text[..at]
                    .iter_mut()
                    .zip([b' ', 0x7f, 0xc3, 0xff, b'!', b'#', b'[', b']'].iter().cycle())
                    .for_each(|(t, c)| *t = *c);
                assert_eq!(plain_len(&text), 20);
                text[at] = stop;
                assert_eq!(plain_len(&text), at, "stop {stop:#x} at {at}");
            }
        }
    }
}
