//! The signals simba listens to: SIGINT, SIGTERM, SIGHUP and SIGQUIT.

use nix::sys::signal::Signal;
use tokio::signal::unix::{SignalKind, signal};

use crate::status::{Failure, Status};

/// Streams of the four signals simba handles (registered once, at start).
#[derive(Debug)]
pub(crate) struct Signals {
    int: tokio::signal::unix::Signal,
    term: tokio::signal::unix::Signal,
    hup: tokio::signal::unix::Signal,
    quit: tokio::signal::unix::Signal,
}

impl Signals {
    /// Installs the handlers: from now on these signals no longer end simba by default.
    pub(crate) fn new() -> Result<Self, Failure> {
        let on = |kind: SignalKind| {
            signal(kind)
                .map_err(|e| Failure::with(Status::Internal, e, "cannot install a signal handler"))
        };
        Ok(Signals {
            int: on(SignalKind::interrupt())?,
            term: on(SignalKind::terminate())?,
            hup: on(SignalKind::hangup())?,
            quit: on(SignalKind::quit())?,
        })
    }

    /// The next signal received. Cancel safe.
    pub(crate) async fn recv(&mut self) -> Signal {
        loop {
            let got = tokio::select! {
                s = self.int.recv() => s.map(|()| Signal::SIGINT),
                s = self.term.recv() => s.map(|()| Signal::SIGTERM),
                s = self.hup.recv() => s.map(|()| Signal::SIGHUP),
                s = self.quit.recv() => s.map(|()| Signal::SIGQUIT),
            };
            if let Some(sig) = got {
                return sig;
            }
            // A stream ended (the runtime is shutting down): nothing more will come.
            std::future::pending::<()>().await;
        }
    }
}

/// `128 + signal`, the shell's status for "ended by this signal".
pub(crate) fn status_for(sig: Signal) -> u8 {
    u8::try_from(128 + sig as i32).unwrap_or(255)
}
