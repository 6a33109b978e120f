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
//! again (an `ASK`: the owner no longer holds the key) to the node importing its slot, preceded by
//! `ASKING`, in one pipeline per node. Which node imports a slot is what its owner's `CLUSTER NODES`
//! says (`[slot->-node]` on its own line), since the error fred passes on no longer holds the `ASK`'s
//! address; a node that owns no slot yet (a primary just added) is reached through a client of its own
//! ([`Newcomers`]).
//!
//! Reads ride in one pipeline, sent again command by command when a redirection fails it; writes are
//! sent one by one from the start, so none runs twice. Every step sends its commands in their order,
//! so two commands of one key (a hot set's increments and its trim) run in order. On a standalone
//! server or behind Sentinel nothing is redirected, and every batch is one pipeline.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::time::Duration;

use fred::clients::Client;
use fred::prelude::{Builder, ClientLike, Error as FredError, ErrorKind, Options, Value};
use fred::types::config::{Server, ServerConfig};
use fred::types::{ClusterHash, CustomCommand};
use futures::future::join_all;
use parking_lot::Mutex;
use tokio::sync::watch;

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
///
/// One connection is made per node, in a task of its own, whatever number of commands wait for it: a
/// read that gives up waiting (its deadline) neither stops it nor leaves a second one behind.
pub struct Newcomers {
    /// The pool's configuration, its server replaced by the newcomer's.
    builder: Builder,
    /// How long a connection may take (`store.redis.connect_timeout`).
    connect: Duration,
    /// The newcomers in the order they were first asked for, each with its id and its connection:
    /// `None` while it is being made.
    clients: Arc<Mutex<Vec<Newcomer>>>,
    next_id: AtomicU64,
    /// Set by `close`: no connection is made after it.
    closed: Arc<AtomicBool>,
}

struct Newcomer {
    server: Server,
    id: u64,
    ready: watch::Receiver<Option<Result<Client, FredError>>>,
}

/// The most newcomers' clients kept; opening another closes the oldest.
const MAX_NEWCOMERS: usize = 8;

impl Newcomers {
    pub fn new(builder: Builder, connect: Duration) -> Self {
        Self {
            builder,
            connect,
            clients: Arc::new(Mutex::new(Vec::new())),
            next_id: AtomicU64::new(0),
            closed: Arc::new(AtomicBool::new(false)),
        }
    }

    /// The client of `server`, once connected.
    async fn client(&self, server: &Server) -> Result<Client, FredError> {
        let mut ready = self.connection(server);
        let answer = ready
            .wait_for(Option::is_some)
            .await
            .map_err(|_| FredError::new(ErrorKind::Canceled, "the store was closed"))?;
        match answer.as_ref() {
            Some(result) => result.clone(),
            None => Err(FredError::new(ErrorKind::Unknown, "no connection was made")),
        }
    }

    /// The connection of `server`: the one made or being made, else a new one, made in a task of its
    /// own.
    fn connection(&self, server: &Server) -> watch::Receiver<Option<Result<Client, FredError>>> {
        let mut clients = self.clients.lock();
        if self.closed.load(Relaxed) {
            let closed = FredError::new(ErrorKind::Canceled, "the store was closed");
            return watch::channel(Some(Err(closed))).1;
        }
        if let Some(i) = clients.iter().position(|n| n.server == *server) {
            // One whose task ended without an answer (it panicked) is made again.
            let n = &clients[i];
            if n.ready.borrow().is_some() || n.ready.has_changed().is_ok() {
                return n.ready.clone();
            }
            clients.remove(i);
        }
        let id = self.next_id.fetch_add(1, Relaxed);
        let (tx, rx) = watch::channel(None);
        if clients.len() >= MAX_NEWCOMERS {
            let oldest = clients.remove(0);
            close_when_made(oldest.ready);
        }
        clients.push(Newcomer {
            server: server.clone(),
            id,
            ready: rx.clone(),
        });
        drop(clients);
        let mut config = self.builder.get_config().cloned().unwrap_or_default();
        config.server = ServerConfig::Centralized {
            server: server.clone(),
        };
        let mut builder = self.builder.clone();
        builder.set_config(config);
        let (wait, list, server) = (self.connect, self.clients.clone(), server.clone());
        tokio::spawn(async move {
            // What to quit once the answer is out: the commands waiting are not held up by it.
            let mut unused = None;
            let made = match builder.build() {
                Ok(client) => match tokio::time::timeout(wait, client.init()).await {
                    Ok(Ok(_)) => Ok(client),
                    failed => {
                        unused = Some(client);
                        Err(match failed {
                            Ok(Err(e)) => e,
                            _ => FredError::new(
                                ErrorKind::Timeout,
                                format!(
                                    "no connection to {}:{} within {wait:?}",
                                    server.host, server.port
                                ),
                            ),
                        })
                    }
                },
                Err(e) => Err(e),
            };
            // A failed connection is forgotten, so the next command tries again; one dropped from the
            // list meanwhile (closed, or the oldest of too many) is closed now.
            {
                let mut clients = list.lock();
                let listed = clients.iter().position(|n| n.id == id);
                match (&made, listed) {
                    (Err(_), Some(i)) => {
                        clients.remove(i);
                    }
                    (Ok(client), None) => unused = Some(client.clone()),
                    _ => {}
                }
            }
            let _ = tx.send(Some(made));
            if let Some(client) = unused {
                let _ = client.quit().await;
            }
        });
        rx
    }

