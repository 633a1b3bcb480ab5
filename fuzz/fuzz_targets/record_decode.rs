//! Arbitrary bytes through the stored-response decoder: never a panic; whatever decodes re-encodes
//! to a record that decodes to the same response.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    idempotent_tower::__fuzz::decode_record(data);
});
