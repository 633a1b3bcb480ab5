//! A payment provider's ledger in a file, shared by processes: what the uncertain-outcome tests
//! charge, verify against, and count.
//!
//! It deduplicates charges by their idempotency key, as Stripe does: a second charge under a
//! key it has seen answers the first charge and moves no money. A charge is one line,
//! `<idempotency key> <charge id> <amount>`, appended with one write and flushed before the
//! call returns, so that a process killed right after it leaves the charge in the file.

use std::io::Write;
use std::path::{Path, PathBuf};

/// A ledger file (created on the first charge).
#[derive(Debug, Clone)]
pub struct Ledger {
    path: PathBuf,
}

/// One charge the ledger holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Charge {
    /// The idempotency key it was made under.
    pub key: String,
    /// The provider's id for it.
    pub id: String,
    /// The amount, in cents.
    pub amount: u64,
}

impl Ledger {
    /// The ledger in the file at `path`.
    pub fn at(path: impl AsRef<Path>) -> Ledger {
        Ledger { path: path.as_ref().to_owned() }
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Charges `amount` under the idempotency key `key`, once: a repeat under the same key
    /// answers the first charge's id and charges nothing. Not safe against a concurrent charge
    /// under the same key from another process (the tests serialise those by the step's lease).
    pub fn charge(&self, key: &str, amount: u64) -> String {
        if let Some(charge) = self.find(key) {
            return charge.id;
        }
        let id = format!("ch_{}", &key[..key.len().min(12)]);
        let mut file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.path)
            .unwrap_or_else(|e| panic!("open the ledger {}: {e}", self.path.display()));
        file.write_all(format!("{key} {id} {amount}\n").as_bytes()).expect("append to the ledger");
        file.sync_data().expect("flush the ledger");
        id
    }

    /// The charge made under `key`, if any.
    pub fn find(&self, key: &str) -> Option<Charge> {
        self.charges().into_iter().find(|c| c.key == key)
    }

    /// Every charge, in the order made.
    pub fn charges(&self) -> Vec<Charge> {
        let Ok(text) = std::fs::read_to_string(&self.path) else { return Vec::new() };
        text.lines()
            .map(|line| {
                let mut parts = line.split(' ');
                let (Some(key), Some(id), Some(amount)) = (parts.next(), parts.next(), parts.next()) else {
                    panic!("a torn ledger line: {line:?}")
                };
                Charge { key: key.to_owned(), id: id.to_owned(), amount: amount.parse().expect("an amount") }
            })
            .collect()
    }
}
