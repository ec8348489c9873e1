//! RFC 7395 framed streams (no `<stream:stream>` wrapper, `<open/>` / `<close/>` elements):
//! the same invariants as `stream_reader`, see `presenced_fuzz::check`.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| presenced_fuzz::check(data, true));
