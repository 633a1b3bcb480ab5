//! The store's Lua scripts and how they are called: as functions of one library (`FUNCTION
//! LOAD`, `FCALL`; Redis 7.0+, Valkey) where the server takes it, else by `EVALSHA`.
//!
//! Every script reads the record through the layout prelude (`layout.lua`): some forty constants
//! and five helper functions. Sent by `EVALSHA`, the prelude runs on every call, and making its
//! helpers (closures over the constants) costs Redis more than a `GET` does (BENCHMARKS.md has
//! the figures). In a library the prelude runs once, when the library is loaded, and
//! each function is only its own body.
//!
//! The library is named after a digest of its text (`idempotent_<12 hex>`), and so are its
//! functions, so that two versions of this crate on one server each call their own. A server
//! that does not know the function (a restart without persistence, a `FUNCTION FLUSH`, a new
//! cluster node) gets the library loaded (`FUNCTION LOAD REPLACE`, on every master of a cluster)
//! and the call again, as a script is reloaded on `NOSCRIPT`. A server that refuses functions
//! (before Redis 7.0: an unknown command; an ACL without `FCALL` or `FUNCTION`: `NOPERM`) turns
//! them off for the store, which then sends `EVALSHA`.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, LazyLock};

use deadpool_redis::redis::{self, Script, ServerErrorKind};
use sha2::{Digest, Sha256};

use super::source;

/// The library: its name and the text `FUNCTION LOAD` takes.
struct Library {
    name: String,
    text: String,
}

/// Each record script by the name of its function (after the library's name and `_`), with its
/// flags. A function without flags is refused as a whole while the server is over its memory
/// limit (an `EVALSHA` script only at its first write): `read` writes nothing (`no-writes`), and
/// `delete` only deletes (`allow-oom`), so both still run then, as by `EVALSHA`.
const FUNCTIONS: [(&str, &str, &str); 9] = [
    ("acquire", source::ACQUIRE, ""),
    ("complete", source::COMPLETE, ""),
    ("release", source::RELEASE, ""),
    ("renew", source::RENEW, ""),
    ("abandon", source::ABANDON, ""),
    ("resolve", source::RESOLVE, ""),
    ("read", source::READ, "no-writes"),
    ("release_fenced", source::RELEASE_FENCED, ""),
    ("delete", source::DELETE, "allow-oom"),
];

/// A script's source without the prelude every one starts with.
fn body(script: &'static str) -> &'static str {
    script.strip_prefix(source::LAYOUT).expect("every script starts with the layout prelude")
}

static LIBRARY: LazyLock<Library> = LazyLock::new(|| {
    let mut body = String::from(source::LAYOUT);
    for (function, script, flag) in FUNCTIONS {
        // The script's `KEYS` and `ARGV` become the function's parameters of those names.
        let flags = if flag.is_empty() { String::new() } else { format!(", flags = {{'{flag}'}}") };
        let script = self::body(script);
        body.push_str(&format!(
            "\nredis.register_function{{function_name = '{{LIB}}_{function}', callback = function(KEYS, ARGV)\n\
             {script}\nend{flags}}}\n"
        ));
    }
    let digest = Sha256::digest(body.as_bytes());
    let name = format!("idempotent_{}", &crate::key::hex(&digest)[..12]);
    let text = format!("#!lua name={name}\n{}", body.replace("{LIB}", &name));
    Library { name, text }
});

/// The library's name.
pub fn library_name() -> &'static str {
    &LIBRARY.name
}

/// One script of a store: its `EVALSHA` form, and where the store calls functions, the name of
/// its function and the store's switch.
pub(crate) struct Lua {
    script: Script,
    function: Option<(String, Arc<AtomicBool>)>,
}

impl Lua {
    /// A script only ever sent by `EVALSHA` (the state store's commit).
    pub(crate) fn script_only(source: &str) -> Lua {
        Lua { script: Script::new(source), function: None }
    }

    /// The record script `name` (one of [`FUNCTIONS`]), called as a function while `functions`
    /// is on.
    fn record(name: &str, functions: &Arc<AtomicBool>) -> Lua {
        let (_, source, _) = FUNCTIONS.iter().find(|f| f.0 == name).expect("a script of FUNCTIONS");
        let function = format!("{}_{name}", LIBRARY.name);
        Lua { script: Script::new(source), function: Some((function, functions.clone())) }
    }

    /// The command and its first argument that call the script: `FCALL` and the function's
    /// name, or `EVALSHA` and the script's hash. The key count and the keys follow.
    pub(crate) fn call(&self) -> (&'static str, &str) {
        match &self.function {
            Some((name, on)) if on.load(Ordering::Relaxed) => ("FCALL", name),
            _ => ("EVALSHA", self.script.get_hash()),
        }
    }

    /// The script's `EVALSHA` hash.
    pub(crate) fn hash(&self) -> &str {
        self.script.get_hash()
    }

