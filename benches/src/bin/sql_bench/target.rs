//! A database under test ([`Target`]): the rows a run times ([`Path`]), the stores it holds
//! ([`Side`]), and what it reads of their writes and storage.

use super::*;

/// The records table of our store (the builder's default name).
pub(crate) const OUR_TABLE: &str = "idempotent_records";

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Path {
    OursFirst,
    StoreFirst,
    FloorFirst,
    FloorFirstGated,
    PeerFirst,
    OursReplay,
    StoreReplay,
    ReadFirstReplay,
    FloorReplay,
    FloorUpsert,
    PeerReplay,
}

impl Path {
    pub(crate) const ALL: [Path; 11] = [
        Path::OursFirst,
        Path::StoreFirst,
        Path::FloorFirst,
        Path::FloorFirstGated,
        Path::PeerFirst,
        Path::OursReplay,
        Path::StoreReplay,
        Path::ReadFirstReplay,
        Path::FloorReplay,
        Path::FloorUpsert,
        Path::PeerReplay,
    ];

    pub(crate) fn label(self) -> &'static str {
        match self {
            Path::OursFirst => "first execution (ours)",
            Path::StoreFirst => "diag: store acquire + complete, no executor",
            Path::FloorFirst => "floor: INSERT ON CONFLICT DO NOTHING + UPDATE",
            Path::FloorFirstGated => "diag: floor, writes behind one in-process lock",
            Path::PeerFirst => "peer: agent-effects first execution",
            Path::OursReplay => "replay (ours)",
            Path::StoreReplay => "diag: store acquire (replay), no executor",
            Path::ReadFirstReplay => "diag: read-only replay: acquire's row, read alone",
            Path::FloorReplay => "floor: SELECT by key",
            Path::FloorUpsert => "diag: floor no-op upsert RETURNING by key",
            Path::PeerReplay => "peer: agent-effects replay",
        }
    }

    /// The floor this path is compared with.
    pub(crate) fn floor(self) -> Option<Path> {
        match self {
            Path::OursFirst | Path::StoreFirst | Path::FloorFirstGated | Path::PeerFirst => Some(Path::FloorFirst),
            Path::OursReplay | Path::StoreReplay | Path::ReadFirstReplay | Path::FloorUpsert | Path::PeerReplay => {
                Some(Path::FloorReplay)
            }
            Path::FloorFirst | Path::FloorReplay => None,
        }
    }

    /// Whose database file (or tables) the path writes to.
    pub(crate) fn side(self) -> Side {
        match self {
            Path::OursFirst | Path::StoreFirst | Path::OursReplay | Path::StoreReplay | Path::ReadFirstReplay => {
                Side::Ours
            }
            Path::FloorFirst | Path::FloorFirstGated | Path::FloorReplay | Path::FloorUpsert => Side::Floor,
            Path::PeerFirst | Path::PeerReplay => Side::Peer,
        }
    }

    /// Whether our store's `statements()` counts this path's statements.
    pub(crate) fn through_store(self) -> bool {
        matches!(self, Path::OursFirst | Path::StoreFirst | Path::OursReplay | Path::StoreReplay)
    }

    pub(crate) fn is_peer(self) -> bool {
        self.side() == Side::Peer
    }
}

/// The three stores a database holds in a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Side {
    Ours,
    Floor,
    Peer,
}

impl Side {
    pub(crate) const ALL: [Side; 3] = [Side::Ours, Side::Floor, Side::Peer];

    pub(crate) fn label(self) -> &'static str {
        match self {
            Side::Ours => "ours",
            Side::Floor => "floor",
            Side::Peer => "peer (agent-effects)",
        }
    }
}

/// What a side's calls wrote during a probe.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Written {
    /// Write transactions committed, where the pool is the bench's own (floor and peer).
    pub(crate) commits: Option<u64>,
    /// Rows inserted, updated or deleted, likewise.
    pub(crate) rows: Option<u64>,
    /// Bytes appended to the write-ahead log.
    pub(crate) wal_bytes: u64,
}

