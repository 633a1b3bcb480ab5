//! Creating and checking the tables, once for both databases: the records' table (schema version
//! 3) and a state table (version 1), each registered in `idempotent_schema`. A table this crate
//! did not create, or of another version or shape, is refused with an [`Error::Config`] saying
//! what to do, and never altered. (The pre-release versions 1 and 2 of the records' table were
//! never published; they are refused like any other version.)

use super::SqlStore;
use super::backend::Backend;
use super::driver::Driver;
use super::table::Table;
use crate::error::Error;

/// The schema version of the records' table this crate writes and reads.
pub(crate) const SCHEMA_VERSION: i64 = 3;

/// The schema version of the state table this crate writes and reads.
pub(crate) const STATE_SCHEMA_VERSION: i64 = 1;

/// Whether `name` can name a table of the store: an identifier the statements quote as it is
/// (ASCII letters, digits and `_`, not starting with a digit), at most `max_len` bytes, and not
/// the schema registry `idempotent_schema` in any case. A backend adds its own reserved names.
pub(crate) fn plain_table_name(name: &str, max_len: usize) -> bool {
    let mut chars = name.chars();
    chars.next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
        && name.len() <= max_len
        && !name.eq_ignore_ascii_case("idempotent_schema")
}

impl<B: Backend> SqlStore<B> {
    /// [`migrate`](Self::migrate), its failures reported as `op` (`open` when opening the store).
    pub(super) async fn migrate_as(&self, op: &'static str) -> Result<(), Error> {
        B::bound_migration(self, op, self.migrate_records(op)).await
    }

    async fn migrate_records(&self, op: &'static str) -> Result<(), Error> {
        let err = |e: sqlx::Error| self.error(op, e);
        let table = &self.inner.table;
        let shown = table.shown();
        let db = &self.inner.describe;
        let builder = B::BUILDER_TABLE;
        let mut tx = B::begin_migration(self).await.map_err(err)?;
        let version = B::registered_version(&mut tx, table).await.map_err(err)?;
        let columns = B::columns(&mut tx, table).await.map_err(err)?;
        let exists = B::exists(&mut tx, table).await.map_err(err)?;
        let expected = B::expected_columns();
        match version {
            Some(SCHEMA_VERSION) if columns == expected => {}
            Some(SCHEMA_VERSION) => {
                return Err(Error::Config(format!(
                    "{db}: table `{shown}` is marked as idempotent schema version {SCHEMA_VERSION} but has the \
                     columns ({}) instead of ({}); it was changed by hand. Restore it, or drop it and its row in \
                     idempotent_schema (losing its records), or choose another table with {builder}",
                    columns.join(", "),
                    expected.join(", ")
                )));
            }
            Some(v) => {
                return Err(Error::Config(format!(
                    "{db}: table `{shown}` has idempotent schema version {v}, and this version of idempotent-core \
                     reads version {SCHEMA_VERSION} only; use the idempotent-core that wrote it, or choose another \
                     table with {builder}"
                )));
            }
            None if exists => {
                return Err(Error::Config(format!(
                    "{db}: table `{shown}` exists (columns: {}) but was not created by idempotent-core; it was left \
                     as it is. Choose another table with {builder}, or drop that one",
                    columns.join(", ")
                )));
            }
            None => {
                B::Db::run_ddl(&mut tx, B::create_records(table)).await.map_err(err)?;
                B::register(&mut tx, table, SCHEMA_VERSION).await.map_err(err)?;
            }
        }
        tx.commit().await.map_err(err)
    }

    /// Creates the state table `table` if it is missing, or checks that it is the one this
    /// crate creates.
    pub(super) async fn migrate_state_table(&self, table: &Table) -> Result<(), Error> {
        let err = |e: sqlx::Error| self.error("migrate", e);
        let shown = table.shown();
        let db = &self.inner.describe;
        let mut tx = B::begin_migration(self).await.map_err(err)?;
        let version = B::registered_version(&mut tx, table).await.map_err(err)?;
        let exists = B::exists(&mut tx, table).await.map_err(err)?;
        match version {
            Some(STATE_SCHEMA_VERSION) if exists => {}
            Some(v) => {
                return Err(Error::Config(format!(
                    "{db}: state table `{shown}` is marked as schema version {v} (or is missing), and this version \
                     of idempotent-core reads version {STATE_SCHEMA_VERSION} only; use the idempotent-core that \
                     wrote it, or drop it and its row in idempotent_schema (losing its states)"
                )));
            }
            None if exists => {
                return Err(Error::Config(format!(
                    "{db}: table `{shown}` exists but was not created by idempotent-core; it was left as it is. \
                     Drop it, or name the store's table otherwise ({}), which renames the state table",
                    B::BUILDER_TABLE
                )));
            }
            None => {
                B::Db::run_ddl(&mut tx, B::create_state(table)).await.map_err(err)?;
                B::register(&mut tx, table, STATE_SCHEMA_VERSION).await.map_err(err)?;
            }
        }
        tx.commit().await.map_err(err)
    }
}
