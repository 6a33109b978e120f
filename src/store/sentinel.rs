//! Following a Sentinel fail-over the moment the sentinels announce it.
//!
//! fred finds the master through the sentinels when it connects, and only then: a connection to a
//! master that was deposed but still answers (`SENTINEL FAILOVER`, or a fail-over after a partition
//! that healed) stays where it is. Until the sentinels turn the old master into a replica, which takes
//! them seconds (10 s in a probe of three sentinels), it takes writes, answers them, and then throws
//! them away when it resynchronises from the new master: writes answered 200 and lost.
//!
//! So every sentinel the URL names is subscribed to on `+switch-master`, which each publishes as it
//! switches (`<name> <old-ip> <old-port> <new-ip> <new-port>`); a switch of the master the URL follows
//! makes every pooled client reconnect, which asks the sentinels again and finds the new master, and
//! the invalidation subscriber too ([`Moves`]), whose reconnection flushes the cache as any does.
//! A sentinel that is down or cannot be subscribed to is tried again every second; while none can be,
//! a fail-over is followed as before: when the old master's connections close or stop answering.

use std::time::Duration;

use fred::clients::SubscriberClient;
use fred::prelude::{
    Builder, ClientLike, Config as FredConfig, EventInterface, Pool, PubsubInterface,
    ReconnectPolicy, Server, ServerConfig, Value,
};
use tokio::sync::broadcast::error::RecvError;
use tokio::sync::watch;

/// The channel on which a sentinel announces a new master.
const SWITCH_CHANNEL: &str = "+switch-master";

/// How often a sentinel that cannot be reached is tried again.
const RETRY: Duration = Duration::from_secs(1);

/// The latest master the sentinels announced, `host:port`; every announcement of a new one changes
/// it once, whichever sentinel (of several, which all announce it) said so first.
pub(super) type Moves = watch::Sender<Option<String>>;

/// Subscribes to every sentinel of `config` (nothing when it is not a Sentinel configuration) until
/// `stop` fires, and makes `pool` reconnect when one announces a new master for the URL's service.
pub(super) fn follow(
    config: &FredConfig,
    connect_timeout: Duration,
    pool: Pool,
    moves: Moves,
    stop: watch::Receiver<bool>,
) {
    let ServerConfig::Sentinel {
        hosts,
        service_name,
        ..
    } = &config.server
    else {
        return;
    };
    for host in hosts {
        let sentinel = FredConfig {
            server: ServerConfig::Centralized {
                server: host.clone(),
            },
            // The sentinels are reached as the URL says: with TLS for `rediss-sentinel://`, and without
            // the master's credentials, as fred reaches them.
            tls: config.tls.clone(),
            fail_fast: false,
            ..FredConfig::default()
        };
        let mut builder = Builder::from_config(sentinel);
        builder
            .set_policy(ReconnectPolicy::new_constant(0, millis(RETRY)))
            .with_connection_config(|c| {
                c.connection_timeout = connect_timeout;
                c.internal_command_timeout = connect_timeout;
            });
        let sub = match builder.build_subscriber_client() {
            Ok(sub) => sub,
            Err(e) => {
                tracing::warn!(
                    sentinel = %host,
                    "cannot follow this sentinel's fail-over announcements: {e}"
                );
                continue;
            }
        };
        tokio::spawn(listen(
            sub,
            host.clone(),
            service_name.clone(),
            pool.clone(),
            moves.clone(),
            stop.clone(),
        ));
    }
}

fn millis(d: Duration) -> u32 {
    u32::try_from(d.as_millis()).unwrap_or(u32::MAX)
}

async fn listen(
    sub: SubscriberClient,
    sentinel: Server,
    service: String,
    pool: Pool,
    moves: Moves,
    mut stop: watch::Receiver<bool>,
) {
    let mut messages = sub.message_rx();
    // Taken before connecting: the first connection is announced here too, and subscribes.
    let mut connected = sub.reconnect_rx();
    let _connection = sub.connect();
    loop {
        tokio::select! {
            _ = stop.changed() => break,
            c = connected.recv() => match c {
                Ok(_) | Err(RecvError::Lagged(_)) => {
                    if let Err(e) = sub.subscribe(SWITCH_CHANNEL).await {
                        tracing::warn!(
                            sentinel = %sentinel,
                            "cannot subscribe to this sentinel's fail-over announcements ({SWITCH_CHANNEL}): {e}"
                        );
                    }
                }
                Err(RecvError::Closed) => break,
            },
            m = messages.recv() => match m {
                Ok(m) => {
                    let text = match &m.value {
                        Value::String(s) => s.to_string(),
                        Value::Bytes(b) => String::from_utf8_lossy(b).into_owned(),
                        _ => continue,
                    };
                    let Some((from, to)) = switch_of(&text, &service) else {
                        continue;
                    };
                    // The first sentinel to tell moves the pool; the others' word is the same news.
                    let news = moves.send_if_modified(|last| {
                        if last.as_deref() == Some(to.as_str()) {
                            return false;
                        }
                        *last = Some(to.clone());
                        true
                    });
                    if news {
                        tracing::warn!(
                            sentinel = %sentinel,
                            "Sentinel moved the master `{service}` from {from} to {to}: reconnecting to the new master"
                        );
                        reconnect(&pool).await;
                    }
                }
                Err(RecvError::Lagged(_)) => {}
                Err(RecvError::Closed) => break,
            },
        }
    }
    let _ = sub.quit().await;
}

/// Makes every pooled client reconnect, each through the sentinels.
async fn reconnect(pool: &Pool) {
    let all = pool.clients().iter().map(|c| c.force_reconnection());
    for r in futures::future::join_all(all).await {
        if let Err(e) = r {
            tracing::warn!("reconnecting to the new master failed (fred retries): {e}");
        }
    }
}

/// `(old, new)` master addresses of a `+switch-master` message about `service`.
fn switch_of(message: &str, service: &str) -> Option<(String, String)> {
    let mut words = message.split_ascii_whitespace();
    if words.next()? != service {
        return None;
    }
    let (old_host, old_port, new_host, new_port) =
        (words.next()?, words.next()?, words.next()?, words.next()?);
    Some((
        format!("{old_host}:{old_port}"),
        format!("{new_host}:{new_port}"),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_switch_is_read_for_its_service_only() {
        assert_eq!(
            switch_of("mymaster 127.0.0.1 6379 10.0.0.2 6380", "mymaster"),
            Some(("127.0.0.1:6379".to_owned(), "10.0.0.2:6380".to_owned()))
        );
        assert_eq!(
            switch_of("other 127.0.0.1 6379 10.0.0.2 6380", "mymaster"),
            None
        );
        assert_eq!(switch_of("mymaster 127.0.0.1 6379", "mymaster"), None);
        assert_eq!(switch_of("", "mymaster"), None);
    }
}
