//! Parsing `#[idempotent(...)]`'s options. Every misuse is a `syn::Error` at the offending token.

use std::fmt;

use proc_macro2::{Span, TokenStream};
use quote::ToTokens;
use syn::ext::IdentExt;
use syn::parse::{Parse, ParseStream};
use syn::punctuated::Punctuated;
use syn::{Expr, ExprLit, Ident, Lit, LitInt, LitStr, Member, Path, Token};

mod kw {
    syn::custom_keyword!(step);
    syn::custom_keyword!(retention);
    syn::custom_keyword!(ttl);
    syn::custom_keyword!(lease);
    syn::custom_keyword!(key);
    syn::custom_keyword!(skip);
    syn::custom_keyword!(version);
    syn::custom_keyword!(on_in_flight);
    syn::custom_keyword!(store_errors);
    syn::custom_keyword!(ctx);
    syn::custom_keyword!(transaction);
    syn::custom_keyword!(verify);
    syn::custom_keyword!(on_recovered);
}

const OPTIONS: &str = "`step`, `retention` (or `ttl`), `lease`, `key(..)`, `skip(..)`, `version`, \
                       `on_in_flight`, `store_errors`, `ctx`, `transaction`, `verify`, `on_recovered` or `crate`";

/// What a step without a verifier does with a recovered attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Recovered {
    Run,
    NeedsAttention,
}

/// What a call does when another attempt is running.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum InFlight {
    Wait,
    Reject,
}

/// A number of seconds, at least 1. Its upper bound is the executor's, checked when the step
/// runs (`Error::Config`), so that the bounds are defined and enforced in one place.
#[derive(Debug)]
pub(crate) struct Seconds {
    pub(crate) secs: u64,
}

/// Where `ctx = ..` says the run context is.
pub(crate) enum ContextArg {
    /// `ctx = run`: the parameter of that name.
    Param(Ident),
    /// `ctx = self.ctx`, `ctx = self.inner.ctx`: a field of the receiver.
    Field(SelfField),
}

/// `self.a.b`: a path of one or more fields on the receiver, with the user's tokens and spans.
pub(crate) struct SelfField {
    pub(crate) receiver: Token![self],
    pub(crate) fields: Vec<(Token![.], Member)>,
}

impl fmt::Display for SelfField {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("self")?;
        for (_, member) in &self.fields {
            match member {
                Member::Named(name) => write!(f, ".{name}")?,
                Member::Unnamed(index) => write!(f, ".{}", index.index)?,
            }
        }
        Ok(())
    }
}

impl ToTokens for SelfField {
    fn to_tokens(&self, tokens: &mut TokenStream) {
        self.receiver.to_tokens(tokens);
        for (dot, member) in &self.fields {
            dot.to_tokens(tokens);
            member.to_tokens(tokens);
        }
    }
}

