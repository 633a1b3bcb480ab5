//! `ctx = self.field`: the run context is a field of the receiver, owned (`RunContext`) or
//! shared (`Arc<RunContext>`), at any depth, with every kind of receiver.

use std::sync::Arc;

use idempotent_core::{Error, MemoryStore, RunContext, idempotent};

struct Owned {
    ctx: RunContext,
    runs: u32,
}

impl Owned {
    #[idempotent(step = "owned_ref", ctx = self.ctx)]
    async fn by_ref(&self, n: u32) -> Result<u32, Error> {
        Ok(n + self.runs)
    }

    #[idempotent(step = "owned_mut", ctx = self.ctx)]
    async fn by_mut(&mut self, n: u32) -> Result<u32, Error> {
        self.runs += 1;
        Ok(n + self.runs)
    }

    #[idempotent(step = "owned_value", ctx = self.ctx)]
    async fn by_value(self, n: u32) -> Result<u32, Error> {
        // The body still owns `self`, context field included.
        let Owned { ctx, runs } = self;
        Ok(n + runs + ctx.run_id().len() as u32)
    }
}

struct Shared {
    ctx: Arc<RunContext>,
}

impl Shared {
    #[idempotent(step = "shared", ctx = self.ctx)]
    async fn call(&self, n: u32) -> Result<u32, Error> {
        Ok(n * 2)
    }
}

struct Service {
    inner: Shared,
}

struct Tuple(RunContext);

impl Service {
    #[idempotent(step = "nested", ctx = self.inner.ctx, crate = "::idempotent_core")]
    async fn call(&self, n: u32) -> Result<u32, Error> {
        Ok(n * 3)
    }
}

impl Tuple {
    #[idempotent(step = "tuple", ctx = self.0)]
    async fn call(&self, n: u32) -> Result<u32, Error> {
        Ok(n * 4)
    }
}

fn main() {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let ctx = RunContext::new(MemoryStore::new(), "run-f");
        let mut owned = Owned { ctx: ctx.clone(), runs: 0 };
        assert_eq!(owned.by_ref(1).await.unwrap(), 1);
        assert_eq!(owned.by_mut(1).await.unwrap(), 2);
        assert_eq!(owned.by_mut(1).await.unwrap(), 2); // replayed
        assert_eq!(owned.runs, 1);
        assert_eq!(owned.by_value(1).await.unwrap(), 7);

        let shared = Shared { ctx: Arc::new(ctx.clone()) };
        assert_eq!(shared.call(5).await.unwrap(), 10);
        let service = Service { inner: shared };
        assert_eq!(service.call(5).await.unwrap(), 15);
        assert_eq!(Tuple(ctx).call(5).await.unwrap(), 20);
    });
}
