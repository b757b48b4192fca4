//! A TCP proxy on a free loopback port that delays everything it forwards by a fixed time each way: the
//! network between a service's pods and their database, which is never loopback. Bytes keep their order;
//! the delay is added to each chunk as it is read, so bandwidth is not limited. It can also make the
//! connections it already carries stop answering ([`DelayProxy::stall`]): a failover that left clients
//! holding half-open connections; or, told nothing of a close either ([`DelayProxy::vanish`]), a host
//! gone. Or it can close them and refuse new ones until told otherwise ([`DelayProxy::cut`],
//! [`DelayProxy::mend`]): a link down for a while. Or it can carry only so many bytes a second each way
//! ([`DelayProxy::narrow`]): a slow network. Or, for PostgreSQL, it can pass on everything but the
//! server's notices ([`DelayProxy::without_notices`]): a pooler in transaction mode.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio::time::Instant;

pub struct DelayProxy {
    pub port: u16,
    accept: JoinHandle<()>,
    /// Connections accepted so far; each is numbered in that order.
    accepted: Arc<AtomicU64>,
    /// Connections numbered below this stopped forwarding.
    stalled_below: Arc<AtomicU64>,
    /// Whether a stalled connection keeps a close from one side to itself (see [`DelayProxy::vanish`]).
    silent: Arc<AtomicBool>,
    /// Whether new connections are closed at once (see [`DelayProxy::cut`]).
    refusing: Arc<AtomicBool>,
    /// The forwarding tasks of the connections accepted so far.
    links: Arc<Mutex<Vec<JoinHandle<()>>>>,
}

impl DelayProxy {
    /// Forwards connections to `127.0.0.1:target`, `delay` each way.
    pub async fn start(target: u16, delay: Duration) -> DelayProxy {
        Self::open(target, Shape { delay, ..Shape::default() }).await
    }

    /// Forwards connections to `127.0.0.1:target`, each carrying at most `bytes_per_second` each way.
    pub async fn narrow(target: u16, bytes_per_second: u64) -> DelayProxy {
        Self::open(target, Shape { bytes_per_second: Some(bytes_per_second), ..Shape::default() }).await
    }

    /// Forwards connections to the PostgreSQL server at `127.0.0.1:target`, without delay, passing on
    /// everything it says but its notices (`NotificationResponse`): `LISTEN` is answered and nothing
    /// sent to the channel arrives, as behind a pooler in transaction mode (PgBouncer's, Supavisor's),
    /// which hands the server session to other clients between transactions. Its clients must not ask
    /// for TLS (`sslmode=disable`): the proxy reads the messages.
    pub async fn without_notices(target: u16) -> DelayProxy {
        Self::open(target, Shape { drops_notices: true, ..Shape::default() }).await
    }

    async fn open(target: u16, shape: Shape) -> DelayProxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let (accepted, stalled_below) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
        let (silent, refusing) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicBool::new(false)));
        let links = Arc::new(Mutex::new(Vec::new()));
        let (counted, stalled, quiet) = (accepted.clone(), stalled_below.clone(), silent.clone());
        let (refuse, tasks) = (refusing.clone(), links.clone());
        let accept = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                if refuse.load(Ordering::SeqCst) {
                    continue;
                }
                let number = counted.fetch_add(1, Ordering::SeqCst);
                let Ok(server) = TcpStream::connect(("127.0.0.1", target)).await else { continue };
                let _ = (client.set_nodelay(true), server.set_nodelay(true));
                let ((client_read, client_write), (server_read, server_write)) =
                    (client.into_split(), server.into_split());
                let link = Link { number, shape, stalled_below: stalled.clone(), silent: quiet.clone() };
                let mut tasks = tasks.lock().unwrap();
                // Cut while it was being connected: closed with the others.
                if refuse.load(Ordering::SeqCst) {
                    continue;
                }
                let notices = shape.drops_notices.then(DropNotices::default);
                tasks.push(tokio::spawn(forward(client_read, server_write, link.clone(), None)));
                tasks.push(tokio::spawn(forward(server_read, client_write, link, notices)));
            }
        });
        DelayProxy { port, accept, accepted, stalled_below, silent, refusing, links }
    }

    /// Closes every connection open now, and each one opened later as soon as it is accepted, until
    /// [`DelayProxy::mend`]: both ends learn of it, as when a link goes down and comes back.
    pub fn cut(&self) {
        let mut links = self.links.lock().unwrap();
        self.refusing.store(true, Ordering::SeqCst);
        self.stall();
        for task in links.drain(..) {
            task.abort();
        }
    }

    /// Forwards new connections again after [`DelayProxy::cut`].
    pub fn mend(&self) {
        self.refusing.store(false, Ordering::SeqCst);
    }

    /// Every connection open now stops forwarding in both directions, its sockets left open: what its
    /// ends send is read and dropped, so they wait for answers that never come. Connections opened
    /// later are forwarded as before.
    pub fn stall(&self) {
        self.stalled_below.store(self.accepted.load(Ordering::SeqCst), Ordering::SeqCst);
    }

    /// [`DelayProxy::stall`], and a side that closes its end is not told to the other, which goes on
    /// waiting: the other side's host vanished (no FIN, no RST).
    pub fn vanish(&self) {
        self.silent.store(true, Ordering::SeqCst);
        self.stall();
    }

    /// [`DelayProxy::vanish`] for connections opened later too: the database stopped answering
    /// anybody.
    pub fn blackhole(&self) {
        self.silent.store(true, Ordering::SeqCst);
        self.stalled_below.store(u64::MAX, Ordering::SeqCst);
    }
}

