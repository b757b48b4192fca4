//! A TCP proxy on a free loopback port that delays everything it forwards by a fixed time each way: the
//! network between a service's pods and their database, which is never loopback. Bytes keep their order;
//! the delay is added to each chunk as it is read, so bandwidth is not limited.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

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
}

impl DelayProxy {
    /// Forwards connections to `127.0.0.1:target`, `delay` each way.
    pub async fn start(target: u16, delay: Duration) -> DelayProxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let accept = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) = TcpStream::connect(("127.0.0.1", target)).await else { continue };
                let _ = (client.set_nodelay(true), server.set_nodelay(true));
                let ((client_read, client_write), (server_read, server_write)) =
                    (client.into_split(), server.into_split());
                tokio::spawn(forward(client_read, server_write, delay));
                tokio::spawn(forward(server_read, client_write, delay));
            }
        });
        DelayProxy { port, accept }
    }
}

impl Drop for DelayProxy {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

/// Copies `from` to `to`, each chunk written `delay` after it was read; ends when either side closes.
async fn forward(mut from: OwnedReadHalf, mut to: OwnedWriteHalf, delay: Duration) {
    let (chunks, mut due) = mpsc::unbounded_channel::<(Instant, Vec<u8>)>();
    let writer = tokio::spawn(async move {
        while let Some((at, chunk)) = due.recv().await {
            tokio::time::sleep_until(at).await;
            if to.write_all(&chunk).await.is_err() {
                return;
            }
        }
        let _ = to.shutdown().await;
    });
    let mut buffer = vec![0; 64 * 1024];
    while let Ok(read) = from.read(&mut buffer).await {
        if read == 0 || chunks.send((Instant::now() + delay, buffer[..read].to_vec())).is_err() {
            break;
        }
    }
    drop(chunks);
    let _ = writer.await;
}
