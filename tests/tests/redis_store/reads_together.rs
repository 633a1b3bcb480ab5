//! Replays' reads under load: started while the server is stopped, they wait for a read out and go
//! out together as one `MGET`, each caller still getting its own record; callers that give up hold
//! up no one, waiting reads fail within the command timeout, and go out alone when the reads out are
//! never polled again.

use std::time::{Duration, Instant};

use idempotent_core::{Error, RedisStore, RedisStoreBuilder, RunContext};
use idempotent_tests::{Monitored, RedisServer, unique};

/// Callers whose records are done (caller `i`'s result is `i * 7`), on a store that has replayed
/// enough in a row to read first.
async fn replaying(store: RedisStore, callers: u32) -> RunContext {
    let ctx = RunContext::new(store, unique("run"));
    for i in 0..callers {
        let _: u32 = ctx.step("s").run(&i, |_| async move { Ok::<_, Error>(i * 7) }).await.unwrap();
    }
    for _ in 0..16 {
        let _: u32 = ctx.step("s").run(&0, |_| async { Ok::<_, Error>(1) }).await.unwrap();
    }
    ctx
}

/// Starts the replays of `replaying`'s callers while the server is stopped. On a one-thread
/// runtime, when this returns every caller has run up to its read (sent, or waiting to go out):
/// each yields only there, and each of this task's yields lets the scheduler run up to a tick's
/// worth of the others (61 in tokio 1.54) before this one runs again; one yield per caller is
/// more than enough.
async fn replays_while_stopped(
    server: &RedisServer,
    ctx: &RunContext,
    callers: u32,
) -> Vec<tokio::task::JoinHandle<Result<u32, Error>>> {
    server.pause();
    let started = (0..callers)
        .map(|i| {
            let ctx = ctx.clone();
            tokio::spawn(async move {
                ctx.step("s").run(&i, |_| async { Err::<u32, _>(Error::Config("ran again".into())) }).await
            })
        })
        .collect();
    for _ in 0..callers {
        tokio::task::yield_now().await;
    }
    started
}

/// `callers` replays on a store of two connections from `builder`, all started while the server
/// is stopped (`replays_while_stopped`), so that their reads go out under load; each caller must
/// get its own record. Returns the commands `MONITOR` saw the replays send.
async fn replayed_together(server: &RedisServer, builder: RedisStoreBuilder, callers: u32) -> Monitored {
    let s = builder.pool_size(2).connect_lazy().unwrap();
    s.warm_up().await.unwrap();
    let ctx = replaying(s, callers).await;
    let monitor = server.monitor();
    let started = replays_while_stopped(server, &ctx, callers).await;
    server.resume();
    for (i, caller) in (0..callers).zip(started) {
        assert_eq!(caller.await.expect("a caller panicked").unwrap(), i * 7, "caller {i} did not get its own record");
    }
    monitor.finish()
}

/// Under load, replays' reads wait for a read out to come back and go out together as one
/// `MGET`; each caller still gets its own record.
#[tokio::test(flavor = "current_thread")]
async fn reads_under_load_go_out_together_and_each_caller_gets_its_own_record() {
    const CALLERS: u32 = 100;
    let server = RedisServer::start();
    let seen = replayed_together(&server, RedisStore::builder(server.url()), CALLERS).await;
    let keys = |name: &str| -> Vec<usize> {
        seen.client.iter().zip(&seen.args).filter(|(c, _)| *c == name).map(|(_, n)| *n).collect()
    };
    let (gets, mgets) = (keys("get"), keys("mget"));
    assert_eq!(seen.client.len(), gets.len() + mgets.len(), "a replay sent more than reads: {:?}", seen.client);
    assert!(gets.iter().all(|n| *n == 1), "{gets:?}");
    assert!(
        mgets.iter().any(|n| *n > 1),
        "no read went out together with others: {} GETs, MGETs of {mgets:?} keys",
        gets.len()
    );
    assert_eq!(gets.len() + mgets.iter().sum::<usize>(), CALLERS as usize, "each caller's record is read once");
}

