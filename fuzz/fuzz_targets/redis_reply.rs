#![no_main]
//! See docs/testing.md (*Fuzzing*): the body lives with the code it tests and is replayed over
//! `corpus/redis_reply` by that crate's tests.

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    simba_redis::fuzzing::reply(data);
});
