//! PostgreSQL as a [`Target`]: the bench's own tables in the database of `--postgres <url>`.

use super::*;

/// The pool size of our PostgreSQL store, which the floor shares (it is the store's pool) and the
/// peer's pool is given too.
pub(crate) const PG_CONNECTIONS: u32 = 16;
/// Our PostgreSQL store's per-call timeout (the builder's default is 5 s; at c=64 on 16
/// connections a call may wait for a connection behind 48 others on a loaded machine).
pub(crate) const PG_TIMEOUT: Duration = Duration::from_secs(10);
/// Our store's table, the floor's table (both in the connection's `current_schema()`), and the
/// peer's schema: the bench's own names, dropped at the start and at the end of a run.
pub(crate) const PG_OURS: &str = "sql_bench_ours";
pub(crate) const PG_FLOOR: &str = "sql_bench_floor";
pub(crate) const PG_PEER_SCHEMA: &str = "sql_bench_peer";
/// PostgreSQL: our store in table `sql_bench_ours`, the floor in `sql_bench_floor` through the
/// store's own pool (`PostgresStore::pool`), the peer in schema `sql_bench_peer`, all in the
/// database of the URL; dropped before and after a run.
///
/// What a call writes is read from the whole cluster at concurrency 1 (so it includes whatever
/// else runs on the server meanwhile): WAL bytes from `pg_current_wal_insert_lsn()` deltas, and,
/// in the "write commits" column, transaction ids assigned (`pg_snapshot_xmax` of the current
/// snapshot), one per write transaction. `pg_stat_database.xact_commit` is not used: backends
/// flush it to shared memory at most once a second, or after 10 s idle, so a delta right after
/// the pass would miss commits. Rows written are not counted. Storage is `pg_table_size` of each
/// table (heap and TOAST, dead row versions included) and `pg_relation_size` of each index, and
/// `pg_column_size` of the rows as payload.
pub(crate) struct PostgresTarget {
    pub(crate) ours: PostgresStore,
    pub(crate) peer: Option<agent_effects::Runtime<agent_effects_postgres::PostgresStore>>,
    /// Two connections of the bench's own: prefill, probes, storage, cleanup.
    pub(crate) admin: PgPool,
    /// Peer effects prefilled so far (their ids are numbered).
    pub(crate) peer_prefilled: AtomicU64,
    pub(crate) floor_sql: FloorSql,
    /// acquire's row of a key on our table, read alone (the read-only replay row).
    pub(crate) read_ours: SqlStr,
}

/// The cluster's WAL insert position and next transaction id at the start of a probe.
pub(crate) struct PgProbe {
    pub(crate) lsn: String,
    pub(crate) next_xid: i64,
}

impl PostgresTarget {
    pub(crate) async fn open(url: &str, peer: bool) -> PostgresTarget {
        let admin = PgPoolOptions::new()
            .max_connections(2)
            .connect(url)
            .await
            .unwrap_or_else(|e| panic!("sql_bench: cannot connect to {url}: {e}; start the server or fix the URL"));
        Self::drop_tables(&admin).await;
        let ours = PostgresStore::builder(url)
            .table(PG_OURS)
            .max_connections(PG_CONNECTIONS)
            .timeout(PG_TIMEOUT)
            .connect()
            .await
            .expect("open the PostgresStore under test");
        // The floor's table is ours as the store created it: columns, defaults, constraints,
        // indexes, and its storage parameters (`fillfactor`), which `LIKE` does not copy.
        let options: Option<Vec<String>> =
            sqlx::query_scalar("SELECT reloptions FROM pg_class WHERE oid = to_regclass($1)")
                .bind(PG_OURS)
                .fetch_one(ours.pool())
                .await
                .expect("read our table's storage parameters");
        let with = options.map(|o| format!(" WITH ({})", o.join(", "))).unwrap_or_default();
        let create = format!("CREATE TABLE \"{PG_FLOOR}\" (LIKE \"{PG_OURS}\" INCLUDING ALL){with}");
        sqlx::raw_sql(AssertSqlSafe(create)).execute(ours.pool()).await.expect("create the floor's table");
        let peer = if peer {
            // `PostgresOptions::connect`: its own pool (of `PG_CONNECTIONS`), its migrations, in a
            // schema of the bench's.
            let store = agent_effects_postgres::PostgresOptions::new()
                .schema(PG_PEER_SCHEMA)
                .max_connections(PG_CONNECTIONS)
                .connect(url)
                .await
                .expect("open the peer's store");
            Some(agent_effects::Runtime::new(store))
        } else {
            None
        };
        let read_ours = AssertSqlSafe(format!(
            "SELECT token, fingerprint, state, fence, attempt, recovered, lease_until - {now} AS left_us, result \
             FROM \"{PG_OURS}\" WHERE key = $1 AND expires_at > {now}",
            now = "(extract(epoch FROM statement_timestamp()) * 1000000)::bigint"
        ))
        .into_sql_str();
        PostgresTarget {
            ours,
            peer,
            admin,
            peer_prefilled: AtomicU64::new(0),
            floor_sql: FloorSql::new(PG_FLOOR),
            read_ours,
        }
    }

