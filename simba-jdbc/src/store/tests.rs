//! The store's own unit tests (its contract is the kit's, in `tests/`).

use super::returning_acquire;

#[test]
fn only_mariadb_from_10_5_acquires_in_one_statement() {
    for (version, one) in [
        ("10.11.19-MariaDB-0+deb12u1", true),
        ("10.5.0-MariaDB", true),
        ("11.4.2-MariaDB-log", true),
        ("10.4.32-MariaDB", false),
        ("5.5.5-10.11.6-MariaDB", false),
        ("8.0.36", false),
        ("8.4.0-commercial", false),
        ("MariaDB", false),
        ("", false),
    ] {
        assert_eq!(returning_acquire(version), one, "{version}");
    }
}
