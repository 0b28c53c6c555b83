use super::*;

fn reason(e: Error) -> (String, String) {
    match e {
        Error::InvalidConfig { field, reason } => (field.to_owned(), reason),
        other => panic!("expected InvalidConfig, got {other:?}"),
    }
}

#[test]
fn schemes() {
    #[cfg(feature = "mysql")]
    {
        assert!(
            matches!(parse_url("mariadb://u:p@h:3306/db"), Ok(Target::Mysql(u)) if u == "mysql://u:p@h:3306/db")
        );
        assert!(matches!(
            parse_url("mysql://root@127.0.0.1/x"),
            Ok(Target::Mysql(_))
        ));
    }
    #[cfg(feature = "postgres")]
    {
        assert!(matches!(
            parse_url("postgresql://u@h/db"),
            Ok(Target::Postgres(_))
        ));
        assert!(matches!(
            parse_url("postgres://u:p@h:5432/db?sslmode=disable"),
            Ok(Target::Postgres(_))
        ));
    }
    #[cfg(feature = "sqlite")]
    {
        assert!(
            matches!(parse_url("sqlite:///tmp/a.db"), Ok(Target::Sqlite { path, memory: false }) if path == "/tmp/a.db")
        );
        assert!(
            matches!(parse_url("sqlite://rel.db"), Ok(Target::Sqlite { path, .. }) if path == "rel.db")
        );
        assert!(matches!(
            parse_url("sqlite::memory:"),
            Ok(Target::Sqlite { memory: true, .. })
        ));
        assert!(matches!(
            parse_url("sqlite://:memory:"),
            Ok(Target::Sqlite { memory: true, .. })
        ));
        assert!(parse_url("sqlite://").is_err());
    }
}

/// URLs that tokio-postgres parses but refuses only when connecting are refused here,
/// saying why (before: a connection failure reading "invalid configuration").
#[cfg(feature = "postgres")]
#[test]
fn malformed_postgres_urls_say_what_is_wrong() {
    for (url, says) in [
        ("postgres://u@/db", "names no host"),
        ("postgres://", "names no host"),
        ("postgres://u@h:99999/db", "`port`"),
        ("postgres://u@a,b/db?port=1,2,3", "2 hosts but"),
    ] {
        let (field, msg) = reason(parse_url(url).expect_err(url));
        assert_eq!(field, "url");
        assert!(
            msg.contains(says) && msg.contains("HOST:PORT/DATABASE"),
            "{url}: {msg}"
        );
    }
    assert!(parse_url("postgres://u@h1,h2:5433/db").is_ok());
}

#[test]
fn unknown_scheme_says_what_is_supported() {
    let (field, msg) = reason(parse_url("redis://127.0.0.1").expect_err("redis"));
    assert_eq!(field, "url");
    assert!(msg.contains("unsupported scheme `redis`"), "{msg}");
    assert!(
        msg.contains("postgres://") && msg.contains("sqlite://"),
        "{msg}"
    );
    assert!(msg.contains("features enabled"), "{msg}");
    assert!(parse_url("").is_err());
    assert!(parse_url("no-scheme").is_err());
}

#[test]
fn passwords_are_redacted() {
    assert_eq!(
        redact_url("mysql://root:hunter2@db:3306/x"),
        "mysql://root:***@db:3306/x"
    );
    assert_eq!(
        redact_url("postgres://u@h/db?password=hunter2&sslmode=disable"),
        "postgres://u@h/db?password=***&sslmode=disable"
    );
    assert_eq!(redact_url("sqlite:///tmp/x.db"), "sqlite:///tmp/x.db");
    let c = SqlConfig::new("postgres://me:hunter2@h/db");
    assert!(!format!("{c:?}").contains("hunter2"));
    assert!(!c.redacted_url().contains("hunter2"));
}

#[test]
fn table_names() {
    for ok in ["simba_mutex", "app.simba_mutex", "_t1", "T"] {
        validate_table(ok).expect(ok);
    }
    for bad in [
        "",
        "1abc",
        "a-b",
        "a.b.c",
        "a;drop",
        "x y",
        "\"q\"",
        &"t".repeat(49),
    ] {
        assert!(validate_table(bad).is_err(), "{bad:?}");
    }
}

#[test]
fn settings_are_checked() {
    let base = SqlConfig::new("sqlite::memory:");
    #[cfg(feature = "sqlite")]
    base.validate().expect("defaults are valid");
    let (f, _) = reason(base.clone().with_pool_size(0).validate().expect_err("pool"));
    assert!(f == "pool_size" || f == "url");
    #[cfg(feature = "sqlite")]
    {
        let (f, _) = reason(
            base.clone()
                .with_statement_timeout(Duration::ZERO)
                .validate()
                .expect_err("zero"),
        );
        assert_eq!(f, "statement_timeout");
        let (f, _) = reason(
            base.clone()
                .with_statement_timeout(Duration::from_micros(1500))
                .validate()
                .expect_err("sub-ms"),
        );
        assert_eq!(f, "statement_timeout");
        let (f, _) = reason(
            base.clone()
                .with_max_name_len(201)
                .validate()
                .expect_err("len"),
        );
        assert_eq!(f, "max_name_len");
        let (f, _) = reason(base.with_table("bad name").validate().expect_err("table"));
        assert_eq!(f, "table");
    }
}
