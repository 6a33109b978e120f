//! The Open Inference Protocol (KServe V2) infer endpoint: raw tensors in, raw tensors out, no hydration.
//! It shares the model's queue, batcher and session pool with predict, so existing KServe/Triton clients
//! get the same engine. Errors are `{"error": "..."}` as the protocol specifies.

use std::time::Instant;

use axum::Json;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};
use serde_json::Value as Json_;

use crate::gateway::Gateway;
use crate::infer::{Engine, InferError};
use crate::telemetry::{Laps, Stage, Timings};

/// An error in the protocol's shape.
#[derive(Debug)]
pub struct OipError(pub StatusCode, pub String);

impl IntoResponse for OipError {
    fn into_response(self) -> Response {
        // Cut as the other routes' errors are: a name sent back could be as long as the body.
        let message = crate::error::bounded(&self.1, crate::error::MAX_MESSAGE_BYTES);
        let mut r = (self.0, Json(serde_json::json!({ "error": message }))).into_response();
        if self.0 == StatusCode::SERVICE_UNAVAILABLE {
            r.headers_mut().insert(
                axum::http::header::RETRY_AFTER,
                axum::http::HeaderValue::from_static("1"),
            );
        }
        r
    }
}

/// The request, or a 400 naming the field (`inputs[0].shape[1]: ...`) in the protocol's words rather
/// than Rust's.
fn parse_request(body: &[u8]) -> Result<InferRequest, OipError> {
    let mut de = serde_json::Deserializer::from_slice(body);
    let req: InferRequest = serde_path_to_error::deserialize(&mut de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        let what = inner.to_string();
        // Where a syntax error is is the one thing to say about it. The path-tracking pass loses the
        // position; a plain pass over the body finds it again.
        // The field, where the path is one (a list nested past the parser's limit in
        // `inputs[0].data`); not at the top, nor a position the tracker could not name.
        let named = path != "." && !path.contains('?');
        if inner.is_syntax() || inner.is_eof() {
            let located = serde_json::from_slice::<serde::de::IgnoredAny>(body).err();
            let what = located.map_or(what, |e| e.to_string());
            return if named {
                bad(format!("invalid infer request: {path}: {what}"))
            } else {
                bad(format!("invalid infer request: {what}"))
            };
        }
        let what = crate::decode::strip_position(&what)
            .replace("expected i64", "expected an integer")
            .replace("expected a sequence", "expected a list");
        if !named {
            bad(format!("invalid infer request: {what}"))
        } else {
            bad(format!("invalid infer request: {path}: {what}"))
        }
    })?;
    de.end()
        .map_err(|e| bad(format!("invalid infer request: {e}")))?;
    Ok(req)
}

fn bad(msg: impl Into<String>) -> OipError {
    OipError(StatusCode::BAD_REQUEST, msg.into())
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, expecting = "an infer request object")]
pub struct InferRequest {
    #[serde(default)]
    pub id: Option<String>,
    pub inputs: Vec<InputTensor>,
    #[serde(default)]
    pub outputs: Option<Vec<RequestedOutput>>,
    #[serde(default)]
    pub parameters: Option<Parameters>,
}

#[derive(Debug, Deserialize)]
#[serde(
    deny_unknown_fields,
    expecting = "an input tensor object ({\"name\", \"shape\", \"datatype\", \"data\"})"
)]
pub struct InputTensor {
    pub name: String,
    pub shape: Vec<i64>,
    pub datatype: String,
    pub data: Json_,
    #[serde(default)]
    pub parameters: Option<Parameters>,
}

#[derive(Debug, Deserialize)]
#[serde(
    deny_unknown_fields,
    expecting = "a requested output object ({\"name\": ...})"
)]
pub struct RequestedOutput {
    pub name: String,
    #[serde(default)]
    pub parameters: Option<Parameters>,
}

/// The protocol's free-form `parameters`. They are ignored, except the binary tensor extension's, which
/// would change what the body means: refused, rather than answered as if they were not there.
pub type Parameters = serde_json::Map<String, Json_>;

/// `at` names where the parameters are (`inputs[0].`); built only for the error.
fn check_parameters(at: impl FnOnce() -> String, p: Option<&Parameters>) -> Result<(), OipError> {
    if let Some(key) = p.and_then(|p| p.keys().find(|k| k.starts_with("binary_data"))) {
        return Err(bad(format!(
            "{}parameters.{key}: the binary tensor extension is not supported; send the data as JSON",
            at()
        )));
    }
    Ok(())
}

