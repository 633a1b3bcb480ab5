//! The `#[idempotent]` attribute macro for `idempotent-core`.
//!
//! Use it through `idempotent_core::idempotent` (the `macros` feature).

use proc_macro::TokenStream;

/// Makes every call of an `async fn` an idempotent step (see `idempotent_core`).
#[proc_macro_attribute]
pub fn idempotent(_args: TokenStream, _item: TokenStream) -> TokenStream {
    "compile_error!(\"#[idempotent] is not implemented yet\");".parse().unwrap()
}
