//! A plain Redis GET round trip, measured in the same run as the gateway, so the miss path can be
//! reported beside what one store round trip costs on this machine at this moment.
//!
//! It speaks just enough RESP for `AUTH`, `SELECT` and `GET` over one connection, sequentially: the
//! floor of any cache miss.

use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

/// Percentiles of the GET round trips.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RedisGet {
    pub samples: u64,
    pub p50_us: u64,
    pub p99_us: u64,
    pub p999_us: u64,
}

struct Url {
    addr: String,
    password: Option<(Option<String>, String)>,
    db: Option<u32>,
}

/// Checks a `--redis-url` before any load is sent: its syntax, and that it is loopback unless
/// `allow_remote`.
pub fn check_url(url: &str, allow_remote: bool) -> Result<(), String> {
    parse(url, allow_remote).map(|_| ())
}

/// `url` with its password (if any) masked, for messages: a credential does not belong in a terminal's
/// scroll-back or a CI log.
pub fn redact(url: &str) -> String {
    let Some(rest) = url.strip_prefix("redis://") else {
        return url.to_string();
    };
    let Some((auth, host)) = rest.rsplit_once('@') else {
        return url.to_string();
    };
    match auth.split_once(':') {
        Some((user, _)) => format!("redis://{user}:***@{host}"),
        None => format!("redis://***@{host}"),
    }
}

fn parse(url: &str, allow_remote: bool) -> Result<Url, String> {
    let shown = redact(url);
    let rest = url
        .strip_prefix("redis://")
        .ok_or_else(|| format!("{shown:?}: expected redis://[user:password@]host:port[/db]"))?;
    let (auth, hostpart) = match rest.rsplit_once('@') {
        Some((a, h)) => (Some(a), h),
        None => (None, rest),
    };
    let (hostport, db) = match hostpart.split_once('/') {
        Some((h, d)) if !d.is_empty() => (
            h,
            Some(
                d.parse::<u32>()
                    .map_err(|_| format!("{shown:?}: the database must be a number"))?,
            ),
        ),
        Some((h, _)) => (h, None),
        None => (hostpart, None),
    };
    let host = match hostport.find(']') {
        Some(i) if hostport.starts_with('[') => &hostport[..=i],
        _ => hostport.rsplit_once(':').map_or(hostport, |(h, _)| h),
    };
    let loopback = host == "localhost"
        || host
            .trim_start_matches('[')
            .trim_end_matches(']')
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback());
    if !loopback && !allow_remote {
        return Err(format!(
            "{shown:?}: only loopback Redis servers are probed (pass --allow-remote to lift this)"
        ));
    }
    let addr = match hostport.rsplit_once(':') {
        // An IPv6 address without a port ends in `]`, and its colons are not a port separator.
        Some((_, port)) if !hostport.ends_with(']') => match port.parse::<u16>() {
            Ok(p) if p > 0 => hostport.to_string(),
            _ => {
                return Err(format!(
                    "{shown:?}: the port must be 1-65535 (got {port:?})"
                ));
            }
        },
        _ => format!("{hostport}:6379"),
    };
    let password = auth.map(|a| match a.split_once(':') {
        Some((u, p)) if !u.is_empty() => (Some(u.to_string()), p.to_string()),
        Some((_, p)) => (None, p.to_string()),
        None => (None, a.to_string()),
    });
    Ok(Url { addr, password, db })
}

fn command(args: &[&str]) -> Vec<u8> {
    let mut out = format!("*{}\r\n", args.len()).into_bytes();
    for a in args {
        out.extend_from_slice(format!("${}\r\n", a.len()).as_bytes());
        out.extend_from_slice(a.as_bytes());
        out.extend_from_slice(b"\r\n");
    }
    out
}

/// Reads one RESP reply (simple string, error, integer, bulk string or nil); returns an error reply as Err.
async fn reply(r: &mut BufReader<TcpStream>, line: &mut String) -> Result<(), String> {
    line.clear();
    r.read_line(line).await.map_err(|e| e.to_string())?;
    match line.as_bytes().first() {
        Some(b'+' | b':') => Ok(()),
        Some(b'-') => Err(line.trim_end().to_string()),
        Some(b'$') => {
            let n: i64 = line[1..]
                .trim_end()
                .parse()
                .map_err(|_| format!("bad reply {line:?}"))?;
            if n >= 0 {
                let mut buf = vec![0u8; n as usize + 2];
                r.read_exact(&mut buf).await.map_err(|e| e.to_string())?;
            }
            Ok(())
        }
        _ => Err(format!("unexpected reply {line:?}")),
    }
}