/// A command timeout too long to add to the clock (`Duration::MAX`, no bound in effect) is
/// taken by reads that wait to go out together as by every other call: no panic, each caller
/// its own record.
#[tokio::test(flavor = "current_thread")]
async fn waiting_reads_take_a_command_timeout_too_long_for_the_clock() {
    const CALLERS: u32 = 40;
    let server = RedisServer::start();
    let builder = RedisStore::builder(server.url()).command_timeout(Duration::MAX);
    let seen = replayed_together(&server, builder, CALLERS).await;
    assert!(seen.client.iter().any(|c| c == "mget"), "no read waited to go out together: {:?}", seen.client);
}

/// A caller that gives up while its read is out or waits holds up none of the others; and with
/// no answer at all, a read that waits fails within the command timeout like one that is out.
#[tokio::test(flavor = "current_thread")]
async fn reads_waiting_together_outlive_callers_that_give_up_and_fail_in_time() {
    const CALLERS: u32 = 100;
    let server = RedisServer::start();
    let s = RedisStore::builder(server.url())
        .pool_size(2)
        .command_timeout(Duration::from_millis(300))
        .connect_lazy()
        .unwrap();
    s.warm_up().await.unwrap();
    let ctx = replaying(s, CALLERS).await;

    // Every third caller gives up: the first ones had their reads out, the later ones waited.
    let callers = replays_while_stopped(&server, &ctx, CALLERS).await;
    for caller in callers.iter().step_by(3) {
        caller.abort();
    }
    server.resume();
    for (i, caller) in (0..CALLERS).zip(callers) {
        match caller.await {
            Err(e) => assert!(i % 3 == 0 && e.is_cancelled(), "caller {i}: {e}"),
            Ok(res) => assert_eq!(res.unwrap(), i * 7, "caller {i} did not get its own record"),
        }
    }

    // No answer: every caller fails, those whose reads waited too, within the timeout's bound.
    let started = Instant::now();
    let callers = replays_while_stopped(&server, &ctx, CALLERS).await;
    for (i, caller) in (0..CALLERS).zip(callers) {
        let err = caller.await.unwrap().unwrap_err();
        assert!(err.is_store_failure(), "caller {i}: {err}");
    }
    let took = started.elapsed();
    server.resume();
    assert!(took < Duration::from_secs(3), "the callers took {took:?} to fail, far beyond the 300 ms timeout");
    let again: u32 = ctx.step("s").run(&5, |_| async { Ok::<_, Error>(0) }).await.unwrap();
    assert_eq!(again, 35, "after the outage the record replays");
}

/// A read out whose caller stops polling it holds up the reads waiting behind it for no longer
/// than half the command timeout: they then go out alone.
#[tokio::test(flavor = "current_thread")]
async fn waiting_reads_go_out_alone_when_the_reads_out_are_never_polled_again() {
    let server = RedisServer::start();
    let s = RedisStore::builder(server.url())
        .pool_size(2)
        .command_timeout(Duration::from_millis(400))
        .connect_lazy()
        .unwrap();
    s.warm_up().await.unwrap();
    let ctx = replaying(s, 24).await;
    let replay = |i: u32| {
        let ctx = ctx.clone();
        async move { ctx.step("s").run(&i, |_| async { Err::<u32, _>(Error::Config("ran again".into())) }).await }
    };
    // Sixteen replays polled once (each sends its read) and then never again: their reads stay
    // counted as out, so the store is busy and every further read waits.
    let mut held: Vec<futures_util::future::LocalBoxFuture<'_, Result<u32, Error>>> =
        (0..16).map(|i| Box::pin(replay(i)) as _).collect();
    for f in &mut held {
        std::future::poll_fn(|cx| {
            assert!(f.as_mut().poll(cx).is_pending(), "a replay answered before its reply could arrive");
            std::task::Poll::Ready(())
        })
        .await;
    }
    let started = Instant::now();
    for i in 16..24 {
        assert_eq!(replay(i).await.unwrap(), i * 7, "caller {i} did not get its own record");
    }
    let took = started.elapsed();
    assert!(took >= Duration::from_millis(8 * 200), "the waiting reads did not wait: {took:?}");
    assert!(took < Duration::from_secs(8), "the waiting reads took {took:?}");
    drop(held);
}
