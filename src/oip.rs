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

/// A shape's dimensions: integers, a whole float as the integer it is (an encoder that writes every
/// number as a double), and one past int64 named as too large rather than as a float, which is what
/// JSON's reader makes of it.
fn dims<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<i64>, D::Error> {
    struct Dim(i64);
    impl<'de> Deserialize<'de> for Dim {
        fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            d.deserialize_any(DimVisitor)
        }
    }
    struct DimVisitor;
    impl serde::de::Visitor<'_> for DimVisitor {
        type Value = Dim;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("an integer")
        }
        fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<Dim, E> {
            Ok(Dim(v))
        }
        fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<Dim, E> {
            i64::try_from(v)
                .map(Dim)
                .map_err(|_| E::custom(format!("{v} is larger than a dimension can be")))
        }
        fn visit_f64<E: serde::de::Error>(self, v: f64) -> Result<Dim, E> {
            use crate::value::FloatAsInt;
            match crate::value::float_as_int(v) {
                FloatAsInt::Exact(i) => Ok(Dim(i)),
                FloatAsInt::NotWhole => Err(E::invalid_type(
                    serde::de::Unexpected::Float(v),
                    &"an integer",
                )),
                FloatAsInt::Inexact => Err(E::custom(format!(
                    "{v:e} is past 2^53, where a float no longer tells neighbouring integers apart: send it as an integer"
                ))),
                FloatAsInt::OutOfRange | FloatAsInt::LowerBound if v > 0.0 => Err(E::custom(
                    format!("{v:e} is larger than a dimension can be"),
                )),
                FloatAsInt::OutOfRange | FloatAsInt::LowerBound => Err(E::custom(format!(
                    "{v:e} is smaller than a dimension can be"
                ))),
            }
        }
    }
    Ok(Vec::<Dim>::deserialize(d)?
        .into_iter()
        .map(|x| x.0)
        .collect())
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
        let what =
            crate::decode::strip_position(&what).replace("expected i64", "expected an integer");
        let what =
            crate::decode::plain_types(&what).replace("expected a sequence", "expected a list");
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
    #[serde(deserialize_with = "dims")]
    pub shape: Vec<i64>,
    pub datatype: String,
    pub data: crate::oip_data::TensorData,
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
///
/// `binary_data: false` and `binary_data_output: false` ask for what this endpoint does (JSON), as
/// Triton's client sends them for outputs requested with `binary_data=False`; any other `binary_data*`
/// parameter asks for the binary extension.
fn check_parameters(at: impl FnOnce() -> String, p: Option<&Parameters>) -> Result<(), OipError> {
    let binary = p.and_then(|p| {
        p.iter().find(|(k, v)| {
            k.starts_with("binary_data")
                && !(matches!(k.as_str(), "binary_data" | "binary_data_output")
                    && *v == &Json_::Bool(false))
        })
    });
    if let Some((key, value)) = binary {
        return Err(bad(format!(
            "{}parameters.{key}: {value} asks for the binary tensor extension, which is not supported; send the data as JSON (Triton's client: binary_data=False for each input and output)",
            at()
        )));
    }
    Ok(())
}

#[derive(Serialize)]
struct OutputTensor<'a> {
    name: &'a str,
    datatype: &'static str,
    shape: Vec<usize>,
    data: &'a [f32],
}

