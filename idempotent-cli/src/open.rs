//! Opening the store `--store` names. Every URL goes to the library's `store::connect` but
//! `sqlite:` ones: a SQLite file that does not exist is refused (a mistyped path would otherwise
//! become a new, empty store that answers "no records"), unless the URL asks to create it with
//! sqlx's `?mode=rwc`.

use std::io::ErrorKind;
use std::path::Path;
use std::sync::Arc;

use idempotent_core::{SharedStore, SqliteStore};

use crate::exit::{Code, Failure};

/// The store at `url`.
pub(crate) async fn open(url: &str) -> Result<SharedStore, Failure> {
    let Some(rest) = url.strip_prefix("sqlite://").or_else(|| url.strip_prefix("sqlite:")) else {
        return Ok(idempotent_core::store::connect(url).await?);
    };
    let (path, create) = sqlite_target(url, rest)?;
    if !create {
        must_exist(path)?;
    }
    Ok(Arc::new(SqliteStore::connect(path).await?))
}

/// The file a `sqlite:` URL names (`rest` is what follows the scheme), and whether the URL asks
/// for it to be created (`?mode=rwc`).
fn sqlite_target<'a>(url: &str, rest: &'a str) -> Result<(&'a str, bool), Failure> {
    let (path, query) = rest.split_once('?').unwrap_or((rest, ""));
    let mut create = false;
    for option in query.split('&').filter(|o| !o.is_empty()) {
        match option {
            "mode=rwc" => create = true,
            "mode=rw" => create = false,
            _ if option.starts_with("mode=") => {
                return Err(Failure::usage(format!(
                    "`{option}` in {url}: the command reads and writes the store, so the mode is `rw` (the \
                     default: the file must exist) or `rwc` (create the file if it is missing)"
                )));
            }
            _ => {
                return Err(Failure::usage(format!(
                    "`{option}` in {url} is not an option the command knows: a SQLite URL takes only \
                     `?mode=rwc` (create the file if it is missing) or `?mode=rw` (the default)"
                )));
            }
        }
    }
    if path.is_empty() || path == ":memory:" {
        return Err(Failure::usage(format!(
            "{url} names no file: give the SQLite file the service writes its records to, as sqlite://path \
             (relative to the current directory) or sqlite:///absolute/path"
        )));
    }
    Ok((path, create))
}

/// Refuses a path that is not an existing file, saying what to do.
fn must_exist(path: &str) -> Result<(), Failure> {
    let unreachable = |what: String| Failure::new(Code::Store, what);
    match std::fs::metadata(path) {
        Ok(meta) if meta.is_dir() => Err(unreachable(format!(
            "the SQLite path `{path}` is a directory, not a database file: give the file the service writes \
             its records to"
        ))),
        Ok(_) => Ok(()),
        Err(e) if e.kind() == ErrorKind::NotFound => {
            let looked =
                std::path::absolute(Path::new(path)).map_or_else(|_| path.to_owned(), |p| p.display().to_string());
            Err(unreachable(format!(
                "no SQLite database at `{path}` ({looked} does not exist), and nothing was created: check the \
                 path (sqlite://path is relative to the current directory, sqlite:///path is absolute), or, to \
                 start an empty store there, add ?mode=rwc (--store 'sqlite://{path}?mode=rwc')"
            )))
        }
        Err(e) => Err(unreachable(format!("cannot read the SQLite path `{path}`: {e}"))),
    }
}