    /// After `err` answered `cmd` (a call of this script): the command to send instead, once
    /// the server was given what it lacked, or `None` when `err` is not about the script.
    /// `NOSCRIPT` loads the script; an unknown function loads the library; a server that
    /// refuses functions turns them off, and the call goes again as `EVALSHA`.
    pub(crate) async fn recover<C>(
        &self,
        conn: &mut C,
        cmd: &redis::Cmd,
        err: &redis::RedisError,
    ) -> redis::RedisResult<Option<redis::Cmd>>
    where
        C: redis::aio::ConnectionLike + Send,
    {
        if err.kind() == redis::ErrorKind::Server(ServerErrorKind::NoScript) {
            self.script.load_async(conn).await?;
            return Ok(Some(cmd.clone()));
        }
        if self.function.is_none() || !is_fcall(cmd) {
            return Ok(None);
        }
        if is_unknown_function(err) {
            if self.load_library(conn).await? {
                return Ok(Some(cmd.clone()));
            }
            // Not loaded: this call goes by EVALSHA (functions stay on unless it was a refusal).
        } else if refuses_functions(err) {
            self.functions_off(err);
        } else {
            return Ok(None);
        }
        Ok(Some(self.as_evalsha(cmd)))
    }

    /// Loads the library (`FUNCTION LOAD REPLACE`; on a cluster, on every master): `false` when
    /// the server answered with an error, so that the caller sends `EVALSHA` instead: a refusal
    /// of functions turns them off for the store; another error (the server over its memory
    /// limit, which refuses `FUNCTION LOAD` but runs a script) only costs this call its
    /// function. An error of the connection is returned.
    async fn load_library<C>(&self, conn: &mut C) -> redis::RedisResult<bool>
    where
        C: redis::aio::ConnectionLike + Send,
    {
        let load = redis::cmd("FUNCTION").arg("LOAD").arg("REPLACE").arg(&LIBRARY.text).clone();
        match load.query_async::<redis::Value>(conn).await {
            Ok(_) => Ok(true),
            Err(e) if refuses_functions(&e) => {
                self.functions_off(&e);
                Ok(false)
            }
            Err(e) if matches!(e.kind(), redis::ErrorKind::Server(_)) => {
                tracing::debug!(error = %e, "idempotent.redis: FUNCTION LOAD failed; this call goes by EVALSHA");
                Ok(false)
            }
            Err(e) => Err(e),
        }
    }

    /// Turns functions off for the store, after the server refused them with `err`.
    fn functions_off(&self, err: &redis::RedisError) {
        if let Some((_, on)) = &self.function
            && on.swap(false, Ordering::Relaxed)
        {
            tracing::info!(error = %err, "idempotent.redis: the server refuses Redis functions; the store calls its scripts by EVALSHA");
        }
    }

    /// `cmd`, an `FCALL` of this script, as the `EVALSHA` of it.
    fn as_evalsha(&self, cmd: &redis::Cmd) -> redis::Cmd {
        let mut out = redis::Cmd::new();
        out.arg("EVALSHA").arg(self.script.get_hash());
        for arg in cmd.args_iter().skip(2) {
            if let redis::Arg::Simple(bytes) = arg {
                out.arg(bytes);
            }
        }
        out
    }

    /// Makes the server know the script: loads the library (where the store calls functions;
    /// a refusal turns them off), unless `library_loaded`, or else the script. Returns whether
    /// the library is loaded.
    pub(crate) async fn load<C>(&self, conn: &mut C, library_loaded: bool) -> redis::RedisResult<bool>
    where
        C: redis::aio::ConnectionLike + Send,
    {
        if let Some((_, on)) = &self.function
            && on.load(Ordering::Relaxed)
            && (library_loaded || self.load_library(conn).await?)
        {
            return Ok(true);
        }
        self.script.load_async(conn).await.map(|_| library_loaded)
    }
}

fn is_fcall(cmd: &redis::Cmd) -> bool {
    matches!(cmd.args_iter().next(), Some(redis::Arg::Simple(b"FCALL")))
}

/// `ERR Function not found`.
fn is_unknown_function(err: &redis::RedisError) -> bool {
    err.kind() == redis::ErrorKind::Server(ServerErrorKind::ResponseError)
        && err.detail().is_some_and(|d| d.starts_with("Function not found"))
}

/// An unknown command (`FCALL` or `FUNCTION` before Redis 7.0) or one the connection's ACL user
/// may not run (`NOPERM` naming the command; a `NOPERM` for a key is not about functions).
fn refuses_functions(err: &redis::RedisError) -> bool {
    match err.kind() {
        redis::ErrorKind::Server(ServerErrorKind::NoPerm) => err.detail().is_some_and(|d| {
            let d = d.to_ascii_lowercase();
            d.contains("'fcall") || d.contains("'function")
        }),
        redis::ErrorKind::Server(ServerErrorKind::ResponseError) => {
            err.detail().is_some_and(|d| d.starts_with("unknown command") || d.starts_with("unknown subcommand"))
        }
        _ => false,
    }
}

