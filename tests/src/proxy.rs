//! A TCP proxy that injects faults between a client and a server on loopback.
//!
//! Point the store at [`FaultProxy::url`] instead of the server and switch [`Fault`]s per test:
//! added latency, connection resets, a blackhole (bytes are swallowed, nothing answers), or
//! "forward the request but drop the reply" — the fault that makes a client believe a command
//! failed when the server executed it.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// What the proxy does to traffic.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Forward both ways.
    Pass,
    /// Forward both ways, delaying each chunk by a duration chosen uniformly in `min..=max`.
    Latency {
        /// Shortest delay.
        min: Duration,
        /// Longest delay.
        max: Duration,
    },
    /// Reset every open connection and every new one.
    Reset,
    /// A partition: accept, forward nothing, answer nothing, until the fault changes; held bytes
    /// are then delivered in order (or dropped with the connection on `Reset`).
    Blackhole,
    /// Forward client → server, but drop server → client (then reset, as a lost reply would).
    DropReplies,
    /// Forward both ways, but drop each reply chunk with probability `percent`/100 (then reset
    /// the connection, as a lost reply would): the server executed the command, the client never
    /// hears of it, for a random fraction of the commands.
    DropSomeReplies {
        /// The share of replies lost, in percent.
        percent: u8,
    },
}

/// A running proxy; stops when dropped.
#[derive(Debug)]
pub struct FaultProxy {
    addr: SocketAddr,
    fault: watch::Sender<Fault>,
    forwarded_replies: Arc<Mutex<u64>>,
    /// Connections open (a client's accepted, its forwarding not yet ended).
    open: watch::Sender<usize>,
    task: tokio::task::JoinHandle<()>,
}

impl FaultProxy {
    /// Starts a proxy on a free loopback port forwarding to `upstream` (e.g. `127.0.0.1:7001`).
    pub async fn start(upstream: SocketAddr) -> FaultProxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind the proxy");
        let addr = listener.local_addr().unwrap();
        let (fault, rx) = watch::channel(Fault::Pass);
        let forwarded_replies = Arc::new(Mutex::new(0));
        let counter = forwarded_replies.clone();
        let open = watch::Sender::new(0);
        let opened = open.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((client, _)) = listener.accept().await else { return };
                let rx = rx.clone();
                let counter = counter.clone();
                let opened = opened.clone();
                opened.send_modify(|n| *n += 1);
                tokio::spawn(async move {
                    let _ = serve(client, upstream, rx, counter).await;
                    opened.send_modify(|n| *n -= 1);
                });
            }
        });
        FaultProxy { addr, fault, forwarded_replies, open, task }
    }

    /// The proxy's `redis://` URL.
    pub fn url(&self) -> String {
        format!("redis://{}", self.addr)
    }

    /// The proxy's address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Switches the fault for open and new connections.
    pub fn set(&self, fault: Fault) {
        self.fault.send_replace(fault);
    }

    /// Resets every open connection, dropping whatever a [`Fault::Blackhole`] held, and returns
    /// once all of them are closed (then new connections are reset too, until the fault changes).
    pub async fn reset_all(&self) {
        self.set(Fault::Reset);
        let mut open = self.open.subscribe();
        let _ = open.wait_for(|n| *n == 0).await;
    }

    /// How many reply chunks were forwarded to clients so far.
    pub fn forwarded_replies(&self) -> u64 {
        *self.forwarded_replies.lock().unwrap()
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn serve(
    client: TcpStream,
    upstream: SocketAddr,
    mut rx: watch::Receiver<Fault>,
    counter: Arc<Mutex<u64>>,
) -> std::io::Result<()> {
    let fault = *rx.borrow_and_update();
    if fault == Fault::Reset {
        client.set_zero_linger()?;
        return Ok(());
    }
    let server = TcpStream::connect(upstream).await?;
    client.set_nodelay(true)?;
    server.set_nodelay(true)?;
    let (mut cr, mut cw) = client.into_split();
    let (mut sr, mut sw) = server.into_split();
    let up_rx = rx.clone();
    let up = async move {
        let mut rx = up_rx;
        let mut buf = vec![0u8; 16 * 1024];
        loop {
            let n = tokio::select! {
                r = cr.read(&mut buf) => r?,
                _ = wait_reset(&mut rx) => return Ok::<_, std::io::Error>(()),
            };
            if n == 0 {
                return Ok(());
            }
            match past_blackhole(&mut rx).await {
                Fault::Reset => return Ok(()),
                Fault::Latency { min, max } => tokio::time::sleep(pick(min, max)).await,
                _ => {}
            }
            sw.write_all(&buf[..n]).await?;
        }
    };
    let down = async move {
        let mut buf = vec![0u8; 16 * 1024];
        loop {
            let n = tokio::select! {
                r = sr.read(&mut buf) => r?,
                _ = wait_reset(&mut rx) => return Ok::<_, std::io::Error>(()),
            };
            if n == 0 {
                return Ok(());
            }
            match past_blackhole(&mut rx).await {
                Fault::Reset => return Ok(()),
                // The server executed the command; the client never hears of it.
                Fault::DropReplies => return Ok(()),
                Fault::DropSomeReplies { percent } if roll() < u64::from(percent) => return Ok(()),
                Fault::Latency { min, max } => tokio::time::sleep(pick(min, max)).await,
                _ => {}
            }
            cw.write_all(&buf[..n]).await?;
            *counter.lock().unwrap() += 1;
        }
    };
    // Whichever side ends first ends the connection (dropping both halves closes both sockets).
    tokio::select! {
        r = up => r,
        r = down => r,
    }
}

/// The fault to apply to a chunk just read. While the fault is `Blackhole` the chunk is held (and,
/// since nothing more is read, the sender is stalled by TCP flow control), as a partition does:
/// TCP never delivers later bytes without the earlier ones, so bytes are never dropped from the
/// middle of a stream — dropping them would desynchronize request/reply pairing in a way no real
/// network can. When the partition ends the chunk goes on (or the connection is reset).
async fn past_blackhole(rx: &mut watch::Receiver<Fault>) -> Fault {
    loop {
        let fault = *rx.borrow_and_update();
        if fault != Fault::Blackhole {
            return fault;
        }
        if rx.changed().await.is_err() {
            return Fault::Reset;
        }
    }
}

/// Completes when the fault becomes `Reset`.
async fn wait_reset(rx: &mut watch::Receiver<Fault>) {
    loop {
        if *rx.borrow_and_update() == Fault::Reset {
            return;
        }
        if rx.changed().await.is_err() {
            std::future::pending::<()>().await;
        }
    }
}

/// A number in `0..100`, spread evenly (splitmix64 over a shared counter).
fn roll() -> u64 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0x853c_49e6_748f_ea9b);
    let mut z = NEXT.fetch_add(0x9e37_79b9_7f4a_7c15, Ordering::Relaxed);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    (z ^ (z >> 31)) % 100
}

