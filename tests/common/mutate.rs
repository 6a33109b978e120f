//! Seeded mutations of structured documents (request bodies, schema files, config files, data rows) and of
//! their bytes, for tests that check that whatever a person or a caller gets wrong is refused cleanly.

use serde_json::{Map, Value as Json, json};

/// splitmix64: small, seedable, good enough to pick mutations.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }

    pub fn chance(&mut self, percent: u64) -> bool {
        self.next() % 100 < percent
    }

    pub fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len())]
    }
}

/// Names that the endpoints and the demo rows know, so mutations reach past "unknown field" into the
/// decoders' corners.
pub const REQUEST_NAMES: &[&str] = &[
    "entities",
    "candidates",
    "context",
    "options",
    "user_id",
    "item_id",
    "hour_of_day",
    "device",
    "timings",
    "return_features",
    "deadline_ms",
    "features",
    "views",
    "rows",
    "event_timestamp",
    "age",
    "country",
    "is_premium",
    "avg_session_minutes",
    "embedding",
    "price",
    "ctr_7d",
    "inputs",
    "outputs",
    "name",
    "shape",
    "datatype",
    "data",
    "parameters",
    "binary_data",
    "id",
    "user_profile",
    "item_stats",
    "user_profile:age",
    "category",
    "brand",
    "impressions_7d",
    "feature_service",
    "full_feature_names",
    "request_context",
    "ctr",
    "kind",
    "view",
    "version",
    "entity",
    "dtype",
    "default",
    "max_age",
    "cache",
    "ttl",
    "float32[4]",
    "",
];

/// Names found in schema files, so mutations rename and add keys that mean something.
pub const SCHEMA_NAMES: &[&str] = &[
    "kind",
    "name",
    "version",
    "entity",
    "entities",
    "key",
    "dtype",
    "description",
    "max_age",
    "cache",
    "ttl",
    "refresh_after",
    "negative_ttl",
    "max_staleness",
    "store",
    "key_ttl",
    "timeout",
    "features",
    "default",
    "file",
    "input",
    "outputs",
    "device",
    "batching",
    "max_batch_rows",
    "max_delay_us",
    "sessions",
    "context",
    "inputs",
    "feature",
    "transform",
    "standardize",
    "mean",
    "std",
    "log1p",
    "one_hot",
    "vocabulary",
    "hash_bucket",
    "buckets",
    "fill_missing",
    "value",
    "clip",
    "min",
    "max",
    "bucketize",
    "boundaries",
    "user_profile:age",
    "item_stats:price",
    "context:device",
    "int64",
    "float32",
    "float32[4]",
    "string",
    "bool",
    "view",
    "model",
    "entity",
    "cuda",
    "auto",
];

/// A value chosen to sit on an edge: extremes, wrong types, odd strings, nesting.
pub fn wild(rng: &mut Rng, names: &[&str], depth: usize) -> Json {
    let choice = rng.below(if depth > 2 { 22 } else { 26 });
    match choice {
        0 => Json::Null,
        1 => json!(true),
        2 => json!(0),
        3 => json!(-1),
        4 => json!(i64::MAX),
        5 => json!(i64::MIN),
        6 => json!(u64::MAX),
        7 => json!(1e308),
        8 => json!(-3.4e38),
        9 => json!(3.5e38),
        10 => json!(1e-320),
        11 => json!(0.5),
        12 => json!(""),
        13 => json!("u_1"),
        14 => json!("i_7"),
        15 => json!("x".repeat(rng.below(5000))),
        16 => json!("ü\u{0}\u{ffff}😀\u{202e}:hy:user_profile:"),
        17 => json!(rng.pick(names)),
        18 => json!(rng.below(2000)),
        19 => json!(-(rng.below(2000) as i64)),
        20 => json!((rng.next() as f64) / 7.0),
        21 => json!("FP32"),
        22 | 23 => Json::Array(
            (0..rng.below(4))
                .map(|_| wild(rng, names, depth + 1))
                .collect(),
        ),
        _ => {
            let mut m = Map::new();
            for _ in 0..rng.below(4) {
                m.insert((*rng.pick(names)).to_owned(), wild(rng, names, depth + 1));
            }
            Json::Object(m)
        }
    }
}

/// Every node of `v` as a path of object keys and array indices.
fn paths(v: &Json, at: &mut Vec<Step>, out: &mut Vec<Vec<Step>>) {
    out.push(at.clone());
    match v {
        Json::Object(m) => {
            for (k, child) in m {
                at.push(Step::Key(k.clone()));
                paths(child, at, out);
                at.pop();
            }
        }
        Json::Array(a) => {
            for (i, child) in a.iter().enumerate() {
                at.push(Step::Index(i));
                paths(child, at, out);
                at.pop();
            }
        }
        _ => {}
    }
}

