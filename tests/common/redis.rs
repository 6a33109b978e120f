//! A real `redis-server` for tests: started on a free port with no persistence, stopped on drop, and
//! controllable mid-test: frozen (`pause`/`resume`, SIGSTOP/SIGCONT), made slow (`DEBUG SLEEP`), stopped and
//! restarted on the same port. Commands go over a tiny blocking RESP client, so a test can inspect Redis
//! (`INFO commandstats`, raw keys) without going through the code under test.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hydrant::app::open_store;
use hydrant::config::Config;
use hydrant::store::Store;

use super::{TestApp, load_demo_rows, test_config};

/// A RESP reply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    Status(String),
    Error(String),
    Int(i64),
    Bulk(Option<Vec<u8>>),
    Array(Vec<Reply>),
}

impl Reply {
    /// The reply as text (status or bulk string), for assertions.
    pub fn text(&self) -> String {
        match self {
            Reply::Status(s) | Reply::Error(s) => s.clone(),
            Reply::Bulk(Some(b)) => String::from_utf8_lossy(b).into_owned(),
            other => format!("{other:?}"),
        }
    }

    pub fn bytes(&self) -> Option<Vec<u8>> {
        match self {
            Reply::Bulk(b) => b.clone(),
            _ => None,
        }
    }
}

pub struct RedisServer {
    port: u16,
    cluster: bool,
    /// A cluster node's bus port, chosen free rather than left at `port + 10000`, which may be taken or
    /// past 65535.
    bus_port: Option<u16>,
    password: Option<String>,
    /// TLS port and the folder holding `ca.crt`, `server.crt`, `server.key`.
    tls: Option<(u16, PathBuf)>,
    dir: tempfile::TempDir,
    child: Option<Child>,
}

impl RedisServer {
    /// A standalone server.
    pub fn start() -> Self {
        Self::launch(false, None, false)
    }

    /// A server that requires `AUTH` with `password`.
    pub fn start_with_password(password: &str) -> Self {
        Self::launch(false, Some(password.to_owned()), false)
    }

    /// A server that also listens with TLS, its certificate signed by a CA made for the test (`ca_file`);
    /// `url` is then the `rediss://` one. The plain port stays for the test's own commands.
    pub fn start_tls() -> Self {
        Self::launch(false, None, true)
    }

    /// The PEM file of the CA that signed a TLS server's certificate.
    pub fn ca_file(&self) -> PathBuf {
        self.tls.as_ref().expect("a TLS server").1.join("ca.crt")
    }

    /// A one-node Redis Cluster owning every hash slot: it refuses multi-key commands across slots
    /// (`CROSSSLOT`) exactly as a real cluster does.
    pub fn start_cluster() -> Self {
        let s = Self::launch(true, None, false);
        let r = s.cmd(&["CLUSTER", "ADDSLOTSRANGE", "0", "16383"]);
        assert_eq!(r, Reply::Status("OK".into()), "{r:?}");
        let until = Instant::now() + Duration::from_secs(10);
        while !s
            .cmd(&["CLUSTER", "INFO"])
            .text()
            .contains("cluster_state:ok")
        {
            assert!(Instant::now() < until, "the cluster did not become ok");
            std::thread::sleep(Duration::from_millis(20));
        }
        s
    }

    /// Two cluster nodes that know each other, the first owning hash slots 0-8191 and the second
    /// 8192-16383, so a slot can be moved from one to the other as `redis-cli --cluster reshard` does
    /// ([`migrate_key`](Self::migrate_key), [`hand_over_slot`](Self::hand_over_slot)).
    pub fn start_cluster_pair() -> (Self, Self) {
        let a = Self::launch(true, None, false);
        let b = Self::launch(true, None, false);
        for (node, first, last) in [(&a, "0", "8191"), (&b, "8192", "16383")] {
            let r = node.cmd(&["CLUSTER", "ADDSLOTSRANGE", first, last]);
            assert_eq!(r, Reply::Status("OK".into()), "{r:?}");
        }
        a.meet(&b, 2, || a.slot_owner(9000) == b.node_id());
        (a, b)
    }

