//! The annotated function's parameters: the names each one binds, and where the run context is.
//!
//! A parameter is a plain name (`order_id: &str`) or a destructuring pattern
//! (`Parameters(args): Parameters<RefundArgs>`, `(x, y): (i32, i32)`); the payload is made of the
//! names the patterns bind, so a pattern must bind at least one (`_` or `Parameters(_)` is an
//! error unless the parameter is the context). The context is a plain parameter found by its
//! type, any bound name or plain parameter named by `ctx = name`, or a field of `self`.

use proc_macro2::TokenStream;
use quote::{ToTokens, quote, quote_spanned};
use syn::ext::IdentExt;
use syn::{FnArg, Ident, Pat, PatIdent, PatType, Signature, Type, TypePath};

use crate::attr::{Args, ContextArg, SelfField};

/// A typed parameter (not `self`).
pub(crate) struct Param<'a> {
    /// The name, when the pattern is a plain binding (`name`, `mut name`, `ref name`).
    pub(crate) ident: Option<&'a Ident>,
    /// Every name the pattern binds, in order: the plain name, or those of a destructuring
    /// pattern (`args` in `Parameters(args)`).
    pub(crate) bindings: Vec<&'a Ident>,
    pub(crate) arg: &'a PatType,
}

impl<'a> Param<'a> {
    /// A plain parameter of that name.
    pub(crate) fn is_named(&self, name: &Ident) -> bool {
        self.ident.is_some_and(|i| i.unraw() == name.unraw())
    }

    /// The name the pattern binds that is spelled `name`.
    pub(crate) fn binding(&self, name: &Ident) -> Option<&'a Ident> {
        self.bindings.iter().copied().find(|b| b.unraw() == name.unraw())
    }
}

/// The typed parameters with the names they bind; a pattern whose names cannot be seen (one a
/// macro writes) is an error.
pub(crate) fn params(sig: &Signature) -> syn::Result<Vec<Param<'_>>> {
    let mut params = Vec::new();
    for input in &sig.inputs {
        let FnArg::Typed(arg) = input else { continue };
        let ident = match &*arg.pat {
            Pat::Ident(PatIdent { ident, subpat: None, .. }) => Some(ident),
            _ => None,
        };
        let mut bindings = Vec::new();
        collect_bindings(&arg.pat, &mut bindings)?;
        params.push(Param { ident, bindings, arg });
    }
    Ok(params)
}

/// The names `pat` binds. A path (`None`, a unit struct) and a literal bind nothing; in an
/// or-pattern every case binds the same names, so the first one's are taken.
fn collect_bindings<'a>(pat: &'a Pat, out: &mut Vec<&'a Ident>) -> syn::Result<()> {
    match pat {
        Pat::Ident(p) => {
            out.push(&p.ident);
            if let Some((_, sub)) = &p.subpat {
                collect_bindings(sub, out)?;
            }
        }
        Pat::Tuple(p) => p.elems.iter().try_for_each(|e| collect_bindings(e, out))?,
        Pat::TupleStruct(p) => p.elems.iter().try_for_each(|e| collect_bindings(e, out))?,
        Pat::Slice(p) => p.elems.iter().try_for_each(|e| collect_bindings(e, out))?,
        Pat::Struct(p) => p.fields.iter().try_for_each(|f| collect_bindings(&f.pat, out))?,
        Pat::Reference(p) => collect_bindings(&p.pat, out)?,
        Pat::Paren(p) => collect_bindings(&p.pat, out)?,
        Pat::Type(p) => collect_bindings(&p.pat, out)?,
        Pat::Or(p) => {
            if let Some(first) = p.cases.first() {
                collect_bindings(first, out)?;
            }
        }
        Pat::Wild(_) | Pat::Rest(_) | Pat::Path(_) | Pat::Lit(_) | Pat::Range(_) | Pat::Const(_) => {}
        other => {
            return Err(syn::Error::new_spanned(
                other,
                "`#[idempotent]` cannot see the names this pattern binds (the payload is made of them); \
                 write the pattern out, or bind the parameter to a name and destructure it inside the body",
            ));
        }
    }
    Ok(())
}