#[derive(Clone, Debug)]
enum Step {
    Key(String),
    Index(usize),
}

fn node<'a>(v: &'a mut Json, path: &[Step]) -> &'a mut Json {
    path.iter().fold(v, |v, step| match step {
        Step::Key(k) => &mut v[k.as_str()],
        Step::Index(i) => &mut v[*i],
    })
}

/// One structural mutation of `v`: replace, drop, add or repeat a node.
pub fn mutate_tree(rng: &mut Rng, names: &[&str], v: &mut Json) {
    let mut all = Vec::new();
    paths(v, &mut Vec::new(), &mut all);
    let path = rng.pick(&all).clone();
    let target = node(v, &path);
    match rng.below(6) {
        0 | 1 => *target = wild(rng, names, 0),
        2 => match target {
            Json::Object(m) if !m.is_empty() => {
                let k = m
                    .keys()
                    .nth(rng.below(m.len()))
                    .cloned()
                    .unwrap_or_default();
                m.remove(&k);
            }
            Json::Array(a) if !a.is_empty() => {
                a.remove(rng.below(a.len()));
            }
            _ => *target = Json::Null,
        },
        3 => match target {
            Json::Object(m) => {
                m.insert((*rng.pick(names)).to_owned(), wild(rng, names, 0));
            }
            Json::Array(a) => a.push(wild(rng, names, 0)),
            _ => *target = json!([target.clone()]),
        },
        4 => {
            // Many copies: reaches the limits on candidates, keys and rows.
            if let Json::Array(a) = target
                && let Some(first) = a.first().cloned()
            {
                let n = *rng.pick(&[2, 99, 1000, 1001, 5000]);
                a.resize(n, first);
            }
        }
        _ => {
            // A key renamed: unknown or repeated names.
            if let Json::Object(m) = target
                && !m.is_empty()
            {
                let k = m
                    .keys()
                    .nth(rng.below(m.len()))
                    .cloned()
                    .unwrap_or_default();
                if let Some(val) = m.remove(&k) {
                    m.insert((*rng.pick(names)).to_owned(), val);
                }
            }
        }
    }
}

/// A mutated document: `doc` (the parsed `original`, `None` when it does not parse) after one to three
/// structural mutations, printed by `print` (`original` stays when the mutated tree cannot be printed in
/// the format); then, three times in ten, byte damage.
pub fn mutated(
    rng: &mut Rng,
    names: &[&str],
    original: &[u8],
    doc: Option<Json>,
    print: impl Fn(&Json) -> Option<Vec<u8>>,
) -> Vec<u8> {
    let mut out = original.to_vec();
    if let Some(mut tree) = doc {
        for _ in 0..1 + rng.below(3) {
            mutate_tree(rng, names, &mut tree);
        }
        if let Some(printed) = print(&tree) {
            out = printed;
        }
    }
    if rng.chance(30) {
        mutate_bytes(rng, &mut out);
    }
    out
}

/// Byte-level damage to a serialized body: truncation, stray bytes, a flipped bit, a spliced token.
pub fn mutate_bytes(rng: &mut Rng, body: &mut Vec<u8>) {
    const TOKENS: &[&[u8]] = &[
        b",",
        b"}",
        b"]",
        b"\"",
        b"\\u",
        b"\\ud800",
        b"1e999999",
        b"-",
        b"NaN",
        b"[[[[[[[[[[",
        b"\xff\xfe",
        b"\xc1",
        b"\xdd\xff\xff\xff\xff",
        b"\xdf\xff\xff\xff\xff",
        b"\xc7\x05\x01",
        b"\x00",
    ];
    let at = rng.below(body.len() + 1);
    match rng.below(4) {
        0 => body.truncate(at),
        1 => {
            let tok = rng.pick(TOKENS);
            body.splice(at..at, tok.iter().copied());
        }
        2 => {
            if let Some(b) = body.get_mut(at) {
                *b ^= 1 << rng.below(8);
            }
        }
        _ => {
            let b = rng.next() as u8;
            body.insert(at, b);
        }
    }
}

pub fn env_number(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}

/// A short, printable account of a body for a failure message.
pub fn describe(body: &[u8]) -> String {
    let s = String::from_utf8_lossy(body);
    if s.len() > 600 {
        format!(
            "{}… ({} bytes)",
            &s[..s.floor_char_boundary(600)],
            body.len()
        )
    } else {
        s.into_owned()
    }
}
