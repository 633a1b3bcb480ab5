//! What the serializer and the parser both write with: JCS string escaping and number
//! formatting, the canonical order of an object's members, and the buffers each thread keeps
//! between calls.

use std::borrow::Cow;
use std::ops::Range;

use super::CanonicalError;

/// Writes `s` as a JSON string literal with the escaping RFC 8785 §3.2.2.2 prescribes.
pub(super) fn write_str(out: &mut Vec<u8>, s: &str) {
    let bytes = s.as_bytes();
    out.reserve(bytes.len() + 2);
    out.push(b'"');
    let mut run = 0;
    loop {
        let i = next_escape(bytes, run);
        out.extend_from_slice(&bytes[run..i]);
        let Some(&b) = bytes.get(i) else { break };
        let esc: &[u8] = match b {
            b'"' => b"\\\"",
            b'\\' => b"\\\\",
            0x08 => b"\\b",
            0x09 => b"\\t",
            0x0a => b"\\n",
            0x0c => b"\\f",
            0x0d => b"\\r",
            _ => {
                const HEX: &[u8; 16] = b"0123456789abcdef";
                &[b'\\', b'u', b'0', b'0', HEX[(b >> 4) as usize], HEX[(b & 0xf) as usize]]
            }
        };
        out.extend_from_slice(esc);
        run = i + 1;
    }
    out.push(b'"');
}

/// The index of the first byte at or after `from` that a JSON string must escape (a control
/// character, `"` or `\`), or `bytes.len()` when there is none.
///
/// Almost every string needs no escape at all, so eight bytes are tested at a time (the last
/// word overlapping the one before it): a word has a byte below 0x20 when subtracting 0x20
/// from each byte borrows into a top bit the byte did not have, and a byte equal to `"` or `\`
/// when the word XORed with that byte has a zero byte (the same test against 0x01). Both tests
/// are exact for "some byte in this word" (a borrow starts only at a byte that matches), so a
/// word they pass is skipped whole and a word they flag is scanned byte by byte.
fn next_escape(bytes: &[u8], from: usize) -> usize {
    const ONES: u64 = u64::from_ne_bytes([0x01; 8]);
    const HIGH: u64 = u64::from_ne_bytes([0x80; 8]);
    let below = |w: u64, n: u8| w.wrapping_sub(ONES * u64::from(n)) & !w & HIGH;
    let flagged = |word: &[u8]| {
        let w = u64::from_ne_bytes(word.try_into().expect("a word of 8 bytes"));
        below(w, 0x20) | below(w ^ (ONES * u64::from(b'"')), 1) | below(w ^ (ONES * u64::from(b'\\')), 1) != 0
    };
    let first = |part: &[u8]| part.iter().position(|&b| b < 0x20 || b == b'"' || b == b'\\');
    let mut words = bytes[from..].chunks_exact(8);
    let mut i = from;
    for word in &mut words {
        if flagged(word) {
            return i + first(word).expect("a flagged word holds a byte to escape");
        }
        i += 8;
    }
    let rest = words.remainder();
    // The last eight bytes, when there are that many: those before `rest` passed already.
    if rest.is_empty() || (bytes.len() - from >= 8 && !flagged(&bytes[bytes.len() - 8..])) {
        return bytes.len();
    }
    i + first(rest).unwrap_or(rest.len())
}

/// Writes `v` in the number form JCS prescribes (ECMAScript's); NaN and infinities have none.
pub(super) fn write_f64(out: &mut Vec<u8>, v: f64) -> Result<(), CanonicalError> {
    if !v.is_finite() {
        return Err(CanonicalError::NonFinite(v));
    }
    out.extend_from_slice(ryu_js::Buffer::new().format_finite(v).as_bytes());
    Ok(())
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

/// Puts one object's members in canonical order, for the serializer and the JSON parser alike.
///
/// `out[start..]` holds the members as written, in arrival order and separated by commas;
/// `members` holds their names and their ranges in `out`. Members out of order are rewritten
/// through `scratch`. A name that appears twice is an error (returned, with `out` unchanged).
pub(super) fn order_members<'m>(
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
    rewrite(out, scratch, start, members.iter().map(|m| &m.1));
    Ok(())
}

