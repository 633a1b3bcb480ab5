//! Compile-time behaviour of `#[idempotent]`: what expands and runs, and the error each misuse
//! gets (pinned in `ui/fail/*.stderr`; regenerate with `TRYBUILD=overwrite` and read the diff).

#[test]
fn ui() {
    let t = trybuild::TestCases::new();
    t.pass("tests/ui/pass/*.rs");
    t.compile_fail("tests/ui/fail/*.rs");
}