/// What a side's records take on disk.
#[derive(Debug, Clone, Default)]
pub(crate) struct Storage {
    /// Records (rows of the side's main table).
    pub(crate) records: u64,
    /// The database file's size (after a checkpoint into it).
    pub(crate) file_bytes: u64,
    /// Per b-tree (table or index): name, bytes of pages, bytes of payload.
    pub(crate) btrees: Vec<(String, u64, u64)>,
}

impl Storage {
    pub(crate) fn page_bytes(&self) -> u64 {
        self.btrees.iter().map(|b| b.1).sum()
    }
}

/// A database under test: our store on it, the raw floor through the same driver and pool
/// settings, and the peer crate's store on it.
///
/// Two implementations: [`SqliteTarget`] and [`PostgresTarget`].
pub(crate) trait Target: Send + Sync + 'static {
    /// The peer's store on this database.
    type PeerStore: EffectStore;
    /// What a probe holds between its two readings.
    type Probe: Send;
    /// Whether the database has one write lock for the whole file (SQLite), which the gated floor
    /// row queues for in the process.
    const SINGLE_WRITER: bool;
    /// Whether [`read_first_replay`](Target::read_first_replay) is written (it is not where our
    /// store's acquire reads first already).
    const READ_FIRST: bool;

    /// The database, its version and its settings, for the report.
    fn describe(&self) -> impl Future<Output = String> + Send;
    /// Our store.
    fn store(&self) -> SharedStore;
    /// Statements our store ran so far.
    fn statements(&self) -> u64;
    /// The peer's runtime on its store, unless `--no-peer`.
    fn peer(&self) -> Option<&agent_effects::Runtime<Self::PeerStore>>;
    /// The first-execution floor for a fresh `key`: claim the key, then store the outcome.
    fn floor_first(&self, key: &[u8; 32], stored: &[u8]) -> impl Future<Output = ()> + Send;
    /// A diagnostic next to the first-execution floor: the same statements, each taking one lock of
    /// this process first, so that the pool's connections queue for the database's write lock
    /// in the process instead of in SQLite's busy handler (which sleeps 1, 2, 5, 10 … ms between
    /// tries). `None` where the database has no such single write lock.
    fn floor_first_gated(&self, key: &[u8; 32], stored: &[u8]) -> Option<impl Future<Output = ()> + Send>;
    /// The replay floor: read a done row by key.
    fn floor_replay(&self, key: &[u8; 32]) -> impl Future<Output = ()> + Send;
    /// A diagnostic next to the replay floor: what our acquire's replay would cost as a read
    /// statement alone (`SELECT` of acquire's row by key on our store's table, through the
    /// store's pool, answered as acquire answers a done record). `None` where acquire's replay is
    /// that read already (SQLite).
    fn read_first_replay(&self, key: &Key, fp: &Fingerprint) -> Option<impl Future<Output = ()> + Send>;
    /// A diagnostic next to the replay floor: an upsert of a done row that changes nothing and
    /// returns it (a write statement: on SQLite, the file's write lock).
    fn floor_upsert(&self, key: &[u8; 32]) -> impl Future<Output = ()> + Send;
    /// Writes realistic done rows straight into a side's tables, in one statement, until it holds
    /// `total` records; returns how many it wrote.
    fn prefill(&self, side: Side, total: u64, stored: &[u8]) -> impl Future<Output = u64> + Send;
    /// Starts measuring what a side writes.
    fn probe(&self, side: Side) -> impl Future<Output = Self::Probe> + Send;
    /// What the side wrote since `probe`.
    fn probe_end(&self, side: Side, probe: Self::Probe) -> impl Future<Output = Written> + Send;
    /// What the side's records take on disk now.
    fn storage(&self, side: Side) -> impl Future<Output = Storage> + Send;
}