    /// Introduces `node` to this node's cluster (`CLUSTER MEET`), and waits until both say the cluster
    /// is ok with `nodes` nodes, and `also` holds.
    fn meet(&self, node: &Self, nodes: usize, also: impl Fn() -> bool) {
        let bus = node.cluster_bus_port().to_string();
        let r = self.cmd(&["CLUSTER", "MEET", "127.0.0.1", &node.port.to_string(), &bus]);
        assert_eq!(r, Reply::Status("OK".into()), "{r:?}");
        let until = Instant::now() + Duration::from_secs(20);
        let known = format!("cluster_known_nodes:{nodes}");
        let ready = |n: &Self| {
            let info = n.cmd(&["CLUSTER", "INFO"]).text();
            info.contains("cluster_state:ok") && info.contains(&known)
        };
        while !(ready(self) && ready(node) && also()) {
            assert!(
                Instant::now() < until,
                "the cluster of {nodes} nodes did not form"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// A cluster node that owns no slot yet, joined to the cluster of `member` (of two nodes), as
    /// `redis-cli --cluster add-node` adds one before slots are moved to it.
    pub fn join_empty_node(member: &Self) -> Self {
        let node = Self::launch(true, None, false);
        member.meet(&node, 3, || !node.slot_owner(0).is_empty());
        node
    }

    /// This cluster node's id.
    pub fn node_id(&self) -> String {
        self.cmd(&["CLUSTER", "MYID"]).text()
    }

    /// The hash slot of `key`.
    pub fn key_slot(&self, key: &str) -> u16 {
        match self.cmd(&["CLUSTER", "KEYSLOT", key]) {
            Reply::Int(n) => u16::try_from(n).expect("a slot"),
            other => panic!("CLUSTER KEYSLOT: {other:?}"),
        }
    }

    /// The id of the node this node believes owns `slot` (empty when none).
    fn slot_owner(&self, slot: u16) -> String {
        let Reply::Array(ranges) = self.cmd(&["CLUSTER", "SLOTS"]) else {
            return String::new();
        };
        for range in ranges {
            let Reply::Array(parts) = range else { continue };
            let (Some(Reply::Int(first)), Some(Reply::Int(last)), Some(Reply::Array(master))) =
                (parts.first(), parts.get(1), parts.get(2))
            else {
                continue;
            };
            if (*first..=*last).contains(&i64::from(slot)) {
                return master.get(2).map(Reply::text).unwrap_or_default();
            }
        }
        String::new()
    }

    /// Starts moving the slot of `key` from this node to `to`, if it is not on the way yet, and moves
    /// `key` itself (`MIGRATE`): the slot's other keys stay here, and this node answers a request for
    /// `key` with an `ASK` redirection to `to`. Answers the slot.
    pub fn migrate_key(&self, to: &Self, key: &str) -> u16 {
        let slot = self.key_slot(key);
        let s = slot.to_string();
        let ok = Reply::Status("OK".into());
        assert_eq!(
            to.cmd(&["CLUSTER", "SETSLOT", &s, "IMPORTING", &self.node_id()]),
            ok
        );
        assert_eq!(
            self.cmd(&["CLUSTER", "SETSLOT", &s, "MIGRATING", &to.node_id()]),
            ok
        );
        let r = self.cmd(&[
            "MIGRATE",
            "127.0.0.1",
            &to.port.to_string(),
            key,
            "0",
            "5000",
        ]);
        assert_eq!(r, ok, "MIGRATE {key}");
        slot
    }

    /// Ends a migration as `redis-cli --cluster reshard` does: the slot's keys still here (the demo
    /// rows of other views too) are moved, then `to` owns `slot`, and this node answers a request for
    /// one of them with a `MOVED` redirection.
    pub fn hand_over_slot(&self, to: &Self, slot: u16) {
        let s = slot.to_string();
        let Reply::Array(left) = self.cmd(&["CLUSTER", "GETKEYSINSLOT", &s, "100000"]) else {
            panic!("CLUSTER GETKEYSINSLOT {s}");
        };
        for key in left {
            self.migrate_key(to, &key.text());
        }
        let id = to.node_id();
        for node in [to, self] {
            let r = node.cmd(&["CLUSTER", "SETSLOT", &s, "NODE", &id]);
            assert_eq!(r, Reply::Status("OK".into()), "{r:?}");
        }
    }

    /// Runs a command preceded by `ASKING` on one connection, as a client redirected by `ASK` does: how
    /// a node importing a slot answers for the keys moved to it so far.
    pub fn cmd_asking(&self, args: &[&str]) -> Reply {
        let mut c = Conn::open(self.port, self.password.as_deref()).expect("connect");
        assert_eq!(c.call(&[b"ASKING"]), Ok(Reply::Status("OK".into())));
        let args: Vec<&[u8]> = args.iter().map(|a| a.as_bytes()).collect();
        c.call(&args).expect("a command after ASKING")
    }

    /// The port of this cluster node's bus.
    fn cluster_bus_port(&self) -> u16 {
        self.bus_port.expect("a cluster node")
    }

    fn launch(cluster: bool, password: Option<String>, tls: bool) -> Self {
        let mut last_err = String::new();
        // A free port can be taken between finding it and binding it: try a few.
        for _ in 0..5 {
            let dir = tempfile::tempdir().expect("tempdir");
            let tls = tls.then(|| (free_port(), make_certs(dir.path())));
            let mut s = Self {
                port: free_port(),
                cluster,
                bus_port: cluster.then(free_port),
                password: password.clone(),
                tls,
                dir,
                child: None,
            };
            match s.spawn() {
                Ok(()) => return s,
                Err(e) => last_err = e,
            }
        }
        panic!("redis-server did not start: {last_err}");
    }

    fn args(&self) -> Vec<String> {
        let mut a: Vec<String> = [
            "--port",
            &self.port.to_string(),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--enable-debug-command",
            "yes",
            "--dir",
            &self.dir.path().display().to_string(),
        ]
        .iter()
        .map(|s| (*s).to_owned())
        .collect();
        if self.cluster {
            a.extend(
                [
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    "nodes.conf",
                    "--cluster-announce-ip",
                    "127.0.0.1",
                ]
                .map(str::to_owned),
            );
            a.extend([
                "--cluster-port".to_owned(),
                self.cluster_bus_port().to_string(),
            ]);
        }
        if let Some(p) = &self.password {
            a.extend(["--requirepass".to_owned(), p.clone()]);
        }
        if let Some((port, dir)) = &self.tls {
            let f = |name: &str| dir.join(name).display().to_string();
            a.extend([
                "--tls-port".to_owned(),
                port.to_string(),
                "--tls-cert-file".to_owned(),
                f("server.crt"),
                "--tls-key-file".to_owned(),
                f("server.key"),
                "--tls-ca-cert-file".to_owned(),
                f("ca.crt"),
                "--tls-auth-clients".to_owned(),
                "no".to_owned(),
            ]);
        }
        a
    }

    fn spawn(&mut self) -> Result<(), String> {
        let child = Command::new(redis_server())
            .args(self.args())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| format!("cannot run redis-server: {e}"))?;
        self.child = Some(child);
        let until = Instant::now() + Duration::from_secs(5);
        loop {
            if let Ok(Reply::Status(pong)) = self.try_cmd(&[b"PING"])
                && pong == "PONG"
            {
                return Ok(());
            }
            if let Some(Ok(Some(status))) = self.child.as_mut().map(Child::try_wait) {
                self.child = None;
                return Err(format!("redis-server exited: {status}"));
            }
            if Instant::now() > until {
                self.kill();
                return Err("no PONG within 5 s".into());
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// The URL hydrant connects with.
    pub fn url(&self) -> String {
        let auth = self
            .password
            .as_ref()
            .map(|p| format!(":{p}@"))
            .unwrap_or_default();
        if let Some((port, _)) = &self.tls {
            return format!("rediss://{auth}127.0.0.1:{port}");
        }
        let scheme = if self.cluster {
            "redis-cluster"
        } else {
            "redis"
        };
        format!("{scheme}://{auth}127.0.0.1:{}", self.port)
    }

    fn pid(&self) -> u32 {
        self.child
            .as_ref()
            .expect("redis-server is not running")
            .id()
    }

    /// Freezes the server (SIGSTOP): connections stay open, nothing is answered.
    pub fn pause(&self) {
        signal("-STOP", self.pid());
    }

    pub fn resume(&self) {
        signal("-CONT", self.pid());
    }

    /// Makes the server busy for `d` (`DEBUG SLEEP`, sent from a thread; returns at once).
    pub fn sleep(&self, d: Duration) {
        let port = self.port;
        let password = self.password.clone();
        let secs = format!("{:.3}", d.as_secs_f64());
        std::thread::spawn(move || {
            let mut c = Conn::open(port, password.as_deref()).expect("connect");
            let _ = c.call(&[b"DEBUG", b"SLEEP", secs.as_bytes()]);
        });
        // Let the command reach the server before the caller goes on.
        std::thread::sleep(Duration::from_millis(20));
    }

    /// Stops the server (SIGKILL); `restart` brings it back, empty, on the same port.
    pub fn stop(&mut self) {
        self.kill();
    }

    pub fn restart(&mut self) {
        assert!(self.child.is_none(), "stop it first");
        if let Err(e) = self.spawn() {
            panic!("redis-server did not restart on port {}: {e}", self.port);
        }
    }

    /// Stops the server and starts it again requiring `password`, as an operator turning a password
    /// on or rotating it would.
    #[allow(dead_code)]
    pub fn restart_with_password(&mut self, password: &str) {
        self.kill();
        self.password = Some(password.to_owned());
        self.restart();
    }

    fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// Runs a command with text arguments.
    pub fn cmd(&self, args: &[&str]) -> Reply {
        let args: Vec<&[u8]> = args.iter().map(|a| a.as_bytes()).collect();
        self.cmd_bytes(&args)
    }

    /// Runs a command with binary arguments.
    pub fn cmd_bytes(&self, args: &[&[u8]]) -> Reply {
        self.try_cmd(args)
            .unwrap_or_else(|e| panic!("redis command {:?} failed: {e}", args.first()))
    }

    fn try_cmd(&self, args: &[&[u8]]) -> Result<Reply, String> {
        Conn::open(self.port, self.password.as_deref())?.call(args)
    }

    /// How often `command` (lower case, e.g. `mget`) ran since start or the last `reset_stats`.
    pub fn calls(&self, command: &str) -> u64 {
        let info = self.cmd(&["INFO", "commandstats"]).text();
        let prefix = format!("cmdstat_{command}:calls=");
        info.lines()
            .find_map(|l| l.strip_prefix(&prefix))
            .and_then(|rest| rest.split(',').next())
            .and_then(|n| n.parse().ok())
            .unwrap_or(0)
    }

    pub fn reset_stats(&self) {
        self.cmd(&["CONFIG", "RESETSTAT"]);
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        // SIGKILL works on a stopped process too.
        self.kill();
    }
}

/// A Redis Sentinel (`redis-server --sentinel`) following `master` as `mymaster`; stopped when dropped.
pub struct Sentinel {
    pub port: u16,
    /// The master's password, which this sentinel requires too (fred sends the URL's to both).
    password: Option<String>,
    child: Child,
    _dir: tempfile::TempDir,
}

impl Sentinel {
    pub fn start(master: &RedisServer) -> Self {
        Self::start_with(master, "")
    }

    /// The `redis-sentinel://` URL that reaches the master this sentinel watches.
    pub fn url(&self) -> String {
        let auth = self
            .password
            .as_ref()
            .map(|p| format!(":{p}@"))
            .unwrap_or_default();
        format!(
            "redis-sentinel://{auth}127.0.0.1:{}/0?sentinelServiceName=mymaster",
            self.port
        )
    }

    /// A sentinel that calls the master down after 500 ms without an answer and fails over at once.
    pub fn start_quick_to_fail_over(master: &RedisServer) -> Self {
        Self::start_with(
            master,
            "sentinel down-after-milliseconds mymaster 500\nsentinel failover-timeout mymaster 5000\n",
        )
    }

    fn start_with(master: &RedisServer, extra: &str) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let port = free_port();
        // Sentinel rewrites its config file, so it gets one of its own.
        let conf = dir.path().join("sentinel.conf");
        // A master with a password: the sentinel uses it, and requires it of its own clients.
        let auth = master
            .password
            .as_ref()
            .map(|p| format!("sentinel auth-pass mymaster {p}\nrequirepass {p}\n"))
            .unwrap_or_default();
        std::fs::write(
            &conf,
            format!(
                "port {port}\nbind 127.0.0.1\ndir {}\nsentinel monitor mymaster 127.0.0.1 {} 1\n{auth}{extra}",
                dir.path().display(),
                master.port
            ),
        )
        .expect("sentinel.conf");
        let child = Command::new(redis_server())
            .arg(&conf)
            .arg("--sentinel")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server --sentinel");
        let s = Self {
            port,
            password: master.password.clone(),
            child,
            _dir: dir,
        };
        let until = Instant::now() + Duration::from_secs(5);
        loop {
            let answer = Conn::open(port, s.password.as_deref())
                .and_then(|mut c| c.call(&[b"SENTINEL", b"get-master-addr-by-name", b"mymaster"]));
            if matches!(answer, Ok(Reply::Array(ref a)) if a.len() == 2) {
                return s;
            }
            assert!(
                Instant::now() < until,
                "the sentinel did not start: {answer:?}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// A command to the sentinel.
    pub fn cmd(&self, args: &[&str]) -> Result<Reply, String> {
        let args: Vec<&[u8]> = args.iter().map(|a| a.as_bytes()).collect();
        Conn::open(self.port, self.password.as_deref())?.call(&args)
    }

    /// The port of the master the sentinel names now.
    pub fn master_port(&self) -> Option<u16> {
        match self.cmd(&["SENTINEL", "get-master-addr-by-name", "mymaster"]) {
            Ok(Reply::Array(a)) if a.len() == 2 => a[1].text().parse().ok(),
            _ => None,
        }
    }
}

impl Drop for Sentinel {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn redis_server() -> PathBuf {
    std::env::var_os("REDIS_SERVER")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("redis-server"))
}

/// A CA and a server certificate for 127.0.0.1 signed by it, made with the `openssl` command.
fn make_certs(dir: &std::path::Path) -> PathBuf {
    let run = |args: &[&str]| {
        let out = Command::new("openssl")
            .args(args)
            .current_dir(dir)
            .output()
            .expect("the openssl command (apt-get install openssl)");
        assert!(
            out.status.success(),
            "openssl {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    std::fs::write(
        dir.join("server.ext"),
        "subjectAltName=IP:127.0.0.1\nbasicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n",
    )
    .expect("ext");
    run(&[
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "2",
        "-subj",
        "/CN=hydrant test CA",
        "-keyout",
        "ca.key",
        "-out",
        "ca.crt",
    ]);
    run(&[
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-subj",
        "/CN=127.0.0.1",
        "-keyout",
        "server.key",
        "-out",
        "server.csr",
    ]);
    run(&[
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca.crt",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-days",
        "2",
        "-extfile",
        "server.ext",
        "-out",
        "server.crt",
    ]);
    dir.to_owned()
}

fn free_port() -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind");
    l.local_addr().expect("addr").port()
}

fn signal(sig: &str, pid: u32) {
    let ok = Command::new("kill")
        .args([sig, &pid.to_string()])
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    assert!(ok, "kill {sig} {pid} failed");
}

/// One blocking RESP connection.
struct Conn {
    r: BufReader<TcpStream>,
}

impl Conn {
    fn open(port: u16, password: Option<&str>) -> Result<Self, String> {
        let s = TcpStream::connect(("127.0.0.1", port)).map_err(|e| e.to_string())?;
        s.set_read_timeout(Some(Duration::from_secs(10)))
            .map_err(|e| e.to_string())?;
        let mut c = Self {
            r: BufReader::new(s),
        };
        if let Some(p) = password {
            match c.call(&[b"AUTH", p.as_bytes()])? {
                Reply::Status(_) => {}
                other => return Err(format!("AUTH: {other:?}")),
            }
        }
        Ok(c)
    }

    fn call(&mut self, args: &[&[u8]]) -> Result<Reply, String> {
        let mut out = format!("*{}\r\n", args.len()).into_bytes();
        for a in args {
            out.extend_from_slice(format!("${}\r\n", a.len()).as_bytes());
            out.extend_from_slice(a);
            out.extend_from_slice(b"\r\n");
        }
        self.r
            .get_mut()
            .write_all(&out)
            .map_err(|e| e.to_string())?;
        self.read()
    }

    fn read(&mut self) -> Result<Reply, String> {
        let mut line = String::new();
        self.r.read_line(&mut line).map_err(|e| e.to_string())?;
        let line = line.trim_end_matches("\r\n");
        let (kind, rest) = line.split_at(line.len().min(1));
        let int = |s: &str| s.parse::<i64>().map_err(|e| format!("{s:?}: {e}"));
        Ok(match kind {
            "+" => Reply::Status(rest.to_owned()),
            "-" => Reply::Error(rest.to_owned()),
            ":" => Reply::Int(int(rest)?),
            "$" => {
                let n = int(rest)?;
                if n < 0 {
                    Reply::Bulk(None)
                } else {
                    let mut buf = vec![0; n as usize + 2];
                    self.r.read_exact(&mut buf).map_err(|e| e.to_string())?;
                    buf.truncate(n as usize);
                    Reply::Bulk(Some(buf))
                }
            }
            "*" => {
                let n = int(rest)?;
                let mut items = Vec::new();
                for _ in 0..n.max(0) {
                    items.push(self.read()?);
                }
                Reply::Array(items)
            }
            _ => return Err(format!("unexpected reply line {line:?}")),
        })
    }
}

/// The test config with the store on `redis`.
pub fn config_for(redis: &RedisServer) -> Config {
    let mut c = test_config();
    c.store.redis.url = redis.url();
    c
}

/// A store on `redis` with the demo rows loaded through the bulk loader.
pub async fn seeded(redis: &RedisServer) -> Arc<dyn Store> {
    let store = open_store(&config_for(redis)).await.expect("redis store");
    load_demo_rows(&store).await;
    store
}

/// A ready gateway on `redis` (its own connections), with `edit` applied to the config.
pub async fn gateway(redis: &RedisServer, edit: impl FnOnce(&mut Config)) -> TestApp {
    let mut c = config_for(redis);
    edit(&mut c);
    let store = open_store(&c).await.expect("redis store");
    gateway_over(c, store).await
}

/// A ready gateway over `store`.
pub async fn gateway_over(c: Config, store: Arc<dyn Store>) -> TestApp {
    let app = TestApp::spawn_with(c, store, None).await;
    app.wait_ready().await;
    app
}
