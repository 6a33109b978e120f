//! The bulk loader: feature rows from JSON Lines or CSV files, validated against the view's schema and
//! written to the store in atomic batches.
//!
//! A row names its entity key (the view's entity, e.g. `user_id`), optionally `event_timestamp` (RFC 3339 or
//! milliseconds since the epoch; the load time when absent), and features by name; a feature left out is
//! stored as null and served as its default. A bad row is rejected with its line number and the reason;
//! the good rows still load. Each batch is one atomic write, so no row is ever half-written.

use std::io::BufRead;
use std::path::Path;

use crate::config::LimitsConfig;
use crate::decode::{EntityKey, key_string};
use crate::schema::View;
use crate::store::{Store, key};
use crate::value::{Record, Value};

/// Rows per store write.
pub const BATCH: usize = 1000;

/// A line number and the row parsed from it (or why it could not be).
type ParsedLine = (
    usize,
    Result<serde_json::Map<String, serde_json::Value>, String>,
);

/// A row the loader refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rejected {
    /// 1-based line in the file (for CSV, counting the header).
    pub line: usize,
    pub reason: String,
}

/// What a load did.
#[derive(Debug, Default)]
pub struct Report {
    pub written: usize,
    pub rejected: Vec<Rejected>,
}

/// Turns one JSON object into the store key and record of `view`.
pub fn parse_row(
    view: &View,
    prefix: &str,
    row: &serde_json::Map<String, serde_json::Value>,
    now_ms: i64,
    limits: &LimitsConfig,
) -> Result<(String, Record), String> {
    let entity = &view.entity;
    let raw_key = row
        .get(&entity.name)
        .ok_or_else(|| format!("missing the entity key `{}`", entity.name))?;
    let k = match raw_key {
        serde_json::Value::String(s) => EntityKey::Str(s.clone()),
        serde_json::Value::Number(n) if n.is_i64() => {
            EntityKey::Int(n.as_i64().unwrap_or_default())
        }
        other => {
            return Err(format!(
                "`{}` must be a string or an integer, got {other}",
                entity.name
            ));
        }
    };
    let entity_key = key_string(entity, &k, &entity.name, limits).map_err(|e| e.to_string())?;
    let event_ts_ms = match row.get("event_timestamp") {
        None | Some(serde_json::Value::Null) => now_ms,
        Some(serde_json::Value::Number(n)) => n
            .as_i64()
            .ok_or("`event_timestamp` must be whole milliseconds since the Unix epoch")?,
        Some(serde_json::Value::String(s)) => humantime::parse_rfc3339_weak(s)
            .map_err(|_| {
                format!(
                    "`event_timestamp` `{s}` is not an RFC 3339 time (e.g. 2026-11-01T12:00:00Z)"
                )
            })?
            .duration_since(std::time::UNIX_EPOCH)
            .map_err(|_| "`event_timestamp` is before 1970".to_owned())?
            .as_millis() as i64,
        Some(other) => {
            return Err(format!(
                "`event_timestamp` must be a string or a number, got {other}"
            ));
        }
    };
    for name in row.keys() {
        if name != &entity.name && name != "event_timestamp" && view.feature_index(name).is_none() {
            return Err(format!(
                "unknown feature `{name}` (view `{}` has: {})",
                view.name,
                feature_names(view)
            ));
        }
    }
    let mut values = Vec::with_capacity(view.features.len());
    for f in &view.features {
        let v = match row.get(&f.name) {
            None => Value::Null,
            Some(j) => Value::from_json(j)
                .and_then(|v| f.dtype.coerce(v))
                .map_err(|e| format!("feature `{}`: {e}", f.name))?,
        };
        values.push(v);
    }
    Ok((
        key(prefix, &view.name, &entity_key),
        Record {
            schema_version: view.version,
            event_ts_ms,
            values,
        },
    ))
}

fn feature_names(view: &View) -> String {
    view.features
        .iter()
        .map(|f| f.name.as_str())
        .collect::<Vec<_>>()
        .join(", ")
}

