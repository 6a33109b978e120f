//! Single-key commands on a Redis Cluster, pipelined, with the cluster's redirections followed here
//! rather than by fred.
//!
//! While a slot is resharded (`redis-cli --cluster reshard`, `rebalance`, adding a node), its old owner
//! answers a command for a key it no longer holds with `ASK <slot> <host:port>`: send that one command,
//! preceded by `ASKING`, to the new owner. Once the move ends, the old owner answers `MOVED`: refresh the
//! slot map and resend. fred 10.1 follows `MOVED`, but not `ASK`: it sends `ASKING` to the new owner and
//! then the command itself to the old one again, which answers `ASK` again, until the command runs out of
//! attempts, and that error ends the client's routing task, so the client stays disconnected for good. A
//! resharding would thus fail every read of a moved key for as long as it lasts, and kill the pool's
//! clients one by one.
//!
//! So the pool is built with `max_redirections = 0` ([`configure`]): fred then answers a redirected
//! command with an error, after refreshing its slot map on a `MOVED`, and keeps running. [`run`] sends a
//! redirected command again on its own (a `MOVED` one now reaches the new owner), and one redirected
//! again (an `ASK`: the new owner no longer holds the key) to the node importing its slot, preceded by
//! `ASKING`. Which node imports a slot is what its owner's `CLUSTER NODES` says (`[slot->-node]` on its
//! own line), since the error fred passes on no longer holds the `ASK`'s address; a node that owns no
//! slot yet (a primary just added) is reached through a client of its own ([`Newcomers`]). Reads ride in one
//! pipeline, sent again command by command when a redirection fails it; writes are sent one by one
//! from the start, so none runs twice.

use std::collections::BTreeMap;

use futures::future::join_all;

use std::time::Duration;

use fred::clients::Client;
use fred::prelude::{Builder, ClientLike, Error as FredError, ErrorKind, Options, Value};
use fred::types::config::{Server, ServerConfig};
use fred::types::{ClusterHash, CustomCommand};
use parking_lot::Mutex;

/// One single-key command: its name and its arguments, the key first.
pub struct Op {
    pub cmd: &'static str,
    pub args: Vec<Value>,
    /// Sending it twice does no harm (a read): it may ride in a pipeline, which a redirection of any
    /// of its commands fails as a whole, after the others ran.
    repeatable: bool,
}

impl Op {
    /// A command that changes something: sent on its own, so that it runs once.
    pub fn write(cmd: &'static str, args: Vec<Value>) -> Self {
        Self {
            cmd,
            args,
            repeatable: false,
        }
    }

    /// A command that only reads.
    pub fn read(cmd: &'static str, args: Vec<Value>) -> Self {
        Self {
            cmd,
            args,
            repeatable: true,
        }
    }

    /// The hash slot of the command's key.
    fn slot(&self) -> u16 {
        let key: &[u8] = match self.args.first() {
            Some(Value::String(s)) => s.as_bytes(),
            Some(Value::Bytes(b)) => b,
            _ => &[],
        };
        fred::util::redis_keyslot(key)
    }
}

/// Has fred follow no redirection itself (see the module doc).
pub fn configure(connection: &mut fred::types::config::ConnectionConfig) {
    connection.max_redirections = 0;
}

/// Clients of their own for nodes that import a slot but are in no slot map yet: a primary just added,
/// its first slot on the way. The pool's clients connect only to the nodes that own slots, so the keys
/// moved to such a node are reached through one of these, opened at its first `ASK` and kept (at most
/// [`MAX_NEWCOMERS`]) while the resharding goes on; once the node owns a slot, the pool's own slot map
/// has it.
pub struct Newcomers {
    /// The pool's configuration, its server replaced by the newcomer's.
    builder: Builder,
    clients: Mutex<Vec<(Server, Client)>>,
}

/// The most newcomers' clients kept; opening another closes the oldest.
const MAX_NEWCOMERS: usize = 8;

impl Newcomers {
    pub fn new(builder: Builder) -> Self {
        Self {
            builder,
            clients: Mutex::new(Vec::new()),
        }
    }

