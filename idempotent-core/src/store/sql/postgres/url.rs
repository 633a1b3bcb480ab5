//! Reading a PostgreSQL URL: the store's own query parameters (`schema`,
//! `transaction_pooling`), which are taken out before sqlx reads the rest; whether the TLS it
//! asks for was built in; and how the store names its database in logs and errors (never with
//! the password).

use sqlx::postgres::{PgConnectOptions, PgSslMode};

use crate::error::Error;

/// What the URL's own query parameters set (`None`: not given).
#[derive(Debug, Default, PartialEq, Eq)]
pub(super) struct UrlSettings {
    /// `schema=<name>`: [`PostgresStoreBuilder::schema`](super::PostgresStoreBuilder::schema).
    pub(super) schema: Option<String>,
    /// `transaction_pooling=true|false`:
    /// [`PostgresStoreBuilder::transaction_pooling`](super::PostgresStoreBuilder::transaction_pooling).
    pub(super) transaction_pooling: Option<bool>,
}

/// Splits `url` into the URL sqlx reads (the store's own parameters taken out) and what those
/// parameters set. A `transaction_pooling` other than `true` or `false` is an [`Error::Config`].
pub(super) fn own_parameters(url: &str) -> Result<(String, UrlSettings), Error> {
    let Some((base, query)) = url.split_once('?') else { return Ok((url.to_owned(), UrlSettings::default())) };
    let (query, fragment) = match query.split_once('#') {
        Some((query, fragment)) => (query, Some(fragment)),
        None => (query, None),
    };
    let mut settings = UrlSettings::default();
    let mut rest = Vec::new();
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
        match key {
            "schema" => settings.schema = Some(value.to_owned()),
            "transaction_pooling" => {
                settings.transaction_pooling = Some(match value {
                    "true" => true,
                    "false" => false,
                    _ => {
                        return Err(Error::Config(format!(
                            "`transaction_pooling={value}` in {}: it is `true` (the URL reaches PostgreSQL through \
                             a pooler in transaction mode, such as PgBouncer's pool_mode = transaction) or `false`",
                            redact(url)
                        )));
                    }
                });
            }
            _ => rest.push(pair),
        }
    }
    let mut sqlx_url = base.to_owned();
    if !rest.is_empty() {
        sqlx_url.push('?');
        sqlx_url.push_str(&rest.join("&"));
    }
    if let Some(fragment) = fragment {
        sqlx_url.push('#');
        sqlx_url.push_str(fragment);
    }
    Ok((sqlx_url, settings))
}

/// Refuses a URL whose `sslmode` needs TLS (`require`, `verify-ca`, `verify-full`) when the
/// store was built without it (`tls_built_in`: the `tls-rustls` feature), rather than let sqlx
/// fail each connection later.
pub(super) fn check_tls(options: &PgConnectOptions, tls_built_in: bool, url: &str) -> Result<(), Error> {
    let mode = match options.get_ssl_mode() {
        PgSslMode::Require => "require",
        PgSslMode::VerifyCa => "verify-ca",
        PgSslMode::VerifyFull => "verify-full",
        PgSslMode::Disable | PgSslMode::Allow | PgSslMode::Prefer => return Ok(()),
    };
    if tls_built_in {
        return Ok(());
    }
    Err(Error::Config(format!(
        "{} asks for TLS (sslmode={mode}), and this build of idempotent-core has no TLS for PostgreSQL: turn on the \
         `tls-rustls` feature of idempotent-core (or of idempotent-tower), or connect without TLS (sslmode=disable \
         or prefer)",
        redact(url)
    )))
}

/// `postgres://user@host:port/database`: the connection's target without its password.
pub(super) fn describe(options: &PgConnectOptions) -> String {
    let user = options.get_username();
    let db = options.get_database().unwrap_or(user);
    match options.get_socket() {
        Some(dir) => format!("postgres://{user}@/{db}?host={}&port={}", dir.display(), options.get_port()),
        None => format!("postgres://{user}@{}:{}/{db}", options.get_host(), options.get_port()),
    }
}

/// The URL with the password of its user part, if any, replaced by `***`.
pub(super) fn redact(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else { return "(not a URL)".to_owned() };
    let Some((userinfo, host)) = rest.rsplit_once('@') else { return url.to_owned() };
    match userinfo.split_once(':') {
        Some((user, _)) => format!("{scheme}://{user}:***@{host}"),
        None => url.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use std::str::FromStr;

    use super::*;

    #[test]
    fn descriptions_and_errors_never_show_the_password() {
        let options = PgConnectOptions::from_str("postgres://app:s3cret@db.internal:6543/orders").unwrap();
        assert_eq!(describe(&options), "postgres://app@db.internal:6543/orders");
        assert_eq!(redact("postgres://app:s3cret@db/x"), "postgres://app:***@db/x");
        assert_eq!(redact("postgres://app@db/x"), "postgres://app@db/x");
        assert!(!redact("postgres://a:b:c@d/x").contains('b'));
    }

    #[test]
    fn the_stores_own_parameters_are_taken_out_and_the_rest_kept() {
        let (url, settings) =
            own_parameters("postgres://a@h/db?sslmode=require&schema=payments&transaction_pooling=true&x=1").unwrap();
        assert_eq!(url, "postgres://a@h/db?sslmode=require&x=1");
        assert_eq!(settings, UrlSettings { schema: Some("payments".to_owned()), transaction_pooling: Some(true) });
        let (url, settings) = own_parameters("postgres://a@h/db?schema=s").unwrap();
        assert_eq!((url.as_str(), settings.schema.as_deref()), ("postgres://a@h/db", Some("s")));
        assert_eq!(own_parameters("postgres://a@h/db").unwrap().0, "postgres://a@h/db");
        let err = own_parameters("postgres://a:pw@h/db?transaction_pooling=yes").unwrap_err().to_string();
        assert!(err.contains("transaction_pooling=yes") && !err.contains("pw"), "{err}");
    }

    #[test]
    fn tls_without_the_feature_is_a_config_error_naming_it() {
        for mode in ["require", "verify-ca", "verify-full"] {
            let url = format!("postgres://app:pw@db/x?sslmode={mode}");
            let options = PgConnectOptions::from_str(&url).unwrap();
            assert!(check_tls(&options, true, &url).is_ok());
            let Err(Error::Config(msg)) = check_tls(&options, false, &url) else { panic!("{mode} accepted") };
            assert!(msg.contains("`tls-rustls` feature") && msg.contains(mode) && !msg.contains("pw"), "{msg}");
        }
        for mode in ["disable", "prefer"] {
            let url = format!("postgres://app@db/x?sslmode={mode}");
            assert!(check_tls(&PgConnectOptions::from_str(&url).unwrap(), false, &url).is_ok());
        }
    }
}
