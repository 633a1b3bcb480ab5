//! Expanding an annotated `async fn` into a call of `idempotent_core`'s executor.
//!
//! The function keeps its signature (less the `transaction = ..` parameter, if one is named:
//! the step begins that transaction, and the body's action takes it as its first parameter, in
//! `Step::run_in_transaction`). Its new body clones the run context, serializes every
//! payload argument to canonical JSON (one call per argument, spanned at that parameter, so a
//! non-serializable one is reported there and by name), and hands the original body to
//! `Step::run` as the action, wrapped in an `async move` block whose type is pinned to the user's
//! return type, as `#[tracing::instrument]` does, so that rustc reports type errors in the body
//! against that return type. The expansion's own locals (`__idempotent_*`) have mixed-site
//! hygiene, so a parameter that happens to share one of their names is still the user's.
//!
//! As in tracing-attributes, `check` reads the signature against the options (every error is
//! found there, before any code is written), `gen_block` writes the new body and `gen_function`
//! puts it back inside the signature.

use proc_macro2::{Span, TokenStream};
use quote::{ToTokens, format_ident, quote, quote_spanned};
use syn::ext::IdentExt;
use syn::spanned::Spanned;
use syn::visit_mut::VisitMut;
use syn::{
    AttrStyle, Block, FnArg, GenericParam, Ident, ItemFn, Pat, Path, ReturnType, Signature, Type, TypeImplTrait,
    TypePath,
};

use crate::attr::{Args, InFlight, Recovered};
use crate::params::{Context, Param, context, is_context_type, params};

/// The annotated function, rewritten, or the first misuse found.
pub(crate) fn expand(args: Args, item: ItemFn) -> syn::Result<TokenStream> {
    let checked = check(&args, &item.sig)?;
    let body = gen_block(&args, &checked, &item.block);
    Ok(gen_function(&item, checked.transaction.as_ref(), body))
}

/// The function again, with its signature (less the `transaction` parameter, which the step
/// provides) and attributes, around the new body.
fn gen_function(item: &ItemFn, transaction: Option<&TransactionParam<'_>>, body: TokenStream) -> TokenStream {
    // `modifiers` is always empty: `default fn` does not parse as an `ItemFn`.
    let ItemFn { attrs, vis, sig, block: _, modifiers: _ } = item;
    let (outer, inner): (Vec<_>, Vec<_>) = attrs.iter().partition(|a| matches!(a.style, AttrStyle::Outer));
    let mut sig = sig.clone();
    if let Some(tx) = transaction {
        // Found by address in the checked signature, `tx.ty` being borrowed from it.
        sig.inputs = item
            .sig
            .inputs
            .pairs()
            .filter(|pair| !matches!(pair.value(), FnArg::Typed(arg) if std::ptr::eq(&*arg.ty, tx.ty)))
            .map(|pair| pair.cloned())
            .collect();
    }
    quote! {
        #(#outer)*
        #vis #sig {
            #(#inner)*
            #body
        }
    }
}

/// What the expansion takes from a signature that passed every check.
struct Checked<'a> {
    ret: ResultType<'a>,
    /// Where the run context is.
    ctx: Context<'a>,
    /// The payload: the names the parameters bind, in order.
    payload: Vec<&'a Ident>,
    /// The parameter `transaction = ..` names.
    transaction: Option<TransactionParam<'a>>,
}

/// The parameter the step's transaction is bound to: left out of the generated signature, and
/// the first parameter of the action instead.
struct TransactionParam<'a> {
    pat: &'a Pat,
    ty: &'a Type,
}

