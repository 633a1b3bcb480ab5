//! Parsing `#[idempotent(...)]`'s options. Every misuse is a `syn::Error` at the offending token.

use proc_macro2::Span;
use syn::ext::IdentExt;
use syn::parse::{Parse, ParseStream};
use syn::punctuated::Punctuated;
use syn::{Expr, ExprLit, Ident, Lit, LitStr, Path, Token};

mod kw {
    syn::custom_keyword!(step);
    syn::custom_keyword!(ttl);
    syn::custom_keyword!(lease);
    syn::custom_keyword!(key);
    syn::custom_keyword!(skip);
    syn::custom_keyword!(version);
    syn::custom_keyword!(on_in_flight);
    syn::custom_keyword!(store_errors);
    syn::custom_keyword!(ctx);
}

const OPTIONS: &str = "`step`, `ttl`, `lease`, `key(..)`, `skip(..)`, `version`, `on_in_flight`, \
                       `store_errors`, `ctx` or `crate`";

/// What a call does when another attempt is running.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum InFlight {
    Wait,
    Reject,
}

/// A number of seconds, at least 1 and at most the option's maximum.
#[derive(Debug)]
pub(crate) struct Seconds {
    pub(crate) secs: u64,
}

/// The parsed options.
#[derive(Default)]
pub(crate) struct Args {
    pub(crate) step: Option<LitStr>,
    pub(crate) ttl: Option<Seconds>,
    pub(crate) lease: Option<Seconds>,
    pub(crate) key: Option<Vec<Ident>>,
    pub(crate) skip: Option<Vec<Ident>>,
    pub(crate) version: Option<u32>,
    pub(crate) on_in_flight: Option<InFlight>,
    pub(crate) store_errors: bool,
    pub(crate) ctx: Option<Ident>,
    pub(crate) krate: Option<Path>,
}

impl Args {
    /// The step name; parsing guarantees it is present.
    pub(crate) fn step(&self) -> &LitStr {
        self.step.as_ref().expect("`step` is checked when parsing")
    }
}

/// Fails when an option was already given.
fn once<T>(slot: &Option<T>, name: &str, span: Span) -> syn::Result<()> {
    match slot {
        Some(_) => Err(syn::Error::new(span, format!("`{name}` is given twice; keep one"))),
        None => Ok(()),
    }
}

impl Parse for Args {
    fn parse(input: ParseStream<'_>) -> syn::Result<Self> {
        let mut args = Args::default();
        let mut store_errors: Option<Span> = None;
        while !input.is_empty() {
            let lookahead = input.lookahead1();
            if lookahead.peek(kw::step) {
                let kw: kw::step = input.parse()?;
                once(&args.step, "step", kw.span)?;
                equals(input, "step", kw.span, "step = \"issue_refund\"")?;
                let name: LitStr = input.parse()?;
                if name.value().trim().is_empty() {
                    return Err(syn::Error::new(
                        name.span(),
                        "`step` is empty; name the step, e.g. `step = \"issue_refund\"` (the name is part of every key)",
                    ));
                }
                args.step = Some(name);
            } else if lookahead.peek(kw::ttl) {
                let kw: kw::ttl = input.parse()?;
                once(&args.ttl, "ttl", kw.span)?;
                args.ttl = Some(seconds(
                    input,
                    "ttl",
                    kw.span,
                    MAX_TTL,
                    "how long the result is kept and replayed, e.g. `ttl = 86400` for a day",
                )?);
            } else if lookahead.peek(kw::lease) {
                let kw: kw::lease = input.parse()?;
                once(&args.lease, "lease", kw.span)?;
                args.lease = Some(seconds(
                    input,
                    "lease",
                    kw.span,
                    MAX_LEASE,
                    "how long one attempt holds the key without renewing, e.g. `lease = 60`",
                )?);
            } else if lookahead.peek(kw::key) {
                let kw: kw::key = input.parse()?;
                once(&args.key, "key", kw.span)?;
                args.key = Some(names(input, "key", kw.span)?);
            } else if lookahead.peek(kw::skip) {
                let kw: kw::skip = input.parse()?;
                once(&args.skip, "skip", kw.span)?;
                args.skip = Some(names(input, "skip", kw.span)?);
            } else if lookahead.peek(kw::version) {
                let kw: kw::version = input.parse()?;
                once(&args.version, "version", kw.span)?;
                equals(input, "version", kw.span, "version = 2")?;
                let expr: Expr = input.parse()?;
                args.version = Some(match ungroup(&expr) {
                    Expr::Lit(ExprLit { lit: Lit::Int(int), .. }) => int.base10_parse::<u32>().map_err(|_| {
                        syn::Error::new_spanned(&expr, "`version` must fit in a u32, e.g. `version = 2`")
                    })?,
                    _ => {
                        return Err(syn::Error::new_spanned(
                            &expr,
                            "`version` must be an integer literal, e.g. `version = 2`",
                        ));
                    }
                });
            } else if lookahead.peek(kw::on_in_flight) {
                let kw: kw::on_in_flight = input.parse()?;
                once(&args.on_in_flight, "on_in_flight", kw.span)?;
                equals(input, "on_in_flight", kw.span, "on_in_flight = \"reject\"")?;
                let policy: LitStr = input.parse()?;
                args.on_in_flight = Some(match policy.value().as_str() {
                    "wait" => InFlight::Wait,
                    "reject" => InFlight::Reject,
                    other => {
                        return Err(syn::Error::new(
                            policy.span(),
                            format!("unknown `on_in_flight` policy {other:?}; expected \"wait\" or \"reject\""),
                        ));
                    }
                });
            } else if lookahead.peek(kw::store_errors) {
                let kw: kw::store_errors = input.parse()?;
                once(&store_errors, "store_errors", kw.span)?;
                if input.peek(Token![=]) {
                    return Err(input.error(
                        "`store_errors` takes no value: write `store_errors` to store and replay `Err` outcomes",
                    ));
                }
                store_errors = Some(kw.span);
                args.store_errors = true;
            } else if lookahead.peek(kw::ctx) {
                let kw: kw::ctx = input.parse()?;
                once(&args.ctx, "ctx", kw.span)?;
                equals(input, "ctx", kw.span, "ctx = run")?;
                args.ctx = Some(input.call(Ident::parse_any)?);
            } else if lookahead.peek(Token![crate]) {
                let kw: Token![crate] = input.parse()?;
                once(&args.krate, "crate", kw.span)?;
                equals(input, "crate", kw.span, "crate = \"::my_idempotent\"")?;
                let path: LitStr = input.parse()?;
                args.krate = Some(path.parse::<Path>().map_err(|_| {
                    syn::Error::new(
                        path.span(),
                        "`crate` must be a path to idempotent-core, e.g. `crate = \"::my_idempotent\"`",
                    )
                })?);
            } else if input.peek(Ident::peek_any) {
                let unknown = input.call(Ident::parse_any)?;
                return Err(syn::Error::new(
                    unknown.span(),
                    format!("unknown option `{unknown}`; expected one of {OPTIONS}"),
                ));
            } else {
                return Err(lookahead.error());
            }
            if input.is_empty() {
                break;
            }
            input.parse::<Token![,]>()?;
        }
        if args.step.is_none() {
            return Err(syn::Error::new(
                Span::call_site(),
                "missing `step`: name the step, e.g. `#[idempotent(step = \"issue_refund\")]` (the name is part of every key)",
            ));
        }
        Ok(args)
    }
}