/// The parsed options.
#[derive(Default)]
pub(crate) struct Args {
    pub(crate) step: Option<LitStr>,
    /// `retention = N`, or its older name `ttl = N`.
    pub(crate) retention: Option<Seconds>,
    pub(crate) lease: Option<Seconds>,
    pub(crate) key: Option<Vec<Ident>>,
    pub(crate) skip: Option<Vec<Ident>>,
    pub(crate) version: Option<u32>,
    pub(crate) on_in_flight: Option<InFlight>,
    pub(crate) store_errors: bool,
    pub(crate) ctx: Option<ContextArg>,
    /// `transaction = tx`: the parameter the body's transaction is bound to.
    pub(crate) transaction: Option<Ident>,
    /// `verify = path`: the async fn called instead of the body when the attempt is recovered.
    pub(crate) verify: Option<Path>,
    pub(crate) on_recovered: Option<Recovered>,
    /// Where `on_recovered` was written, for the errors that name it.
    pub(crate) on_recovered_span: Option<Span>,
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
        let mut retention: Option<&'static str> = None;
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
            } else if lookahead.peek(kw::retention) || lookahead.peek(kw::ttl) {
                let (name, span) = match input.parse::<Option<kw::ttl>>()? {
                    Some(kw) => ("ttl", kw.span),
                    None => ("retention", input.parse::<kw::retention>()?.span),
                };
                match retention {
                    Some(first) if first != name => {
                        return Err(syn::Error::new(
                            span,
                            format!("`{name}` and `{first}` are one option (`ttl` is the older name); keep one"),
                        ));
                    }
                    _ => once(&args.retention, name, span)?,
                }
                retention = Some(name);
                args.retention = Some(seconds(
                    input,
                    name,
                    span,
                    &format!("how long the result is kept and replayed, e.g. `{name} = 86400` for a day"),
                )?);
            } else if lookahead.peek(kw::lease) {
                let kw: kw::lease = input.parse()?;
                once(&args.lease, "lease", kw.span)?;
                args.lease = Some(seconds(
                    input,
                    "lease",
                    kw.span,
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
                if args.transaction.is_some() {
                    return Err(store_errors_with_transaction(kw.span));
                }
                store_errors = Some(kw.span);
                args.store_errors = true;
            } else if lookahead.peek(kw::ctx) {
                let kw: kw::ctx = input.parse()?;
                once(&args.ctx, "ctx", kw.span)?;
                equals(input, "ctx", kw.span, "ctx = run")?;
                args.ctx = Some(context(input)?);
            } else if lookahead.peek(kw::transaction) {
                let kw: kw::transaction = input.parse()?;
                once(&args.transaction, "transaction", kw.span)?;
                equals(input, "transaction", kw.span, "transaction = tx")?;
                if !input.peek(Ident::peek_any) || input.peek(Token![self]) {
                    return Err(input.error(
                        "`transaction` takes the name of a parameter of type `&mut sqlx::Transaction<'_, DB>`, \
                         e.g. `transaction = tx`",
                    ));
                }
                let name = input.call(Ident::parse_any)?;
                if !input.is_empty() && !input.peek(Token![,]) {
                    return Err(input.error(
                        "`transaction` takes the name of a parameter, not an expression: e.g. `transaction = tx`",
                    ));
                }
                if let Some(span) = store_errors {
                    return Err(store_errors_with_transaction(span));
                }
                args.transaction = Some(name);
            } else if lookahead.peek(kw::verify) {
                let kw: kw::verify = input.parse()?;
                once(&args.verify, "verify", kw.span)?;
                equals(input, "verify", kw.span, "verify = find_charge")?;
                let path: Path = input.parse().map_err(|_| {
                    syn::Error::new(
                        kw.span,
                        "`verify` takes the path of an async fn, e.g. `verify = find_charge`, taking the \
                         `Attempt` and returning `Result<Verdict<T>, E>`",
                    )
                })?;
                args.verify = Some(path);
            } else if lookahead.peek(kw::on_recovered) {
                let kw: kw::on_recovered = input.parse()?;
                once(&args.on_recovered, "on_recovered", kw.span)?;
                equals(input, "on_recovered", kw.span, "on_recovered = \"needs_attention\"")?;
                let policy: LitStr = input.parse()?;
                args.on_recovered_span = Some(kw.span);
                args.on_recovered = Some(match policy.value().as_str() {
                    "run" => Recovered::Run,
                    "needs_attention" => Recovered::NeedsAttention,
                    other => {
                        return Err(syn::Error::new(
                            policy.span(),
                            format!("unknown `on_recovered` policy {other:?}; expected \"run\" or \"needs_attention\""),
                        ));
                    }
                });
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
        if let (Some(_), Some(verify)) = (&args.transaction, &args.verify) {
            return Err(syn::Error::new_spanned(
                verify,
                "`verify` does not combine with `transaction`: the step's record commits in the same \
                 transaction as the body's writes, so a recovered attempt knows they did not commit; \
                 remove `verify`",
            ));
        }
        if let Some(span) = args.on_recovered_span {
            if args.verify.is_some() {
                return Err(syn::Error::new(
                    span,
                    "`on_recovered` does not combine with `verify`: the verifier decides what a recovered \
                     attempt does (`Verdict::Unknown` leaves the record for a person); remove one",
                ));
            }
            if args.transaction.is_some() {
                return Err(syn::Error::new(
                    span,
                    "`on_recovered` does not combine with `transaction`: the step's record commits with the \
                     body's writes, so a recovered attempt knows they did not commit; remove `on_recovered`",
                ));
            }
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

/// `store_errors` and `transaction` together, reported at `store_errors`.
fn store_errors_with_transaction(span: Span) -> syn::Error {
    syn::Error::new(
        span,
        "`store_errors` does not combine with `transaction`: an `Err` from the body rolls its transaction \
         back and frees the key, so that a retry runs it again; remove `store_errors`, or return the \
         permanent failure inside `Ok(..)`",
    )
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

/// `= <integer literal>`, at least 1. The upper bound is the executor's (see [`Seconds`]).
fn seconds(input: ParseStream<'_>, name: &str, span: Span, what: &str) -> syn::Result<Seconds> {
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
    Ok(Seconds { secs })
}

/// After `ctx =`: a parameter name, or a path of fields on `self`.
fn context(input: ParseStream<'_>) -> syn::Result<ContextArg> {
    const WRITE: &str = "name the parameter that holds the `RunContext` (`ctx = run`) or the field of \
                         `self` that does (`ctx = self.ctx`)";
    let context = if input.peek(Token![self]) {
        let receiver: Token![self] = input.parse()?;
        let mut fields = Vec::new();
        while let Some(dot) = input.parse::<Option<Token![.]>>()? {
            if !(input.peek(Ident) || input.peek(LitInt)) {
                let at = if input.is_empty() { dot.span } else { input.span() };
                return Err(syn::Error::new(
                    at,
                    "`ctx = self.`: write the name of the field after the `.`, e.g. `ctx = self.ctx`",
                ));
            }
            fields.push((dot, input.parse::<Member>()?));
        }
        if fields.is_empty() {
            return Err(syn::Error::new(
                receiver.span,
                "`ctx = self`: name the field of `self` that holds the `RunContext`, e.g. `ctx = self.ctx`",
            ));
        }
        ContextArg::Field(SelfField { receiver, fields })
    } else if input.peek(Ident::peek_any) {
        let name = input.call(Ident::parse_any)?;
        if input.peek(Token![.]) {
            return Err(syn::Error::new(
                name.span(),
                format!(
                    "`ctx` reads a field of `self` only (`ctx = self.ctx`), not of the parameter `{name}`: \
                     pass the context as a parameter of its own and name it (`ctx = run`)"
                ),
            ));
        }
        ContextArg::Param(name)
    } else if input.peek(Token![&]) {
        return Err(input.error(format!("`ctx` takes a name, not a reference (the macro borrows it): {WRITE}")));
    } else {
        return Err(input.error(format!("`ctx` takes a name, not an expression: {WRITE}")));
    };
    if !input.is_empty() && !input.peek(Token![,]) {
        return Err(input.error(format!("`ctx` takes a name, not a method call or another expression: {WRITE}")));
    }
    Ok(context)
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
