//! The floor: the statements a record's row needs at the least, on a table made from our store's,
//! in each database's dialect (and the macros that run them on a pool of either).

use super::*;

/// The columns the bench writes in a record's row, ours and the floor's alike: those of our
/// store's table (schema version 3: idempotent-core's `store/sql/mod.rs`), in its order. The
/// floor's table itself is made from our store's (see [`SqliteTarget::open`] and
/// [`PostgresTarget::open`]), so its columns, types, constraints and indexes follow the store's.
pub(crate) const RECORD_COLUMNS: &str = "key, fingerprint, state, token, fence, attempt, recovered, lease_until, expires_at, \
                              result, step, run_id, tenant, created_at, updated_at";
/// The token, lease and retention of the floor's rows.
pub(crate) const FLOOR_TOKEN: &str = "0123456789abcdef0123456789abcdef";
pub(crate) const LEASE_US: i64 = 60_000_000;
pub(crate) const KEEP_US: i64 = 86_400_000_000;

/// The floor's statements on a table of our columns, in SQL both databases read (`$n`
/// placeholders, `false` for a boolean), with the table's name in them.
pub(crate) struct FloorSql {
    /// A first execution's claim: `INSERT … ON CONFLICT (key) DO NOTHING` of a running row.
    pub(crate) claim: SqlStr,
    /// A first execution's outcome: `UPDATE … WHERE key = $1`, as our complete writes it.
    pub(crate) done: SqlStr,
    /// The replay floor: `SELECT … WHERE key = $1`.
    pub(crate) select: SqlStr,
    /// A diagnostic: an upsert that changes nothing and returns the row.
    pub(crate) upsert: SqlStr,
}

impl FloorSql {
    pub(crate) fn new(table: &str) -> FloorSql {
        let sql = |s: String| AssertSqlSafe(s).into_sql_str();
        FloorSql {
            claim: sql(format!(
                "INSERT INTO {table} ({RECORD_COLUMNS}) VALUES ($1, $2, 'running', $3, $4, 1, false, $5, $6, NULL, \
                 'floor', NULL, NULL, $4, $4) ON CONFLICT (key) DO NOTHING"
            )),
            done: sql(format!(
                "UPDATE {table} SET state = 'done', result = $2, expires_at = $3, updated_at = $4 WHERE key = $1"
            )),
            select: sql(format!("SELECT fingerprint, state, result FROM {table} WHERE key = $1")),
            upsert: sql(format!(
                "INSERT INTO {table} ({RECORD_COLUMNS}) VALUES ($1, $2, 'running', $3, 0, 1, false, 0, 0, NULL, '', \
                 NULL, NULL, 0, 0) ON CONFLICT (key) DO UPDATE SET state = {table}.state RETURNING fingerprint, \
                 state, result"
            )),
        }
    }
}

/// What the prefill statements say differently in the two databases.
pub(crate) struct Dialect {
    /// 32 random bytes, and 32 random hex characters.
    pub(crate) random_bytes: &'static str,
    pub(crate) random_hex: &'static str,
    /// A numbered peer effect id from `c.n`.
    pub(crate) peer_id: &'static str,
    /// How a write transaction begins.
    pub(crate) begin: &'static str,
    /// Rows `c(n)` for n in `from..=to` (SQL expressions): what goes before the `INSERT`, and its
    /// `FROM` item.
    pub(crate) series: fn(&str, &str) -> (String, String),
}

pub(crate) const SQLITE: Dialect = Dialect {
    random_bytes: "randomblob(32)",
    random_hex: "lower(hex(randomblob(16)))",
    peer_id: "printf('00000000-0000-7000-8000-%012x', c.n)",
    begin: "BEGIN IMMEDIATE",
    series: |from, to| {
        (format!("WITH RECURSIVE c(n) AS (SELECT {from} UNION ALL SELECT n + 1 FROM c WHERE n < {to})\n"), "c".into())
    },
};

pub(crate) const POSTGRES: Dialect = Dialect {
    random_bytes: "decode(md5(random()::text) || md5(random()::text), 'hex')",
    random_hex: "md5(random()::text)",
    peer_id: "('00000000-0000-7000-8000-' || lpad(to_hex(c.n), 12, '0'))::uuid",
    begin: "BEGIN",
    series: |from, to| (String::new(), format!("generate_series({from}::bigint, {to}::bigint) AS c(n)")),
};

impl Dialect {
    /// Prefills `table` (ours or the floor's) with `$1` realistic done rows of schema version 3
    /// (random key, fingerprint and token, the stored result; fence and times `$2`, lease `$3`,
    /// expiry `$4`, result `$5`), in one statement.
    pub(crate) fn prefill_records(&self, table: &str) -> String {
        let (with, from) = (self.series)("1", "$1");
        let rb = self.random_bytes;
        format!(
            "{with}INSERT INTO {table} ({RECORD_COLUMNS})\n\
             SELECT {rb}, {rb}, 'done', {hex}, $2, 1, false, $3, $4, $5, 'prefill', NULL, NULL, $2, $2 FROM {from}",
            hex = self.random_hex,
        )
    }

