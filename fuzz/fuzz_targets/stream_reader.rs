//! Classic RFC 6120 streams: arbitrary bytes, split at fuzzer-chosen points, under fuzzer-chosen
//! limits. See `presenced_fuzz::check` for the invariants.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| presenced_fuzz::check(data, false));
