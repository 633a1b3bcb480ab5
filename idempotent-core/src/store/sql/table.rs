//! How the statements name a store's tables: the records' table, its state table and the
//! registry `idempotent_schema`, each in the store's schema when it has one (PostgreSQL's
//! `PostgresStoreBuilder::schema`), else unqualified (PostgreSQL: the connection's
//! `current_schema()`; SQLite: the file's `main`).

use std::fmt;

/// A table of a store: its name (a validated identifier) and the schema it lives in, if named.
///
/// `Display` writes it as the statements do: `"schema"."name"` or `"name"`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Table {
    schema: Option<String>,
    name: String,
}

impl Table {
    /// `name` in `schema` (both validated identifiers), or unqualified.
    pub(crate) fn new(schema: Option<String>, name: String) -> Self {
        Table { schema, name }
    }

    /// The table's own name, unquoted: the registry's key, and the stem of its indexes' names.
    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    /// The schema it was put in, if one was named.
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    pub(crate) fn schema(&self) -> Option<&str> {
        self.schema.as_deref()
    }

    /// The table `name` next to this one (in the same schema).
    pub(crate) fn sibling(&self, name: String) -> Table {
        Table { schema: self.schema.clone(), name }
    }

    /// The schema registry `idempotent_schema` that registers this table.
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    pub(crate) fn registry(&self) -> Table {
        self.sibling("idempotent_schema".to_owned())
    }

    /// `schema.name` or `name`, for messages.
    pub(crate) fn shown(&self) -> String {
        match &self.schema {
            Some(schema) => format!("{schema}.{}", self.name),
            None => self.name.clone(),
        }
    }
}

impl fmt::Display for Table {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(schema) = &self.schema {
            write!(f, "\"{schema}\".")?;
        }
        write!(f, "\"{}\"", self.name)
    }
}

#[cfg(test)]
mod tests {
    use super::Table;

    #[test]
    fn statements_quote_and_qualify() {
        let plain = Table::new(None, "records".to_owned());
        assert_eq!(plain.to_string(), "\"records\"");
        assert_eq!(plain.registry().to_string(), "\"idempotent_schema\"");
        let qualified = Table::new(Some("payments".to_owned()), "records".to_owned());
        assert_eq!(qualified.to_string(), "\"payments\".\"records\"");
        assert_eq!(qualified.sibling("records_state".to_owned()).to_string(), "\"payments\".\"records_state\"");
        assert_eq!(qualified.registry().to_string(), "\"payments\".\"idempotent_schema\"");
        assert_eq!(qualified.shown(), "payments.records");
        assert_eq!(qualified.name(), "records");
    }
}
