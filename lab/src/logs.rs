//! The lab's log lines on stderr: colour only for a person at a terminal, and the demo's
//! start-up held back.
//!
//! A broker that has just started answers its first clients with errors it expects them to
//! retry (its group coordinator is still loading, its partitions have no leader yet), and
//! librdkafka logs each as a warning. In the demo those lines would land inside the live table on
//! a healthy run, so during its first [`START_UP`] it counts them ([`HeldBack`]) and prints one
//! line under the table instead. Everything else, and every librdkafka line after that, is
//! printed at once and in full. With `TALLY_LOG` set nothing is held back: a person debugging
//! the start sees every line asked for.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::fmt::Write as _;
use std::io::IsTerminal as _;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tracing::field::{Field, Visit};
use tracing::{Event, Subscriber};
use tracing_subscriber::EnvFilter;
use tracing_subscriber::layer::{Context, Layer, SubscriberExt as _};
use tracing_subscriber::util::SubscriberInitExt as _;

/// How long after the lab starts librdkafka's expected start-up messages are held back: the
/// demo's broker and the coordinator of its group start within it, with room on a busy machine.
pub const START_UP: Duration = Duration::from_secs(60);

/// The librdkafka messages of a broker that is still starting, each with the words that find it
/// and what the summary calls it. A refused connection is not one of them: the demo's clients
/// start after its broker listens, so one means the broker has gone.
const EXPECTED_AT_START: &[(&str, &str)] = &[
    ("Coordinator load in progress", "coordinator load"),
    ("Coordinator not available", "coordinator not yet available"),
    ("Not coordinator", "coordinator moved"),
    ("Leader not available", "partition leader not yet elected"),
];

/// Installs the process's subscriber: TALLY_LOG's filter when it is set, warnings otherwise (the
/// demo draws a table on stdout). With `hold_back` and no TALLY_LOG, the demo's start-up
/// messages are counted by the [`HeldBack`] it returns rather than printed.
pub fn init(hold_back: bool) -> Option<HeldBack> {
    let asked = std::env::var_os("TALLY_LOG").is_some();
    let filter = EnvFilter::try_from_env("TALLY_LOG").unwrap_or_else(|_| "warn".into());
    let held_back = (hold_back && !asked).then(|| HeldBack::new(START_UP));
    let colour = colour_wanted(
        std::io::stderr().is_terminal(),
        std::env::var_os("NO_COLOR"),
    );
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(colour)
        .finish()
        .with(held_back.clone())
        .init();
    held_back
}

/// Whether log lines carry colour: only on a terminal, and never with `NO_COLOR` set to
/// anything (<https://no-color.org>). A file or a pipe gets plain text.
fn colour_wanted(is_terminal: bool, no_color: Option<OsString>) -> bool {
    is_terminal && no_color.is_none_or(|value| value.is_empty())
}

/// What the summary calls `message` when it is one of librdkafka's expected start-up messages.
fn expected_at_start(message: &str) -> Option<&'static str> {
    if !message.starts_with("librdkafka: ") {
        return None;
    }
    EXPECTED_AT_START
        .iter()
        .find(|(words, _)| message.contains(words))
        .map(|(_, what)| *what)
}

/// A layer that keeps librdkafka's expected start-up messages from the log until a deadline,
/// and counts them by what they say.
#[derive(Clone)]
pub struct HeldBack {
    until: Instant,
    counts: Arc<Mutex<BTreeMap<&'static str, u64>>>,
}

impl HeldBack {
    /// Holds back for `window` from now.
    fn new(window: Duration) -> HeldBack {
        HeldBack {
            until: Instant::now() + window,
            counts: Arc::default(),
        }
    }

    /// One line for under the demo's table, or `None` when nothing was held back.
    pub fn summary(&self) -> Option<String> {
        let counts = self.counts.lock().unwrap_or_else(|e| e.into_inner());
        let total: u64 = counts.values().sum();
        if total == 0 {
            return None;
        }
        let plural = if total == 1 { "" } else { "s" };
        let mut line =
            format!("held back {total} expected start-up message{plural} of librdkafka:");
        for (i, (what, n)) in counts.iter().enumerate() {
            let comma = if i == 0 { "" } else { "," };
            let _ = write!(line, "{comma} {what} ({n})");
        }
        line.push_str("; TALLY_LOG=warn shows them");
        Some(line)
    }
}

