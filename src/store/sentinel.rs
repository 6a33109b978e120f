//! Following a Sentinel fail-over the moment the sentinels announce it.
//!
//! fred finds the master through the sentinels when it connects, and only then: a connection to a
//! master that was deposed but still answers (`SENTINEL FAILOVER`, or a fail-over after a partition
//! that healed) stays where it is. Until the sentinels turn the old master into a replica, which takes
//! them seconds (10 s in a probe of three sentinels), it takes writes, answers them, and then throws
//! them away when it resynchronises from the new master: writes answered 200 and lost.
//!
//! So every sentinel the URL names is subscribed to on `+switch-master`, which each publishes as it
//! switches (`<name> <old-ip> <old-port> <new-ip> <new-port>`), and on `+promoted-slave`, which the
//! sentinel leading the fail-over publishes as soon as the replica it chose answers as a master
//! (`slave <ip:port> <ip> <port> @ <name> <old-ip> <old-port>`): the leader announces
//! `+switch-master` itself only once every other replica follows the new master, seconds later, and
//! a URL that names only the leader would otherwise wait for that. From then on the leader already
//! names the promoted replica as the master. On a switch of the master the URL
//! follows, every pooled client not connected to the new master reconnects, which asks the sentinels
//! again; one that lands elsewhere (a sentinel that has not switched yet answered it) is made to
//! reconnect again, a few times. Once the pool has moved, the invalidation subscriber is told
//! ([`Moves`]) and reconnects too, which flushes the cache as any of its reconnections does. Several
//! sentinels announce the same switch: the first moves the pool, and the others find it moved.
//!
//! Each sentinel's connection is pinged and timed out as the pool's are, so one that died silently is
//! found and reconnected; one that is down, or refuses the subscription, is tried again every second,
//! with a warning the first time. Meanwhile a fail-over is followed as without this: when the old
//! master's connections close or stop answering.

use std::sync::Arc;
use std::time::Duration;

use fred::clients::SubscriberClient;
use fred::prelude::{
    Builder, ClientLike, Config as FredConfig, EventInterface, Pool, PubsubInterface,
    ReconnectPolicy, Server, ServerConfig, Value,
};

use super::redis::{millis, watch_connection};
use tokio::sync::broadcast::error::RecvError;
use tokio::sync::watch;

/// The channel on which a sentinel announces a new master.
const SWITCH_CHANNEL: &str = "+switch-master";

/// The channel on which the sentinel leading a fail-over announces the replica it promoted.
const PROMOTED_CHANNEL: &str = "+promoted-slave";

/// How often a sentinel that cannot be reached or subscribed to is tried again.
const RETRY: Duration = Duration::from_secs(1);

/// How many times a client that reconnected to another server than the announced master is made to
/// reconnect again, [`RETRY`] / 5 apart.
const MOVE_ATTEMPTS: u32 = 10;

/// Counts the moves of the pool to a new master: the invalidation subscriber reconnects at each.
pub(super) type Moves = watch::Sender<u64>;

/// Subscribes to every sentinel of `config` (nothing when it is not a Sentinel configuration) until
/// `stop` fires, and moves `pool` when one announces a new master for the URL's service.
pub(super) fn follow(
    config: &FredConfig,
    connect_timeout: Duration,
    unresponsive: Duration,
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
    // One switch handled at a time, so the sentinels that announce it after the first find it done.
    let moving = Arc::new(tokio::sync::Mutex::new(()));
    for host in hosts {
        let sentinel = FredConfig {
            server: ServerConfig::Centralized {
                server: host.clone(),
            },
            // The sentinels are reached as fred reaches them: with the URL's TLS and credentials (fred
            // sends the master's to the sentinels too; one that has no password drops them).
            tls: config.tls.clone(),
            username: config.username.clone(),
            password: config.password.clone(),
            fail_fast: false,
            ..FredConfig::default()
        };
        let mut builder = Builder::from_config(sentinel);
        builder
            .set_policy(ReconnectPolicy::new_constant(0, millis(RETRY)))
            .with_connection_config(|c| watch_connection(c, connect_timeout, unresponsive));
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
        let follower = Follower {
            sentinel: host.clone(),
            service: service_name.clone(),
            pool: pool.clone(),
            moves: moves.clone(),
            moving: moving.clone(),
            connect_timeout,
        };
        tokio::spawn(follower.listen(sub, unresponsive, stop.clone()));
    }
}

struct Follower {
    sentinel: Server,
    service: String,
    pool: Pool,
    moves: Moves,
    moving: Arc<tokio::sync::Mutex<()>>,
    connect_timeout: Duration,
}

