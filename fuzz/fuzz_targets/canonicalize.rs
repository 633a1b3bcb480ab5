//! Arbitrary bytes through the JSON canonicalizer: never a panic; accepted input has a canonical
//! form that is valid JSON and canonical itself.
#![no_main]

use idempotent_core::canonical::canonicalize_json;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(out) = canonicalize_json(data) {
        if let Err(e) = serde_json::from_slice::<serde_json::Value>(&out) {
            // serde_json's own nesting limit is the only reason it may refuse our output.
            assert!(e.to_string().contains("recursion limit"), "canonical output is not JSON: {e}");
        }
        assert_eq!(canonicalize_json(&out).expect("canonical output is accepted"), out, "not idempotent");
    }
});