#[derive(Serialize)]
struct OutputTensor<'a> {
    name: &'a str,
    datatype: &'static str,
    shape: [usize; 2],
    data: &'a [f32],
}

#[derive(Serialize)]
struct InferResponse<'a> {
    model_name: &'a str,
    model_version: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    id: Option<&'a str>,
    outputs: Vec<OutputTensor<'a>>,
}

const DATATYPES: [&str; 13] = [
    "BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64", "FP16",
    "FP32", "FP64", "BYTES",
];

/// Flattens row-major `data` into `out`: a flat list of numbers, or a list of rows of exactly `width`
/// numbers each. Each element must be a number within float32's range.
fn flatten(v: &Json_, out: &mut Vec<f32>, limit: usize, width: usize) -> Result<(), String> {
    let Json_::Array(items) = v else {
        return Err(format!("expected a list of numbers, found {v}"));
    };
    if items.first().is_some_and(Json_::is_array) {
        for (i, row) in items.iter().enumerate() {
            let Json_::Array(row) = row else {
                return Err(format!("row {i} is not a list"));
            };
            if row.len() != width {
                return Err(format!(
                    "row {i} has {} elements; the shape's rows have {width}",
                    row.len()
                ));
            }
            for x in row {
                number(x, out, limit)?;
            }
        }
        return Ok(());
    }
    items.iter().try_for_each(|x| number(x, out, limit))
}

fn number(v: &Json_, out: &mut Vec<f32>, limit: usize) -> Result<(), String> {
    let Json_::Number(n) = v else {
        return Err(format!("expected numbers, found {v}"));
    };
    if out.len() >= limit {
        return Err(format!("more elements than the shape's {limit}"));
    }
    let f = n.as_f64().ok_or("a number out of range")?;
    out.push(crate::value::to_float32(f)?);
    Ok(())
}

/// `POST /v2/models/{model}/infer` on the model's engine.
pub async fn infer(gw: &Gateway, engine: &Engine, body: &[u8]) -> Result<Response, OipError> {
    let started = Instant::now();
    // V2 traffic counts in the model's stats like predict's: requests, rows, errors and the stages it
    // has (decode, queue, infer, encode).
    let mut laps = Laps::from(started);
    let mut t = Timings::default();
    let result = run_infer(gw, engine, body, started, &mut laps, &mut t).await;
    match result {
        Ok((response, rows)) => {
            t.total_us = laps.total();
            engine.stats().record_stages(&t, rows, &Stage::RAW);
            Ok(response)
        }
        Err(e) => {
            engine.stats().failed(e.0);
            Err(e)
        }
    }
}

