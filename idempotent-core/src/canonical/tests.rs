//! Tests that hold the serializer and the parser to the same canonical form.

use serde::{Serialize, ser};
use serde_json::json;

use super::{CanonicalError, MAX_DEPTH, canonicalize_json, to_canonical_vec, with_canonical, with_canonical_json};

pub(super) fn canon<T: Serialize + ?Sized>(v: &T) -> String {
    String::from_utf8(to_canonical_vec(v).unwrap()).unwrap()
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
fn reused_buffers_never_leak_into_the_next_result() {
    let long = serde_json::json!({"z": "a long value that fills the buffer", "y": [1, 2, 3], "x": {"b": 1, "a": 2}});
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
    let expected = r#"{"a":{"p":{"r":2,"s":1},"q":1},"m":2,"z":{"a":3,"b":[{"c":2,"d":1},{"f":{"g":2,"h":1}}],"y":1}}"#;
    let value = Outer {
        z: Z { y: 1, b: (D { d: 1, c: 2 }, F { f: H { h: 1, g: 2 } }), a: 3 },
        m: 2,
        a: A { q: 1, p: P { s: 1, r: 2 } },
    };
    assert_eq!(canon(&value), expected);
    let text = br#"{"z":{"y":1,"b":[{"d":1,"c":2},{"f":{"h":1,"g":2}}],"a":3},"m":2,"a":{"q":1,"p":{"s":1,"r":2}}}"#;
    assert_eq!(canonicalize_json(text).unwrap(), expected.as_bytes());
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
}

/// Structs are put in order from the order remembered for their names: a second type with the
/// same names in another order, a struct whose fields vary (skipped ones), a struct inside a
/// map, and more types than a thread remembers all come out in canonical order every time.
#[test]
fn remembered_struct_orders_fit_only_their_own_names() {
    #[derive(Serialize)]
    struct BA {
        b: u8,
        a: u8,
    }
    #[derive(Serialize)]
    struct AB {
        a: u8,
        b: u8,
    }
    #[derive(Serialize)]
    struct Skips {
        z: u8,
        #[serde(skip_serializing_if = "Option::is_none")]
        m: Option<u8>,
        a: u8,
    }
    for _ in 0..3 {
        assert_eq!(canon(&BA { b: 2, a: 1 }), r#"{"a":1,"b":2}"#);
        assert_eq!(canon(&AB { a: 1, b: 2 }), r#"{"a":1,"b":2}"#);
        assert_eq!(canon(&Skips { z: 3, m: Some(2), a: 1 }), r#"{"a":1,"m":2,"z":3}"#);
        assert_eq!(canon(&Skips { z: 3, m: None, a: 1 }), r#"{"a":1,"z":3}"#);
        let map = std::collections::HashMap::from([("y", BA { b: 2, a: 1 }), ("x", BA { b: 4, a: 3 })]);
        assert_eq!(canon(&map), r#"{"x":{"a":3,"b":4},"y":{"a":1,"b":2}}"#);
    }
    // Twenty types with names of their own (more than a thread remembers), twice over.
    macro_rules! structs {
        ($($name:ident $f:ident $g:ident),*) => {
            $(
                #[derive(Serialize)]
                struct $name {
                    $g: u8,
                    $f: u8,
                }
            )*
            for _ in 0..2 {
                $(assert_eq!(canon(&$name { $g: 2, $f: 1 }), format!(r#"{{"{}":1,"{}":2}}"#, stringify!($f), stringify!($g)));)*
            }
        };
    }
    structs!(
        S0 a0 b0, S1 a1 b1, S2 a2 b2, S3 a3 b3, S4 a4 b4, S5 a5 b5, S6 a6 b6, S7 a7 b7, S8 a8 b8, S9 a9 b9,
        S10 a10 b10, S11 a11 b11, S12 a12 b12, S13 a13 b13, S14 a14 b14, S15 a15 b15, S16 a16 b16,
        S17 a17 b17, S18 a18 b18, S19 a19 b19
    );
}

/// A struct that writes one field twice is refused every time: a refused order is never
/// remembered.
#[test]
fn a_repeated_field_is_refused_every_time() {
    struct Twice;
    impl Serialize for Twice {
        fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
            use serde::ser::SerializeStruct;
            let mut st = s.serialize_struct("Twice", 2)?;
            st.serialize_field("b", &1)?;
            st.serialize_field("b", &2)?;
            st.end()
        }
    }
    for _ in 0..2 {
        assert!(matches!(to_canonical_vec(&Twice), Err(CanonicalError::DuplicateKey(k)) if k == "b"));
    }
}