/// What a proxy does to the bytes it forwards.
#[derive(Clone, Copy, Default)]
struct Shape {
    /// Added to each chunk, each way.
    delay: Duration,
    /// The most each connection carries each way.
    bytes_per_second: Option<u64>,
    /// Whether PostgreSQL's notices are dropped on their way to the client.
    drops_notices: bool,
}

/// One forwarded connection: its number, its shape, and the proxy's stall mark.
#[derive(Clone)]
struct Link {
    number: u64,
    shape: Shape,
    stalled_below: Arc<AtomicU64>,
    silent: Arc<AtomicBool>,
}

impl Link {
    fn stalled(&self) -> bool {
        self.number < self.stalled_below.load(Ordering::SeqCst)
    }
}

impl Drop for DelayProxy {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

/// What the server says, without its notices: PostgreSQL's messages are a type byte and a length that
/// counts itself, and a notice's type is `A`. A message is passed on once it has come whole.
#[derive(Default)]
struct DropNotices {
    pending: Vec<u8>,
}

impl DropNotices {
    fn pass(&mut self, chunk: &[u8]) -> Vec<u8> {
        self.pending.extend_from_slice(chunk);
        let (mut passed, mut at) = (Vec::new(), 0);
        while let Some(header) = self.pending.get(at..at + 5) {
            let length = 1 + u32::from_be_bytes(header[1..].try_into().unwrap()) as usize;
            let Some(message) = self.pending.get(at..at + length) else { break };
            if message[0] != b'A' {
                passed.extend_from_slice(message);
            }
            at += length;
        }
        self.pending.drain(..at);
        passed
    }
}

/// Copies `from` to `to` (without PostgreSQL's notices if given `notices`), each chunk written the
/// link's delay after it was read and no faster than its rate, until the link is stalled; ends when
/// either side closes.
async fn forward(mut from: OwnedReadHalf, mut to: OwnedWriteHalf, link: Link, mut notices: Option<DropNotices>) {
    let Shape { delay, bytes_per_second, .. } = link.shape;
    let (chunks, mut due) = mpsc::unbounded_channel::<(Instant, Vec<u8>)>();
    let writer = tokio::spawn(async move {
        while let Some((at, chunk)) = due.recv().await {
            tokio::time::sleep_until(at).await;
            if link.stalled() {
                continue;
            }
            if to.write_all(&chunk).await.is_err() {
                return;
            }
            if let Some(rate) = bytes_per_second {
                tokio::time::sleep(Duration::from_secs_f64(chunk.len() as f64 / rate as f64)).await;
            }
        }
        if link.stalled() && link.silent.load(Ordering::SeqCst) {
            // Closed once the other direction's reader is done with the socket, not before.
            to.forget();
        } else {
            let _ = to.shutdown().await;
        }
    });
    let mut buffer = vec![0; 64 * 1024];
    while let Ok(read) = from.read(&mut buffer).await {
        if read == 0 {
            break;
        }
        let chunk = match &mut notices {
            Some(notices) => notices.pass(&buffer[..read]),
            None => buffer[..read].to_vec(),
        };
        if chunks.send((Instant::now() + delay, chunk)).is_err() {
            break;
        }
    }
    drop(chunks);
    let _ = writer.await;
}
