//! The request mix: turns a scenario into predict request bodies (JSON or MessagePack).
//!
//! Bodies are built per request (not from a pre-built pool) so the key stream really follows the
//! scenario's Zipf law for the whole run; building one costs a few microseconds.

use std::collections::{HashMap, HashSet};
use std::fmt::Write as _;
use std::sync::Arc;

use hyper::body::Bytes;
use serde::Serialize;
use serde::ser::{SerializeMap, SerializeSeq, Serializer};

use crate::sample::{Rng, Zipf};
use crate::scenario::{ContextGen, ContextValue, Format, KeySpace, Scenario};

/// A key space ready to draw from.
#[derive(Debug, Clone)]
struct Keys {
    entity: Arc<str>,
    prefix: Arc<str>,
    zipf: Zipf,
    keys: u64,
}

impl Keys {
    fn new(k: &KeySpace) -> Keys {
        // validate() guarantees keys >= 1 and zipf >= 0, so clamping never changes anything.
        let zipf = Zipf::clamped(k.keys, k.zipf);
        Keys {
            entity: Arc::from(k.entity.as_str()),
            prefix: Arc::from(k.prefix.as_str()),
            zipf,
            keys: k.keys.max(1),
        }
    }

    /// Zipf rank r maps to key index r-1, so `{prefix}0` is the hottest key.
    fn draw_index(&self, rng: &mut Rng) -> u64 {
        self.zipf.sample(rng) - 1
    }

    fn format(&self, index: u64, out: &mut String) {
        out.clear();
        out.push_str(&self.prefix);
        let _ = write!(out, "{index}");
    }
}

/// Generates predict request bodies for one stream (one open-loop scheduler or one closed-loop
/// worker); streams with different seeds are independent.
#[derive(Debug, Clone)]
pub struct Workload {
    users: Keys,
    items: Keys,
    cand_min: usize,
    cand_max: usize,
    distinct: bool,
    context: Arc<[(String, ContextGen)]>,
    format: Format,
    timings: bool,
    rng: Rng,
    user: String,
    cands: Vec<String>,
    seen: HashSet<u64>,
    /// For a taken key, a key at or after it (cyclically) from which the next unused one is
    /// searched: the taken keys' chains, compressed as they are walked, so the fallback of
    /// [`Workload::draw_candidates`] finds the next unused key without scanning every taken one.
    skip: HashMap<u64, u64>,
    path: Vec<u64>,
}

impl Workload {
    pub fn new(s: &Scenario, seed: u64) -> Workload {
        Workload {
            users: Keys::new(&s.users),
            items: Keys::new(&s.items),
            cand_min: s.candidates.min,
            cand_max: s.candidates.max,
            distinct: s.candidates.distinct,
            context: Arc::from(s.context.clone()),
            format: s.format,
            timings: s.timings,
            rng: Rng::new(seed),
            user: String::new(),
            cands: Vec::new(),
            seen: HashSet::new(),
            skip: HashMap::new(),
            path: Vec::new(),
        }
    }

    /// The next request body, encoded in the scenario's format.
    pub fn next_body(&mut self) -> Bytes {
        let u = self.users.draw_index(&mut self.rng);
        let mut user = std::mem::take(&mut self.user);
        self.users.format(u, &mut user);
        self.user = user;

        let n = if self.cand_min == self.cand_max {
            self.cand_min
        } else {
            self.rng
                .range_i64(self.cand_min as i64, self.cand_max as i64)
                .max(1) as usize
        };
        self.draw_candidates(n);

        let mut ctx: Vec<(&str, Ctx)> = Vec::with_capacity(self.context.len());
        for (name, g) in self.context.iter() {
            ctx.push((name.as_str(), gen_context(g, &mut self.rng)));
        }

        let req = PredictRequest {
            entities: One {
                key: &self.users.entity,
                value: &self.user,
            },
            context: CtxMap(&ctx),
            candidates: Cands {
                key: &self.items.entity,
                values: &self.cands[..n],
            },
            options: Options {
                timings: self.timings,
            },
        };
        let encoded = match self.format {
            Format::Json => serde_json::to_vec(&req).map_err(|e| e.to_string()),
            Format::Msgpack => rmp_serde::to_vec_named(&req).map_err(|e| e.to_string()),
        };
        // Encoding plain strings and numbers into a Vec cannot fail; an empty body would only
        // show up as 4xx errors in the report, never as a crash.
        Bytes::from(encoded.unwrap_or_default())
    }

