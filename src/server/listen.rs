//! Accepting connections and serving HTTP/1.1 on them with a read timeout (axum's own `serve`
//! sets none): a client that sends its request head slower than the timeout, or opens a
//! connection and sends nothing, is disconnected, so slow or idle clients cannot hold
//! connections open for ever. (The body's timeout is the handlers': they read it themselves.)

use std::future::Future;
use std::time::Duration;

use axum::Router;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::watch;

/// Serves `app` on `listener` until `shutdown` completes; then stops accepting connections,
/// lets the requests in flight finish and closes idle connections. A request head (the line
/// and headers) must arrive within `read_timeout` of the connection's start or of the
/// previous response.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    read_timeout: Duration,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    // Dropping the receiver tells every connection (and the accept loop) to shut down.
    let (signal_tx, signal_rx) = watch::channel(());
    tokio::spawn(async move {
        shutdown.await;
        drop(signal_rx);
    });
    // Every connection holds a receiver; when all are gone, every connection has ended.
    let (close_tx, close_rx) = watch::channel(());
    loop {
        let accepted = tokio::select! {
            a = listener.accept() => a,
            _ = signal_tx.closed() => break,
        };
        let stream = match accepted {
            Ok((stream, _)) => stream,
            // Out of file descriptors or the like: wait rather than spin.
            Err(_) => {
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        // Streamed tokens should leave at once, not wait for more to fill a packet.
        let _ = stream.set_nodelay(true);
        let service = TowerToHyperService::new(app.clone());
        let signal_tx = signal_tx.clone();
        let close_rx = close_rx.clone();
        tokio::spawn(async move {
            let mut builder = http1::Builder::new();
            builder
                .timer(TokioTimer::new())
                .header_read_timeout(read_timeout);
            let conn = builder.serve_connection(TokioIo::new(stream), service);
            let mut conn = std::pin::pin!(conn);
            let mut signal = std::pin::pin!(signal_tx.closed());
            let mut shutting_down = false;
            loop {
                tokio::select! {
                    _ = conn.as_mut() => break,
                    _ = &mut signal, if !shutting_down => {
                        shutting_down = true;
                        conn.as_mut().graceful_shutdown();
                    }
                }
            }
            drop(close_rx);
        });
    }
    drop(close_rx);
    drop(listener);
    close_tx.closed().await;
    Ok(())
}
