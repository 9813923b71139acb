//! Redis dies under the consumer (SIGKILL) and comes back from its append-only file, three times
//! while events keep arriving. The second and third times the tail of the AOF is cut off first, as
//! after a power failure with `appendfsync everysec`: counters and fences roll back together, and
//! the consumer must replay from the fences to end exact.

mod common;

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use common::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const PARTITIONS: i32 = 8;
const FIRST_WAVE: usize = 80_000;
const CHUNK: usize = 2_000;
/// Bytes cut off the newest AOF file before each restart (0: a plain SIGKILL).
const CUTS: [u64; 3] = [0, 256 << 10, 1 << 20];

#[test]
fn counts_survive_redis_restarts_from_a_torn_aof() {
    let run = Scenario::new("e2e_redis_restart", "redis", PARTITIONS);
    let (group, topic, prefix) = (&run.group, &run.topic, &run.prefix);
    let mut rng = StdRng::seed_from_u64(run.seed ^ 0x0bad_5eed);
    let mut redis = RedisServer::start_with_aof();

    let mut w = Workload::new(run.seed, PARTITIONS);
    let first = w.grow(FIRST_WAVE);
    produce(&run.brokers, topic, w.messages(first));
    eprintln!("[e2e_redis_restart] first wave of {FIRST_WAVE} produced");

    let metrics_addr = format!("127.0.0.1:{}", free_port());
    let mut args = run.tally_args(&redis.url());
    args.extend(
        [
            "--metrics-addr",
            &metrics_addr,
            "--batch-max-events",
            "5000",
        ]
        .map(String::from),
    );
    let mut tally = Tally::spawn_args("tally", &args);

    // Events keep arriving until after the last restart, so every partition has batches to
    // apply once Redis is back.
    let producer = run.stream(w, CHUNK, Duration::from_millis(250));
    // The restarts hit a running consumer: start-up stops at a store it cannot read (a
    // supervisor restarts it), which is not what this test is about.
    wait_for("tally's first batch", Duration::from_secs(60), || {
        tally.assert_running();
        let fences = read_fences(&mut redis.conn(), prefix, group, topic, PARTITIONS as usize);
        fences.iter().any(Option::is_some).then_some(())
    });

    for (round, cut) in CUTS.into_iter().enumerate() {
        thread::sleep(Duration::from_millis(rng.random_range(1000..2500)));
        tally.assert_running();
        let before = read_fences(&mut redis.conn(), prefix, group, topic, PARTITIONS as usize);
        redis.kill();
        let removed = if cut > 0 {
            redis.truncate_aof_tail(cut)
        } else {
            0
        };
        let down = Duration::from_millis(rng.random_range(500..1500));
        thread::sleep(down);
        let t = Instant::now();
        redis.restart();
        let after = read_fences(&mut redis.conn(), prefix, group, topic, PARTITIONS as usize);
        let rolled_back: Vec<String> = before
            .iter()
            .zip(&after)
            .enumerate()
            .filter(|(_, (b, a))| a < b)
            .map(|(p, (b, a))| format!("p{p} {b:?}->{a:?}"))
            .collect();
        eprintln!(
            "[e2e_redis_restart] round {}: redis down {:.1} s, {removed} AOF bytes cut, reloaded in {:.1} s; fences rolled back: [{}]",
            round + 1,
            down.as_secs_f64(),
            t.elapsed().as_secs_f64(),
            rolled_back.join(", ")
        );
    }
    let w = producer.stop();
    eprintln!("[e2e_redis_restart] {}", w.describe());

    let hwms = run.hwms(w.events.len());
    let mut conn = redis.conn();
    run.wait_applied(&mut conn, &hwms, Duration::from_secs(150), || {
        tally.assert_running()
    });
    if let Ok(text) = try_scrape_metrics(&metrics_addr) {
        let show = |name: &str| {
            metric_series(&text, name)
                .iter()
                .map(|(l, v)| format!("{name}{l} {v}"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        eprintln!(
            "[e2e_redis_restart] {}; {}; {}",
            show("tally_batches_total"),
            show("tally_resyncs_total"),
            show("tally_redis_retries_total")
        );
    }

    run.assert_exact(&mut conn, &w.truth);

    let status = tally.sigterm_and_wait(Duration::from_secs(20));
    assert!(status.success(), "tally exited with {status} after SIGTERM");
}

/// Between tally and Redis, a proxy the test controls: it forwards every connection until it
/// has passed on the answer to the first PING (the one that ends tally's opening of the
/// store), then cuts every connection, open or new, until told to stop, as a restart or a
/// failover would. tally is then between its open and the end of its checks, for certain.
struct CuttingProxy {
    port: u16,
    cutting: Arc<AtomicBool>,
}

impl CuttingProxy {
    fn start(redis_port: u16) -> CuttingProxy {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind the proxy");
        let port = listener.local_addr().unwrap().port();
        let cutting = Arc::new(AtomicBool::new(false));
        let ponged = Arc::new(AtomicBool::new(false));
        let open: Arc<Mutex<Vec<TcpStream>>> = Arc::default();
        {
            let cutting = cutting.clone();
            thread::spawn(move || {
                for client in listener.incoming() {
                    let Ok(client) = client else { continue };
                    if cutting.load(Ordering::SeqCst) {
                        drop(client);
                        continue;
                    }
                    let Ok(server) = TcpStream::connect(("127.0.0.1", redis_port)) else {
                        continue;
                    };
                    let mut held = open.lock().unwrap();
                    held.extend([client.try_clone().unwrap(), server.try_clone().unwrap()]);
                    drop(held);
                    let (c2, s2) = (client.try_clone().unwrap(), server.try_clone().unwrap());
                    thread::spawn(move || pipe(client, server, None));
                    let (cutting, ponged, open) = (cutting.clone(), ponged.clone(), open.clone());
                    thread::spawn(move || {
                        pipe(
                            s2,
                            c2,
                            Some(Box::new(move |bytes: &[u8]| {
                                if !ponged.load(Ordering::SeqCst)
                                    && bytes.windows(5).any(|w| w == b"+PONG")
                                {
                                    ponged.store(true, Ordering::SeqCst);
                                    cutting.store(true, Ordering::SeqCst);
                                    for stream in open.lock().unwrap().drain(..) {
                                        let _ = stream.shutdown(Shutdown::Both);
                                    }
                                }
                            })),
                        )
                    });
                }
            });
        }
        CuttingProxy { port, cutting }
    }

    /// Forwards again, from the next connection on.
    fn stop_cutting(&self) {
        self.cutting.store(false, Ordering::SeqCst);
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }
}

type Seen = Box<dyn FnMut(&[u8]) + Send>;

/// Copies `from` to `to` until either closes; `seen` is shown each chunk after it was passed on.
fn pipe(mut from: TcpStream, mut to: TcpStream, mut seen: Option<Seen>) {
    let mut buf = [0u8; 16 << 10];
    loop {
        match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                if to.write_all(&buf[..n]).is_err() {
                    break;
                }
                if let Some(seen) = seen.as_mut() {
                    seen(&buf[..n]);
                }
            }
        }
    }
    let _ = from.shutdown(Shutdown::Both);
    let _ = to.shutdown(Shutdown::Both);
}

/// Redis stops answering right after tally opened the store and before its start-up checks
/// ran (as a restart or a failover does): the checks begin again, with a WARN line, rather than
/// exit or pass a check unread, and once the store answers, counting is exact.
#[test]
fn a_start_cut_off_from_redis_part_way_starts_its_checks_again() {
    let run = Scenario::new("e2e_redis_restart_start", "startcut", PARTITIONS);
    let redis = RedisServer::start();
    let w = run.produce_workload(run.seed, 4_000, PARTITIONS);
    let proxy = CuttingProxy::start(redis.port());
    let mut tally = Tally::spawn_args("tally", &run.tally_args(&proxy.url()));
    let retry_line = "Redis stopped answering during the start-up checks; starting them again.";
    wait_for("a start-up check cut off", Duration::from_secs(30), || {
        tally.assert_running();
        tally.log_text().contains(retry_line).then_some(())
    });
    // Cut for a moment longer: a second attempt fails too.
    thread::sleep(Duration::from_millis(500));
    proxy.stop_cutting();
    eprintln!(
        "[e2e_redis_restart] {} start attempts cut",
        tally.log_text().matches(retry_line).count()
    );

    let mut conn = redis.conn();
    run.wait_applied(
        &mut conn,
        &run.hwms(w.events.len()),
        Duration::from_secs(60),
        || tally.assert_running(),
    );
    let status = tally.sigterm_and_wait(Duration::from_secs(20));
    assert!(status.success(), "tally exited with {status} after SIGTERM");
    // A check whose connection was cut is made again, never passed as unreadable.
    let log = tally.log_text();
    for unread in [
        "Cannot read the store's version",
        "Cannot read maxmemory-policy",
        "Cannot read hash-max-listpack-entries",
    ] {
        assert!(!log.contains(unread), "{unread}: {}", tally.log_tail(30));
    }
    run.assert_exact(&mut conn, &w.truth);
}
