//! Reading the Prometheus endpoint of a running `tally`.

use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::Duration;

/// GET /metrics from `addr` ("127.0.0.1:PORT") and return the body.
pub fn try_scrape_metrics(addr: &str) -> std::io::Result<String> {
    let (status, body) = http_get(addr, "/metrics")?;
    if status != 200 {
        return Err(std::io::Error::other(format!("metrics answered {status}")));
    }
    Ok(body)
}

/// GET `path` from `addr` ("127.0.0.1:PORT"): the status code and the body.
pub fn http_get(addr: &str, path: &str) -> std::io::Result<(u16, String)> {
    let sock = addr
        .to_socket_addrs()?
        .next()
        .ok_or_else(|| std::io::Error::other("no address"))?;
    let mut stream = TcpStream::connect_timeout(&sock, Duration::from_secs(2))?;
    stream.set_read_timeout(Some(Duration::from_secs(10)))?;
    write!(
        stream,
        "GET {path} HTTP/1.0\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )?;
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw)?;
    let text = String::from_utf8_lossy(&raw).into_owned();
    let (head, body) = text
        .split_once("\r\n\r\n")
        .ok_or_else(|| std::io::Error::other("malformed HTTP response"))?;
    let status_line = head.lines().next().unwrap_or_default();
    let status = status_line
        .split_whitespace()
        .nth(1)
        .and_then(|code| code.parse().ok())
        .ok_or_else(|| std::io::Error::other(format!("bad status line {status_line:?}")))?;
    let chunked = head
        .lines()
        .any(|l| l.to_ascii_lowercase().starts_with("transfer-encoding:") && l.contains("chunked"));
    let body = if chunked {
        dechunk(body)
    } else {
        body.to_string()
    };
    Ok((status, body))
}

fn dechunk(mut body: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = body.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
        if n == 0 || rest.len() < n {
            break;
        }
        out.push_str(&rest[..n]);
        body = rest[n..].trim_start_matches("\r\n");
    }
    out
}

pub fn scrape_metrics(addr: &str) -> String {
    try_scrape_metrics(addr).unwrap_or_else(|e| panic!("scrape http://{addr}/metrics: {e}"))
}

/// Partitions a running consumer owns, from `tally_assigned_partitions` at `addr`; None while
/// the endpoint does not answer or lacks the metric.
pub fn assigned_partitions(addr: &str) -> Option<f64> {
    let text = try_scrape_metrics(addr).ok()?;
    metric_value(&text, "tally_assigned_partitions")
}

/// Value of the series written exactly as `name_with_labels` (e.g. `x_total{reason="decode"}`).
pub fn metric_value(text: &str, name_with_labels: &str) -> Option<f64> {
    text.lines().filter(|l| !l.starts_with('#')).find_map(|l| {
        let rest = l.strip_prefix(name_with_labels)?;
        if !rest.starts_with(' ') {
            return None;
        }
        rest.split_whitespace().next()?.parse().ok()
    })
}

/// Sum of every series of metric `name`, whatever its labels.
pub fn metric_sum(text: &str, name: &str) -> f64 {
    metric_series(text, name).iter().map(|(_, v)| v).sum()
}

/// Every series of metric `name`: (label part, value).
pub fn metric_series(text: &str, name: &str) -> Vec<(String, f64)> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let rest = l.strip_prefix(name)?;
            let (labels, value) = if rest.starts_with('{') {
                let end = rest.find('}')?;
                (&rest[..=end], &rest[end + 1..])
            } else if rest.starts_with(' ') {
                ("", rest)
            } else {
                return None;
            };
            let v: f64 = value.split_whitespace().next()?.parse().ok()?;
            Some((labels.to_string(), v))
        })
        .collect()
}