    fn draw_candidates(&mut self, n: usize) {
        while self.cands.len() < n {
            self.cands.push(String::new());
        }
        self.seen.clear();
        self.skip.clear();
        // Distinct draws from a steep Zipf head repeat often; after a bounded number of retries the
        // rest are the next unused keys after a random one (validate() guarantees n <= keys when
        // distinct, so there always are enough).
        let max_tries = n.saturating_mul(50).max(100);
        let mut tries = 0;
        let mut i = 0;
        while i < n {
            let mut idx = self.items.draw_index(&mut self.rng);
            tries += 1;
            if self.distinct && self.seen.contains(&idx) {
                if tries < max_tries {
                    continue;
                }
                idx = self.next_unused(idx);
            }
            if self.distinct {
                self.seen.insert(idx);
            }
            self.items.format(idx, &mut self.cands[i]);
            i += 1;
        }
    }

    /// The first key at or after `idx` (cyclically) not taken in this request: what a scan key by
    /// key would find, in amortized O(log n) (path compression) rather than O(n) per call, so a
    /// request of 10,000 candidates over a steep head stays linear-ish. There always is one, since
    /// validate() keeps the candidates at most `items.keys` when distinct.
    fn next_unused(&mut self, idx: u64) -> u64 {
        let keys = self.items.keys;
        let mut at = idx;
        self.path.clear();
        // Each step moves to a key further on (cyclically) that was unused when its link was set,
        // and at most n keys are taken: bounded by the taken keys.
        while self.seen.contains(&at) {
            self.path.push(at);
            at = self.skip.get(&at).copied().unwrap_or((at + 1) % keys);
        }
        for &p in &self.path {
            self.skip.insert(p, at);
        }
        at
    }
}

#[derive(Debug, Clone)]
enum Ctx {
    Int(i64),
    Float(f64),
    Bool(bool),
    Str(Arc<str>),
}

fn gen_context(g: &ContextGen, rng: &mut Rng) -> Ctx {
    match g {
        ContextGen::IntRange([lo, hi]) => Ctx::Int(rng.range_i64(*lo, *hi)),
        ContextGen::FloatRange([lo, hi]) => Ctx::Float(lo + (hi - lo) * rng.next_f64()),
        ContextGen::OneOf(values) => {
            let i = rng.below(values.len().max(1) as u64) as usize;
            values.get(i).map(value_ctx).unwrap_or(Ctx::Bool(false))
        }
        ContextGen::Value(v) => value_ctx(v),
    }
}

fn value_ctx(v: &ContextValue) -> Ctx {
    match v {
        ContextValue::Bool(b) => Ctx::Bool(*b),
        ContextValue::Int(i) => Ctx::Int(*i),
        ContextValue::Float(f) => Ctx::Float(*f),
        ContextValue::Str(s) => Ctx::Str(Arc::from(s.as_str())),
    }
}

#[derive(Serialize)]
struct PredictRequest<'a> {
    entities: One<'a>,
    context: CtxMap<'a>,
    candidates: Cands<'a>,
    options: Options,
}

#[derive(Serialize)]
struct Options {
    timings: bool,
}

/// `{"<key>": "<value>"}`
struct One<'a> {
    key: &'a str,
    value: &'a str,
}

impl Serialize for One<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut m = s.serialize_map(Some(1))?;
        m.serialize_entry(self.key, self.value)?;
        m.end()
    }
}

/// `[{"<key>": "<v1>"}, {"<key>": "<v2>"}]`
struct Cands<'a> {
    key: &'a str,
    values: &'a [String],
}

impl Serialize for Cands<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut seq = s.serialize_seq(Some(self.values.len()))?;
        for v in self.values {
            seq.serialize_element(&One {
                key: self.key,
                value: v,
            })?;
        }
        seq.end()
    }
}