impl Follower {
    async fn listen(
        self,
        sub: SubscriberClient,
        unresponsive: Duration,
        mut stop: watch::Receiver<bool>,
    ) {
        let sentinel = &self.sentinel;
        let mut messages = sub.message_rx();
        let mut errors = sub.error_rx();
        // Taken before connecting: the first connection is announced here too, and subscribes.
        let mut connected = sub.reconnect_rx();
        let connection = sub.connect();
        // A subscription has no command in flight: pinged, a dead connection is found.
        let beat = tokio::spawn(super::redis::heartbeat(
            vec![sub.clone()],
            super::redis::SUBSCRIBER_HEARTBEAT,
            unresponsive,
            stop.clone(),
        ));
        // Whether this sentinel's trouble was logged and not yet its recovery.
        let mut troubled = false;
        loop {
            tokio::select! {
                _ = stop.changed() => break,
                c = connected.recv() => match c {
                    Ok(_) | Err(RecvError::Lagged(_)) => match sub.subscribe(vec![SWITCH_CHANNEL, PROMOTED_CHANNEL]).await {
                        Ok(()) if troubled => {
                            troubled = false;
                            tracing::info!(sentinel = %sentinel, "following this sentinel's fail-over announcements again");
                        }
                        Ok(()) => {}
                        Err(e) => {
                            if !troubled {
                                troubled = true;
                                tracing::warn!(
                                    sentinel = %sentinel,
                                    "cannot subscribe to this sentinel's fail-over announcements ({SWITCH_CHANNEL}, {PROMOTED_CHANNEL}): {e}; trying again every {RETRY:?}"
                                );
                            }
                            tokio::select! {
                                _ = stop.changed() => break,
                                () = tokio::time::sleep(RETRY) => {}
                            }
                            // Its reconnection comes back here and subscribes again.
                            let _ = sub.force_reconnection().await;
                        }
                    },
                    Err(RecvError::Closed) => break,
                },
                e = errors.recv() => match e {
                    Ok((e, _)) => {
                        if !troubled {
                            troubled = true;
                            tracing::warn!(
                                sentinel = %sentinel,
                                "cannot reach this sentinel to follow its fail-over announcements: {e}; trying again every {RETRY:?}"
                            );
                        }
                    }
                    Err(RecvError::Lagged(_)) => {}
                    Err(RecvError::Closed) => break,
                },
                m = messages.recv() => match m {
                    Ok(m) => {
                        let text = match &m.value {
                            Value::String(s) => s.to_string(),
                            Value::Bytes(b) => String::from_utf8_lossy(b).into_owned(),
                            _ => continue,
                        };
                        let moved = if &*m.channel == PROMOTED_CHANNEL {
                            promotion_of(&text, &self.service)
                        } else {
                            switch_of(&text, &self.service)
                        };
                        let Some((from, to)) = moved else {
                            continue;
                        };
                        tokio::select! {
                            _ = stop.changed() => break,
                            () = self.move_to(&from, &to) => {}
                        }
                    }
                    Err(RecvError::Lagged(_)) => {}
                    Err(RecvError::Closed) => break,
                },
            }
        }
        beat.abort();
        let _ = tokio::time::timeout(self.connect_timeout, sub.quit()).await;
        connection.abort();
    }

    /// Moves every pooled client that is not on `to` (`host:port`), then tells the subscriber.
    async fn move_to(&self, from: &str, to: &str) {
        let _one_at_a_time = self.moving.lock().await;
        let service = &self.service;
        // A client that is not connected reconnects through the sentinels by itself (fred's policy):
        // forced too, it would only take away a connection that just came up.
        let elsewhere = |c: &&fred::clients::Client| c.is_connected() && !on(c, to);
        if !self.pool.clients().iter().any(|c| elsewhere(&c)) {
            return;
        }
        tracing::warn!(
            sentinel = %self.sentinel,
            "Sentinel moved the master `{service}` from {from} to {to}: reconnecting to the new master"
        );
        for attempt in 1..=MOVE_ATTEMPTS {
            let moving = self
                .pool
                .clients()
                .iter()
                .filter(elsewhere)
                .map(|c| c.force_reconnection());
            for r in futures::future::join_all(moving).await {
                if let Err(e) = r {
                    tracing::warn!("reconnecting to the new master failed (fred retries): {e}");
                }
            }
            // Reconnected, but through a sentinel that had not switched yet: again, a little later.
            let astray: Vec<String> = self
                .pool
                .clients()
                .iter()
                .flat_map(|c| c.active_connections())
                .map(|s| s.to_string())
                .filter(|s| s != to)
                .collect();
            if astray.is_empty() {
                break;
            }
            if attempt == MOVE_ATTEMPTS {
                tracing::warn!(
                    "after {MOVE_ATTEMPTS} reconnections, connections are still on {} rather than the announced master {to}",
                    astray.join(", ")
                );
                break;
            }
            tokio::time::sleep(RETRY / 5).await;
        }
        // The subscriber last, so that it does not listen on the new master while reads still go to
        // the old one (a value read there in between could outlive a write's announcement).
        self.moves.send_modify(|n| *n = n.wrapping_add(1));
    }
}

/// Whether `client` is connected to `to` (`host:port`) as far as fred knows (it knows a connection's
/// server once the connection's `CLIENT ID` was read; not knowing counts as not on it).
fn on(client: &fred::clients::Client, to: &str) -> bool {
    let servers = client.active_connections();
    !servers.is_empty() && servers.iter().all(|s| s.to_string() == to)
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

/// `(old, new)` master addresses of a `+promoted-slave` message about `service`:
/// `slave <ip:port> <ip> <port> @ <service> <old-ip> <old-port>`.
fn promotion_of(message: &str, service: &str) -> Option<(String, String)> {
    let words: Vec<&str> = message.split_ascii_whitespace().collect();
    match words.as_slice() {
        ["slave", _, ip, port, "@", name, old_ip, old_port] if *name == service => {
            Some((format!("{old_ip}:{old_port}"), format!("{ip}:{port}")))
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_promotion_is_read_for_its_service_only() {
        let m = "slave 127.0.0.1:6380 127.0.0.1 6380 @ mymaster 127.0.0.1 6379";
        assert_eq!(
            promotion_of(m, "mymaster"),
            Some(("127.0.0.1:6379".to_owned(), "127.0.0.1:6380".to_owned()))
        );
        assert_eq!(promotion_of(m, "other"), None);
        assert_eq!(
            promotion_of("master mymaster 127.0.0.1 6379", "mymaster"),
            None
        );
    }

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