/// Where the run context is.
pub(crate) enum Context<'a> {
    /// A plain parameter found by its type, or a parameter or a name bound inside a parameter's
    /// pattern (`Extension(ctx)`) named by `ctx = name`: anything that derefs to `RunContext`.
    Binding(&'a Ident),
    /// rig's `&mut ToolContext` parameter named by `ctx = name`: the context is the
    /// `Arc<RunContext>` the host attached to it as a scope.
    ToolScope(&'a Ident),
    /// A field of the receiver, named by `ctx = self.ctx`.
    Field(&'a SelfField),
}

impl Context<'_> {
    /// The binding `ident` is the context (found by address: `ident` comes from the same
    /// signature).
    pub(crate) fn is(&self, ident: &Ident) -> bool {
        match self {
            Context::Binding(ctx) | Context::ToolScope(ctx) => std::ptr::eq(*ctx, ident),
            Context::Field(_) => false,
        }
    }

    pub(crate) fn is_named(&self, name: &Ident) -> bool {
        match self {
            Context::Binding(ctx) | Context::ToolScope(ctx) => ctx.unraw() == name.unraw(),
            Context::Field(_) => false,
        }
    }

    /// An expression of type `RunContext`: a clone of the context, spanned at the user's tokens
    /// so that a context of the wrong type is reported there. For a `ToolContext` without a
    /// `RunContext` scope it returns `Err(Error::Config)` from the function.
    pub(crate) fn value(&self, p: &TokenStream, krate: &TokenStream, step: &syn::LitStr) -> TokenStream {
        match self {
            Context::Binding(ident) => quote_spanned!(ident.span()=> #p::RunContext::clone(&#ident)),
            Context::Field(field) => quote_spanned!(field.receiver.span=> #p::RunContext::clone(&#field)),
            Context::ToolScope(ident) => {
                let scope = Ident::new("__idempotent_scope", proc_macro2::Span::mixed_site());
                let message = format!(
                    "step `{}`: the ToolContext `{}` carries no RunContext; attach one where the tool is \
                     called: `ToolContext::new().with_scope(Arc::new(run_context))`",
                    step.value(),
                    ident.unraw()
                );
                let lookup = quote_spanned!(ident.span()=> #ident.scope::<#p::RunContext>());
                quote! {
                    match #lookup {
                        ::core::option::Option::Some(#scope) => #p::RunContext::clone(&*#scope),
                        ::core::option::Option::None => {
                            return ::core::result::Result::Err(::core::convert::From::from(
                                #krate::Error::Config(::std::string::String::from(#message)),
                            ));
                        }
                    }
                }
            }
        }
    }
}

/// The run context: the parameter, binding or field `ctx = ..` names, else the one plain
/// parameter typed `RunContext`.
pub(crate) fn context<'a>(
    args: &'a Args,
    sig: &Signature,
    has_receiver: bool,
    params: &[Param<'a>],
) -> syn::Result<Context<'a>> {
    match &args.ctx {
        Some(ContextArg::Param(name)) => {
            let Some((param, ident)) = params.iter().find_map(|p| Some((p, p.binding(name)?))) else {
                return Err(syn::Error::new(
                    name.span(),
                    format!("`ctx = {name}`: this function has no parameter named `{name}`, and no pattern binds it"),
                ));
            };
            if param.ident.is_some() && is_tool_context_type(&param.arg.ty) {
                return Ok(Context::ToolScope(ident));
            }
            return Ok(Context::Binding(ident));
        }
        Some(ContextArg::Field(field)) if !has_receiver => {
            return Err(syn::Error::new(
                field.receiver.span,
                format!(
                    "`ctx = {field}`: this function has no `self`; make it a method, or name a parameter with `ctx = name`"
                ),
            ));
        }
        Some(ContextArg::Field(field)) => return Ok(Context::Field(field)),
        None => {}
    }
    let mut found = params.iter().filter(|p| is_context_type(&p.arg.ty));
    let Some(ctx) = found.next() else {
        return Err(no_context(sig, params));
    };
    if let Some(other) = found.next() {
        return Err(syn::Error::new_spanned(
            &other.arg.pat,
            "more than one `RunContext` parameter; choose the one the step runs in with `ctx = name`",
        ));
    }
    let Some(ident) = ctx.ident else {
        return Err(syn::Error::new_spanned(
            &ctx.arg.pat,
            "the context parameter needs a plain name (`ctx: &RunContext`), so the step can use it",
        ));
    };
    Ok(Context::Binding(ident))
}

/// No parameter is typed `RunContext` and `ctx` was not given: say where it might be.
fn no_context(sig: &Signature, params: &[Param<'_>]) -> syn::Error {
    const NONE: &str = "no context parameter: `#[idempotent]` takes the store and the run id from a parameter of \
                        type `&RunContext` (or `RunContext`); add one, or say where the context is with `ctx = name` \
                        (a parameter, or a name a parameter's pattern binds) or `ctx = self.ctx` (a field)";
    for param in params {
        if let Some(name) = param.ident
            && is_tool_context_type(&param.arg.ty)
        {
            let name = name.unraw();
            return syn::Error::new_spanned(
                &param.arg.pat,
                format!(
                    "no context parameter: to take the `RunContext` from this `ToolContext`'s scope, name it \
                     with `ctx = {name}`"
                ),
            );
        }
        if param.ident.is_none() && mentions_context(&param.arg.ty) {
            let names: Vec<String> = param.bindings.iter().map(|b| format!("`ctx = {}`", b.unraw())).collect();
            return syn::Error::new_spanned(
                &param.arg.pat,
                format!(
                    "no context parameter: `#[idempotent]` finds the context by type only in a plain parameter \
                     (`ctx: &RunContext`); for one bound inside this pattern, name the binding: {}",
                    if names.is_empty() { "bind it to a name first".to_owned() } else { names.join(" or ") }
                ),
            );
        }
    }
    syn::Error::new(sig.paren_token.span.join(), NONE)
}

/// `RunContext`, `&RunContext`, `idempotent_core::RunContext`, ... .
pub(crate) fn is_context_type(ty: &Type) -> bool {
    last_segment_is(ty, "RunContext")
}

/// `&mut ToolContext`, `&mut rig::tool::ToolContext`, ... (rig's).
fn is_tool_context_type(ty: &Type) -> bool {
    last_segment_is(ty, "ToolContext")
}

fn last_segment_is(ty: &Type, name: &str) -> bool {
    match ty {
        Type::Reference(r) => last_segment_is(&r.elem, name),
        Type::Paren(p) => last_segment_is(&p.elem, name),
        Type::Group(g) => last_segment_is(&g.elem, name),
        Type::Path(TypePath { qself: None, path, attrs: _ }) => path.segments.last().is_some_and(|s| s.ident == name),
        _ => false,
    }
}

/// The type names `RunContext` anywhere (`Extension<RunContext>`).
fn mentions_context(ty: &Type) -> bool {
    fn walk(tokens: TokenStream) -> bool {
        tokens.into_iter().any(|t| match t {
            proc_macro2::TokenTree::Ident(i) => i == "RunContext",
            proc_macro2::TokenTree::Group(g) => walk(g.stream()),
            _ => false,
        })
    }
    walk(ty.to_token_stream())
}
