//! Signals: where the commands' shutdown comes from.
//!
//! [`shutdown_on_signal`] hands a command a token that is cancelled on the
//! first SIGINT (Ctrl-C) or SIGTERM, after one log line. The signal itself
//! stops nothing: the command holding the token winds down in its own order
//! and returns, and `main` reports how it ended as for any other return.
//! Once installed, the handlers stay for the life of the process (tokio's
//! rule), so a second signal during the wind-down is ignored rather than
//! killing the process half-way; SIGKILL still stops it at once. The handlers
//! are installed when the token is made, early in each command: a signal
//! before then (while the flags are read) has its default effect. A handler
//! that cannot be installed is a panic, which ends the command.

use tokio_util::sync::CancellationToken;

/// A token cancelled on SIGINT or SIGTERM. The handlers are installed before
/// this returns, so a signal from then on winds the command down.
pub fn shutdown_on_signal() -> CancellationToken {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler");
    let mut interrupt = signal(SignalKind::interrupt()).expect("SIGINT handler");
    let shutdown = CancellationToken::new();
    let cancel = shutdown.clone();
    tally::infra::tasks::spawn("signals", async move {
        tokio::select! {
            _ = interrupt.recv() => {}
            _ = term.recv() => {}
        }
        tracing::info!("Signal received; shutting down.");
        cancel.cancel();
    });
    shutdown
}
