//! Mutated scenario files: each is refused with a message that names the scenario (and, for a bad value,
//! the key), or accepted; an accepted one plans its run and generates request bodies without panicking or
//! hanging. Seeded like hydrant's mutation tests: `MUTATION_CASES=N`, `MUTATION_SEED=S`.

#[path = "../../tests/common/mutate.rs"]
#[allow(dead_code)]
mod mutate;

use std::panic::AssertUnwindSafe;
use std::time::Duration;

use loadtest::scenario::Scenario;
use loadtest::workload::Workload;
use mutate::{Rng, describe, env_number, mutated};
use serde_json::Value as Json;

/// The keys scenario files use.
const NAMES: &[&str] = &[
    "target",
    "model",
    "format",
    "candidates",
    "timeout_ms",
    "name",
    "timings",
    "load",
    "mode",
    "rate",
    "concurrency",
    "step_s",
    "confirm_s",
    "fraction",
    "duration_s",
    "warm_up_s",
    "max_in_flight",
    "users",
    "items",
    "keys",
    "zipf",
    "prefix",
    "min",
    "max",
    "distinct",
    "context",
    "int_range",
    "one_of",
    "floor",
    "enabled",
    "open",
    "closed",
    "max-then-fraction",
    "json",
    "msgpack",
    "http://127.0.0.1:8080",
    "http://10.0.0.1:8080",
];

#[test]
fn mutated_scenarios_are_refused_naming_the_key_or_run_their_workload() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("scenarios");
    let files: Vec<_> = std::fs::read_dir(&dir)
        .expect("scenarios")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "toml"))
        .collect();
    let cases = env_number("MUTATION_CASES", 300);
    let mut rng = Rng(env_number("MUTATION_SEED", 0x6c6f_6164) ^ 3);
    let (mut accepted, mut refused) = (0, 0);
    for i in 0..cases {
        let file = rng.pick(&files).clone();
        let text = std::fs::read_to_string(&file).expect("read");
        let case_seed = rng.next();
        let mut r = Rng(case_seed);
        let bytes = mutated(
            &mut r,
            NAMES,
            text.as_bytes(),
            toml::from_str::<Json>(&text).ok(),
            |t| toml::to_string(t).ok().map(String::into_bytes),
        );
        let case = format!(
            "case {i} (seed {case_seed:#x}), {}: {}",
            file.display(),
            describe(&bytes)
        );
        let Ok(text) = String::from_utf8(bytes) else {
            continue; // a scenario is read as UTF-8 text; Scenario::load refuses other bytes
        };
        let parsed =
            std::panic::catch_unwind(|| Scenario::from_toml_str(&text, "mutated.toml", "m"))
                .unwrap_or_else(|_| panic!("the parser panicked on {case}"));
        match parsed {
            Ok(scenario) => {
                accepted += 1;
                // Planning and generating bodies run on another thread, so a hang fails the test.
                let (tx, rx) = std::sync::mpsc::channel();
                let worker = std::thread::spawn(move || {
                    let result = std::panic::catch_unwind(AssertUnwindSafe(|| {
                        let _ = scenario.planned_duration();
                        let mut w = Workload::new(&scenario, 7);
                        for _ in 0..50 {
                            let _ = w.next_body();
                        }
                    }));
                    let _ = tx.send(result.is_ok());
                });
                match rx.recv_timeout(Duration::from_secs(10)) {
                    Ok(true) => {
                        let _ = worker.join();
                    }
                    Ok(false) => panic!("the workload panicked on {case}"),
                    Err(_) => panic!("the workload hung on {case}"),
                }
            }
            Err(e) => {
                refused += 1;
                let message = e.to_string();
                assert!(
                    message.starts_with("scenario mutated.toml: ") && message.len() > 24,
                    "{case}: a refusal that does not name the scenario or say why: {message}"
                );
                if let Some(key) = e.key() {
                    assert!(!key.is_empty(), "{case}: an empty key in {message}");
                }
            }
        }
    }
    eprintln!("scenario mutations: {accepted} accepted, {refused} refused");
    assert!(
        accepted > 0 && refused > cases / 4,
        "{accepted} accepted, {refused} refused"
    );
}