struct CtxMap<'a>(&'a [(&'a str, Ctx)]);

impl Serialize for CtxMap<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut m = s.serialize_map(Some(self.0.len()))?;
        for (k, v) in self.0 {
            m.serialize_key(k)?;
            match v {
                Ctx::Int(i) => m.serialize_value(i)?,
                Ctx::Float(f) => m.serialize_value(f)?,
                Ctx::Bool(b) => m.serialize_value(b)?,
                Ctx::Str(st) => m.serialize_value(&**st)?,
            }
        }
        m.end()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scenario::Scenario;

    fn scenario(extra: &str, candidates: &str) -> Scenario {
        let text = format!(
            r#"
target = "http://127.0.0.1:8080"
model = "ctr"
candidates = {candidates}
{extra}

[load]
mode = "open-loop"
rate = 10
duration_s = 1

[users]
keys = 1000
zipf = 1.1

[items]
keys = 2000

[context]
hour_of_day = {{ int_range = [0, 23] }}
device = {{ one_of = ["ios", "android", "web"] }}
"#
        );
        Scenario::from_toml_str(&text, "t", "t").expect("scenario")
    }

    #[test]
    fn json_body_has_the_contract_shape() {
        let mut w = Workload::new(&scenario("", "[1, 10]"), 1);
        for _ in 0..200 {
            let body = w.next_body();
            let v: serde_json::Value = serde_json::from_slice(&body).expect("json");
            let user = v["entities"]["user_id"].as_str().expect("user");
            assert!(user.starts_with("u_"));
            let idx: u64 = user[2..].parse().expect("index");
            assert!(idx < 1000);
            let cands = v["candidates"].as_array().expect("candidates");
            assert!((1..=10).contains(&cands.len()));
            let mut seen = HashSet::new();
            for c in cands {
                let item = c["item_id"].as_str().expect("item");
                assert!(seen.insert(item.to_string()), "duplicate candidate {item}");
            }
            let hour = v["context"]["hour_of_day"].as_i64().expect("hour");
            assert!((0..=23).contains(&hour));
            assert!(
                ["ios", "android", "web"]
                    .contains(&v["context"]["device"].as_str().expect("device"))
            );
            assert_eq!(v["options"]["timings"], true);
        }
    }

    #[test]
    fn candidates_stay_distinct_when_a_steep_head_asks_for_the_whole_key_space() {
        let text = scenario("", "50")
            .source
            .replace("keys = 2000", "keys = 50\nzipf = 1.5");
        let s = Scenario::from_toml_str(&text, "t", "t").expect("scenario");
        let mut w = Workload::new(&s, 7);
        for _ in 0..100 {
            let v: serde_json::Value = serde_json::from_slice(&w.next_body()).expect("json");
            let items: HashSet<&str> = v["candidates"]
                .as_array()
                .expect("candidates")
                .iter()
                .map(|c| c["item_id"].as_str().expect("item"))
                .collect();
            assert_eq!(items.len(), 50, "all 50 keys, none twice");
        }
    }

    /// 10,000 distinct candidates from 10,000 keys over a steep head: nearly every draw repeats, so
    /// most candidates come from the fallback. It must be as a scan would make it (each the first
    /// unused key at or after the draw) and quick.
    #[test]
    fn the_distinct_fallback_is_the_next_unused_key_and_quick() {
        let text = scenario("", "2000")
            .source
            .replace("candidates = 2000", "candidates = 10000")
            .replace("keys = 2000", "keys = 10000\nzipf = 3.0");
        let s = Scenario::from_toml_str(&text, "t", "t").expect("scenario");
        let mut w = Workload::new(&s, 3);
        let started = std::time::Instant::now();
        for _ in 0..3 {
            w.next_body();
            let mut got: Vec<u64> = w.cands[..10_000]
                .iter()
                .map(|c| c.trim_start_matches("i_").parse().expect("index"))
                .collect();
            got.sort_unstable();
            assert!(got.iter().copied().eq(0..10_000), "every key once");
        }
        assert!(
            started.elapsed()
                < std::time::Duration::from_secs(if cfg!(debug_assertions) { 5 } else { 1 }),
            "three requests took {:?}",
            started.elapsed()
        );

        // Against a plain scan, on a key space with gaps to jump and the wrap-around at the end.
        let mut w = Workload::new(&scenario("", "1"), 1);
        w.items.keys = 10;
        for taken in [2, 3, 4, 7, 9, 0] {
            w.seen.insert(taken);
        }
        let scan = |seen: &HashSet<u64>, mut at: u64| {
            while seen.contains(&at) {
                at = (at + 1) % 10;
            }
            at
        };
        for draw in [2, 9, 7, 3] {
            let expected = scan(&w.seen, draw);
            let got = w.next_unused(draw);
            assert_eq!(got, expected, "after drawing {draw}");
            w.seen.insert(got);
        }
        assert_eq!(w.seen.len(), 10, "all keys taken");
    }

    #[test]
    fn msgpack_body_decodes_to_the_same_fields() {
        let mut w = Workload::new(&scenario("format = \"msgpack\"", "3"), 1);
        let body = w.next_body();
        let v: serde_json::Value = rmp_serde::from_slice(&body).expect("msgpack map");
        assert!(v["entities"]["user_id"].is_string());
        assert_eq!(v["candidates"].as_array().map(Vec::len), Some(3));
    }

    #[test]
    fn same_seed_same_stream() {
        let s = scenario("", "5");
        let mut a = Workload::new(&s, 9);
        let mut b = Workload::new(&s, 9);
        for _ in 0..20 {
            assert_eq!(a.next_body(), b.next_body());
        }
    }
}