/// Reads rows from `reader`: JSON Lines, or CSV when `csv` is set. Calls `sink` with each batch of valid rows.
pub async fn load<R: BufRead>(
    view: &View,
    prefix: &str,
    reader: R,
    csv: bool,
    limits: &LimitsConfig,
    store: &dyn Store,
) -> anyhow::Result<Report> {
    let now = crate::value::now_ms();
    let mut report = Report::default();
    let mut batch: Vec<(String, Vec<u8>)> = Vec::with_capacity(BATCH);
    let mut rows: Vec<ParsedLine> = Vec::new();
    if csv {
        read_csv(view, reader, &mut rows)?;
    } else {
        for (i, line) in reader.lines().enumerate() {
            let line = line?;
            if line.trim().is_empty() {
                continue;
            }
            let parsed = match serde_json::from_str::<serde_json::Value>(&line) {
                Ok(serde_json::Value::Object(m)) => Ok(m),
                Ok(_) => Err("expected a JSON object".to_owned()),
                Err(e) => Err(format!("not valid JSON: {e}")),
            };
            rows.push((i + 1, parsed));
        }
    }
    for (line, parsed) in rows {
        match parsed.and_then(|m| parse_row(view, prefix, &m, now, limits)) {
            Ok((k, record)) => batch.push((k, record.encode())),
            Err(reason) => report.rejected.push(Rejected { line, reason }),
        }
        if batch.len() >= BATCH {
            report.written += batch.len();
            store
                .put_many(std::mem::take(&mut batch), view.policy.key_ttl)
                .await?;
        }
    }
    if !batch.is_empty() {
        report.written += batch.len();
        store.put_many(batch, view.policy.key_ttl).await?;
    }
    Ok(report)
}

/// Parses CSV into JSON objects typed by the view: empty cells are null, `float32[N]` cells hold a JSON list.
fn read_csv<R: BufRead>(view: &View, reader: R, out: &mut Vec<ParsedLine>) -> anyhow::Result<()> {
    use crate::value::Dtype;
    let mut rdr = csv::ReaderBuilder::new().flexible(true).from_reader(reader);
    let headers = rdr.headers()?.clone();
    for (i, rec) in rdr.records().enumerate() {
        let line = i + 2;
        let rec = match rec {
            Ok(r) => r,
            Err(e) => {
                out.push((line, Err(format!("not valid CSV: {e}"))));
                continue;
            }
        };
        if rec.len() != headers.len() {
            out.push((
                line,
                Err(format!(
                    "{} cells, the header has {}",
                    rec.len(),
                    headers.len()
                )),
            ));
            continue;
        }
        let mut m = serde_json::Map::new();
        let mut bad = None;
        for (h, cell) in headers.iter().zip(rec.iter()) {
            if cell.is_empty() {
                continue;
            }
            let dtype = if h == view.entity.name {
                Some(view.entity.dtype)
            } else {
                view.features.iter().find(|f| f.name == h).map(|f| f.dtype)
            };
            let v = match dtype {
                Some(Dtype::String) => serde_json::Value::String(cell.to_owned()),
                Some(Dtype::Bool) => match cell.to_ascii_lowercase().as_str() {
                    "true" | "1" => serde_json::Value::Bool(true),
                    "false" | "0" => serde_json::Value::Bool(false),
                    _ => {
                        bad = Some(format!("`{h}`: `{cell}` is not a boolean"));
                        break;
                    }
                },
                Some(_) => match serde_json::from_str(cell) {
                    Ok(v) => v,
                    Err(_) => {
                        bad = Some(format!(
                            "`{h}`: `{cell}` is not a number (lists are written as [0.1, 0.2])"
                        ));
                        break;
                    }
                },
                // event_timestamp or an unknown column: parse_row reports unknown names.
                None => serde_json::from_str(cell)
                    .unwrap_or_else(|_| serde_json::Value::String(cell.to_owned())),
            };
            m.insert(h.to_owned(), v);
        }
        out.push((line, bad.map_or(Ok(m), Err)));
    }
    Ok(())
}

/// Whether `path` is read as CSV (by its extension).
pub fn is_csv(path: &Path) -> bool {
    path.extension()
        .and_then(|e| e.to_str())
        .is_some_and(|e| e.eq_ignore_ascii_case("csv"))
}