    /// Drops the bench's tables and schema, and our table's line in `idempotent_schema` (and that
    /// table, if nothing else is in it).
    pub(crate) async fn drop_tables(admin: &PgPool) {
        let sql = format!(
            "DROP TABLE IF EXISTS \"{PG_OURS}\", \"{PG_FLOOR}\";\n\
             DROP SCHEMA IF EXISTS \"{PG_PEER_SCHEMA}\" CASCADE;\n\
             DO $$ BEGIN\n\
               IF to_regclass('idempotent_schema') IS NOT NULL THEN\n\
                 DELETE FROM idempotent_schema WHERE name = '{PG_OURS}';\n\
                 IF NOT EXISTS (SELECT 1 FROM idempotent_schema) THEN DROP TABLE idempotent_schema; END IF;\n\
               END IF;\n\
             END $$"
        );
        sqlx::raw_sql(AssertSqlSafe(sql)).execute(admin).await.expect("drop the bench's tables");
    }

    /// The side's tables, schema-qualified where needed, main table first.
    pub(crate) fn tables(side: Side) -> &'static [&'static str] {
        match side {
            Side::Ours => &[PG_OURS],
            Side::Floor => &[PG_FLOOR],
            Side::Peer => {
                &["sql_bench_peer.effects", "sql_bench_peer.effect_events", "sql_bench_peer.late_observations"]
            }
        }
    }

    pub(crate) async fn count(&self, side: Side) -> u64 {
        let sql = format!("SELECT count(*) FROM {}", Self::tables(side)[0]);
        let n: i64 = sqlx::query_scalar(AssertSqlSafe(sql)).fetch_one(&self.admin).await.unwrap();
        n as u64
    }

    pub(crate) async fn columns(&self, table: &str) -> Vec<String> {
        sqlx::query_scalar(
            "SELECT column_name::text FROM information_schema.columns WHERE table_schema = $1 AND table_name = $2 \
             ORDER BY ordinal_position",
        )
        .bind(PG_PEER_SCHEMA)
        .bind(table)
        .fetch_all(&self.admin)
        .await
        .unwrap()
    }
}

impl Target for PostgresTarget {
    type PeerStore = agent_effects_postgres::PostgresStore;
    type Probe = PgProbe;
    const SINGLE_WRITER: bool = false;
    const READ_FIRST: bool = true;

    async fn describe(&self) -> String {
        let row = sqlx::query(
            "SELECT current_setting('server_version'), current_setting('fsync'), \
             current_setting('synchronous_commit'), inet_server_port()",
        )
        .fetch_one(&self.admin)
        .await
        .unwrap();
        let (version, fsync, sync): (String, String, String) = (row.get(0), row.get(1), row.get(2));
        let port: Option<i32> = row.get(3);
        format!(
            "PostgreSQL {version} on port {}, fsync {fsync}, synchronous_commit {sync}; ours and floor: one pool \
             of {PG_CONNECTIONS} connections (the store's), peer: its own pool of {PG_CONNECTIONS}",
            port.unwrap_or(0)
        )
    }

    fn store(&self) -> SharedStore {
        Arc::new(self.ours.clone())
    }

    fn statements(&self) -> u64 {
        self.ours.statements()
    }

    fn peer(&self) -> Option<&agent_effects::Runtime<Self::PeerStore>> {
        self.peer.as_ref()
    }

    async fn floor_first(&self, key: &[u8; 32], stored: &[u8]) {
        floor_first!(&self.floor_sql, self.ours.pool(), key, stored, None::<&tokio::sync::Mutex<()>>)
    }

    fn floor_first_gated(&self, _: &[u8; 32], _: &[u8]) -> Option<impl Future<Output = ()> + Send> {
        None::<std::future::Ready<()>>
    }

    async fn floor_replay(&self, key: &[u8; 32]) {
        floor_read!(select, self.floor_sql, self.ours.pool(), key)
    }