    /// The client of `server`, connected within `wait`.
    async fn client(&self, server: &Server, wait: Duration) -> Result<Client, FredError> {
        if let Some((_, c)) = self.clients.lock().iter().find(|(s, _)| s == server) {
            return Ok(c.clone());
        }
        let mut config = self.builder.get_config().cloned().unwrap_or_default();
        config.server = ServerConfig::Centralized {
            server: server.clone(),
        };
        let mut builder = self.builder.clone();
        builder.set_config(config);
        let client = builder.build()?;
        let connected = tokio::time::timeout(wait, client.init()).await;
        if !matches!(connected, Ok(Ok(_))) {
            let quit = client.clone();
            tokio::spawn(async move { quit.quit().await });
            return Err(match connected {
                Ok(Err(e)) => e,
                _ => FredError::new(
                    ErrorKind::Timeout,
                    format!(
                        "no connection to {}:{} within {wait:?}",
                        server.host, server.port
                    ),
                ),
            });
        }
        let mut clients = self.clients.lock();
        if let Some((_, c)) = clients.iter().find(|(s, _)| s == server) {
            // Opened meanwhile by another read: that one is kept.
            let (kept, extra) = (c.clone(), client);
            tokio::spawn(async move { extra.quit().await });
            return Ok(kept);
        }
        if clients.len() >= MAX_NEWCOMERS {
            let (_, oldest) = clients.remove(0);
            tokio::spawn(async move { oldest.quit().await });
        }
        clients.push((server.clone(), client.clone()));
        Ok(client)
    }

    /// Closes every newcomer's client.
    pub async fn close(&self) {
        let clients: Vec<Client> = self.clients.lock().drain(..).map(|(_, c)| c).collect();
        for c in clients {
            let _ = c.quit().await;
        }
    }
}

/// Where a command redirected by `ASK` goes: a node the pool's client is connected to, or a newcomer.
enum Asked {
    Connected(Server),
    Newcomer(Server),
}

/// Runs `ops` on `client` with `options`: one result per op, in order.
///
/// Each op is answered by its own owner's redirection, so each is followed on its own: the first send
/// (after which fred has refreshed its slot map if it was a `MOVED`), a second send to the owner fred
/// knows now, and only when that owner redirects too (it no longer holds the key: `ASK`), the node
/// importing the slot, with `ASKING`.
pub async fn run(
    client: &Client,
    newcomers: &Newcomers,
    options: &Options,
    ops: &[Op],
) -> Vec<Result<Value, FredError>> {
    let mut results = if ops.iter().all(|op| op.repeatable) {
        // Reads ride in one pipeline. A redirection fails it as a whole (fred answers its one responder
        // with the error and drops the other answers), so then every read is sent again on its own,
        // which is its first send of its own.
        let results = pipeline(client, options, ops).await;
        if !results.iter().any(is_redirection) {
            return results;
        }
        join_all(
            ops.iter()
                .map(|op| alone(client, newcomers, options, op, None)),
        )
        .await
    } else {
        // Writes are sent one by one (fred still writes them to each node's socket together), so a
        // redirection fails only the write redirected, and none runs twice.
        join_all(
            ops.iter()
                .map(|op| alone(client, newcomers, options, op, None)),
        )
        .await
    };
    let redirected: Vec<usize> = (0..ops.len())
        .filter(|&i| is_redirection(&results[i]))
        .collect();
    if redirected.is_empty() {
        return results;
    }
    let again = join_all(
        redirected
            .iter()
            .map(|&i| alone(client, newcomers, options, &ops[i], None)),
    )
    .await;
    for (&i, r) in redirected.iter().zip(again) {
        results[i] = r;
    }
    let asked: Vec<usize> = redirected
        .into_iter()
        .filter(|&i| is_redirection(&results[i]))
        .collect();
    if asked.is_empty() {
        return results;
    }
    // Redirected by the owner of a fresh slot map: the slot is being moved, and the key has left.
    let mut slots: BTreeMap<u16, Vec<usize>> = BTreeMap::new();
    for i in asked {
        slots.entry(ops[i].slot()).or_default().push(i);
    }
    let mut sends = Vec::new();
    for (slot, indices) in slots {
        match importer(client, options, slot).await {
            Ok(asked) => {
                let asked = std::sync::Arc::new(asked);
                sends.extend(indices.into_iter().map(|i| (i, asked.clone())));
            }
            Err(e) => {
                for i in indices {
                    results[i] = Err(e.clone());
                }
            }
        }
    }
    let answers = join_all(
        sends
            .iter()
            .map(|(i, asked)| alone(client, newcomers, options, &ops[*i], Some(asked))),
    )
    .await;
    for ((i, _), r) in sends.iter().zip(answers) {
        results[*i] = r;
    }
    results
}