    /// Closes every newcomer's client (those still being made, once made).
    pub async fn close(&self) {
        let gone: Vec<Newcomer> = {
            let mut clients = self.clients.lock();
            self.closed.store(true, Relaxed);
            clients.drain(..).collect()
        };
        let mut made = Vec::new();
        for n in gone {
            let answer = n.ready.borrow().clone();
            match answer {
                Some(Ok(client)) => made.push(client),
                Some(Err(_)) => {}
                None => close_when_made(n.ready),
            }
        }
        join_all(made.iter().map(|c| c.quit())).await;
    }
}

/// Closes a newcomer's client once its connection is made (at once if it is).
fn close_when_made(mut ready: watch::Receiver<Option<Result<Client, FredError>>>) {
    tokio::spawn(async move {
        let made = ready
            .wait_for(Option::is_some)
            .await
            .ok()
            .and_then(|v| v.clone());
        if let Some(Ok(client)) = made {
            let _ = client.quit().await;
        }
    });
}

/// Where a command redirected by `ASK` goes: a node the pool's client is connected to, or a newcomer.
#[derive(PartialEq)]
enum Asked {
    Connected(Server),
    Newcomer(Server),
}

/// Runs `ops` on `client` with `options`: one result per op, in order.
///
/// Each op is answered by its own owner's redirection, so each is followed on its own: the first send
/// (after which fred has refreshed its slot map if it was a `MOVED`), a second send to the owner fred
/// knows now, and only when that owner redirects too (it no longer holds the key: `ASK`), the node
/// importing the slot, with `ASKING`. Two ops of one key stay in order: each step sends its ops in
/// their order, on the connection of the node concerned.
pub async fn run(
    client: &Client,
    newcomers: &Newcomers,
    options: &Options,
    ops: &[Op],
) -> Vec<Result<Value, FredError>> {
    if !client.is_clustered() {
        // No redirections: one pipeline, whatever the ops.
        return pipeline(client, options, ops).await;
    }
    if ops.iter().all(|op| op.repeatable) {
        // Reads ride in one pipeline. A redirection fails it as a whole (fred answers its one responder
        // with the error and drops the other answers), so then every read is sent again on its own,
        // which is its first send of its own.
        let results = pipeline(client, options, ops).await;
        if !results.iter().any(is_redirection) {
            return results;
        }
    }
    // Writes are sent one by one from the start (fred still writes them to each node's socket together,
    // in order), so a redirection fails only the write redirected, and none runs twice.
    let all: Vec<usize> = (0..ops.len()).collect();
    let mut results = singly(client, options, ops, &all).await;
    // Sent again: after a `MOVED`, fred's slot map has the new owner.
    let redirected = redirections(&results);
    put(
        &mut results,
        &redirected,
        singly(client, options, ops, &redirected).await,
    );
    // Redirected by the owner of a fresh slot map: the slot is being moved, and the key has left.
    let mut slots: BTreeMap<u16, Vec<usize>> = BTreeMap::new();
    for i in redirections(&results) {
        slots.entry(ops[i].slot()).or_default().push(i);
    }
    let importers = join_all(slots.keys().map(|&slot| importer(client, options, slot))).await;
    let mut targets: Vec<(Asked, Vec<usize>)> = Vec::new();
    let mut unmoved = Vec::new();
    for ((_, indices), found) in slots.into_iter().zip(importers) {
        match found {
            Ok(Some(asked)) => match targets.iter_mut().find(|(a, _)| *a == asked) {
                Some((_, all)) => all.extend(indices),
                None => targets.push((asked, indices)),
            },
            // No longer moving (it just ended, and fred's slot map was refreshed from a node that had
            // not heard yet): once more to the owner fred knows now.
            Ok(None) => unmoved.extend(indices),
            Err(e) => {
                for i in indices {
                    results[i] = Err(e.clone());
                }
            }
        }
    }
    // Grouped by slot above: back in the batch's order, which each send keeps.
    unmoved.sort_unstable();
    put(
        &mut results,
        &unmoved,
        singly(client, options, ops, &unmoved).await,
    );
    for (_, indices) in &mut targets {
        indices.sort_unstable();
    }
    let answers = join_all(
        targets
            .iter()
            .map(|(asked, indices)| asking(client, newcomers, options, ops, asked, indices)),
    )
    .await;
    for ((_, indices), answers) in targets.iter().zip(answers) {
        put(&mut results, indices, answers);
    }
    results
}

/// The ops whose answer is a redirection fred did not follow.
fn redirections(results: &[Result<Value, FredError>]) -> Vec<usize> {
    (0..results.len())
        .filter(|&i| is_redirection(&results[i]))
        .collect()
}