/// The `=` after an option's name; its absence is reported at the name.
fn equals(input: ParseStream<'_>, name: &str, span: Span, example: &str) -> syn::Result<()> {
    if input.peek(Token![=]) {
        input.parse::<Token![=]>()?;
        Ok(())
    } else {
        Err(syn::Error::new(span, format!("`{name}` needs a value, e.g. `{example}`")))
    }
}

/// A literal passed through a `macro_rules!` `$x:expr` arrives wrapped in an invisible group.
fn ungroup(expr: &Expr) -> &Expr {
    match expr {
        Expr::Group(g) => ungroup(&g.expr),
        other => other,
    }
}

/// The longest `ttl`: 10 years (3650 days). Stores turn it into a deadline, which must stay
/// representable (an `Instant` overflows, Redis scripts see huge numbers in exponent notation).
const MAX_TTL: (u64, &str) = (3650 * 24 * 60 * 60, "10 years");
/// The longest `lease`: a day. An attempt that crashes blocks its key for a whole lease.
const MAX_LEASE: (u64, &str) = (24 * 60 * 60, "1 day");

/// `= <integer literal>`, at least 1 and at most `max`.
fn seconds(input: ParseStream<'_>, name: &str, span: Span, max: (u64, &str), what: &str) -> syn::Result<Seconds> {
    equals(input, name, span, &format!("{name} = 60"))?;
    let expr: Expr = input.parse()?;
    let Expr::Lit(ExprLit { lit: Lit::Int(int), .. }) = ungroup(&expr) else {
        return Err(syn::Error::new_spanned(
            &expr,
            format!("`{name}` must be a whole number of seconds as an integer literal: {what}"),
        ));
    };
    let secs = int.base10_parse::<u64>().map_err(|_| {
        syn::Error::new(int.span(), format!("`{name}` must be a whole number of seconds that fits in a u64: {what}"))
    })?;
    if secs == 0 {
        return Err(syn::Error::new(int.span(), format!("`{name}` must be at least 1 second: {what}")));
    }
    let (max, max_words) = max;
    if secs > max {
        return Err(syn::Error::new(
            int.span(),
            format!("`{name}` must be at most {max} seconds ({max_words}): {what}"),
        ));
    }
    Ok(Seconds { secs })
}

/// `(a, b, ...)`: at least one parameter name, each once.
fn names(input: ParseStream<'_>, option: &str, span: Span) -> syn::Result<Vec<Ident>> {
    if !input.peek(syn::token::Paren) {
        return Err(syn::Error::new(span, format!("`{option}` takes a list of parameters, e.g. `{option}(order_id)`")));
    }
    let content;
    let parens = syn::parenthesized!(content in input);
    let list: Punctuated<Ident, Token![,]> = content.parse_terminated(Ident::parse_any, Token![,])?;
    if list.is_empty() {
        return Err(syn::Error::new(
            parens.span.join(),
            format!("`{option}()` names no parameter; list parameters, e.g. `{option}(order_id)`, or remove it"),
        ));
    }
    let mut seen: Vec<Ident> = Vec::with_capacity(list.len());
    for name in list {
        if seen.iter().any(|s| s.unraw() == name.unraw()) {
            return Err(syn::Error::new(name.span(), format!("`{name}` is listed twice in `{option}(..)`")));
        }
        seen.push(name);
    }
    Ok(seen)
}
