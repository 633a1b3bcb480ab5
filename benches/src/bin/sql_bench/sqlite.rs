//! SQLite as a [`Target`]: one directory, one file per side, and the commit and update hooks that
//! count what the floor and the peer write.

use super::*;

/// Commits and row changes on every connection of a pool (SQLite commit and update hooks).
#[derive(Default)]
pub(crate) struct Hooks {
    pub(crate) commits: AtomicU64,
    pub(crate) rows: AtomicU64,
}

impl Hooks {
    pub(crate) fn read(&self) -> (u64, u64) {
        (self.commits.load(Ordering::Relaxed), self.rows.load(Ordering::Relaxed))
    }
}

/// Adds the hooks to each connection the pool opens.
pub(crate) fn with_hooks(options: SqlitePoolOptions, hooks: &Arc<Hooks>) -> SqlitePoolOptions {
    let hooks = hooks.clone();
    options.after_connect(move |conn, _| {
        let hooks = hooks.clone();
        Box::pin(async move {
            let mut handle = conn.lock_handle().await?;
            let commits = hooks.clone();
            handle.set_commit_hook(move || {
                commits.commits.fetch_add(1, Ordering::Relaxed);
                true
            });
            handle.set_update_hook(move |_| {
                hooks.rows.fetch_add(1, Ordering::Relaxed);
            });
            Ok(())
        })
    })
}

/// A pool with the connection and pool settings `SqliteStoreBuilder::connect` uses (idempotent-core's `store/sql/sqlite/builder.rs`), and
/// the hooks: the floor's.
pub(crate) async fn store_like_pool(path: &FsPath, hooks: &Arc<Hooks>) -> SqlitePool {
    with_hooks(
        SqlitePoolOptions::new()
            .max_connections(MAX_CONNECTIONS)
            .min_connections(0)
            .acquire_timeout(BUSY_TIMEOUT)
            .test_before_acquire(false),
        hooks,
    )
    .connect_with(
        SqliteConnectOptions::new()
            .filename(path)
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(SqliteSynchronous::Full)
            .busy_timeout(BUSY_TIMEOUT),
    )
    .await
    .unwrap_or_else(|e| panic!("open {}: {e}", path.display()))
}

pub(crate) fn now_us() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_micros() as i64
}

/// SQLite: one directory, one file per side.
pub(crate) struct SqliteTarget {
    pub(crate) dir: PathBuf,
    pub(crate) ours: SqliteStore,
    pub(crate) floor: SqlitePool,
    pub(crate) floor_hooks: Arc<Hooks>,
    pub(crate) floor_sql: FloorSql,
    pub(crate) peer: Option<(agent_effects::Runtime<agent_effects_sqlite::SqliteStore>, Arc<Hooks>)>,
    /// Per side, a pool of two connections of the bench's own on that file: prefill, probes,
    /// storage (one connection holds a read snapshot while the other checkpoints).
    pub(crate) admin: [SqlitePool; 3],
    /// Peer effects prefilled so far (their ids are numbered).
    pub(crate) peer_prefilled: AtomicU64,
    /// The in-process lock of the gated floor row.
    pub(crate) write_gate: tokio::sync::Mutex<()>,
}

impl SqliteTarget {
    pub(crate) async fn open(dir: &FsPath, peer: bool) -> SqliteTarget {
        std::fs::create_dir_all(dir).unwrap();
        let file = |side: Side| dir.join(format!("{}.sqlite", ["ours", "floor", "peer"][side as usize]));
        let ours = SqliteStore::builder(file(Side::Ours))
            .max_connections(MAX_CONNECTIONS)
            .busy_timeout(BUSY_TIMEOUT)
            .connect()
            .await
            .expect("open the SqliteStore under test");

        let floor_hooks = Arc::new(Hooks::default());
        let floor = store_like_pool(&file(Side::Floor), &floor_hooks).await;
        // The floor's table is ours as the store created it, under another name.
        let create: String = sqlx::query_scalar("SELECT sql FROM sqlite_schema WHERE type = 'table' AND name = ?1")
            .bind(OUR_TABLE)
            .fetch_one(ours.pool())
            .await
            .expect("read our table's definition");
        let create = create.replacen(&format!("\"{OUR_TABLE}\""), "floor_records", 1);
        assert!(create.contains("floor_records"), "our table's definition names it: {create}");
        sqlx::raw_sql(AssertSqlSafe(create)).execute(&floor).await.expect("create the floor's table");

        // The peer: the settings of `agent_effects_sqlite::SqliteStore::open` (its lib.rs), with the
        // hooks added through `from_pool`, which runs its migrations.
        let peer = if peer {
            let hooks = Arc::new(Hooks::default());
            let pool = with_hooks(SqlitePoolOptions::new().max_connections(8), &hooks)
                .connect_with(
                    SqliteConnectOptions::new()
                        .filename(file(Side::Peer))
                        .create_if_missing(true)
                        .journal_mode(SqliteJournalMode::Wal)
                        .synchronous(SqliteSynchronous::Full)
                        .busy_timeout(Duration::from_secs(5))
                        .foreign_keys(true),
                )
                .await
                .expect("open the peer's file");
            let store = agent_effects_sqlite::SqliteStore::from_pool(pool).await.expect("migrate the peer's store");
            Some((agent_effects::Runtime::new(store), hooks))
        } else {
            None
        };

        let admin = |side: Side| {
            SqlitePoolOptions::new().max_connections(2).connect_with(
                SqliteConnectOptions::new()
                    .filename(file(side))
                    .create_if_missing(true)
                    .journal_mode(SqliteJournalMode::Wal)
                    .busy_timeout(BUSY_TIMEOUT)
                    // Prefill inserts keys in random order: keep the whole index in memory.
                    .pragma("cache_size", "-2097152"),
            )
        };
        let admin =
            [admin(Side::Ours).await.unwrap(), admin(Side::Floor).await.unwrap(), admin(Side::Peer).await.unwrap()];
        SqliteTarget {
            dir: dir.to_owned(),
            ours,
            floor,
            floor_hooks,
            floor_sql: FloorSql::new("floor_records"),
            peer,
            admin,
            peer_prefilled: AtomicU64::new(0),
            write_gate: tokio::sync::Mutex::new(()),
        }
    }

