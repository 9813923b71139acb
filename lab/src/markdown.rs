//! The Markdown around benchmark reports: a block of generated text kept
//! between two markers of a file, so the prose around it stays, the
//! command, machine and date a report names, and how its figures are
//! written (thousands, ratios).

use std::borrow::Cow;
use std::path::Path;

use anyhow::{Context, Result};

/// Replaces the text between `begin` and `end` in `path` with `text` (or
/// appends the block, markers included, when they are missing).
pub fn write_between(path: &Path, begin: &str, end: &str, text: &str) -> Result<()> {
    let old = std::fs::read_to_string(path).unwrap_or_default();
    let block = format!("{begin}\n{text}{end}");
    let new = match (old.find(begin), old.find(end)) {
        (Some(b), Some(e)) if b < e => format!("{}{block}{}", &old[..b], &old[e + end.len()..]),
        _ if old.is_empty() => format!("{block}\n"),
        _ => format!("{}\n\n{block}\n", old.trim_end()),
    };
    std::fs::write(path, new).with_context(|| format!("cannot write {}", path.display()))
}

/// Prints a command's `report` and, with `--out`, writes it into `out`
/// between `begin` and `end` (see [`write_between`]), saying so on stderr
/// as `command` would.
pub fn publish(
    command: &str,
    report: &str,
    out: Option<&Path>,
    begin: &str,
    end: &str,
) -> Result<()> {
    print!("{report}");
    if let Some(path) = out {
        write_between(path, begin, end, report)?;
        eprintln!("{command}: report written to {}", path.display());
    }
    Ok(())
}

/// This process's command line as a reader would type it again: `tally-lab` and its
/// arguments (see [`shell_line`]).
pub fn command_line() -> String {
    let args: Vec<String> = std::env::args().skip(1).collect();
    shell_line("tally-lab", &args)
}

/// `program` and `args` as one line that a POSIX shell splits back into them: each argument
/// bare when it is plain, else quoted (`--variant "--buckets 16"`), so the line can be pasted.
pub fn shell_line(program: &str, args: &[String]) -> String {
    let mut line = program.to_string();
    for arg in args {
        line.push(' ');
        line.push_str(&quoted(arg));
    }
    line
}

/// `arg` as a shell reads it back: bare when it holds only characters no shell treats
/// specially, in double quotes when nothing inside them would expand, else in single quotes
/// (a `'` inside written as `'\''`).
fn quoted(arg: &str) -> Cow<'_, str> {
    let plain = |c: char| c.is_ascii_alphanumeric() || "-_=.,/:@%+".contains(c);
    if !arg.is_empty() && arg.chars().all(plain) {
        arg.into()
    } else if !arg.contains(['"', '$', '`', '\\', '!']) {
        format!("\"{arg}\"").into()
    } else {
        format!("'{}'", arg.replace('\'', r"'\''")).into()
    }
}

/// A report's first two lines: the command it came from and the machine.
pub fn header(out: &mut String, command: &str) -> std::fmt::Result {
    use std::fmt::Write as _;
    writeln!(out, "Command: `{}` (release build).  ", command.trim_end())?;
    writeln!(out, "Machine: {}.  ", machine())
}

/// "2 cores (AMD EPYC 7B13), 24 GiB, Linux 6.1.0".
fn machine() -> String {
    let cores = std::thread::available_parallelism().map_or(0, usize::from);
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = cpuinfo
        .lines()
        .find_map(|l| {
            l.strip_prefix("model name")?
                .split_once(':')
                .map(|(_, m)| m.trim().to_string())
        })
        .unwrap_or_else(|| "unknown CPU".into());
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let mem_gib = meminfo
        .lines()
        .find_map(|l| {
            l.strip_prefix("MemTotal:")?
                .trim()
                .trim_end_matches("kB")
                .trim()
                .parse::<f64>()
                .ok()
        })
        .map_or(0.0, |kib| kib / 1024.0 / 1024.0);
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    format!(
        "{cores} cores ({model}), {mem_gib:.0} GiB, Linux {}",
        kernel.trim()
    )
}

/// Today's date (UTC) as YYYY-MM-DD.
pub fn today_utc() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    // Civil-from-days, proleptic Gregorian calendar.
    let z = (secs / 86_400) as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!("{year:04}-{month:02}-{day:02}")
}

/// 1234567 -> "1,234,567".
pub fn thousands(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// `a` as a multiple of `b`, "1.50×"; "–" when `b` is not positive or `a` not finite.
pub fn ratio(a: f64, b: f64) -> String {
    if b > 0.0 && a.is_finite() {
        format!("{:.2}×", a / b)
    } else {
        "–".into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_between_named_markers_is_replaced_or_appended() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("b.md");
        std::fs::write(
            &path,
            "# T\n\n<!-- a:begin -->\nold\n<!-- a:end -->\ntail\n",
        )
        .unwrap();
        write_between(&path, "<!-- a:begin -->", "<!-- a:end -->", "new\n").unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        assert_eq!(text, "# T\n\n<!-- a:begin -->\nnew\n<!-- a:end -->\ntail\n");
        write_between(&path, "<!-- b:begin -->", "<!-- b:end -->", "more\n").unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(text.ends_with("tail\n\n<!-- b:begin -->\nmore\n<!-- b:end -->\n"));
        assert_eq!(thousands(1_234_567), "1,234,567");
        assert_eq!(today_utc().len(), 10);
    }

    #[test]
    fn command_lines_quote_what_a_shell_would_split() {
        let args = [
            "bench",
            "--variant",
            "--buckets 16",
            "--tally-arg=--buckets=1",
            "-X",
            "fetch.wait.max.ms=10",
            "it's $HOME",
            "",
        ]
        .map(String::from);
        assert_eq!(
            shell_line("tally-lab", &args),
            r#"tally-lab bench --variant "--buckets 16" --tally-arg=--buckets=1 -X fetch.wait.max.ms=10 'it'\''s $HOME' """#
        );
    }
}
