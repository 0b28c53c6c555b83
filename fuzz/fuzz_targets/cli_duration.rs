#![no_main]
//! See docs/testing.md (*Fuzzing*): the body lives with the code it tests and is replayed over
//! `corpus/cli_duration` by that crate's tests.

#[path = "../../simba-cli/src/duration.rs"]
#[allow(dead_code, unreachable_pub)]
mod duration;

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    duration::fuzz_body(data);
});