impl<S: Subscriber> Layer<S> for HeldBack {
    fn event_enabled(&self, event: &Event<'_>, _: Context<'_, S>) -> bool {
        if Instant::now() >= self.until {
            return true;
        }
        let mut message = Message::default();
        event.record(&mut message);
        let Some(what) = expected_at_start(&message.0) else {
            return true;
        };
        let mut counts = self.counts.lock().unwrap_or_else(|e| e.into_inner());
        *counts.entry(what).or_default() += 1;
        false
    }
}

/// The `message` field of an event.
#[derive(Default)]
struct Message(String);

impl Visit for Message {
    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "message" {
            value.clone_into(&mut self.0);
        }
    }

    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            self.0 = format!("{value:?}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn colour_only_on_a_terminal_without_no_color() {
        assert!(colour_wanted(true, None));
        assert!(colour_wanted(true, Some(OsString::new())));
        assert!(!colour_wanted(true, Some("1".into())));
        assert!(!colour_wanted(true, Some("false".into())));
        assert!(!colour_wanted(false, None));
        assert!(!colour_wanted(false, Some("1".into())));
    }

    #[test]
    fn a_starting_brokers_answers_are_expected() {
        for (message, what) in [
            (
                "librdkafka: GETPID [thrd:main]: Failed to acquire idempotence PID from broker \
                 127.0.0.1:41234/1: Broker: Coordinator load in progress: retrying",
                "coordinator load",
            ),
            (
                "librdkafka: FINDCOORD 127.0.0.1:41234/1: Group coordinator lookup failed: \
                 Broker: Coordinator not available",
                "coordinator not yet available",
            ),
            (
                "librdkafka: COMMITFAIL Offset commit failed: Broker: Not coordinator",
                "coordinator moved",
            ),
            (
                "librdkafka: Global error: Broker: Leader not available: likes [3]",
                "partition leader not yet elected",
            ),
        ] {
            assert_eq!(expected_at_start(message), Some(what), "{message}");
        }
    }

    #[test]
    fn other_messages_are_not() {
        for message in [
            // The broker has gone: the demo's clients start after it listens.
            "librdkafka: Local: Broker transport failure: 127.0.0.1:41234/1: Connect to \
             ipv4#127.0.0.1:41234 failed: Connection refused (after 0ms in state CONNECT)",
            "librdkafka: Local: All broker connections are down",
            "librdkafka: FAIL [thrd:127.0.0.1:41234/1]: SASL authentication error",
            // The same words from tally rather than librdkafka.
            "Batch not applied: Coordinator load in progress",
            "",
        ] {
            assert_eq!(expected_at_start(message), None, "{message}");
        }
    }

    /// What a subscriber with `held_back` writes for `log`, as text.
    fn logged(held_back: &HeldBack, log: impl FnOnce()) -> String {
        let out = Arc::new(Mutex::new(Vec::new()));
        let writer = out.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(move || Captured(writer.clone()))
            .with_ansi(false)
            .finish()
            .with(held_back.clone());
        tracing::subscriber::with_default(subscriber, log);
        String::from_utf8(out.lock().unwrap().clone()).unwrap()
    }

    struct Captured(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Captured {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    const LOAD: &str = "GETPID [thrd:main]: Failed to acquire idempotence PID from broker \
                        127.0.0.1:41234/1: Broker: Coordinator load in progress: retrying";
    const REFUSED: &str = "Local: Broker transport failure: Connection refused";

    #[test]
    fn start_up_noise_is_counted_and_a_real_error_printed_in_full() {
        let held_back = HeldBack::new(START_UP);
        let out = logged(&held_back, || {
            tracing::warn!(target: "librdkafka", "librdkafka: {LOAD}");
            tracing::warn!(target: "librdkafka", "librdkafka: {LOAD}");
            tracing::error!("librdkafka: {REFUSED}");
            tracing::warn!(target: "librdkafka", "librdkafka: FINDCOORD Broker: Not coordinator");
        });
        assert_eq!(out.lines().count(), 1, "{out}");
        assert!(out.contains("ERROR") && out.contains(REFUSED), "{out}");
        assert_eq!(
            held_back.summary().as_deref(),
            Some(
                "held back 3 expected start-up messages of librdkafka: \
                 coordinator load (2), coordinator moved (1); TALLY_LOG=warn shows them"
            )
        );
    }

    #[test]
    fn after_the_start_up_every_line_prints() {
        let held_back = HeldBack::new(Duration::ZERO);
        let out = logged(&held_back, || {
            tracing::warn!(target: "librdkafka", "librdkafka: {LOAD}");
        });
        assert!(out.contains(LOAD), "{out}");
        assert_eq!(held_back.summary(), None);
    }
}