/// Checks the signature against the options: every misuse is an error at its token.
fn check<'a>(args: &'a Args, sig: &'a Signature) -> syn::Result<Checked<'a>> {
    if sig.asyncness.is_none() {
        if returns_boxed_future(sig) {
            return Err(syn::Error::new(
                sig.fn_token.span,
                "`#[idempotent]` only works on an `async fn`, and an attribute above it (rmcp's `#[tool]`) has \
                 already made this one return a boxed future; place `#[idempotent(..)]` above that attribute",
            ));
        }
        return Err(syn::Error::new(
            sig.fn_token.span,
            "`#[idempotent]` only works on an `async fn`: the step waits on the store; make this function `async fn`",
        ));
    }
    if let Some(variadic) = &sig.variadic {
        return Err(syn::Error::new_spanned(variadic, "`#[idempotent]` does not support variadic functions"));
    }
    let ret = result_type(sig)?;
    let params = params(sig)?;
    let has_receiver = sig.inputs.iter().any(|a| matches!(a, FnArg::Receiver(_)));
    let ctx = context(args, sig, has_receiver, &params)?;
    let transaction = transaction(args, &params, &ctx)?;
    check_listed(args, has_receiver, &params, &ctx)?;
    let payload = payload(args, sig, &params, &ctx)?;
    let transaction = transaction.map(|p| TransactionParam { pat: &p.arg.pat, ty: &p.arg.ty });
    Ok(Checked { ret, ctx, payload, transaction })
}

/// The parameter `transaction = name` names: it exists, is not the context, and is a `&mut`
/// borrow of a type whose name ends in `Transaction` (`sqlx::Transaction<'_, DB>`,
/// `sqlx::SqliteTransaction<'_>`, an alias).
fn transaction<'p, 'a>(args: &Args, params: &'p [Param<'a>], ctx: &Context<'_>) -> syn::Result<Option<&'p Param<'a>>> {
    const WRITE: &str = "the transaction parameter is a `&mut` borrow of a sqlx transaction, e.g. \
                         `tx: &mut sqlx::SqliteTransaction<'_>` or `tx: &mut sqlx::Transaction<'_, sqlx::Postgres>`";
    let Some(name) = &args.transaction else { return Ok(None) };
    let Some(param) = params.iter().find(|p| p.is_named(name)) else {
        if params.iter().any(|p| p.binding(name).is_some()) {
            return Err(syn::Error::new(
                name.span(),
                format!("`transaction = {name}`: `{name}` is bound inside a pattern; {WRITE}"),
            ));
        }
        return Err(syn::Error::new(
            name.span(),
            format!("`transaction = {name}`: this function has no parameter named `{name}`; add one ({WRITE})"),
        ));
    };
    if ctx.is_named(name) {
        return Err(syn::Error::new(
            name.span(),
            format!("`transaction = {name}`: `{name}` is the run context; {WRITE}"),
        ));
    }
    let ty = ungroup_type(&param.arg.ty);
    let is_transaction = match ty {
        Type::Reference(r) if r.mutability.is_some() => match ungroup_type(&r.elem) {
            Type::Path(TypePath { qself: None, path, attrs: _ }) => {
                path.segments.last().is_some_and(|s| s.ident.unraw().to_string().ends_with("Transaction"))
            }
            _ => false,
        },
        _ => false,
    };
    if !is_transaction {
        return Err(syn::Error::new_spanned(
            &param.arg.ty,
            format!("`transaction = {name}`: {WRITE}, and this type is not one"),
        ));
    }
    if let Some(lifetime) = named_lifetime(ty) {
        return Err(syn::Error::new_spanned(
            lifetime,
            format!(
                "`transaction = {name}`: write `'_` for the transaction's lifetimes (`&mut sqlx::SqliteTransaction<'_>`): \
                 the step begins the transaction and lends it to the body for the call only"
            ),
        ));
    }
    Ok(Some(param))
}

/// The first lifetime written by name (not `'_`) in `&'a mut T<'b, ..>`.
fn named_lifetime(ty: &Type) -> Option<&syn::Lifetime> {
    let Type::Reference(r) = ty else { return None };
    let named = |l: &&syn::Lifetime| l.ident != "_";
    if let Some(l) = r.lifetime.as_ref().filter(named) {
        return Some(l);
    }
    let Type::Path(TypePath { path, .. }) = ungroup_type(&r.elem) else { return None };
    let syn::PathArguments::AngleBracketed(args) = &path.segments.last()?.arguments else { return None };
    args.args.iter().find_map(|arg| match arg {
        syn::GenericArgument::Lifetime(l) => Some(l).filter(named),
        _ => None,
    })
}

