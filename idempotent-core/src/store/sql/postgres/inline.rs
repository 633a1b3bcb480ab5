//! Statements with their values written in, for a store behind a pooler in transaction mode
//! ([`PostgresStoreBuilder::transaction_pooling`](super::PostgresStoreBuilder::transaction_pooling)).
//!
//! sqlx sends a statement with parameters as two exchanges (parse, then bind and execute), and
//! such a pooler may hand the second to another server connection. Sent instead as one simple
//! query, `SET LOCAL statement_timeout = …; <statement>` is one message, one round trip and one
//! implicit transaction: nothing is prepared, nothing outlives it, and its rows come back in
//! text, which sqlx decodes for every type the store reads.
//!
//! Each value is a literal that no setting of the session can reinterpret: bytes as
//! `'\x<hex>'::bytea`, text as an escape string `E'…'` (backslashes and quotes doubled; text
//! holds no NUL), integers in decimal.

use std::fmt::Write;

use crate::store::sql::driver::Value;

/// `sql` with each placeholder `$n` (outside quoted literals) replaced by the literal of the
/// `n`th value; a placeholder without a value is left as it is (the server then refuses it).
pub(super) fn inline<'a>(sql: &str, args: impl IntoIterator<Item = Value<'a>>) -> String {
    let literals: Vec<String> = args.into_iter().map(literal).collect();
    let mut out = String::with_capacity(sql.len() + literals.iter().map(String::len).sum::<usize>());
    let mut quoted = false;
    let mut chars = sql.char_indices().peekable();
    while let Some((at, c)) = chars.next() {
        if c == '\'' {
            quoted = !quoted;
        }
        if c != '$' || quoted {
            out.push(c);
            continue;
        }
        let mut end = at + 1;
        while let Some(&(i, d)) = chars.peek()
            && d.is_ascii_digit()
        {
            end = i + 1;
            chars.next();
        }
        let value = sql[at + 1..end].parse::<usize>().ok().and_then(|n| literals.get(n.checked_sub(1)?));
        match value {
            Some(literal) => out.push_str(literal),
            None => out.push_str(&sql[at..end]),
        }
    }
    out
}

fn literal(value: Value<'_>) -> String {
    match value {
        Value::Bytes(b) => bytes(b),
        Value::OwnedBytes(b) => bytes(&b),
        Value::OptBytes(Some(b)) => bytes(b),
        Value::OptBytes(None) => "NULL::bytea".to_owned(),
        Value::Text(t) => text(t),
        Value::OwnedText(t) => text(&t),
        Value::OptText(Some(t)) => text(t),
        Value::OptText(None) => "NULL::text".to_owned(),
        Value::Int(n) => format!("({n})::bigint"),
    }
}

fn bytes(b: &[u8]) -> String {
    let mut out = String::with_capacity(b.len() * 2 + 12);
    out.push_str("'\\x");
    for byte in b {
        let _ = write!(out, "{byte:02x}");
    }
    out.push_str("'::bytea");
    out
}

fn text(t: &str) -> String {
    let mut out = String::with_capacity(t.len() + 10);
    out.push_str("E'");
    for c in t.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\'' => out.push_str("''"),
            c => out.push(c),
        }
    }
    out.push_str("'::text");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn placeholders_become_literals_outside_quotes_only() {
        let sql = "UPDATE t SET state = 'done$1', a = $1, b = $2 WHERE key = $10 AND c = $3 AND d = $4 AND e = $5";
        let args = [
            Value::Bytes(&[0, 0xab]),
            Value::Text("it's a \\ test"),
            Value::Int(-7),
            Value::OptText(None),
            Value::OptBytes(None),
        ];
        assert_eq!(
            inline(sql, args),
            "UPDATE t SET state = 'done$1', a = '\\x00ab'::bytea, b = E'it''s a \\\\ test'::text WHERE key = $10 AND \
             c = (-7)::bigint AND d = NULL::text AND e = NULL::bytea"
        );
    }

    #[test]
    fn a_text_cannot_end_its_literal() {
        let hostile = "x'; DROP TABLE t; --\\";
        let out = inline("SELECT $1", [Value::Text(hostile)]);
        assert_eq!(out, "SELECT E'x''; DROP TABLE t; --\\\\'::text");
        // Every quote inside is doubled, and the backslash before the closing quote is escaped.
        let inner = &out["SELECT E'".len()..out.len() - "'::text".len()];
        assert!(!inner.replace("''", "").contains('\''), "{inner}");
    }
}
