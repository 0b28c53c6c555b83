//! The guides of the simba repository as doctests: the root `README.md` and every page of
//! `docs/` and `docs/design/`. `cargo test -p simba-docs --doc` compiles every Rust block in
//! them (blocks that need a server are `no_run`), so no guide shows code that does not build.
//!
//! The crate holds nothing else and is not published. The crate READMEs are doctested by
//! their own crates (`#![doc = include_str!("../README.md")]`).

#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct Readme;

#[cfg(doctest)]
#[doc = include_str!("choosing.md")]
struct Choosing;

#[cfg(doctest)]
#[doc = include_str!("troubleshooting.md")]
struct Troubleshooting;

#[cfg(doctest)]
#[doc = include_str!("performance.md")]
struct Performance;

#[cfg(doctest)]
#[doc = include_str!("safety.md")]
struct Safety;

#[cfg(doctest)]
#[doc = include_str!("testing.md")]
struct Testing;

#[cfg(doctest)]
#[doc = include_str!("design/core.md")]
struct DesignCore;

#[cfg(doctest)]
#[doc = include_str!("design/sql.md")]
struct DesignSql;

#[cfg(doctest)]
#[doc = include_str!("design/redis.md")]
struct DesignRedis;

#[cfg(doctest)]
#[doc = include_str!("design/zookeeper.md")]
struct DesignZookeeper;

#[cfg(doctest)]
#[doc = include_str!("design/etcd.md")]
struct DesignEtcd;