/// Sends `samples` sequential GETs of `key(i)` (at most for `budget`) and returns their percentiles.
pub async fn probe(
    url: &str,
    allow_remote: bool,
    samples: usize,
    budget: Duration,
    key: impl Fn(usize) -> String,
) -> Result<RedisGet, String> {
    let u = parse(url, allow_remote)?;
    let stream = tokio::time::timeout(Duration::from_secs(2), TcpStream::connect(&u.addr))
        .await
        .map_err(|_| format!("{}: no connection within 2 s", u.addr))?
        .map_err(|e| format!("{}: {e}", u.addr))?;
    let _ = stream.set_nodelay(true);
    let mut r = BufReader::new(stream);
    let mut line = String::new();
    if let Some((user, pass)) = &u.password {
        let cmd = match user {
            Some(user) => command(&["AUTH", user, pass]),
            None => command(&["AUTH", pass]),
        };
        r.get_mut()
            .write_all(&cmd)
            .await
            .map_err(|e| e.to_string())?;
        reply(&mut r, &mut line).await?;
    }
    if let Some(db) = u.db {
        r.get_mut()
            .write_all(&command(&["SELECT", &db.to_string()]))
            .await
            .map_err(|e| e.to_string())?;
        reply(&mut r, &mut line).await?;
    }
    let mut hist = hdrhistogram::Histogram::<u64>::new_with_bounds(1, 60_000_000, 3)
        .map_err(|e| e.to_string())?;
    let deadline = Instant::now() + budget;
    for i in 0..samples {
        if Instant::now() >= deadline {
            break;
        }
        let k = key(i);
        let cmd = command(&["GET", &k]);
        let t = Instant::now();
        r.get_mut()
            .write_all(&cmd)
            .await
            .map_err(|e| e.to_string())?;
        reply(&mut r, &mut line).await?;
        let _ = hist.record((t.elapsed().as_micros() as u64).max(1));
    }
    Ok(RedisGet {
        samples: hist.len(),
        p50_us: hist.value_at_quantile(0.5),
        p99_us: hist.value_at_quantile(0.99),
        p999_us: hist.value_at_quantile(0.999),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_never_show_the_password() {
        for url in [
            "redis://user:SECRETPW@10.1.1.1:6379",
            "redis://:SECRETPW@10.1.1.1:6379",
            "redis://SECRETPW@127.0.0.1:99999",
            "redis://user:SECRETPW@127.0.0.1:6379/x",
        ] {
            let e = check_url(url, false).expect_err(url);
            assert!(!e.contains("SECRETPW") && e.contains("***"), "{e}");
        }
        assert_eq!(
            redact("redis://u:p@h:1/0"),
            "redis://u:***@h:1/0".to_string()
        );
        assert_eq!(redact("redis://h:1"), "redis://h:1".to_string());
    }

    #[test]
    fn urls_are_parsed_and_remote_hosts_refused_unless_allowed() {
        let u = parse("redis://127.0.0.1:7000/2", false).expect("loopback");
        assert_eq!((u.addr.as_str(), u.db), ("127.0.0.1:7000", Some(2)));
        let u = parse("redis://:secret@localhost", false).expect("auth");
        assert_eq!(u.addr, "localhost:6379");
        assert_eq!(u.password, Some((None, "secret".to_string())));
        assert!(parse("redis://10.0.0.5:6379", false).is_err());
        assert!(parse("redis://redis:6379", true).is_ok());
        assert!(parse("http://127.0.0.1:6379", false).is_err());
        for bad in [
            "redis://127.0.0.1:99999",
            "redis://127.0.0.1:x",
            "redis://127.0.0.1:",
        ] {
            let e = check_url(bad, false).expect_err(bad);
            assert!(e.contains("port must be 1-65535"), "{e}");
        }
        assert_eq!(
            parse("redis://[::1]", false).expect("v6").addr,
            "[::1]:6379"
        );
        assert_eq!(
            parse("redis://[::1]:7000", false).expect("v6").addr,
            "[::1]:7000"
        );
    }
}