/// The type inside any parentheses and invisible groups.
fn ungroup_type(ty: &Type) -> &Type {
    match ty {
        Type::Paren(t) => ungroup_type(&t.elem),
        Type::Group(t) => ungroup_type(&t.elem),
        other => other,
    }
}

/// `skip(..)` and `key(..)` name parameters that exist, and `key(..)` only payload ones.
fn check_listed(args: &Args, has_receiver: bool, params: &[Param<'_>], ctx: &Context<'_>) -> syn::Result<()> {
    let exists = |name: &Ident| (name == "self" && has_receiver) || params.iter().any(|p| p.binding(name).is_some());
    let skip = args.skip.as_deref().unwrap_or_default();
    for name in skip {
        if !exists(name) {
            return Err(syn::Error::new(
                name.span(),
                format!("`skip({name})`: this function has no parameter named `{name}`"),
            ));
        }
    }
    for name in args.key.as_deref().unwrap_or_default() {
        if !exists(name) {
            return Err(syn::Error::new(
                name.span(),
                format!("`key({name})`: this function has no parameter named `{name}`"),
            ));
        }
        let not_payload = if name == "self" {
            Some("`self` is never part of the payload")
        } else if args.transaction.as_ref().is_some_and(|tx| tx.unraw() == name.unraw()) {
            Some("it is the transaction, not part of the payload")
        } else if ctx.is_named(name) {
            Some("it is the run context, not part of the payload")
        } else if skip.iter().any(|s| s.unraw() == name.unraw()) {
            Some("it is skipped, so it is not part of the payload")
        } else {
            None
        };
        if let Some(why) = not_payload {
            return Err(syn::Error::new(
                name.span(),
                format!("`key({name})`: {why}; the key is made of payload parameters"),
            ));
        }
    }
    Ok(())
}

/// The names that make up the payload: those the parameters bind, but for the context, any
/// other `RunContext` parameter, the transaction and the skipped ones. Each parameter left in
/// needs a name and a concrete type.
fn payload<'a>(args: &Args, sig: &Signature, params: &[Param<'a>], ctx: &Context<'_>) -> syn::Result<Vec<&'a Ident>> {
    let skip = args.skip.as_deref().unwrap_or_default();
    let generics: Vec<Ident> = sig
        .generics
        .params
        .iter()
        .filter_map(|g| match g {
            GenericParam::Type(t) => Some(t.ident.clone()),
            GenericParam::Const(c) => Some(c.ident.clone()),
            GenericParam::Lifetime(_) => None,
        })
        .collect();
    let mut payload = Vec::new();
    for param in params {
        if is_context_type(&param.arg.ty) {
            continue;
        }
        if let Some(tx) = &args.transaction
            && param.is_named(tx)
        {
            continue;
        }
        if param.bindings.is_empty() {
            return Err(syn::Error::new_spanned(
                &param.arg.pat,
                "this parameter binds no name, so it cannot be part of the idempotency payload, which records \
                 arguments by name; bind it to a name (`point: Point`) or name what the pattern holds \
                 (`Parameters(args)`), and `skip(..)` that name if it should not change the key",
            ));
        }
        for &ident in &param.bindings {
            if ctx.is(ident) || skip.iter().any(|s| s.unraw() == ident.unraw()) {
                continue;
            }
            check_concrete(ident, &param.arg.ty, &generics)?;
            payload.push(ident);
        }
    }
    Ok(payload)
}

/// One of the expansion's own locals. They are mixed-site hygienic: the user's parameters and
/// body cannot see them, and they never shadow a user parameter of the same name.
fn local(name: &str) -> Ident {
    Ident::new(name, Span::mixed_site())
}

