//! The lab's log lines on stderr: colour only for a person at a terminal.

use std::ffi::OsString;
use std::io::IsTerminal as _;

use tracing_subscriber::EnvFilter;

/// Installs the process's subscriber: TALLY_LOG's filter when it is set, warnings otherwise (the
/// demo draws a table on stdout).
pub fn init() {
    let filter = EnvFilter::try_from_env("TALLY_LOG").unwrap_or_else(|_| "warn".into());
    let colour = colour_wanted(
        std::io::stderr().is_terminal(),
        std::env::var_os("NO_COLOR"),
    );
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(colour)
        .init();
}

/// Whether log lines carry colour: only on a terminal, and never with `NO_COLOR` set to
/// anything (<https://no-color.org>). A file or a pipe gets plain text.
fn colour_wanted(is_terminal: bool, no_color: Option<OsString>) -> bool {
    is_terminal && no_color.is_none_or(|value| value.is_empty())
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
}