/// Rewrites `out[start..]`, members separated by commas, with the members at `ranges` (ranges
/// of `out` as it is) in that order, through `scratch`.
fn rewrite<'r>(out: &mut Vec<u8>, scratch: &mut Vec<u8>, start: usize, ranges: impl Iterator<Item = &'r Range<usize>>) {
    scratch.clear();
    scratch.extend_from_slice(&out[start..]);
    out.truncate(start);
    for (i, range) in ranges.enumerate() {
        if i > 0 {
            out.push(b',');
        }
        out.extend_from_slice(&scratch[range.start - start..range.end - start]);
    }
}

/// The canonical order of the members of structs serialized before on this thread, so that
/// putting a struct's members in order again costs a comparison of their names' addresses, not
/// a sort.
///
/// A struct's field names are `&'static str`: two names at the same address with the same
/// length are the same text, so a struct whose members arrive with the names of a remembered
/// one, in the same order, takes its order. Objects with a name that is not static (map keys)
/// are sorted every time, as are objects of fewer than two members (nothing to order). Once
/// [`Orders::MAX`] orders are remembered, a new one takes the oldest entry's place and its
/// buffers: remembering allocates nothing then.
#[derive(Default)]
pub(super) struct Orders {
    remembered: Vec<Order>,
    /// The entry the next new order replaces, once [`Orders::MAX`] are remembered.
    next: usize,
}

#[derive(Default)]
struct Order {
    /// The names' addresses and lengths, in the order the members arrived.
    names: Vec<(usize, usize)>,
    /// The arrival index of the member at each place of the canonical order.
    order: Vec<u16>,
    /// Whether the members arrive in canonical order (nothing to rewrite).
    in_order: bool,
}

impl Orders {
    /// How many orders a thread remembers (a process serializes a handful of payload types).
    const MAX: usize = 16;
    /// The most members a remembered struct has.
    const MAX_MEMBERS: usize = 64;

    /// Puts one object's members in canonical order, as [`order_members`] does, from a
    /// remembered order when one fits; remembers the order of a struct it sorted. A name that
    /// appears twice is an error (returned, with `out` unchanged).
    pub(super) fn order(
        &mut self,
        out: &mut Vec<u8>,
        scratch: &mut Vec<u8>,
        start: usize,
        members: &mut [Member],
    ) -> Result<(), String> {
        let key = |m: &Member| match &m.0 {
            Cow::Borrowed(name) => Some((name.as_ptr() as usize, name.len())),
            Cow::Owned(_) => None,
        };
        let cacheable = (2..=Self::MAX_MEMBERS).contains(&members.len()) && members.iter().all(|m| key(m).is_some());
        if !cacheable {
            return order_members(out, scratch, start, members).map_err(str::to_owned);
        }
        let fits = |o: &&Order| {
            o.names.len() == members.len() && o.names.iter().zip(&*members).all(|(n, m)| key(m) == Some(*n))
        };
        if let Some(found) = self.remembered.iter().find(fits) {
            if !found.in_order {
                rewrite(out, scratch, start, found.order.iter().map(|&i| &members[usize::from(i)].1));
            }
            return Ok(());
        }
        // A new order, in the buffers of the entry it is to take: the names as they arrive, then
        // `order_members` sorts the members (and refuses a name that appears twice); the names,
        // all different then, say where each sorted member arrived.
        let mut new = if self.remembered.len() < Self::MAX {
            Order::default()
        } else {
            std::mem::take(&mut self.remembered[self.next])
        };
        new.names.clear();
        new.names.extend(members.iter().filter_map(key));
        order_members(out, scratch, start, members).map_err(str::to_owned)?;
        let names = &new.names;
        new.order.clear();
        new.order.extend(members.iter().map(|m| names.iter().position(|n| key(m) == Some(*n)).map_or(0, |i| i as u16)));
        new.in_order = new.order.iter().enumerate().all(|(place, &i)| usize::from(i) == place);
        if self.remembered.len() < Self::MAX {
            self.remembered.push(new);
        } else {
            self.remembered[self.next] = new;
            self.next = (self.next + 1) % Self::MAX;
        }
        Ok(())
    }
}

