//! `idempotent`: see, and fix safely, what an idempotent store holds.
//!
//! Records are read and changed only through the library's `Store` API (`inspect`, `scan`,
//! `release_fenced`, `resolve`, `delete`), so the tool works the same on every store:
//!
//! ```text
//! idempotent --store redis://127.0.0.1:6379 list --state stuck
//! idempotent --store sqlite://records.db inspect --run order-7 --step charge --args '["order-7",1500]'
//! idempotent --store postgres://app@db/app release 3f1c…e9 --fence 17 --yes
//! idempotent --store redis://a:7000,redis://b:7001 stats
//! ```
//!
//! `--store` (or `IDEMPOTENT_STORE`) is `redis://host:port` (several, comma-separated, for a
//! cluster), `rediss://…`, `redis+sentinel://host:port,host:port/master-name` (the master those
//! sentinels name), `sqlite://path` (an existing file: a missing one is refused, and created only
//! with `?mode=rwc`) or `postgres://user@host/db` (with TLS by
//! `?sslmode=verify-full&sslrootcert=ca.crt`, a store in a schema by `?schema=payments`, through
//! PgBouncer in transaction mode by `?transaction_pooling=true`). Tables are printed by
//! default, one JSON document with `--json`. Destructive commands (`release`, `resolve`,
//! `purge`) print what they would change and change nothing without `--yes`.
//!
//! Exit codes: 0 done; 1 the store failed or could not be reached (a SQLite file that does not
//! exist); 2 the command line is wrong (a key that several records' keys start with); 3 no such
//! record; 4 refused (the record is not as the command requires: another fence,
//! another state, a live lease; or `doctor` found a problem); 5 nothing changed (a destructive
//! command without `--yes`).
//!
//! Install with `cargo install --locked --path idempotent-cli`.

use std::process::ExitCode;

use clap::Parser;

mod args;
mod commands;
mod doctor;
mod duration;
mod exit;
mod open;
mod render;
mod which;

use args::{Cli, Command};
use exit::{Code, Failure};

fn main() -> ExitCode {
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build() {
        Ok(rt) => rt,
        Err(e) => return fail(&cli, Failure::new(Code::Store, format!("cannot start the async runtime: {e}"))),
    };
    match runtime.block_on(run(&cli)) {
        Ok(report) => {
            if cli.json {
                println!("{}", report.json);
            } else {
                print!("{}", report.text);
            }
            report.code.into()
        }
        Err(failure) => fail(&cli, failure),
    }
}

fn fail(cli: &Cli, failure: Failure) -> ExitCode {
    if cli.json {
        println!("{}", serde_json::json!({ "error": failure.message, "exit_code": failure.code as u8 }));
    }
    eprintln!("idempotent: {}", failure.message);
    failure.code.into()
}

async fn run(cli: &Cli) -> Result<commands::Report, Failure> {
    let url = cli.store.as_deref().ok_or_else(|| {
        Failure::usage("say which store: --store redis://host:port | sqlite://path | postgres://user@host/db (or set IDEMPOTENT_STORE)")
    })?;
    let store = match open::open(url).await {
        Ok(store) => store,
        // doctor says what it could not check, and what to look at.
        Err(failure) if matches!(cli.command, Command::Doctor(_)) && failure.code == Code::Store => {
            return Err(doctor::unreachable(&failure.message));
        }
        Err(failure) => return Err(failure),
    };
    match &cli.command {
        Command::Inspect(which) => commands::inspect(&store, which).await,
        Command::List(args) => commands::list(&store, args).await,
        Command::Release(args) => commands::release(&store, args).await,
        Command::Resolve(args) => commands::resolve(&store, args).await,
        Command::Purge(args) => commands::purge(&store, args).await,
        Command::Stats(select) => commands::stats(&store, select).await,
        Command::Reconcile(select) => commands::reconcile(&store, select).await,
        Command::Doctor(args) => doctor::doctor(&store, args).await,
    }
}