/// Sends `ops` in one pipeline: one result per op. A pipeline that fails as a whole (a redirection, a
/// timeout, a lost connection) answers its one error for every op.
async fn pipeline(client: &Client, options: &Options, ops: &[Op]) -> Vec<Result<Value, FredError>> {
    let p = client.pipeline().with_options(options);
    for op in ops {
        let cmd = CustomCommand::new_static(op.cmd, ClusterHash::FirstKey, false);
        if let Err(e) = p.custom::<(), Value>(cmd, op.args.clone()).await {
            return vec![Err(e); ops.len()];
        }
    }
    let answers = p.try_all::<Value>().await;
    if answers.len() == ops.len() {
        return answers;
    }
    let e = answers
        .into_iter()
        .find_map(Result::err)
        .unwrap_or_else(|| {
            FredError::new(ErrorKind::Unknown, "a pipeline answered too few results")
        });
    vec![Err(e); ops.len()]
}

/// Sends `op` on its own; to `asked`, the node importing its slot, preceded by `ASKING` (in one
/// pipeline, so nothing comes between them on the connection).
async fn alone(
    client: &Client,
    newcomers: &Newcomers,
    options: &Options,
    op: &Op,
    asked: Option<&Asked>,
) -> Result<Value, FredError> {
    let cmd = CustomCommand::new_static(op.cmd, ClusterHash::FirstKey, false);
    let (client, options) = match asked {
        None => {
            return client
                .with_options(options)
                .custom(cmd, op.args.clone())
                .await;
        }
        Some(Asked::Connected(server)) => (
            client.clone(),
            Options {
                cluster_node: Some(server.clone()),
                ..options.clone()
            },
        ),
        Some(Asked::Newcomer(server)) => {
            let wait = options.timeout.unwrap_or(Duration::from_secs(1));
            (newcomers.client(server, wait).await?, options.clone())
        }
    };
    let p = client.pipeline().with_options(&options);
    let asking = CustomCommand::new_static("ASKING", ClusterHash::Random, false);
    p.custom::<(), Value>(asking, Vec::new()).await?;
    p.custom::<(), Value>(cmd, op.args.clone()).await?;
    let mut answers = p.try_all::<Value>().await;
    match (answers.pop(), answers.pop()) {
        (Some(answer), Some(Ok(_))) => answer,
        (_, Some(Err(e))) | (Some(Err(e)), None) => Err(e),
        _ => Err(FredError::new(
            ErrorKind::Unknown,
            "ASKING and a command answered no result",
        )),
    }
}

/// Whether fred answered a command with a redirection it did not follow.
fn is_redirection(r: &Result<Value, FredError>) -> bool {
    matches!(r, Err(e) if *e.kind() == ErrorKind::Routing && e.details().contains("redirection"))
}