    /// Copies the peer's row `$3` of `table` (by `template_col`) as effects numbered `$1..=$2`,
    /// with new ids and logical keys.
    pub(crate) fn prefill_peer(&self, table: &str, cols: &[String], template_col: &str) -> String {
        let (with, from) = (self.series)("$1", "$2");
        let exprs: Vec<String> = cols
            .iter()
            .map(|c| match c.as_str() {
                "id" | "effect_id" => self.peer_id.to_owned(),
                "logical_key" => self.random_hex.to_owned(),
                other => format!("t.\"{other}\""),
            })
            .collect();
        let cols: Vec<String> = cols.iter().map(|c| format!("\"{c}\"")).collect();
        format!(
            "{with}INSERT INTO {table} ({}) SELECT {} FROM {from}, {table} t WHERE t.{template_col} = $3",
            cols.join(", "),
            exprs.join(", ")
        )
    }
}

/// A first execution on the floor: the claim, then the outcome, on `$pool`, each under the
/// mutex `$gate` (an `Option`) if given. A macro rather than a function generic over sqlx's
/// `Database`, whose bounds for each bound type would outweigh the body; the same for the next.
macro_rules! floor_first {
    ($sql:expr, $pool:expr, $key:expr, $stored:expr, $gate:expr) => {{
        let (sql, key, now): (&FloorSql, &[u8; 32], i64) = ($sql, $key, now_us());
        let held = match $gate {
            Some(g) => Some(g.lock().await),
            None => None,
        };
        let claimed = sqlx::query(sql.claim.clone())
            .bind(&key[..])
            .bind(&[7u8; 32][..])
            .bind(FLOOR_TOKEN)
            .bind(now)
            .bind(now + LEASE_US)
            .bind(now + KEEP_US)
            .execute($pool)
            .await
            .expect("floor INSERT");
        assert_eq!(claimed.rows_affected(), 1, "a fresh floor key was taken");
        drop(held);
        let held = match $gate {
            Some(g) => Some(g.lock().await),
            None => None,
        };
        let done = sqlx::query(sql.done.clone())
            .bind(&key[..])
            .bind($stored)
            .bind(now + KEEP_US)
            .bind(now)
            .execute($pool)
            .await
            .expect("floor UPDATE");
        drop(held);
        assert_eq!(done.rows_affected(), 1);
    }};
}

/// The replay floor (`select`) or the no-op upsert (`upsert`) on `$pool`: the done row of `$key`.
macro_rules! floor_read {
    (select, $sql:expr, $pool:expr, $key:expr) => {
        floor_read!(@row sqlx::query($sql.select.clone()).bind(&$key[..]), $pool, "floor SELECT")
    };
    (upsert, $sql:expr, $pool:expr, $key:expr) => {
        floor_read!(@row sqlx::query($sql.upsert.clone()).bind(&$key[..]).bind(&[7u8; 32][..]).bind(FLOOR_TOKEN),
            $pool, "floor upsert")
    };
    (@row $query:expr, $pool:expr, $what:literal) => {{
        let row = $query.fetch_one($pool).await.expect($what);
        let result: Option<Vec<u8>> = row.get(2);
        black_box((row.get::<&[u8], _>(0), row.get::<&str, _>(1)));
        assert!(result.is_some(), "the floor's replay row is done");
    }};
}

/// Prefills `$table` on `$pool` with `$add` done rows ([`Dialect::prefill_records`]).
macro_rules! prefill_records {
    ($dialect:expr, $pool:expr, $table:expr, $add:expr, $stored:expr) => {{
        let now = now_us();
        sqlx::query(AssertSqlSafe($dialect.prefill_records($table)))
            .bind($add as i64)
            .bind(now)
            .bind(now + LEASE_US)
            .bind(now + KEEP_US)
            .bind($stored)
            .execute($pool)
            .await
            .expect("prefill");
    }};
}

/// Prefills the peer's `effects` and `effect_events` on `$pool` (in one transaction) with `$add`
/// copies of its effect `$template` numbered from `$from`; `$columns` lists the columns of
/// `$table` and `$schema` is what goes before a table's name.
macro_rules! prefill_peer {
    ($dialect:expr, $pool:expr, $schema:expr, $template:expr, $from:expr, $add:expr, |$t:ident| $columns:expr) => {{
        let mut tx = $pool.begin_with($dialect.begin).await.unwrap();
        for (table, template_col) in [("effects", "id"), ("effect_events", "effect_id")] {
            let $t = table;
            let cols: Vec<String> = $columns.await;
            let sql = $dialect.prefill_peer(&format!("{}{table}", $schema), &cols, template_col);
            sqlx::query(AssertSqlSafe(sql))
                .bind($from as i64)
                .bind(($from + $add - 1) as i64)
                .bind(&$template)
                .execute(&mut *tx)
                .await
                .expect("prefill the peer");
        }
        tx.commit().await.unwrap();
    }};
}
