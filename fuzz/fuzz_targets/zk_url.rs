#![no_main]
//! See docs/testing.md (*Fuzzing*): the body lives with the code it tests and is replayed over
//! `corpus/zk_url` by that crate's tests.

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    simba_zookeeper::fuzzing::url(data);
});
