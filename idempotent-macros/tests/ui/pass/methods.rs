//! `&self`, `&mut self` and `self` receivers; `self` is never part of the payload.

use idempotent_core::{Error, MemoryStore, RunContext, idempotent};

struct Account {
    entries: Vec<String>,
}

impl Account {
    #[idempotent(step = "count")]
    async fn count(&self, ctx: &RunContext) -> Result<usize, Error> {
        Ok(self.entries.len())
    }

    #[idempotent(step = "append")]
    async fn append(&mut self, ctx: &RunContext, entry: String) -> Result<usize, Error> {
        self.entries.push(entry);
        Ok(self.entries.len())
    }

    #[idempotent(step = "close")]
    async fn close(self, ctx: RunContext) -> Result<Vec<String>, Error> {
        Ok(self.entries)
    }

    #[idempotent(step = "merge")]
    async fn merged_len(&self, ctx: &RunContext, other: &Self) -> Result<usize, Error>
    where
        Self: Sized,
    {
        Ok(self.entries.len() + other.entries.len())
    }
}

impl serde::Serialize for Account {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.entries.serialize(s)
    }
}

fn main() {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let ctx = RunContext::new(MemoryStore::new(), "run-m");
        let mut account = Account { entries: vec![] };
        assert_eq!(account.append(&ctx, "a".into()).await.unwrap(), 1);
        assert_eq!(account.append(&ctx, "a".into()).await.unwrap(), 1); // replayed
        assert_eq!(account.entries.len(), 1);
        assert_eq!(account.count(&ctx).await.unwrap(), 1);
        let other = Account { entries: vec!["x".into()] };
        assert_eq!(account.merged_len(&ctx, &other).await.unwrap(), 2);
        assert_eq!(account.close(ctx.clone()).await.unwrap(), vec!["a".to_owned()]);
    });
}
