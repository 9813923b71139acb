//! Hot keys: how many writes per second the busiest Redis key and the
//! busiest primary of a 3-primary cluster take, for tally and for the naive
//! consumers.
//!
//! tally's figures are measured: a `MONITOR` connection lists every command
//! redis-server runs, those inside scripts included, for a few seconds of
//! traffic at the latency phase's rate, and each counter key's writes are
//! counted (`INCRBY` and friends one per key, `MSET` one per key it names).
//! Where each key would live on a cluster is computed from the key tally
//! writes on one (the same counter under `--slot-groups`' hash tags), with
//! the slots split in three equal ranges as `redis-cli --cluster create`
//! assigns them. The naive consumers' figures follow from their design, one
//! write per event: the busiest key takes its post's share of events, and a
//! primary takes the busiest key plus a third of the rest.

use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use rustc_hash::FxHashMap;

use tally::domain::routing::KeyLayout;
use tally::domain::slots::{SlotGroups, key_slot};
use tally::infra::config::DEFAULT_SLOT_GROUPS;

/// Primaries of the cluster the figures are computed for.
pub(super) const PRIMARIES: usize = 3;

/// Writes per second to the busiest key and to the busiest primary.
#[derive(Debug, Clone, Default)]
pub(super) struct HotKeys {
    /// The busiest counter key, as written on one server.
    pub key: String,
    /// Its writes per second.
    pub key_rate: f64,
    /// Writes per second to each primary of a 3-primary cluster.
    pub primaries: [f64; PRIMARIES],
    /// Counter writes per second in all.
    pub total_rate: f64,
}

impl HotKeys {
    /// The busiest primary's writes per second.
    pub fn busiest_primary(&self) -> f64 {
        self.primaries.iter().copied().fold(0.0, f64::max)
    }

    /// The naive consumers at `rate` events/s, one write per event, when the
    /// busiest post takes `share` of the events on one key.
    pub fn naive(rate: f64, share: f64) -> HotKeys {
        let key_rate = rate * share;
        let mut primaries = [(rate - key_rate) / PRIMARIES as f64; PRIMARIES];
        primaries[0] += key_rate;
        HotKeys {
            key: String::new(),
            key_rate,
            primaries,
            total_rate: rate,
        }
    }
}

/// A `MONITOR` connection counting counter-key writes until stopped.
pub(super) struct Monitor {
    stop: Arc<AtomicBool>,
    handle: JoinHandle<Result<(FxHashMap<String, u64>, Duration)>>,
}

impl Monitor {
    /// Starts monitoring the redis-server at `url` (`redis://host:port/`).
    pub fn start(url: &str) -> Result<Monitor> {
        let addr = url
            .trim_start_matches("redis://")
            .trim_end_matches('/')
            .to_string();
        let mut stream =
            TcpStream::connect(&addr).with_context(|| format!("MONITOR connection to {addr}"))?;
        stream.set_read_timeout(Some(Duration::from_millis(200)))?;
        stream.write_all(b"MONITOR\r\n")?;
        let mut reader = BufReader::new(stream);
        let mut first = String::new();
        reader.read_line(&mut first)?;
        if !first.starts_with("+OK") {
            bail!("MONITOR was refused: {}", first.trim());
        }
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let handle = std::thread::spawn(move || count_writes(reader, &flag));
        Ok(Monitor { stop, handle })
    }

    /// Stops and returns the figures of the keys under `prefix`.
    pub fn finish(self, prefix: &str) -> Result<HotKeys> {
        self.stop.store(true, Ordering::SeqCst);
        let (writes, elapsed) = self
            .handle
            .join()
            .map_err(|_| anyhow::anyhow!("the MONITOR thread panicked"))??;
        Ok(analyse(&writes, elapsed, prefix))
    }
}