    fn read_first_replay(&self, key: &Key, fp: &Fingerprint) -> Option<impl Future<Output = ()> + Send> {
        let (key, fp) = (*key, *fp);
        Some(async move {
            let row = sqlx::query(self.read_ours.clone())
                .bind(&key.as_bytes()[..])
                .fetch_optional(self.ours.pool())
                .await
                .expect("read-only SELECT of our record")
                .expect("a replay record is there");
            let (token, fingerprint, state): (String, Vec<u8>, String) = (row.get(0), row.get(1), row.get(2));
            let (fence, attempt, recovered, left): (i64, i64, bool, i64) =
                (row.get(3), row.get(4), row.get(5), row.get(6));
            assert!(state == "done" && fingerprint == fp.as_bytes(), "the record is done and ours");
            let result: Option<Vec<u8>> = row.get(7);
            black_box((token, fence, attempt, recovered, left));
            black_box(Acquire::Replay(Bytes::from(result.expect("a done record has a result"))));
        })
    }

    async fn floor_upsert(&self, key: &[u8; 32]) {
        floor_read!(upsert, self.floor_sql, self.ours.pool(), key)
    }

    async fn prefill(&self, side: Side, total: u64, stored: &[u8]) -> u64 {
        let have = self.count(side).await;
        if have >= total {
            return 0;
        }
        let add = total - have;
        match side {
            Side::Ours | Side::Floor => {
                prefill_records!(POSTGRES, &self.admin, Self::tables(side)[0], add, stored)
            }
            Side::Peer => {
                // Copies of one real done effect (and its audit events) under new ids and keys:
                // numbered UUIDs below the runtime's v7 ones, in order.
                let template: sqlx::types::Uuid = sqlx::query_scalar(
                    "SELECT id FROM sql_bench_peer.effects WHERE status = 'committed' ORDER BY id DESC LIMIT 1",
                )
                .fetch_one(&self.admin)
                .await
                .expect("a committed peer effect to copy");
                let from = self.peer_prefilled.fetch_add(add, Ordering::Relaxed) + 1;
                let schema = format!("{PG_PEER_SCHEMA}.");
                prefill_peer!(POSTGRES, self.admin, schema, template, from, add, |table| self.columns(table));
            }
        }
        for table in Self::tables(side) {
            sqlx::raw_sql(AssertSqlSafe(format!("VACUUM ANALYZE {table}"))).execute(&self.admin).await.unwrap();
        }
        add
    }

    async fn probe(&self, _: Side) -> PgProbe {
        let row = sqlx::query(
            "SELECT pg_current_wal_insert_lsn()::text, pg_snapshot_xmax(pg_current_snapshot())::text::bigint",
        )
        .fetch_one(&self.admin)
        .await
        .unwrap();
        PgProbe { lsn: row.get(0), next_xid: row.get(1) }
    }

    async fn probe_end(&self, _: Side, probe: PgProbe) -> Written {
        let row = sqlx::query(
            "SELECT pg_wal_lsn_diff(pg_current_wal_insert_lsn(), $1::pg_lsn)::bigint, \
             pg_snapshot_xmax(pg_current_snapshot())::text::bigint",
        )
        .bind(&probe.lsn)
        .fetch_one(&self.admin)
        .await
        .unwrap();
        let (wal, next_xid): (i64, i64) = (row.get(0), row.get(1));
        Written {
            // Transaction ids assigned: one per write transaction (a read-only one gets none).
            commits: Some((next_xid - probe.next_xid).max(0) as u64),
            rows: None,
            wal_bytes: wal.max(0) as u64,
        }
    }

    async fn storage(&self, side: Side) -> Storage {
        let mut btrees = Vec::new();
        let mut file_bytes = 0;
        for table in Self::tables(side) {
            let row = sqlx::query(AssertSqlSafe(format!(
                "SELECT pg_table_size('{table}'), pg_total_relation_size('{table}'), \
                 (SELECT coalesce(sum(pg_column_size(t.*)), 0)::bigint FROM {table} t)"
            )))
            .fetch_one(&self.admin)
            .await
            .unwrap();
            let (size, total, payload): (i64, i64, i64) = (row.get(0), row.get(1), row.get(2));
            file_bytes += total as u64;
            btrees.push((table.to_string(), size as u64, payload as u64));
            let indexes = sqlx::query(
                "SELECT indexrelid::regclass::text, pg_relation_size(indexrelid) FROM pg_index \
                 WHERE indrelid = $1::regclass ORDER BY 1",
            )
            .bind(*table)
            .fetch_all(&self.admin)
            .await
            .unwrap();
            for ix in indexes {
                btrees.push((ix.get(0), ix.get::<i64, _>(1) as u64, 0));
            }
        }
        Storage { records: self.count(side).await, file_bytes, btrees }
    }
}
