//! The serde serializer: writes the canonical JSON of a `Serialize` value as serde walks it.

use std::borrow::Cow;

use serde::Serialize;
use serde::ser::{self, Impossible};

use super::write::{Member, Orders, Spare, write_f64, write_str};
use super::{CanonicalError, MAX_DEPTH};

/// Serializes `value` to canonical JSON (see the [module docs](super)).
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
    let mut ser = Canonicalizer {
        out,
        depth: 0,
        scratch: std::mem::take(&mut spare.scratch),
        members,
        orders: std::mem::take(&mut spare.orders),
    };
    let res = value.serialize(&mut ser);
    if res.is_err() {
        ser.out.truncate(start);
    }
    spare.scratch = ser.scratch;
    spare.members = ser.members;
    spare.orders = ser.orders;
    res
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
    /// The orders of the structs this thread serialized before.
    orders: Orders,
}

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

/// One object being written: its members are written in arrival order, then reordered at the end.
struct ObjectState {
    /// Offset just after the `{`.
    start: usize,
    /// Where this object's members, in arrival order, start in `Canonicalizer::members`.
    base: usize,
    /// The name whose value comes next (maps give keys and values in separate calls).
    key: Option<String>,
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
        ser.orders
            .order(ser.out, &mut ser.scratch, self.start, &mut ser.members[self.base..])
            .map_err(CanonicalError::DuplicateKey)?;
        ser.members.truncate(self.base);
        ser.out.push(b'}');
        ser.depth -= 1;
        Ok(())
    }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::canonical::tests::canon;
    use std::collections::{BTreeMap, HashMap};

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
    fn non_string_map_keys_are_rejected() {
        let mut m = HashMap::new();
        m.insert(1u32, "a");
        let err = to_canonical_vec(&m).unwrap_err();
        assert_eq!(err, CanonicalError::NonStringKey { kind: "integers" });
        assert!(err.to_string().contains("keys are integers"));
    }
}