/// The new body: clone the context, build the payload, configure the step, run the old body in it.
fn gen_block(args: &Args, checked: &Checked<'_>, block: &Block) -> TokenStream {
    let p = private(args);
    let ctx_var = local("__idempotent_ctx");
    let payload_var = local("__idempotent_payload");
    let identity_var = local("__idempotent_identity");
    let id_var = local("__idempotent_id");
    let step_var = local("__idempotent_step");
    let ctx_value = checked.ctx.value(&p, &krate(args), args.step());
    let payload = gen_payload(&p, &checked.payload, args.key.as_deref().unwrap_or_default());
    let step = args.step();
    let options = gen_options(args, &p);
    let call = gen_call(args, checked, block);
    quote! {
        let #ctx_var: #p::RunContext = #ctx_value;
        let (#payload_var, #identity_var) = #payload;
        let #step_var = #ctx_var.step(#step) #options;
        let #step_var = match &#identity_var {
            ::core::option::Option::Some(#id_var) => #step_var.identity(#id_var),
            ::core::option::Option::None => #step_var,
        };
        #call
    }
}

/// The path of `idempotent_core`, or of its renamed dependency.
fn krate(args: &Args) -> TokenStream {
    let krate: Path = args.krate.clone().unwrap_or_else(|| syn::parse_quote!(::idempotent_core));
    krate.into_token_stream()
}

/// The path of `idempotent_core::__private`, or of its renamed dependency's.
fn private(args: &Args) -> TokenStream {
    let krate = krate(args);
    quote!(#krate::__private)
}

/// A block that serializes each payload argument and evaluates to the payload's digests.
fn gen_payload(p: &TokenStream, payload: &[&Ident], key: &[Ident]) -> TokenStream {
    let payload_var = local("__idempotent_payload");
    let pushes = payload.iter().map(|ident| gen_push(p, ident));
    let key_names = key.iter().map(|k| k.unraw().to_string());
    quote! {
        {
            let mut #payload_var = #p::Payload::new();
            #(#pushes)*
            #payload_var.finish(&[#(#key_names),*])
        }
    }
}

/// Serializes one argument, through a trait of its own whose `on_unimplemented` names the
/// parameter and says how to skip it.
fn gen_push(p: &TokenStream, ident: &Ident) -> TokenStream {
    let payload_var = local("__idempotent_payload");
    let name = ident.unraw().to_string();
    let check = format_ident!("__idempotent_arg_{}", name);
    let message = format!(
        "parameter `{name}` is part of the idempotency payload, but `{{Self}}` does not implement `serde::Serialize`"
    );
    let label = format!("not serializable: leave it out of the payload with `skip({name})`");
    let note = "`#[idempotent]` serializes every parameter except the run context, `self` and \
                the `skip(..)`ed ones into the step's key; skip handles such as clients and connections";
    // Spanned at the parameter so that rustc's error points at it.
    let value = quote_spanned!(ident.span()=> &#ident);
    quote! {
        {
            #[diagnostic::on_unimplemented(message = #message, label = #label, note = #note)]
            #[allow(non_camel_case_types)]
            trait #check {
                fn __idempotent_canonical(&self) -> #p::CanonicalArg;
            }
            impl<T: ?::core::marker::Sized + #p::serde::Serialize> #check for T {
                fn __idempotent_canonical(&self) -> #p::CanonicalArg {
                    #p::canonical(self)
                }
            }
            #payload_var.push(#name, #check::__idempotent_canonical(#value));
        }
    }
}