fn count_writes(
    mut reader: BufReader<TcpStream>,
    stop: &AtomicBool,
) -> Result<(FxHashMap<String, u64>, Duration)> {
    let started = Instant::now();
    let mut writes = FxHashMap::default();
    let mut line = String::new();
    while !stop.load(Ordering::SeqCst) {
        line.clear();
        match reader.read_line(&mut line) {
            Ok(0) => break,
            Ok(_) => count_line(&line, &mut writes),
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok((writes, started.elapsed()))
}

/// Counts the keys one `MONITOR` line writes:
/// `+1700000000.123456 [0 lua] "INCRBY" "key" "5"`.
fn count_line(line: &str, writes: &mut FxHashMap<String, u64>) {
    let words = quoted_words(line);
    let Some(command) = words.first() else {
        return;
    };
    let keys: Vec<&String> = match command.to_ascii_uppercase().as_str() {
        "INCR" | "DECR" | "INCRBY" | "DECRBY" => words.get(1).into_iter().collect(),
        "MSET" => words[1..].iter().step_by(2).collect(),
        _ => return,
    };
    for key in keys {
        *writes.entry(key.clone()).or_default() += 1;
    }
}

/// The double-quoted words of a `MONITOR` line, unescaped (`\"`, `\\`).
fn quoted_words(line: &str) -> Vec<String> {
    let mut words = Vec::new();
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        if c != '"' {
            continue;
        }
        let mut word = String::new();
        while let Some(c) = chars.next() {
            match c {
                '\\' => word.extend(chars.next()),
                '"' => break,
                _ => word.push(c),
            }
        }
        words.push(word);
    }
    words
}

/// The last slot of each primary, as `redis-cli --cluster create` splits 16,384 slots.
const LAST_SLOT: [u16; PRIMARIES] = [5460, 10922, 16383];

/// The primary of a 3-primary cluster that owns `slot`.
fn primary_of(slot: u16) -> usize {
    LAST_SLOT
        .iter()
        .position(|&last| slot <= last)
        .unwrap_or(PRIMARIES - 1)
}

fn analyse(writes: &FxHashMap<String, u64>, elapsed: Duration, prefix: &str) -> HotKeys {
    let single = KeyLayout::new(prefix);
    let cluster = KeyLayout::with_groups(prefix, SlotGroups::cluster(DEFAULT_SLOT_GROUPS));
    let secs = elapsed.as_secs_f64().max(1e-9);
    let mut hot = HotKeys::default();
    for (key, &n) in writes {
        let Some(id) = single.parse_counter_key(key) else {
            continue;
        };
        let rate = n as f64 / secs;
        if rate > hot.key_rate {
            hot.key_rate = rate;
            hot.key = key.clone();
        }
        hot.total_rate += rate;
        hot.primaries[primary_of(key_slot(cluster.key_of(id).as_bytes()))] += rate;
    }
    hot
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn monitor_lines_count_each_written_key() {
        let mut writes = FxHashMap::default();
        count_line(
            r#"+1700000000.1 [0 lua] "INCRBY" "p:likes:1:0" "5""#,
            &mut writes,
        );
        count_line(
            r#"+1700000000.2 [0 lua] "MSET" "p:likes:1:0" "6" "p:likes:2:0" "-1""#,
            &mut writes,
        );
        count_line(r#"+1700000000.3 [0 lua] "GET" "p:likes:2:0""#, &mut writes);
        count_line(
            r#"+1700000000.4 [0 127.0.0.1:5] "INCR" "p:likes:\"q\":0""#,
            &mut writes,
        );
        assert_eq!(writes["p:likes:1:0"], 2);
        assert_eq!(writes["p:likes:2:0"], 1);
        assert_eq!(writes["p:likes:\"q\":0"], 1);
        assert_eq!(writes.len(), 3);
    }

    #[test]
    fn slots_split_in_three_like_redis_cli() {
        assert_eq!(primary_of(0), 0);
        assert_eq!(primary_of(5460), 0);
        assert_eq!(primary_of(5461), 1);
        assert_eq!(primary_of(10922), 1);
        assert_eq!(primary_of(10923), 2);
        assert_eq!(primary_of(16383), 2);
    }

    #[test]
    fn the_naive_busiest_primary_holds_the_busiest_key() {
        let hot = HotKeys::naive(90_000.0, 0.1);
        assert_eq!(hot.key_rate, 9_000.0);
        assert_eq!(hot.busiest_primary(), 9_000.0 + 27_000.0);
    }
}