/// The shape of `rows` rows of an output with `width` numbers per row that the model declares as
/// `declared` (`[-1, 1, 1]`): the declared dimensions after the batch where they are all fixed and hold
/// `width` numbers (none for a number per row, `[-1]`), else `[rows, width]`.
fn output_shape(declared: &[i64], rows: usize, width: usize) -> Vec<usize> {
    let rest = declared.get(1..).unwrap_or_default();
    let fixed: Option<Vec<usize>> = rest.iter().map(|&d| usize::try_from(d).ok()).collect();
    match fixed {
        Some(dims) if dims.iter().try_fold(1usize, |p, &d| p.checked_mul(d)) == Some(width) => {
            std::iter::once(rows).chain(dims).collect()
        }
        _ => vec![rows, width],
    }
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
/// numbers each. Each element must be a number within float32's range. What `data` was read with before
/// [`crate::oip_data::TensorData`]; kept as the reference its tests compare with.
#[cfg(test)]
fn flatten(v: &Json_, out: &mut Vec<f32>, limit: usize, width: usize) -> Result<(), String> {
    let Json_::Array(items) = v else {
        return Err(format!("expected a list of numbers, found {v}"));
    };
    if items.first().is_some_and(Json_::is_array) {
        for (i, row) in items.iter().enumerate() {
            let Json_::Array(row) = row else {
                return Err(format!("row {i} is not a list"));
            };
            // The row's first element that is no float32, when it is a list: nested too deep.
            let bad = row.iter().position(|x| match x {
                Json_::Number(n) => n
                    .as_f64()
                    .is_none_or(|f| crate::value::to_float32(f).is_err()),
                _ => true,
            });
            if let Some(j) = bad
                && row[j].is_array()
            {
                return Err(format!(
                    "row {i} element {j} is a list: data is a list of numbers, or of rows of numbers, and nests no deeper"
                ));
            }
            if row.len() != width {
                return Err(format!(
                    "row {i} has {} elements; the shape's rows have {width}",
                    row.len()
                ));
            }
            for (j, x) in row.iter().enumerate() {
                number(x, out, limit, Some((i, j)))?;
            }
        }
        return Ok(());
    }
    items.iter().try_for_each(|x| number(x, out, limit, None))
}

/// One element, at `(row, column)` of a list of rows, or at `out.len()` of a flat list.
#[cfg(test)]
fn number(
    v: &Json_,
    out: &mut Vec<f32>,
    limit: usize,
    at: Option<(usize, usize)>,
) -> Result<(), String> {
    let Json_::Number(n) = v else {
        return Err(match at {
            Some((r, c)) => format!("row {r} element {c} is not a number: found {v}"),
            None => format!("element {} is not a number: found {v}", out.len()),
        });
    };
    if out.len() >= limit {
        return Err(format!("more elements than the shape's {limit}"));
    }
    let f = n.as_f64().ok_or("a number out of range")?;
    out.push(crate::value::to_float32(f)?);
    Ok(())
}

/// `POST /v2/models/{model}/infer` on the model's engine.
pub async fn infer(
    gw: &Gateway,
    engine: &Engine,
    body: &[u8],
    started: Instant,
) -> Result<Response, OipError> {
    // V2 traffic counts in the model's stats like predict's: requests, rows, errors and the stages it
    // has (decode, queue, infer, encode).
    let mut laps = Laps::from(started);
    let mut t = Timings::default();
    let result = run_infer(gw, engine, body, started, &mut laps, &mut t).await;
    match result {
        Ok((mut response, rows)) => {
            t.total_us = laps.total();
            engine.stats().record_stages(&t, rows, &Stage::RAW);
            // The protocol's answer has no field for them: the stages it has go in `Server-Timing`.
            if let Ok(v) = axum::http::HeaderValue::from_maybe_shared(crate::encode::into_bytes(
                t.server_timing_of(&Stage::RAW),
            )) {
                response
                    .headers_mut()
                    .insert(crate::encode::SERVER_TIMING, v);
            }
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
    let info = engine.info();
    let width = engine.model().width;
    let max_rows = gw.config.limits.max_candidates;
    // `data` holds no more numbers than the largest shape allowed needs.
    let req = crate::oip_data::with_shape(max_rows.saturating_mul(width), width, || {
        parse_request(body)
    })?;
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
    if let Err(e) = input.data.into_buffer(&mut buf, expected, width) {
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
                shape: output_shape(&info.outputs[i].shape, rows, w),
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::oip_data::{TensorData, with_shape};

    #[test]
    fn an_output_keeps_its_declared_dimensions_after_the_batch() {
        let shape = |declared: &[i64], rows, width| output_shape(declared, rows, width);
        assert_eq!(shape(&[-1, 1], 2, 1), [2, 1]);
        assert_eq!(shape(&[-1, 1, 1], 2, 1), [2, 1, 1]);
        assert_eq!(shape(&[-1, 2, 3], 4, 6), [4, 2, 3]);
        // A dimension only the run knows, or dimensions that do not hold the row: flattened.
        assert_eq!(shape(&[-1, -1], 3, 5), [3, 5]);
        assert_eq!(shape(&[-1, 2, 2], 3, 5), [3, 5]);
        // A number per row has no dimension after the batch.
        assert_eq!(shape(&[-1], 3, 1), [3]);
    }

    /// A random `data` value: usually a list of numbers or of rows near `width`, sometimes with an
    /// element of another kind, a number beyond float32, or not a list at all.
    fn data(rng: &mut fastrand::Rng, width: usize) -> String {
        let scalar = |rng: &mut fastrand::Rng| -> String {
            match rng.usize(0..20) {
                0 => "\"x\"".into(),
                1 => "null".into(),
                2 => "true".into(),
                3 => "{\"a\": [1]}".into(),
                4 => "[1, 2]".into(),
                5 => "1e39".into(),
                6 => "-3.5e38".into(),
                7 => "18446744073709551615".into(),
                8 => "-7".into(),
                // Malformed: the whole request is refused as it was, wherever these come.
                9 if rng.usize(0..4) == 0 => "1e400".into(),
                10 if rng.usize(0..4) == 0 => "\"\\ud800\"".into(),
                11 if rng.usize(0..4) == 0 => format!("{}0{}", "[".repeat(130), "]".repeat(130)),
                _ => format!("{}", rng.i32(-1000..1000) as f64 / 8.0),
            }
        };
        let clean = |rng: &mut fastrand::Rng| format!("{}", rng.i32(-100..100));
        let element = |rng: &mut fastrand::Rng| {
            if rng.usize(0..12) == 0 {
                scalar(rng)
            } else {
                clean(rng)
            }
        };
        match rng.usize(0..10) {
            0 => scalar(rng),
            1..=4 => {
                let n = rng.usize(0..12);
                let v: Vec<String> = (0..n).map(|_| element(rng)).collect();
                format!("[{}]", v.join(", "))
            }
            _ => {
                let rows = rng.usize(0..5);
                let v: Vec<String> = (0..rows)
                    .map(|_| {
                        if rng.usize(0..15) == 0 {
                            return scalar(rng);
                        }
                        let len = if rng.usize(0..6) == 0 {
                            rng.usize(0..width + 2)
                        } else {
                            width
                        };
                        let r: Vec<String> = (0..len).map(|_| element(rng)).collect();
                        format!("[{}]", r.join(", "))
                    })
                    .collect();
                format!("[{}]", v.join(", "))
            }
        }
    }

    /// Read as it streams, `data` gives exactly what the tree of JSON values gave: the same numbers, or
    /// the same message for the first problem, with the limit checked where it was, whatever the cap, as
    /// long as it is at least the limit; and malformed JSON anywhere in it (a number out of range, a
    /// broken escape, nesting too deep), even after a problem, fails the read with the same error.
    #[test]
    fn streamed_data_reads_as_the_json_tree_did() {
        let mut rng = fastrand::Rng::with_seed(0x6f69_7064);
        let (mut problems, mut malformed) = (0, 0);
        for _ in 0..30_000 {
            let width = rng.usize(1..4);
            let text = data(&mut rng, width);
            let limit = rng.usize(0..12);
            let cap = limit + rng.usize(0..3);
            let tree: Json_ = match serde_json::from_str(&text) {
                Ok(tree) => tree,
                Err(e) => {
                    let streamed = with_shape(cap, width, || {
                        serde_json::from_str::<TensorData>(&text).map(|_| ())
                    });
                    assert_eq!(
                        streamed.map_err(|e| e.to_string()),
                        Err(e.to_string()),
                        "{text}"
                    );
                    malformed += 1;
                    continue;
                }
            };
            let mut old = Vec::new();
            let old = flatten(&tree, &mut old, limit, width).map(|()| old);
            let streamed: TensorData =
                with_shape(cap, width, || serde_json::from_str(&text)).expect("reads");
            let mut new = Vec::new();
            let new = streamed.into_buffer(&mut new, limit, width).map(|()| new);
            assert_eq!(new, old, "{text} (limit {limit}, width {width}, cap {cap})");
            problems += usize::from(old.is_err());
        }
        // Both outcomes are common enough for the comparison to mean something.
        assert!(
            (5_000..25_000).contains(&problems),
            "{problems} of 30,000 refused"
        );
        assert!(malformed > 300, "{malformed} malformed of 30,000");
    }

    /// Past the cap numbers are counted, not held, and such a tensor is refused as too long.
    #[test]
    fn numbers_past_the_cap_are_counted_not_held() {
        let text = format!("[{}]", vec!["0"; 100_000].join(","));
        let d: TensorData = with_shape(27, 27, || serde_json::from_str(&text)).expect("reads");
        let mut out = Vec::new();
        assert_eq!(
            d.into_buffer(&mut out, 27, 27),
            Err("more elements than the shape's 27".to_owned())
        );
        assert!(out.is_empty());
        // Within the cap, every number.
        let d: TensorData =
            with_shape(27, 27, || serde_json::from_str("[[1, 2], [3, 4]]")).expect("reads");
        assert_eq!(
            d.into_buffer(&mut out, 27, 27),
            Err("row 0 has 2 elements; the shape's rows have 27".to_owned())
        );
        let d: TensorData =
            with_shape(4, 2, || serde_json::from_str("[[1, 2], [3, 4]]")).expect("reads");
        d.into_buffer(&mut out, 4, 2).expect("fits");
        assert_eq!(out, [1.0, 2.0, 3.0, 4.0]);
    }

    /// Data nested a level too deep is named as such, not as rows of the wrong width.
    #[test]
    fn a_list_inside_a_row_is_named_as_nesting() {
        let read = |text: &str| {
            let d: TensorData = with_shape(4, 2, || serde_json::from_str(text)).expect("reads");
            d.into_buffer(&mut Vec::new(), 4, 2)
        };
        let nested = |row, element| {
            Err(format!(
                "row {row} element {element} is a list: data is a list of numbers, or of rows of numbers, and nests no deeper"
            ))
        };
        assert_eq!(read("[[[1, 2], [3, 4]]]"), nested(0, 0));
        assert_eq!(read("[[1, 2], [3, [4]]]"), nested(1, 1));
        assert_eq!(read("[[1, 2], [3, 4, [5]]]"), nested(1, 2));
        // Wrong widths and other elements are said as before.
        assert_eq!(
            read("[[1, 2], [3]]"),
            Err("row 1 has 1 elements; the shape's rows have 2".to_owned())
        );
        assert_eq!(
            read("[[1, 2], [3, {}]]"),
            Err("row 1 element 1 is not a number: found {}".to_owned())
        );
    }
}