/// The `Step` builder calls for the options that were given; the rest keep the context's defaults.
fn gen_options(args: &Args, p: &TokenStream) -> TokenStream {
    let version = args.version.map(|v| quote!(.version(#v)));
    let retention = args.retention.as_ref().map(|s| {
        let secs = s.secs;
        // The one place the expansion names core's retention setter.
        quote!(.retention(#p::Duration::from_secs(#secs)))
    });
    let lease = args.lease.as_ref().map(|s| {
        let secs = s.secs;
        quote!(.lease(#p::Duration::from_secs(#secs)))
    });
    let on_in_flight = args.on_in_flight.map(|policy| match policy {
        InFlight::Wait => quote!(.on_in_flight(#p::OnInFlight::Wait { timeout: #p::DEFAULT_WAIT })),
        InFlight::Reject => quote!(.on_in_flight(#p::OnInFlight::Reject)),
    });
    let on_recovered = args.on_recovered.map(|policy| match policy {
        Recovered::Run => quote!(.on_recovered(#p::OnRecovered::Run)),
        Recovered::NeedsAttention => quote!(.on_recovered(#p::OnRecovered::NeedsAttention)),
    });
    quote!(#version #retention #lease #on_in_flight #on_recovered)
}

/// `Step::run` (or `run_storing_errors`, or `run_in_transaction`) with the old body as its
/// action, awaited.
fn gen_call(args: &Args, checked: &Checked<'_>, block: &Block) -> TokenStream {
    let ret = &checked.ret;
    let fake_return = gen_fake_return(ret);
    // Located at the return type (resolved at the call site, like the rest of the expansion):
    // unmet bounds on `T` and `E`, checked at the call and again at its `.await`, point there.
    let at_ret = Span::call_site().located_at(ret.span);
    let run = match (&checked.transaction, args.store_errors) {
        (Some(_), _) => "run_in_transaction",
        (None, true) => "run_storing_errors",
        (None, false) => "run",
    };
    let run = Ident::new(run, at_ret);
    // Those an error may be reported at keep the position of the user's token with `located_at`.
    let step_at_ret = Ident::new("__idempotent_step", Span::mixed_site().located_at(ret.span));
    let payload_at_ret = Ident::new("__idempotent_payload", Span::mixed_site().located_at(ret.span));
    // The transaction is the async closure's parameter, with the user's pattern and type, so
    // that the body's uses of it resolve to it and the closure's type names the database.
    // With a `Json<T>` outcome the action unwraps the `T` that the step stores.
    let body = match &ret.json {
        None => quote_spanned!(at_ret=> #fake_return #block),
        Some(_) => quote_spanned! {at_ret=>
            ::core::result::Result::map(async move { #fake_return #block }.await, |__idempotent_json| __idempotent_json.0)
        },
    };
    let action = match &checked.transaction {
        Some(TransactionParam { pat, ty }) => quote_spanned! {at_ret=>
            async move |#pat: #ty, _| {
                #body
            }
        },
        None => quote_spanned! {at_ret=>
            move |_| async move {
                #body
            }
        },
    };
    // The parentheses keep the whole call expression in `at_ret`'s context: with the mixed-site
    // receiver first, rustc would see the call's span as another one and report the unmet bound
    // on `T` a second time.
    // `verify` turns the `Step` into a `Verified` step, so it comes after every other option.
    let verify = args.verify.as_ref().map(|path| quote!(.verify(#path)));
    let call = quote_spanned! {at_ret=>
        (#step_at_ret #verify).#run(&#payload_at_ret, #action)
        .await
    };
    match &ret.json {
        None => call,
        Some(json) => quote_spanned!(at_ret=> ::core::result::Result::map(#call, #json)),
    }
}

/// An unreachable early return of the declared type, first thing in the body: rustc infers the
/// body's type from it and reports mismatches against the user's signature.
fn gen_fake_return(ret: &ResultType<'_>) -> TokenStream {
    let ret_ty = ret.ty;
    let fake_var = Ident::new("__idempotent_fake_return", Span::mixed_site().located_at(ret.span));
    quote_spanned! {ret.span=>
        #[allow(
            unknown_lints,
            unreachable_code,
            clippy::diverging_sub_expression,
            clippy::empty_loop,
            clippy::let_unit_value,
            clippy::let_with_type_underscore,
            clippy::needless_return,
            clippy::unreachable
        )]
        if false {
            let #fake_var: #ret_ty = loop {};
            return #fake_var;
        }
    }
}

struct ResultType<'a> {
    ty: &'a Type,
    span: Span,
    /// The constructor of the `Ok` type when it is `Json<T>` (rmcp's, which is neither
    /// `Serialize` nor `Deserialize`): the step stores the `T` inside, and the function returns it
    /// wrapped again.
    json: Option<Path>,
}

/// `Json` (the path as written, without its generic arguments) when `result` is
/// `Result<Json<T>, E>`.
fn json_constructor(result: &Path) -> Option<Path> {
    let syn::PathArguments::AngleBracketed(args) = &result.segments.last()?.arguments else { return None };
    let Some(syn::GenericArgument::Type(Type::Path(TypePath { qself: None, path, .. }))) = args.args.first() else {
        return None;
    };
    let last = path.segments.last()?;
    let syn::PathArguments::AngleBracketed(inner) = &last.arguments else { return None };
    if last.ident != "Json" || inner.args.len() != 1 {
        return None;
    }
    let mut ctor = path.clone();
    if let Some(last) = ctor.segments.last_mut() {
        last.arguments = syn::PathArguments::None;
    }
    Some(ctor)
}

/// A non-async function returning `Pin<Box<dyn Future ..>>`, as rmcp's `#[tool]` rewrites an
/// `async fn`.
fn returns_boxed_future(sig: &Signature) -> bool {
    let ReturnType::Type(_, ty) = &sig.output else { return false };
    let Type::Path(TypePath { path, .. }) = ungroup_type(ty) else { return false };
    path.segments.last().is_some_and(|s| s.ident == "Pin")
        && ty.to_token_stream().into_iter().any(|t| matches!(&t, proc_macro2::TokenTree::Ident(i) if i == "Future"))
}

/// The declared return type, which must look like a `Result`.
fn result_type(sig: &Signature) -> syn::Result<ResultType<'_>> {
    const NEED: &str = "`#[idempotent]` functions return `Result<T, E>` (with `T: Serialize + DeserializeOwned`, \
                        the stored outcome, and `E: From<idempotent_core::Error>`)";
    let ty = match &sig.output {
        ReturnType::Type(_, ty) => &**ty,
        ReturnType::Default => {
            return Err(syn::Error::new(
                sig.paren_token.span.close(),
                format!("{NEED}; this one returns `()`. Add `-> Result<T, E>`"),
            ));
        }
    };
    let mut inner = ty;
    loop {
        match inner {
            Type::Paren(t) => inner = &t.elem,
            Type::Group(t) => inner = &t.elem,
            _ => break,
        }
    }
    let is_result = match inner {
        Type::Path(TypePath { qself: None, path, attrs: _ }) => {
            path.segments.last().is_some_and(|s| s.ident.unraw().to_string().ends_with("Result"))
        }
        _ => false,
    };
    if !is_result {
        return Err(syn::Error::new_spanned(
            ty,
            format!("{NEED}; this type is not a `Result` (a type alias works when its name ends in `Result`)"),
        ));
    }
    let json = match inner {
        Type::Path(TypePath { path, .. }) => json_constructor(path),
        _ => None,
    };
    Ok(ResultType { ty, span: ty.span(), json })
}

/// Refuses payload parameters whose type is generic: their serialized form, and so the key,
/// would depend on the caller's choice of type.
fn check_concrete(ident: &Ident, ty: &Type, generics: &[Ident]) -> syn::Result<()> {
    struct Find<'g> {
        generics: &'g [Ident],
        found: Option<(TokenStream, String)>,
    }
    impl VisitMut for Find<'_> {
        fn visit_type_impl_trait_mut(&mut self, t: &mut TypeImplTrait) {
            self.found.get_or_insert_with(|| (t.to_token_stream(), "an `impl Trait` type".to_owned()));
        }
        fn visit_type_path_mut(&mut self, t: &mut TypePath) {
            if t.qself.is_none()
                && let Some(first) = t.path.segments.first()
                && self.generics.contains(&first.ident)
            {
                let what = format!("the generic type `{}`", first.ident);
                self.found.get_or_insert_with(|| (t.to_token_stream(), what));
                return;
            }
            syn::visit_mut::visit_type_path_mut(self, t);
        }
    }
    let mut find = Find { generics, found: None };
    find.visit_type_mut(&mut ty.clone());
    match find.found {
        None => Ok(()),
        Some((tokens, what)) => Err(syn::Error::new_spanned(
            tokens,
            format!(
                "parameter `{ident}` is part of the idempotency payload but has {what}, so its \
                 serialized form (and the key) would depend on each caller's type; leave it out \
                 with `skip({ident})`, or give it a concrete type",
                ident = ident.unraw()
            ),
        )),
    }
}
