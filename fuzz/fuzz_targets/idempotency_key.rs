//! Arbitrary header bytes through the `Idempotency-Key` parser: never a panic, and an accepted key
//! is 1 to 255 printable ASCII characters.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(key) = idempotent_tower::__fuzz::parse_key(data) {
        assert!(!key.is_empty() && key.len() <= 255, "accepted a key of {} bytes", key.len());
        assert!(key.bytes().all(|b| (0x20..=0x7e).contains(&b)), "accepted a non-printable key {key:?}");
    }
});