    pub(crate) fn admin(&self, side: Side) -> &SqlitePool {
        &self.admin[side as usize]
    }

    pub(crate) fn hooks(&self, side: Side) -> Option<&Hooks> {
        match side {
            Side::Ours => None,
            Side::Floor => Some(&self.floor_hooks),
            Side::Peer => self.peer.as_ref().map(|(_, h)| &**h),
        }
    }

    /// The side's main table and the tables its records also write.
    pub(crate) fn tables(side: Side) -> &'static [&'static str] {
        match side {
            Side::Ours => &[OUR_TABLE],
            Side::Floor => &["floor_records"],
            Side::Peer => &["effects", "effect_events", "late_observations"],
        }
    }

    pub(crate) async fn count(&self, side: Side) -> u64 {
        let sql = format!("SELECT count(*) FROM \"{}\"", Self::tables(side)[0]);
        let n: i64 = sqlx::query_scalar(AssertSqlSafe(sql)).fetch_one(self.admin(side)).await.unwrap();
        n as u64
    }

    /// Frames in the side's WAL now (`PRAGMA wal_checkpoint`'s second column), after a passive
    /// checkpoint.
    pub(crate) async fn wal_frames(&self, side: Side) -> i64 {
        let row = sqlx::query("PRAGMA wal_checkpoint(PASSIVE)").fetch_one(self.admin(side)).await.unwrap();
        row.get::<i64, _>(1)
    }

    pub(crate) async fn checkpoint_truncate(&self, side: Side) {
        let row = sqlx::query("PRAGMA wal_checkpoint(TRUNCATE)").fetch_one(self.admin(side)).await.unwrap();
        assert_eq!(row.get::<i64, _>(0), 0, "the TRUNCATE checkpoint of {} was blocked", side.label());
    }

    pub(crate) async fn columns(&self, side: Side, table: &str) -> Vec<String> {
        sqlx::query_scalar("SELECT name FROM pragma_table_info(?1) ORDER BY cid")
            .bind(table)
            .fetch_all(self.admin(side))
            .await
            .unwrap()
    }
}

/// A read snapshot held on the side's file (so that the WAL is appended to, never restarted), and
/// the readings at its start.
pub(crate) struct SqliteProbe {
    pub(crate) snapshot: sqlx::Transaction<'static, sqlx::Sqlite>,
    pub(crate) frames: i64,
    pub(crate) hooks: Option<(u64, u64)>,
}

impl Target for SqliteTarget {
    type PeerStore = agent_effects_sqlite::SqliteStore;
    type Probe = SqliteProbe;
    const SINGLE_WRITER: bool = true;
    const READ_FIRST: bool = false;

    async fn describe(&self) -> String {
        let version: String =
            sqlx::query_scalar("SELECT sqlite_version()").fetch_one(self.admin(Side::Ours)).await.unwrap();
        format!(
            "SQLite {version} (sqlx, bundled), files in {}; ours and floor: WAL, synchronous FULL, \
             {MAX_CONNECTIONS} connections, busy timeout {}s",
            self.dir.display(),
            BUSY_TIMEOUT.as_secs()
        )
    }

    fn store(&self) -> SharedStore {
        Arc::new(self.ours.clone())
    }

    fn statements(&self) -> u64 {
        self.ours.statements()
    }

    fn peer(&self) -> Option<&agent_effects::Runtime<Self::PeerStore>> {
        self.peer.as_ref().map(|(r, _)| r)
    }