fn pick(min: Duration, max: Duration) -> Duration {
    if max <= min {
        return min;
    }
    let span = (max - min).as_micros() as u64;
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().subsec_nanos() as u64;
    // A cheap spread is enough here: jitter only has to vary, not be unpredictable.
    let r = (nanos.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407) >> 11) % (span + 1);
    min + Duration::from_micros(r)
}

/// A TCP proxy for one HTTP request per connection. It forwards the request; when `lose` says so
/// for the request's head, it waits until the server starts answering (so the request was
/// processed), then closes the client's connection without a byte of the reply.
///
/// `FaultProxy::set(Fault::DropReplies)` loses every reply; this one loses the replies of the
/// attempts a test chose, so that 100 concurrent requests can each lose a known number.
#[derive(Debug)]
pub struct LossyProxy {
    addr: SocketAddr,
    lost: Arc<AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl LossyProxy {
    /// The proxy's address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Starts a proxy on a free loopback port forwarding to `upstream`; `lose` gets each
    /// request's head (request line and headers) and says whether to lose its reply.
    pub async fn start(upstream: SocketAddr, lose: impl Fn(&str) -> bool + Send + Sync + 'static) -> LossyProxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let lose = Arc::new(lose);
        let lost = Arc::new(AtomicUsize::new(0));
        let counter = lost.clone();
        let task = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let (lose, counter) = (lose.clone(), counter.clone());
                tokio::spawn(async move {
                    let _ = relay(client, upstream, &*lose, &counter).await;
                });
            }
        });
        LossyProxy { addr, lost, task }
    }

    /// How many replies were lost so far (the server had started answering each).
    pub fn lost(&self) -> usize {
        self.lost.load(Ordering::SeqCst)
    }
}

impl Drop for LossyProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn relay(
    mut client: TcpStream,
    upstream: SocketAddr,
    lose: &(dyn Fn(&str) -> bool + Send + Sync),
    lost: &AtomicUsize,
) -> std::io::Result<()> {
    let mut head = Vec::new();
    let mut buf = vec![0u8; 16 * 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = client.read(&mut buf).await?;
        if n == 0 {
            return Ok(());
        }
        head.extend_from_slice(&buf[..n]);
    }
    let mut server = TcpStream::connect(upstream).await?;
    server.write_all(&head).await?;
    if !lose(&String::from_utf8_lossy(&head)) {
        tokio::io::copy_bidirectional(&mut client, &mut server).await?;
        return Ok(());
    }
    let (mut client_read, client_write) = client.into_split();
    let (mut server_read, mut server_write) = server.into_split();
    let rest_of_request = tokio::spawn(async move {
        let _ = tokio::io::copy(&mut client_read, &mut server_write).await;
    });
    // The first bytes of the reply: the server has processed the request.
    let n = server_read.read(&mut buf).await?;
    rest_of_request.abort();
    drop(client_write);
    if n > 0 {
        lost.fetch_add(1, Ordering::SeqCst);
    }
    Ok(())
}