/// The store's scripts.
pub(super) struct Scripts {
    pub(super) acquire: Lua,
    pub(super) complete: Lua,
    pub(super) release: Lua,
    pub(super) renew: Lua,
    pub(super) abandon: Lua,
    pub(super) resolve: Lua,
    pub(super) read: Lua,
    pub(super) release_fenced: Lua,
    pub(super) delete: Lua,
}

impl Scripts {
    /// The scripts, called as functions unless `functions` is off (or the server refuses them).
    pub(super) fn new(functions: bool) -> Self {
        let on = Arc::new(AtomicBool::new(functions));
        Scripts {
            acquire: Lua::record("acquire", &on),
            complete: Lua::record("complete", &on),
            release: Lua::record("release", &on),
            renew: Lua::record("renew", &on),
            abandon: Lua::record("abandon", &on),
            resolve: Lua::record("resolve", &on),
            read: Lua::record("read", &on),
            release_fenced: Lua::record("release_fenced", &on),
            delete: Lua::record("delete", &on),
        }
    }

    pub(super) fn all(&self) -> [&Lua; 9] {
        [
            &self.acquire,
            &self.complete,
            &self.release,
            &self.renew,
            &self.abandon,
            &self.resolve,
            &self.read,
            &self.release_fenced,
            &self.delete,
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(cmd: &redis::Cmd) -> Vec<Vec<u8>> {
        cmd.args_iter()
            .map(|a| match a {
                redis::Arg::Simple(b) => b.to_vec(),
                _ => b"<other>".to_vec(),
            })
            .collect()
    }

    #[test]
    fn the_library_registers_every_script_under_its_digest_name() {
        let text = &LIBRARY.text;
        assert!(text.starts_with(&format!("#!lua name={}\n", library_name())));
        assert!(library_name().starts_with("idempotent_") && library_name().len() == "idempotent_".len() + 12);
        for (function, body, flag) in FUNCTIONS {
            let name = format!("'{}_{function}'", library_name());
            assert_eq!(text.matches(&name).count(), 1, "{name}");
            assert!(text.contains(self::body(body)), "{function}'s body");
            let registered = text.split(&name).nth(1).unwrap().split("register_function").next().unwrap();
            let flags = registered.rsplit("end").next().unwrap();
            assert_eq!(flags.contains("flags"), !flag.is_empty(), "{function}: {flags}");
            assert!(flag.is_empty() || flags.contains(&format!("'{flag}'")), "{function}: {flags}");
        }
        assert_eq!(
            FUNCTIONS.iter().filter(|f| !f.2.is_empty()).map(|f| (f.0, f.2)).collect::<Vec<_>>(),
            [("read", "no-writes"), ("delete", "allow-oom")]
        );
        assert!(!text.contains("{LIB}"));
    }

    #[test]
    fn an_fcall_is_sent_again_as_the_evalsha_of_the_same_script() {
        let on = Arc::new(AtomicBool::new(true));
        let lua = Lua::record("complete", &on);
        let (command, name) = lua.call();
        assert_eq!((command, name), ("FCALL", &*format!("{}_complete", library_name())));
        let mut cmd = redis::Cmd::new();
        cmd.arg(command).arg(name).arg(1).arg("idem:k").arg("token").arg(&b"\x00result"[..]);
        assert!(is_fcall(&cmd));
        let again = lua.as_evalsha(&cmd);
        let hash = Script::new(source::COMPLETE).get_hash().to_owned();
        let expected: Vec<Vec<u8>> =
            [&b"EVALSHA"[..], hash.as_bytes(), b"1", b"idem:k", b"token", b"\x00result"].map(<[u8]>::to_vec).to_vec();
        assert_eq!(args(&again), expected);
        on.store(false, Ordering::Relaxed);
        assert_eq!(lua.call(), ("EVALSHA", &*hash));
        assert_eq!(Lua::script_only("return 1").call().0, "EVALSHA");
    }

    #[test]
    fn errors_are_told_apart() {
        let server = |code: &str, detail: &str| {
            redis::RedisError::from((
                redis::ErrorKind::Server(match code {
                    "NOPERM" => ServerErrorKind::NoPerm,
                    _ => ServerErrorKind::ResponseError,
                }),
                "server error",
                detail.to_owned(),
            ))
        };
        assert!(is_unknown_function(&server("ERR", "Function not found")));
        assert!(!is_unknown_function(&server("ERR", "Error running script")));
        assert!(refuses_functions(&server("NOPERM", "this user has no permissions to run the 'fcall' command")));
        assert!(refuses_functions(&server(
            "NOPERM",
            "this user has no permissions to run the 'function|load' command"
        )));
        assert!(!refuses_functions(&server(
            "NOPERM",
            "this user has no permissions to access one of the keys used as arguments"
        )));
        assert!(refuses_functions(&server("ERR", "unknown command 'FCALL', with args beginning with: ")));
        assert!(!refuses_functions(&server("ERR", "Function not found")));
        assert!(!refuses_functions(&server("ERR", "IDEMPOTENT_CORRUPT record")));
    }
}
