//! Log lines on stderr: text for people by default, one JSON object a line
//! with `--log-format json` (`TALLY_LOG_FORMAT=json`) for a log shipper.

use std::ffi::OsString;
use std::io::IsTerminal as _;

use tracing::Subscriber;
use tracing_subscriber::EnvFilter;
use tracing_subscriber::fmt::MakeWriter;
use tracing_subscriber::util::SubscriberInitExt as _;

use crate::cli::LogFormat;

/// Installs the process's subscriber, with TALLY_LOG's filter when it is set
/// and `default_filter` otherwise; `log` records (librdkafka's) go through it
/// too.
pub fn init(format: LogFormat, default_filter: &str) {
    let filter = EnvFilter::try_from_env("TALLY_LOG").unwrap_or_else(|_| default_filter.into());
    let colour = colour_wanted(
        std::io::stderr().is_terminal(),
        std::env::var_os("NO_COLOR"),
    );
    subscriber(format, filter, std::io::stderr, colour).init();
}

/// Whether text lines carry colour: only on a terminal, and never with `NO_COLOR` set to
/// anything (<https://no-color.org>). A file or a pipe gets plain text.
fn colour_wanted(is_terminal: bool, no_color: Option<OsString>) -> bool {
    is_terminal && no_color.is_none_or(|value| value.is_empty())
}

/// The subscriber for `format`, writing to `writer`.
fn subscriber<W>(
    format: LogFormat,
    filter: EnvFilter,
    writer: W,
    ansi: bool,
) -> Box<dyn Subscriber + Send + Sync>
where
    W: for<'w> MakeWriter<'w> + Send + Sync + 'static,
{
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(writer);
    match format {
        LogFormat::Text => Box::new(builder.with_ansi(ansi).finish()),
        // Fields at the top level beside `message`, as log shippers index
        // them; the span in which the event happened, not every parent.
        LogFormat::Json => Box::new(
            builder
                .json()
                .flatten_event(true)
                .with_current_span(true)
                .with_span_list(false)
                .finish(),
        ),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use super::*;

    /// Everything the subscriber writes, shared with the test.
    #[derive(Clone, Default)]
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

    fn log_one(format: LogFormat) -> String {
        let captured = Captured::default();
        let writer = captured.clone();
        let subscriber = subscriber(
            format,
            EnvFilter::new("info"),
            move || writer.clone(),
            false,
        );
        tracing::subscriber::with_default(subscriber, || {
            tracing::debug!("Filtered out.");
            tracing::warn!(partition = 3, offset = 41_i64, "Bad message skipped.");
        });
        let bytes = captured.0.lock().unwrap().clone();
        String::from_utf8(bytes).unwrap()
    }

    #[test]
    fn json_lines_parse_with_the_fields_at_the_top() {
        let out = log_one(LogFormat::Json);
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(lines.len(), 1, "{out}");
        let line: serde_json::Value = serde_json::from_str(lines[0]).expect("one JSON object");
        assert_eq!(line["level"], "WARN");
        assert_eq!(line["message"], "Bad message skipped.");
        assert_eq!(line["partition"], 3);
        assert_eq!(line["offset"], 41);
        assert!(line["timestamp"].is_string(), "{line}");
        assert!(line["target"].is_string(), "{line}");
    }

    #[test]
    fn colour_only_on_a_terminal_without_no_color() {
        assert!(colour_wanted(true, None));
        assert!(colour_wanted(true, Some(OsString::new())));
        assert!(!colour_wanted(true, Some("1".into())));
        assert!(!colour_wanted(false, None));
    }

    #[test]
    fn text_stays_the_default_line() {
        let out = log_one(LogFormat::Text);
        assert_eq!(out.lines().count(), 1, "{out}");
        assert!(
            out.contains(" WARN ") && out.contains("Bad message skipped. partition=3 offset=41"),
            "{out}"
        );
        assert!(serde_json::from_str::<serde_json::Value>(out.trim()).is_err());
    }
}
