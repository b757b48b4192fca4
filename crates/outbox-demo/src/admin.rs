//! The operator's page (`worker --admin-addr`, and `run`): the library's admin router on a listener
//! of its own.

use std::net::SocketAddr;

use outbox_cluster::admin::Admin;

use crate::{Context, Failure};

/// Serves the page on `addr` until the process ends; returns the address bound (`addr` may ask for
/// port 0).
pub async fn serve(ctx: &Context, addr: SocketAddr) -> Result<SocketAddr, Failure> {
    let admin = Admin::new(ctx.outbox.clone(), ctx.db.clone(), ctx.config.admin.clone())?;
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| Failure(format!("cannot serve the operator page on {addr}: {e}")))?;
    let bound = listener.local_addr().map_err(|e| Failure(e.to_string()))?;
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, admin.router()).await {
            tracing::error!(error = %e, "operator page stopped");
        }
    });
    Ok(bound)
}

/// The page's address as a person opens it.
pub fn url(addr: SocketAddr) -> String {
    format!("http://{addr}/")
}
