//! Sending the publishes of many keys' deliveries to the connection together.
//!
//! Each key's run is delivered on a task of its own, with one unacknowledged publish per key: an ack
//! wakes one task, which publishes one message. Tokio runs a task woken by the running one next (its
//! LIFO slot), so the NATS connection task, woken by each publish, wrote every message alone: a
//! `writev` per message for the client, a read per message for the server. Here every delivery hands
//! its message to one task that lets the deliveries already woken take their turn first, then sends
//! all their messages and awaits every ack itself.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::Client;
use async_nats::connection::State;
use async_nats::jetstream::context::{Context, PublishError, PublishErrorKind};
use async_nats::jetstream::message::PublishMessage;
use async_nats::jetstream::publish::PublishAck;
use futures::StreamExt;
use futures::stream::FuturesUnordered;
use tokio::sync::{mpsc, oneshot};

/// A message to publish, and where its ack (or the failure) goes.
struct Request {
    subject: String,
    message: PublishMessage,
    reply: oneshot::Sender<Result<PublishAck, PublishError>>,
}

/// The delivery side: a handle on the sending task, shared by the handler's clones.
#[derive(Clone)]
pub(crate) struct Outgoing {
    js: Context,
    /// How long a publish waits for a connection that is down (the publish timeout).
    wait: Duration,
    sender: Arc<Mutex<Option<mpsc::UnboundedSender<Request>>>>,
}

/// The sending task stopped before it answered (its runtime shut down).
#[derive(Debug, thiserror::Error)]
#[error("the task sending publishes stopped before the ack")]
pub(crate) struct Stopped;

impl Outgoing {
    pub(crate) fn new(js: Context, wait: Duration) -> Self {
        Self { js, wait, sender: Arc::new(Mutex::new(None)) }
    }

    /// Publishes `message` to `subject` and waits for JetStream's ack.
    pub(crate) async fn publish(
        &self,
        subject: String,
        message: PublishMessage,
    ) -> Result<Result<PublishAck, PublishError>, Stopped> {
        let (reply, ack) = oneshot::channel();
        self.send(Request { subject, message, reply });
        ack.await.map_err(|_| Stopped)
    }

    /// Queues `request` for the sending task, starting one on the current runtime if there is none or
    /// the last one stopped with the runtime it ran on. Dropping the last handle ends the task once
    /// its acks are in.
    fn send(&self, request: Request) {
        let mut sender = self.sender.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let request = match sender.as_ref() {
            Some(running) => match running.send(request) {
                Ok(()) => return,
                Err(mpsc::error::SendError(request)) => request,
            },
            None => request,
        };
        let (tx, rx) = mpsc::unbounded_channel();
        tokio::spawn(run(self.js.clone(), self.wait, rx));
        // The receiver was just created and is held by the task: this send cannot fail.
        let _ = tx.send(request);
        *sender = Some(tx);
    }
}

/// Most requests taken in one go.
const BATCH: usize = 4096;

async fn run(js: Context, wait: Duration, mut requests: mpsc::UnboundedReceiver<Request>) {
    let client = js.client();
    let (js, client) = (&js, &client);
    let mut in_flight = FuturesUnordered::new();
    let mut batch = Vec::with_capacity(BATCH);
    let mut open = true;
    loop {
        tokio::select! {
            // Acks first: new requests wait only for the acks already in.
            biased;
            Some(()) = in_flight.next(), if !in_flight.is_empty() => {}
            taken = requests.recv_many(&mut batch, BATCH), if open => {
                if taken == 0 {
                    open = false;
                    continue;
                }
                // The deliveries woken with this one (by the same batch of acks) queue theirs meanwhile.
                tokio::task::yield_now().await;
                while batch.len() < BATCH {
                    let Ok(request) = requests.try_recv() else { break };
                    batch.push(request);
                }
                // Each is sent when `in_flight` is next polled: all of them in one poll, before the
                // connection task runs. A publish waiting for an ack permit does not hold up the others.
                in_flight.extend(batch.drain(..).map(|request| publish(js, client, wait, request)));
            }
            else => break,
        }
    }
}

/// Sends one request's message and hands its ack over. A delivery dropped before its message went to
/// the connection (its partition was fenced, or its lease ran out) never publishes it: as when the
/// delivery itself called the client, only a message already queued may still reach the stream.
///
/// Nor is a message queued while the client is not connected: the client would send it whenever it
/// reconnects, however late, by when the record may have been published by the partition's next owner
/// and its duplicate window passed, so the stream would hold it twice, behind its key's later records.
/// It waits for the connection instead, up to `wait`, and is sent once it is back (a delivery dropped
/// meanwhile never sends it); then it fails. Failing at once, a reconnect of a second (a server of the
/// cluster restarted) cost every key in flight a few of its retries.
async fn publish(js: &Context, client: &Client, wait: Duration, Request { subject, message, mut reply }: Request) {
    let ack = async {
        if !connected(client, wait).await {
            return Err(PublishError::with_source(
                PublishErrorKind::Other,
                format!("not connected to the NATS server (waited {wait:?} for it)"),
            ));
        }
        match js.send_publish(subject, message).await {
            Ok(ack) => ack.await,
            Err(e) => Err(e),
        }
    };
    tokio::select! {
        biased;
        () = reply.closed() => {}
        ack = ack => {
            let _ = reply.send(ack);
        }
    }
}

/// How often a publish waiting for the connection looks at it again.
const CONNECTION_LOOK: Duration = Duration::from_millis(25);

/// Whether `client` is connected, waiting up to `wait` for it (async-nats tells no state change to a
/// client built without its event callback, so the state is looked at every [`CONNECTION_LOOK`]).
async fn connected(client: &Client, wait: Duration) -> bool {
    let deadline = tokio::time::Instant::now() + wait;
    while client.connection_state() != State::Connected {
        if tokio::time::Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(CONNECTION_LOOK).await;
    }
    true
}
