//! The byte-level JSON parser: canonicalizes a JSON document (an HTTP body, say) as it reads it,
//! keeping integers' exact digits.

use std::borrow::Cow;
use std::ops::Range;

use super::MAX_DEPTH;
use super::write::{Spare, order_members, write_f64, write_str};

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
/// from a buffer this thread keeps for it, like [`with_canonical`](super::with_canonical): what
/// the HTTP layer's body fingerprint needs, without allocating once the thread's buffers have
/// grown to fit.
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
    /// Where an object's members are copied while they are put in order (see `order_members`).
    scratch: Vec<u8>,
    /// The members of every object being read, innermost last (see `ser::Canonicalizer::members`).
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
    use crate::canonical::write::Member;

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