/// Puts the `answers` of `ops[indices]` in their places.
fn put(
    results: &mut [Result<Value, FredError>],
    indices: &[usize],
    answers: Vec<Result<Value, FredError>>,
) {
    for (&i, r) in indices.iter().zip(answers) {
        results[i] = r;
    }
}

/// Sends `ops[indices]` one by one, in order: one result each.
async fn singly(
    client: &Client,
    options: &Options,
    ops: &[Op],
    indices: &[usize],
) -> Vec<Result<Value, FredError>> {
    // Each future hands its command to fred's router on its first poll, and `join_all` polls them first
    // in order: the commands reach each node's connection in this order.
    join_all(indices.iter().map(|&i| async move {
        let cmd = CustomCommand::new_static(ops[i].cmd, ClusterHash::FirstKey, false);
        client
            .with_options(options)
            .custom::<Value, Value>(cmd, ops[i].args.clone())
            .await
    }))
    .await
}

/// Sends `ops[indices]` (in that order) to the node importing their slots, each preceded by `ASKING`,
/// in one pipeline on one connection: one result each. A pipeline that fails as a whole
/// answers its error for every op, and is not sent again (some of its ops may have run).
async fn asking(
    client: &Client,
    newcomers: &Newcomers,
    options: &Options,
    ops: &[Op],
    asked: &Asked,
    indices: &[usize],
) -> Vec<Result<Value, FredError>> {
    let (client, options) = match asked {
        Asked::Connected(server) => (
            client.clone(),
            Options {
                cluster_node: Some(server.clone()),
                ..options.clone()
            },
        ),
        Asked::Newcomer(server) => {
            let connected = match options.timeout {
                Some(t) => tokio::time::timeout(t, newcomers.client(server))
                    .await
                    .unwrap_or_else(|_| {
                        Err(FredError::new(
                            ErrorKind::Timeout,
                            "the connection to the node importing the slot is not made yet",
                        ))
                    }),
                None => newcomers.client(server).await,
            };
            match connected {
                Ok(c) => (c, options.clone()),
                Err(e) => return vec![Err(e); indices.len()],
            }
        }
    };
    let p = client.pipeline().with_options(&options);
    for &i in indices {
        let asking = CustomCommand::new_static("ASKING", ClusterHash::Random, false);
        let cmd = CustomCommand::new_static(ops[i].cmd, ClusterHash::FirstKey, false);
        let queued = match p.custom::<(), Value>(asking, Vec::new()).await {
            Ok(()) => p.custom::<(), Value>(cmd, ops[i].args.clone()).await,
            Err(e) => Err(e),
        };
        if let Err(e) = queued {
            return vec![Err(e); indices.len()];
        }
    }
    let answers = match whole(p.try_all::<Value>().await, 2 * indices.len()) {
        Ok(answers) => answers,
        Err(e) => return vec![Err(e); indices.len()],
    };
    // Each command's answer, after its `ASKING`'s; a failed `ASKING` fails its command.
    let mut out = Vec::with_capacity(indices.len());
    let mut answers = answers.into_iter();
    while let (Some(asked), Some(answer)) = (answers.next(), answers.next()) {
        out.push(asked.and(answer));
    }
    out
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
    whole(p.try_all::<Value>().await, ops.len()).unwrap_or_else(|e| vec![Err(e); ops.len()])
}

/// A pipeline's `answers` when there is one for each of its `sent` commands; else the error that failed
/// it as a whole (fred then answers that one error alone).
fn whole(
    answers: Vec<Result<Value, FredError>>,
    sent: usize,
) -> Result<Vec<Result<Value, FredError>>, FredError> {
    if answers.len() == sent {
        return Ok(answers);
    }
    Err(answers
        .into_iter()
        .find_map(Result::err)
        .unwrap_or_else(|| {
            FredError::new(ErrorKind::Unknown, "a pipeline answered too few results")
        }))
}

/// Whether fred answered a command with a redirection it did not follow.
fn is_redirection(r: &Result<Value, FredError>) -> bool {
    matches!(r, Err(e) if *e.kind() == ErrorKind::Routing && e.details().contains("redirection"))
}

/// The node importing `slot`, as its owner's `CLUSTER NODES` says: one `client` is connected to, or a
/// newcomer; `None` when the owner says the slot is not moving.
async fn importer(
    client: &Client,
    options: &Options,
    slot: u16,
) -> Result<Option<Asked>, FredError> {
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
    let Some((ip, hostname, port)) = importing_node(&text, slot) else {
        return Ok(None);
    };
    let known = client
        .active_connections()
        .into_iter()
        .find(|s| s.port == port && (&*s.host == ip || Some(&*s.host) == hostname));
    Ok(Some(match known {
        Some(server) => Asked::Connected(server),
        // Reached as the cluster announces it: by its hostname where it has one.
        None => Asked::Newcomer(Server::new(hostname.unwrap_or(ip), port)),
    }))
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