/// The node importing `slot`, as its owner's `CLUSTER NODES` says: one `client` is connected to, or a
/// newcomer.
async fn importer(client: &Client, options: &Options, slot: u16) -> Result<Asked, FredError> {
    let nodes = CustomCommand::new_static("CLUSTER", ClusterHash::Custom(slot), false);
    let options = Options {
        cluster_hash: Some(ClusterHash::Custom(slot)),
        ..options.clone()
    };
    let text: Value = client
        .with_options(&options)
        .custom(nodes, vec!["NODES"])
        .await?;
    let text = text.as_str().unwrap_or_default();
    let (ip, hostname, port) = importing_node(&text, slot).ok_or_else(|| {
        FredError::new(
            ErrorKind::Cluster,
            format!("slot {slot} is redirected, but its owner does not say where it is moving"),
        )
    })?;
    let known = client
        .active_connections()
        .into_iter()
        .find(|s| s.port == port && (&*s.host == ip || Some(&*s.host) == hostname));
    Ok(match known {
        Some(server) => Asked::Connected(server),
        // Reached as the cluster announces it: by its hostname where it has one.
        None => Asked::Newcomer(Server::new(hostname.unwrap_or(ip), port)),
    })
}

/// From a node's `CLUSTER NODES` answer, the address of the node its own line says `slot` is migrating
/// to (`[slot->-id]`): its IP, the hostname it announces if any, and its port.
fn importing_node(nodes: &str, slot: u16) -> Option<(&str, Option<&str>, u16)> {
    let lines = || {
        nodes
            .lines()
            .map(|l| l.split_ascii_whitespace().collect::<Vec<_>>())
    };
    let mine = lines().find(|f| {
        f.get(2)
            .is_some_and(|flags| flags.split(',').any(|f| f == "myself"))
    })?;
    let marker = format!("[{slot}->-");
    let id = mine
        .iter()
        .skip(8)
        .find_map(|f| f.strip_prefix(marker.as_str())?.strip_suffix(']'))?;
    let theirs = lines().find(|f| f.first() == Some(&id))?;
    // ip:port@cport[,hostname]
    let address = theirs.get(1)?;
    let (endpoint, hostname) = match address.split_once(',') {
        Some((e, h)) => (e, Some(h).filter(|h| !h.is_empty())),
        None => (*address, None),
    };
    let endpoint = endpoint.split('@').next()?;
    let (ip, port) = endpoint.rsplit_once(':')?;
    Some((ip, hostname, port.parse().ok()?))
}

#[cfg(test)]
mod tests {
    use super::importing_node;

    const NODES: &str = "\
07c37dfeb235213a872192d90877d0cd55635b91 127.0.0.1:30004@31004 slave e7d1eecce10fd6bb5eb35b9f99a514335d9ba9ca 0 1426238317239 4 connected
67ed2db8d677e59ec4a4cefb06858cf2a1a89fa1 127.0.0.1:30002@31002 master - 0 1426238316232 2 connected 5461-10922
e7d1eecce10fd6bb5eb35b9f99a514335d9ba9ca 127.0.0.1:30001@31001 myself,master - 0 0 1 connected 0-5460 [93->-67ed2db8d677e59ec4a4cefb06858cf2a1a89fa1] [77-<-292f8b365bb7edb5e285caf0b7e6ddc7265d2f4f]
292f8b365bb7edb5e285caf0b7e6ddc7265d2f4f 10.0.0.7:30003@31003,redis-3.internal master - 0 1426238318243 3 connected 10923-16383
";

    #[test]
    fn the_importer_of_a_migrating_slot_is_read_from_the_owners_own_line() {
        assert_eq!(importing_node(NODES, 93), Some(("127.0.0.1", None, 30002)));
    }

    #[test]
    fn a_slot_not_migrating_or_only_importing_has_no_importer() {
        assert_eq!(importing_node(NODES, 94), None);
        assert_eq!(importing_node(NODES, 77), None);
        assert_eq!(importing_node("", 93), None);
    }

    #[test]
    fn a_node_announcing_a_hostname_is_known_by_it_and_its_ip() {
        let nodes = NODES.replace(
            "[93->-67ed2db8d677e59ec4a4cefb06858cf2a1a89fa1]",
            "[93->-292f8b365bb7edb5e285caf0b7e6ddc7265d2f4f]",
        );
        assert_eq!(
            importing_node(&nodes, 93),
            Some(("10.0.0.7", Some("redis-3.internal"), 30003))
        );
    }
}
