//! The SQL stores beyond the conformance suite, on SQLite (`sqlite::…`) and PostgreSQL
//! (`postgres::…`): the scenarios written once in `idempotent_tests::sql_store`, each on an empty
//! database of its own. What only one of them does is in `sqlite_store.rs` and
//! `postgres_store.rs`.

use idempotent_tests::sql_store::*;

idempotent_tests::on_every_store!(
    sql: one_key_under_64_tasks_on_4_pools_runs_the_action_once,
    two_hundred_keys_by_eight_callers_run_200_actions,
    purge_never_removes_a_record_that_needs_attention,
    an_incompatible_table_is_refused_and_left_alone,
    a_table_name_that_is_not_an_identifier_is_refused,
);
