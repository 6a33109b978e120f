//! The docker-compose file is valid (checked by `docker-compose config`, since these machines run no Docker
//! engine) and describes the topology the local-process load test runs.

mod common;

use common::root;

#[test]
fn docker_compose_config_accepts_the_file_and_it_has_every_service() {
    let out = match std::process::Command::new("docker-compose")
        .current_dir(root())
        .args([
            "-f",
            "docker-compose.yml",
            "--profile",
            "loadtest",
            "--profile",
            "observability",
            "config",
        ])
        .output()
    {
        Ok(o) => o,
        Err(e) => panic!(
            "docker-compose is needed for this test (apt-get install docker-compose; `make test` does): {e}"
        ),
    };
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "docker-compose config failed: {stderr}"
    );
    let doc: serde_yaml::Value = serde_yaml::from_slice(&out.stdout).expect("config prints YAML");
    let services = doc["services"].as_mapping().expect("services");
    for name in [
        "redis",
        "seed",
        "hydrant",
        "loadtest",
        "floor",
        "prometheus",
        "grafana",
    ] {
        assert!(services.contains_key(name), "service {name} missing");
    }
    let env = &doc["services"]["hydrant"]["environment"];
    assert_eq!(
        env["HYDRANT_STORE__REDIS__URL"].as_str(),
        Some("redis://redis:6379")
    );
    assert_eq!(
        doc["services"]["hydrant"]["command"][0].as_str(),
        Some("serve")
    );
    // The load tester starts once hydrant answers ready (it fails at once on a refused connection),
    // and may write its report into the host's folder.
    assert_eq!(
        doc["services"]["loadtest"]["depends_on"]["hydrant"]["condition"].as_str(),
        Some("service_healthy")
    );
    let check =
        serde_yaml::to_string(&doc["services"]["hydrant"]["healthcheck"]["test"]).expect("yaml");
    assert!(check.contains("/v2/health/ready"), "{check}");
    assert_eq!(doc["services"]["loadtest"]["user"].as_str(), Some("0:0"));
    // It measures what `make loadtest` measures, the Redis round trip included.
    let run = serde_yaml::to_string(&doc["services"]["loadtest"]["command"]).expect("yaml");
    assert!(run.contains("--redis-url"), "{run}");
    // Its floor is a container of its own, as hydrant is, so the kernel shares the cores between the two
    // servers alike; on as many threads as hydrant's async workers.
    assert!(
        run.contains("--floor-url") && run.contains("http://floor:9100"),
        "{run}"
    );
    let floor = &doc["services"]["floor"]["command"];
    let floor_args: Vec<&str> = floor
        .as_sequence()
        .expect("floor command")
        .iter()
        .filter_map(|a| a.as_str())
        .collect();
    assert_eq!(floor_args.first(), Some(&"floor"), "{floor_args:?}");
    assert!(floor_args.contains(&"0.0.0.0:9100"), "{floor_args:?}");
    let threads = floor_args
        .iter()
        .position(|&a| a == "--threads")
        .and_then(|i| floor_args.get(i + 1));
    assert_eq!(
        threads.copied(),
        doc["services"]["hydrant"]["environment"]["HYDRANT_SERVER__WORKERS"].as_str(),
        "{floor_args:?}"
    );
    // The build context leaves out the host's build output (tens of GB) and local stores.
    let ignored = std::fs::read_to_string(root().join(".dockerignore")).expect(".dockerignore");
    for path in ["target", ".git", ".ort", "data"] {
        assert!(
            ignored.lines().any(|l| l.trim() == path),
            "{path} is not ignored"
        );
    }
    // The seed job runs the same bulk loader as `make loadtest`'s local topology.
    let seed = serde_yaml::to_string(&doc["services"]["seed"]["command"]).expect("yaml");
    let local = std::fs::read_to_string(root().join("scripts/loadtest.sh")).expect("script");
    for view in ["user_profile", "item_stats"] {
        let cmd = format!("load --view {view} demo/rows/{view}.jsonl");
        assert!(
            seed.contains(&cmd) && local.contains(&cmd),
            "both seed with `{cmd}`"
        );
    }
    // Locally the gateway starts in the load tester's session (a process group of its own keeps the
    // terminal's Ctrl-C off it): a session of its own is a scheduling group of its own, which the kernel
    // gives its share of the cores apart from the in-process floor's (docs/performance.md).
    assert!(
        local.contains("\"${detached[@]}\" \"$bin/hydrant\" serve") && !local.contains("setsid"),
        "scripts/loadtest.sh starts the gateway with `detached`, not setsid"
    );
    // The gateway runs at the log level `make loadtest` runs it at (the request span off), and Redis
    // with the same settings, so the two topologies' figures compare.
    assert_eq!(env["HYDRANT_TELEMETRY__LOG_LEVEL"].as_str(), Some("warn"));
    assert!(local.contains("HYDRANT_TELEMETRY__LOG_LEVEL=\"${LOG_LEVEL:-warn}\""));
    // And on as many async workers, which the load tester's floor then runs on too.
    assert_eq!(env["HYDRANT_SERVER__WORKERS"].as_str(), Some("1"));
    assert!(local.contains("HYDRANT_SERVER__WORKERS=\"${WORKERS:-1}\""));
    let redis = serde_yaml::to_string(&doc["services"]["redis"]["command"]).expect("yaml");
    let lib = std::fs::read_to_string(root().join("scripts/lib.sh")).expect("lib.sh");
    assert!(
        !lib.contains("setsid redis-server"),
        "Redis starts in the session too"
    );
    for flag in ["--save", "--appendonly", "--maxmemory-policy"] {
        assert!(
            redis.contains(flag) && lib.contains(flag),
            "both run redis with {flag}"
        );
    }
    // No token is set in this topology: its ports are published on the host's loopback only, and the
    // image (which listens on every interface) serves no schema registration through the API.
    for service in ["hydrant", "prometheus", "grafana"] {
        let ports = serde_yaml::to_string(&doc["services"][service]["ports"]).expect("yaml");
        assert!(
            ports.contains("host_ip: 127.0.0.1") || ports.contains("127.0.0.1:"),
            "{service} is published beyond the host's loopback: {ports}"
        );
    }
    let image = std::fs::read_to_string(root().join("Dockerfile")).expect("Dockerfile");
    assert!(
        image.contains("HYDRANT_REGISTRY__WRITES=false"),
        "the image's registry writes"
    );
    // The runtime stage trusts the public CAs, which a `rediss://` Redis's certificate is checked
    // against when no `store.redis.tls_ca_file` is named.
    let runtime = image
        .rsplit_once("\nFROM ")
        .map(|(_, stage)| stage)
        .expect("a runtime stage");
    assert!(runtime.contains("ca-certificates"), "{runtime}");
    // The Grafana dashboard shows stage latency beside the hit rate.
    let dash = std::fs::read_to_string(root().join("deploy/grafana/dashboards/hydrant.json"))
        .expect("dashboard");
    assert!(
        dash.contains("hydrant_stage_duration_seconds_bucket")
            && dash.contains("hydrant_cache_lookups_total")
    );
    // Panels of a model's requests take every route its traffic comes by, the versioned infer too.
    let dash: serde_json::Value = serde_json::from_str(&dash).expect("dashboard JSON");
    let mut by_route = Vec::new();
    collect_exprs(&dash, &mut by_route);
    by_route.retain(|e| e.contains("route=~"));
    assert!(!by_route.is_empty());
    for expr in by_route {
        for route in [
            r"/v1/models/\\{model\\}/predict",
            r"/v2/models/\\{model\\}/infer",
            r"/v2/models/\\{model\\}/versions/\\{version\\}/infer",
        ] {
            assert!(expr.contains(route), "{route} missing from {expr}");
        }
    }
}

/// Every `expr` (a PromQL expression) in a Grafana dashboard.
fn collect_exprs(v: &serde_json::Value, out: &mut Vec<String>) {
    match v {
        serde_json::Value::Object(m) => {
            for (k, v) in m {
                match (k.as_str(), v) {
                    ("expr", serde_json::Value::String(e)) => out.push(e.clone()),
                    _ => collect_exprs(v, out),
                }
            }
        }
        serde_json::Value::Array(a) => a.iter().for_each(|v| collect_exprs(v, out)),
        _ => {}
    }
}
