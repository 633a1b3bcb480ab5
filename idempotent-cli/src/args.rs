//! The command line, as clap parses it.

use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use idempotent_core::store::RecordState;

use crate::duration::parse_duration;

const EXIT_CODES: &str = "Exit codes: 0 done; 1 the store failed or could not be reached (a SQLite file that does not exist); \
2 the command line is wrong (a key that several records' keys start with); 3 no such record; 4 refused (another fence, another state, a live lease; or doctor found a problem); \
5 nothing changed (a destructive command without --yes).";

/// See, and fix safely, what an idempotent store holds.
#[derive(Debug, Parser)]
#[command(name = "idempotent", version, about, long_about = None, after_help = EXIT_CODES)]
pub(crate) struct Cli {
    /// The store: redis://host:port (several comma-separated for a cluster), rediss://…,
    /// redis+sentinel://host:port,host:port/master-name (the master those sentinels name),
    /// sqlite://path (an existing file; sqlite://path?mode=rwc creates it) or
    /// postgres://user@host/db (?sslmode=verify-full&sslrootcert=ca.crt, ?schema=name,
    /// ?transaction_pooling=true for PgBouncer in transaction mode).
    #[arg(long, env = "IDEMPOTENT_STORE", global = true, value_name = "URL")]
    pub(crate) store: Option<String>,

    /// Print JSON instead of tables (one document per command).
    #[arg(long, global = true)]
    pub(crate) json: bool,

    #[command(subcommand)]
    pub(crate) command: Command,
}

#[derive(Debug, Subcommand)]
pub(crate) enum Command {
    /// Show one record.
    Inspect(Which),
    /// List records, a page at a time.
    List(List),
    /// Free a lease whose holder is gone: the next call is recovered (destructive: needs --yes).
    Release(Release),
    /// Settle a record that needs attention, as done with a result or as not done (needs --yes).
    Resolve(Resolve),
    /// Remove the records of a run, a step, or older than an age (needs --yes).
    Purge(Purge),
    /// Count records by step and state.
    Stats(Select),
    /// Report the records stuck without an outcome, by step, and what to do with them.
    Reconcile(Select),
    /// Check that the store is reachable, writable and safely configured, and say what the
    /// deployment relies on (TLS, replicas, a pooler).
    Doctor(Doctor),
}

/// What `doctor` checks beyond the store itself.
#[derive(Debug, Args)]
pub(crate) struct Doctor {
    /// The replicas the application's store waits for (`RedisStoreBuilder::wait_for_replicas`):
    /// fails unless the master has at least that many connected.
    #[arg(long, value_name = "N")]
    pub(crate) wait_for_replicas: Option<u32>,
}

/// Which record: its key, or what the executor or the HTTP layer derives it from.
#[derive(Debug, Args)]
pub(crate) struct Which {
    /// The record's key: the start of it as `list` prints it (12 hex digits; any 4 or more
    /// that only one record's key starts with), or all 64 hex digits (`list --json`, an
    /// error's `record_key`).
    #[arg(value_name = "KEY", conflicts_with_all = ["run", "http_key"])]
    pub(crate) key: Option<String>,

    /// The step's run id (with --step and --args: the key the executor derives).
    #[arg(long, requires_all = ["step", "args"], conflicts_with = "http_key")]
    pub(crate) run: Option<String>,

    /// The step's name.
    #[arg(long)]
    pub(crate) step: Option<String>,

    /// The step's version.
    #[arg(long, default_value_t = 0)]
    pub(crate) version: u32,

    /// The step's arguments (its identity), as JSON.
    #[arg(long, value_name = "JSON")]
    pub(crate) args: Option<String>,

    /// The client's Idempotency-Key (with --scope: the key the HTTP layer derives).
    #[arg(long)]
    pub(crate) http_key: Option<String>,

    /// The HTTP layer's scope.
    #[arg(long, default_value = "http")]
    pub(crate) scope: String,

    /// The tenant, if the run or request had one.
    #[arg(long)]
    pub(crate) tenant: Option<String>,
}

/// Which records: every condition given must hold.
#[derive(Debug, Clone, Args)]
pub(crate) struct Select {
    /// Only records in this state: running, stuck, released, needs_attention or done.
    #[arg(long)]
    pub(crate) state: Option<RecordState>,
    /// Only records of this step.
    #[arg(long)]
    pub(crate) step: Option<String>,
    /// Only records of this run id.
    #[arg(long)]
    pub(crate) run: Option<String>,
    /// Only records of this tenant.
    #[arg(long)]
    pub(crate) tenant: Option<String>,
    /// Only records unchanged for at least this long (500ms, 30s, 10m, 2h, 7d).
    #[arg(long, value_name = "AGE", value_parser = parse_duration)]
    pub(crate) older_than: Option<Duration>,
}

#[derive(Debug, Args)]
pub(crate) struct List {
    #[command(flatten)]
    pub(crate) select: Select,
    /// At most this many records.
    #[arg(long, default_value_t = 50)]
    pub(crate) limit: usize,
    /// Go on from where an earlier `list` stopped (the cursor it printed).
    #[arg(long)]
    pub(crate) cursor: Option<String>,
}

#[derive(Debug, Args)]
pub(crate) struct Release {
    #[command(flatten)]
    pub(crate) which: Which,
    /// The fence of the attempt to take the lease from (as `inspect` prints it): a lease taken
    /// over since is left alone.
    #[arg(long)]
    pub(crate) fence: u64,
    /// Make the change (without it, print what would change).
    #[arg(long)]
    pub(crate) yes: bool,
}

#[derive(Debug, Args)]
pub(crate) struct Resolve {
    #[command(flatten)]
    pub(crate) which: Which,
    /// The action did run, and this is its result, as the step returns it, in JSON: stored and
    /// replayed from now on.
    #[arg(long, value_name = "JSON", conflicts_with = "not_done", required_unless_present = "not_done")]
    pub(crate) done: Option<String>,
    /// The action did not run: the next call runs it.
    #[arg(long)]
    pub(crate) not_done: bool,
    /// How long a --done result is kept.
    #[arg(long, value_name = "AGE", value_parser = parse_duration, default_value = "1d")]
    pub(crate) retention: Duration,
    /// Make the change (without it, print what would change).
    #[arg(long)]
    pub(crate) yes: bool,
}

#[derive(Debug, Args)]
pub(crate) struct Purge {
    #[command(flatten)]
    pub(crate) select: Select,
    /// Make the change (without it, print what would change).
    #[arg(long)]
    pub(crate) yes: bool,
}