/// An object member's name and the byte range of `"name":value` in the output (without commas).
/// Struct field names are `&'static str`, so only map keys are owned.
pub(super) type Member = (Cow<'static, str>, Range<usize>);

/// The buffers canonicalizing needs besides its output, kept by each thread between calls so
/// that a call allocates nothing once they have grown to fit its payloads.
///
/// A call takes them out of the thread's slot and puts them back when it is done, so a call
/// made inside another (a `Serialize` impl that canonicalizes something itself) just starts
/// from empty buffers. Buffers that grew past [`Spare::KEEP`] bytes are not kept.
#[derive(Default)]
pub(super) struct Spare {
    pub(super) out: Vec<u8>,
    pub(super) scratch: Vec<u8>,
    pub(super) members: Vec<Member>,
    pub(super) orders: Orders,
}

thread_local! {
    static SPARE: std::cell::Cell<Option<Box<Spare>>> = const { std::cell::Cell::new(None) };
}

impl Spare {
    /// The most a kept buffer may hold: payloads larger than this are rare, and a thread should
    /// not keep their buffers for good.
    const KEEP: usize = 64 << 10;

    pub(super) fn take() -> Box<Spare> {
        SPARE.try_with(|slot| slot.take()).ok().flatten().unwrap_or_default()
    }

    pub(super) fn give_back(mut self: Box<Self>) {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::canonical::tests::canon;
    use crate::canonical::to_canonical_vec;

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

    #[test]
    fn strings_are_not_normalized_and_escaped_per_jcs() {
        assert_ne!(canon("\u{e9}"), canon("e\u{301}"));
        assert_eq!(canon("a\u{1}\u{1f}\u{7f}\u{2028}"), "\"a\\u0001\\u001f\u{7f}\u{2028}\"");
        assert_eq!(canon("tab\there"), r#""tab\there""#);
    }

    #[test]
    fn escapes_are_found_in_every_position_of_a_word() {
        for special in [b'"', b'\\', 0x00, 0x08, 0x1f] {
            for len in 1..20 {
                for at in 0..len {
                    let mut bytes = vec![b'a'; len];
                    bytes[at] = special;
                    assert_eq!(next_escape(&bytes, 0), at, "{special:#x} at {at} of {len}");
                    assert_eq!(next_escape(&bytes, at + 1), len, "after {special:#x} at {at} of {len}");
                }
            }
        }
        // Bytes just outside the escaped ranges, and UTF-8 continuation bytes, are not escapes.
        let clean = "\u{20}!#[]\u{7f}\u{e9}\u{ff61}\u{1F600}abcdefgh";
        assert_eq!(next_escape(clean.as_bytes(), 0), clean.len());
    }

    proptest::proptest! {
        /// Strings are escaped exactly as `serde_json` escapes them (which is what RFC 8785
        /// prescribes: the two-character escapes, `\u00xx` in lowercase for other controls).
        #[test]
        fn strings_escape_as_serde_json_does(s in "(\\PC|[\\x00-\\x1f\"\\\\\\x7f])*") {
            let mut out = Vec::new();
            write_str(&mut out, &s);
            proptest::prop_assert_eq!(String::from_utf8(out).unwrap(), serde_json::to_string(&s).unwrap());
        }

        /// The byte-wise shortcut in `utf16_cmp` agrees with comparing UTF-16 code units, also
        /// for names that share a prefix and mix ASCII, BMP code points above U+E000 and pairs.
        #[test]
        fn member_order_matches_utf16_code_units(a in "[ab\u{e9}\u{ff61}\u{1F600}]{0,5}", b in "[ab\u{e9}\u{ff61}\u{1F600}]{0,5}") {
            proptest::prop_assert_eq!(utf16_cmp(&a, &b), a.encode_utf16().cmp(b.encode_utf16()));
        }
    }
}