async fn run_infer(
    gw: &Gateway,
    engine: &Engine,
    body: &[u8],
    started: Instant,
    laps: &mut Laps,
    t: &mut Timings,
) -> Result<(Response, usize), OipError> {
    // serde would also fill the struct from a JSON array, field by field, and name the struct in its
    // errors: the request is an object, and says so.
    let body = body.strip_prefix(b"\xef\xbb\xbf").unwrap_or(body);
    match body.iter().find(|b| !b.is_ascii_whitespace()) {
        Some(b'{') => {}
        _ => {
            return Err(bad(
                "invalid infer request: expected a JSON object such as {\"inputs\": [{\"name\": ..., \"shape\": [...], \"datatype\": \"FP32\", \"data\": [...]}]}",
            ));
        }
    }
    let req = parse_request(body)?;
    let info = engine.info();
    let width = engine.model().width;
    if req.inputs.len() != 1 {
        return Err(bad(format!(
            "inputs: the model takes exactly one input, `{}`; got {}",
            info.input_name,
            req.inputs.len()
        )));
    }
    let input = &req.inputs[0];
    if input.name != info.input_name {
        return Err(bad(format!(
            "inputs[0].name: unknown input `{}`: the model takes `{}`",
            input.name, info.input_name
        )));
    }
    if !DATATYPES.contains(&input.datatype.as_str()) {
        return Err(bad(format!(
            "inputs[0].datatype: `{}` is not a datatype of the protocol",
            input.datatype
        )));
    }
    if input.datatype != "FP32" {
        return Err(bad(format!(
            "inputs[0].datatype: input `{}` is FP32; got {}",
            input.name, input.datatype
        )));
    }
    let max_rows = gw.config.limits.max_candidates;
    let rows = match input.shape.as_slice() {
        [n, w] if *w == width as i64 && *n >= 1 => usize::try_from(*n).unwrap_or(usize::MAX),
        [_, w] if *w != width as i64 => {
            return Err(bad(format!(
                "inputs[0].shape: input `{}` has shape [batch, {width}]; got {:?}",
                input.name, input.shape
            )));
        }
        _ => {
            return Err(bad(format!(
                "inputs[0].shape: input `{}` has shape [batch, {width}] with batch >= 1; got {:?}",
                input.name, input.shape
            )));
        }
    };
    if rows > max_rows {
        return Err(bad(format!(
            "inputs[0].shape[0]: {rows} rows is more than the limit of {max_rows} (limits.max_candidates)"
        )));
    }
    // Every check that needs no buffer comes before one is taken from the pool.
    check_parameters(String::new, req.parameters.as_ref())?;
    for (i, t) in req.inputs.iter().enumerate() {
        check_parameters(|| format!("inputs[{i}]."), t.parameters.as_ref())?;
    }
    for (i, o) in req.outputs.iter().flatten().enumerate() {
        check_parameters(|| format!("outputs[{i}]."), o.parameters.as_ref())?;
    }
    let wanted: Vec<usize> = match &req.outputs {
        None => (0..info.outputs.len()).collect(),
        Some(outs) if outs.is_empty() => {
            return Err(bad(
                "outputs: an empty list asks for nothing; leave `outputs` out for every output",
            ));
        }
        Some(outs) => {
            let mut v = Vec::with_capacity(outs.len());
            for (j, o) in outs.iter().enumerate() {
                let i = info
                    .outputs
                    .iter()
                    .position(|x| x.name == o.name)
                    .ok_or_else(|| {
                        let names: Vec<_> = info.outputs.iter().map(|x| x.name.as_str()).collect();
                        bad(format!(
                            "outputs[{j}].name: unknown output `{}` (outputs: {})",
                            o.name,
                            names.join(", ")
                        ))
                    })?;
                if v.contains(&i) {
                    return Err(bad(format!(
                        "outputs[{j}].name: output `{}` is requested twice",
                        o.name
                    )));
                }
                v.push(i);
            }
            v
        }
    };
    let expected = rows * width;
    let mut buf = engine.take_buffer();
    buf.clear();
    if let Err(e) = flatten(&input.data, &mut buf, expected, width) {
        engine.give_buffer(buf);
        return Err(bad(format!("inputs[0].data: input `{}`: {e}", input.name)));
    }
    if buf.len() != expected {
        let n = buf.len();
        engine.give_buffer(buf);
        return Err(bad(format!(
            "inputs[0].data: input `{}` has {n} elements; shape {:?} needs {expected}",
            input.name, input.shape
        )));
    }
    let deadline = started + gw.config.limits.request_timeout;
    t.set(Stage::Decode, laps.lap());
    let out = engine
        .infer(rows, buf, deadline)
        .await
        .map_err(|e| match e {
            InferError::QueueFull(_)
            | InferError::QueueTimeout(..)
            | InferError::Expired(_)
            | InferError::Closed(_) => OipError(StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
            other => {
                tracing::error!(cause = %other, "V2 infer failed");
                OipError(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "inference failed; the cause is in the gateway's log".to_owned(),
                )
            }
        })?;
    t.set(Stage::Queue, laps.lap().saturating_sub(out.infer_us));
    t.set(Stage::Infer, out.infer_us);
    if let Some((o, row)) = out.outputs.first_non_finite() {
        let name = info.outputs.get(o).map_or("?", |x| x.name.as_str());
        engine.recycle(out);
        return Err(bad(format!(
            "the model gave a non-finite `{name}` (NaN or infinity) for row {row} of these inputs"
        )));
    }
    let outputs = wanted
        .iter()
        .map(|&i| {
            let (w, data) = out.outputs.get(i);
            OutputTensor {
                name: &info.outputs[i].name,
                datatype: "FP32",
                shape: [rows, w],
                data,
            }
        })
        .collect();
    let resp = InferResponse {
        model_name: &engine.model().name,
        model_version: engine.model().version.to_string(),
        id: req.id.as_deref(),
        outputs,
    };
    let body = Json(&resp).into_response();
    drop(resp);
    engine.recycle(out);
    t.set(Stage::Encode, laps.lap());
    Ok((body, rows))
}