    async fn floor_first(&self, key: &[u8; 32], stored: &[u8]) {
        floor_first!(&self.floor_sql, &self.floor, key, stored, None::<&tokio::sync::Mutex<()>>)
    }

    fn floor_first_gated(&self, key: &[u8; 32], stored: &[u8]) -> Option<impl Future<Output = ()> + Send> {
        Some(async move { floor_first!(&self.floor_sql, &self.floor, key, stored, Some(&self.write_gate)) })
    }

    async fn floor_replay(&self, key: &[u8; 32]) {
        floor_read!(select, self.floor_sql, &self.floor, key)
    }

    fn read_first_replay(&self, _: &Key, _: &Fingerprint) -> Option<impl Future<Output = ()> + Send> {
        // `SqliteStore::acquire` reads first: its replay is that read.
        None::<std::future::Ready<()>>
    }

    async fn floor_upsert(&self, key: &[u8; 32]) {
        floor_read!(upsert, self.floor_sql, &self.floor, key)
    }

    async fn prefill(&self, side: Side, total: u64, stored: &[u8]) -> u64 {
        let have = self.count(side).await;
        if have >= total {
            return 0;
        }
        let add = total - have;
        let admin = self.admin(side);
        match side {
            Side::Ours | Side::Floor => prefill_records!(SQLITE, admin, Self::tables(side)[0], add, stored),
            Side::Peer => {
                // Copies of one real done effect (and its audit events) under new ids and keys.
                // Ids are numbered UUIDs below the runtime's v7 ones, in order, as time-ordered
                // ids are inserted.
                let template: String =
                    sqlx::query_scalar("SELECT id FROM effects WHERE status = 'committed' ORDER BY id DESC LIMIT 1")
                        .fetch_one(admin)
                        .await
                        .expect("a committed peer effect to copy");
                let from = self.peer_prefilled.fetch_add(add, Ordering::Relaxed) + 1;
                prefill_peer!(SQLITE, admin, "", template, from, add, |table| self.columns(side, table));
            }
        }
        // Into the database file, so that the timed rows do not pay for copying the prefill.
        self.checkpoint_truncate(side).await;
        add
    }

    async fn probe(&self, side: Side) -> SqliteProbe {
        let admin = self.admin(side);
        self.checkpoint_truncate(side).await;
        // A frame in the WAL that no checkpoint has copied yet, so that the snapshot below reads
        // through the WAL (read mark > 0): a writer cannot restart the WAL under it.
        sqlx::raw_sql("CREATE TABLE IF NOT EXISTS bench_probe (n INTEGER); INSERT INTO bench_probe VALUES (1)")
            .execute(admin)
            .await
            .unwrap();
        let mut snapshot = admin.begin().await.unwrap();
        let _: i64 = sqlx::query_scalar("SELECT count(*) FROM bench_probe").fetch_one(&mut *snapshot).await.unwrap();
        let frames = self.wal_frames(side).await;
        SqliteProbe { snapshot, frames, hooks: self.hooks(side).map(Hooks::read) }
    }

    async fn probe_end(&self, side: Side, probe: SqliteProbe) -> Written {
        let frames = self.wal_frames(side).await - probe.frames;
        probe.snapshot.rollback().await.unwrap();
        let page: i64 = sqlx::query_scalar("PRAGMA page_size").fetch_one(self.admin(side)).await.unwrap();
        let hooks = self.hooks(side).map(Hooks::read).zip(probe.hooks);
        Written {
            commits: hooks.map(|((c1, _), (c0, _))| c1 - c0),
            rows: hooks.map(|((_, r1), (_, r0))| r1 - r0),
            // A WAL frame is a 24-byte header and a page.
            wal_bytes: frames.max(0) as u64 * (page as u64 + 24),
        }
    }

    async fn storage(&self, side: Side) -> Storage {
        self.checkpoint_truncate(side).await;
        let admin = self.admin(side);
        let tables = Self::tables(side);
        let mut btrees = Vec::new();
        for table in tables {
            let names: Vec<String> = sqlx::query_scalar("SELECT name FROM sqlite_schema WHERE tbl_name = ?1")
                .bind(*table)
                .fetch_all(admin)
                .await
                .unwrap();
            for name in names {
                let row = sqlx::query("SELECT pgsize, payload FROM dbstat(?1, 1) WHERE name = ?2")
                    .bind("main")
                    .bind(&name)
                    .fetch_optional(admin)
                    .await
                    .unwrap();
                if let Some(row) = row {
                    btrees.push((name, row.get::<i64, _>(0) as u64, row.get::<i64, _>(1) as u64));
                }
            }
        }
        let file = self.dir.join(format!("{}.sqlite", ["ours", "floor", "peer"][side as usize]));
        Storage { records: self.count(side).await, file_bytes: std::fs::metadata(file).unwrap().len(), btrees }
    }
}
