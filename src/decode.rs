//! Stage `decode`: parses request bodies (JSON or MessagePack, by `Content-Type`) and checks them against the
//! model's binding, producing the keys to hydrate and the typed context.
//!
//! Every mistake a caller can make maps to a 4xx that names the field: a wrong type
//! (`candidates[3].item_id`), a missing entity, an unknown entity or context field, an empty or oversized
//! candidate list, a key that is empty, too long or holds control characters.

use std::borrow::Cow;
use std::collections::HashMap;
use std::fmt::{self, Write as _};

use axum::http::{HeaderMap, header};
use compact_str::{CompactString, ToCompactString as _};
use serde::Deserialize;
use serde::de::{self, DeserializeOwned, Deserializer, Visitor};
use smallvec::{SmallVec, smallvec};

use crate::config::LimitsConfig;
use crate::error::ApiError;
use crate::schema::{Entity, Model, Registry, View};
use crate::value::{Dtype, Value, ValueVisitor, to_float32};

/// A wire format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    Json,
    Msgpack,
}

/// A media type without its parameters (`application/json; charset=utf-8` is `application/json`).
pub(crate) fn media_essence(mime: &str) -> &str {
    mime.split(';').next().unwrap_or("").trim()
}

/// The bytes of header `name` when it is sent exactly once, for the shortcuts of the usual values.
fn sole_value(headers: &HeaderMap, name: header::HeaderName) -> Option<&[u8]> {
    let mut values = headers.get_all(name).iter();
    match (values.next(), values.next()) {
        (Some(v), None) => Some(v.as_bytes()),
        _ => None,
    }
}

impl Format {
    pub fn content_type(self) -> &'static str {
        match self {
            Self::Json => "application/json",
            Self::Msgpack => "application/msgpack",
        }
    }

    /// The format a media type names (parameters such as `charset` aside), if it is one hydrant speaks.
    pub fn parse(mime: &str) -> Option<Self> {
        let essence = media_essence(mime);
        let is = |name: &str| essence.eq_ignore_ascii_case(name);
        if is("application/json") {
            Some(Self::Json)
        } else if is("application/msgpack")
            || is("application/x-msgpack")
            || is("application/vnd.msgpack")
        {
            Some(Self::Msgpack)
        } else {
            None
        }
    }

    /// The request's format from `Content-Type` (absent means JSON).
    pub fn of_request(headers: &HeaderMap) -> Result<Self, ApiError> {
        // The usual case, exactly: one `application/json` and nothing else to check.
        if sole_value(headers, header::CONTENT_TYPE) == Some(b"application/json") {
            return Ok(Self::Json);
        }
        match content_type(headers)? {
            None => Ok(Self::Json),
            Some(s) => {
                let format =
                    Self::parse(s).ok_or_else(|| ApiError::UnsupportedMediaType(s.to_owned()))?;
                utf8_charset(s)?;
                Ok(format)
            }
        }
    }

    /// The answer's format: the supported type `Accept` prefers (highest `q`, then first; `q=0` refuses a
    /// type; `*/*` and `application/*` mean the request's format), else the request's format.
    ///
    /// A type named with `q=0`, or covered only by a wildcard with `q=0`, is never sent; when both are
    /// refused that way the answer is 406. A header that names neither type (`text/html`) gets the
    /// request's format.
    pub fn of_response(headers: &HeaderMap, request: Self) -> Result<Self, ApiError> {
        // The usual cases, exactly: one line of `application/json` (what clients of a JSON API send) or
        // `*/*` (curl's), which the list below reads the same way.
        match sole_value(headers, header::ACCEPT) {
            Some(b"application/json") => Ok(Self::Json),
            Some(b"*/*") => Ok(request),
            _ => Self::of_accept_list(headers, request),
        }
    }

    /// [`of_response`](Self::of_response), by reading the whole `Accept` list.
    fn of_accept_list(headers: &HeaderMap, request: Self) -> Result<Self, ApiError> {
        // Several `Accept` lines are one list, in order (RFC 9110, 5.3).
        let lines = headers.get_all(header::ACCEPT);
        let mut accept = lines.iter().filter_map(|v| v.to_str().ok()).peekable();
        if accept.peek().is_none() {
            return Ok(request);
        }
        // Per format: the q it was named with and where (first wins), and the q of a wildcard.
        let mut named: [Option<(f32, usize)>; 2] = [None, None];
        let mut wildcard: Option<f32> = None;
        for (pos, part) in accept.flat_map(|line| line.split(',')).enumerate() {
            let mut params = part.split(';');
            let media = params.next().unwrap_or("").trim();
            // Parameter names are case-insensitive: `Q=0` refuses as `q=0` does.
            let Some(q) = params
                .find_map(|p| {
                    let p = p.trim();
                    p.get(..2)
                        .filter(|name| name.eq_ignore_ascii_case("q="))
                        .map(|_| &p[2..])
                })
                .map_or(Some(1.0), |q| q.trim().parse::<f32>().ok())
                .filter(|q| (0.0..=1.0).contains(q))
            else {
                continue;
            };
            match Self::parse(media) {
                Some(f) => {
                    let slot = &mut named[f as usize];
                    if slot.is_none_or(|(b, _)| q > b) {
                        *slot = Some((q, slot.map_or(pos, |(_, p)| p)));
                    }
                }
                None if media == "*/*" || media.eq_ignore_ascii_case("application/*") => {
                    wildcard = Some(wildcard.map_or(q, |w: f32| w.max(q)));
                }
                None => {}
            }
        }
        // Named types first in the order named; a wildcard's types after, the request's first.
        let rank = |f: Self| -> Option<(f32, usize)> {
            named[f as usize].or(wildcard.map(|q| (q, usize::MAX - usize::from(f == request))))
        };
        let mut best: Option<(f32, usize, Self)> = None;
        for f in [Self::Json, Self::Msgpack] {
            if let Some((q, order)) = rank(f).filter(|(q, _)| *q > 0.0)
                && best.is_none_or(|(bq, bo, _)| q > bq || (q == bq && order < bo))
            {
                best = Some((q, order, f));
            }
        }
        if let Some((_, _, f)) = best {
            return Ok(f);
        }
        let refused = |f: Self| rank(f).is_some_and(|(q, _)| q == 0.0);
        let other = match request {
            Self::Json => Self::Msgpack,
            Self::Msgpack => Self::Json,
        };
        if !refused(request) {
            Ok(request)
        } else if !refused(other) {
            Ok(other)
        } else {
            let all: Vec<&str> = lines.iter().filter_map(|v| v.to_str().ok()).collect();
            Err(ApiError::NotAcceptable(all.join(", ")))
        }
    }
}

/// Deserializes `body` in `format`, turning any failure into a 400 that names the field.
///
/// The common case decodes directly; only a body that fails is decoded again with path tracking, so the
/// error can name the field without every good request paying for the bookkeeping.
pub fn parse_body<T: DeserializeOwned + Positional>(
    format: Format,
    body: &[u8],
) -> Result<T, ApiError> {
    // A UTF-8 byte order mark (some editors and Windows tools write one) is not part of the JSON.
    let body = match format {
        Format::Json => body.strip_prefix(b"\xef\xbb\xbf").unwrap_or(body),
        Format::Msgpack => body,
    };
    // serde takes a JSON array for a struct, field by field in order: `[{"user_id": "u_1"}]` would be
    // read as `entities` alone. Every JSON body is an object. (MessagePack encoders write structs as
    // arrays by default, so there an array stays a request.)
    match (format, body.iter().find(|b| !b.is_ascii_whitespace())) {
        (Format::Json, Some(b'[')) => {
            return Err(ApiError::Malformed {
                code: "invalid_json",
                message: "the body is a JSON array: expected a JSON object (one request per call)"
                    .to_owned(),
                field: None,
            });
        }
        (Format::Json, Some(&b)) if b != b'{' => {
            return Err(ApiError::Malformed {
                code: "invalid_json",
                message: "the body is not a JSON object: expected `{...}`".to_owned(),
                field: None,
            });
        }
        _ => {}
    }
    // A MessagePack request is a map (or an array, the default encoding of a struct). Anything else,
    // e.g. JSON sent with a MessagePack content type (`{` reads as the integer 123), says so.
    if format == Format::Msgpack
        && let Some(&first) = body.first()
        && !matches!(first, 0x80..=0x9f | 0xdc..=0xdf)
    {
        return Err(ApiError::Malformed {
            code: "invalid_msgpack",
            message: format!(
                "the body is not a MessagePack map or array (it starts with byte 0x{first:02x}{})",
                if first == b'{' {
                    ", as JSON does: is it JSON sent as application/msgpack?"
                } else {
                    ""
                }
            ),
            field: None,
        });
    }
    if format == Format::Msgpack
        && let Some(key) = msgpack_key_not_string(body, T::FIELDS)
    {
        let at = at_field(&key.map);
        return Err(ApiError::Malformed {
            code: "invalid_msgpack",
            message: format!(
                "a MessagePack map key{at} is not a string ({}): field names are strings (serde \
                 would read an integer key as a field's position)",
                key.kind
            ),
            field: (!at.is_empty()).then_some(key.map),
        });
    }
    // Each pass over the body counts the keys it holds from 0 ([`with_key_limit`]).
    KEYS_HELD.with(|h| h.set(0));
    let fast = match format {
        Format::Json => serde_json::from_slice::<T>(body).ok(),
        Format::Msgpack => {
            let mut de = msgpack_reader(body);
            T::deserialize(&mut de)
                .ok()
                .filter(|_| de.position() == body.len() as u64)
        }
    };
    if let Some(v) = fast {
        return Ok(v);
    }
    KEYS_HELD.with(|h| h.set(0));
    parse_body_tracked(format, body)
}

/// [`parse_body`] for a request, holding no more candidates ([`with_candidate_limit`]) or entity keys
/// ([`with_key_limit`]) than `limits` allow: longer lists are counted for their 413, not kept.
pub fn parse_limited<T: DeserializeOwned + Positional>(
    format: Format,
    body: &[u8],
    limits: &LimitsConfig,
) -> Result<T, ApiError> {
    with_candidate_limit(limits.max_candidates, || {
        with_key_limit(limits.max_entities, || parse_body(format, body))
    })
}

/// Deepest nesting of lists and maps a MessagePack body may have: serde_json's limit for JSON, so the
/// two formats take the same bodies (rmp-serde's own, 1024 levels, is deeper than a debug build's
/// stack allows).
const MAX_MSGPACK_DEPTH: usize = 128;

fn msgpack_reader(
    body: &[u8],
) -> rmp_serde::Deserializer<rmp_serde::decode::ReadReader<std::io::Cursor<&[u8]>>> {
    let mut de = rmp_serde::Deserializer::new(std::io::Cursor::new(body));
    de.set_max_depth(MAX_MSGPACK_DEPTH);
    de
}

fn parse_body_tracked<T: DeserializeOwned + Positional>(
    format: Format,
    body: &[u8],
) -> Result<T, ApiError> {
    let malformed = |code, message: String, path: String| ApiError::Malformed {
        code,
        field: named_field(&path, &message)
            .or_else(|| (!path.is_empty() && path != ".").then_some(path))
            // A top-level field named `""`: its path is empty, as the body's own is.
            .or_else(|| message.starts_with("unknown field ``").then(String::new)),
        message,
    };
    match format {
        Format::Json => {
            let mut de = serde_json::Deserializer::from_slice(body);
            let v: T = serde_path_to_error::deserialize(&mut de).map_err(|e| {
                let path = path_text(e.path(), T::FIELDS);
                let inner = e.into_inner();
                if inner.is_syntax() || inner.is_eof() {
                    // Where the parser was (a number beyond float64 in `context.hour_of_day`, a token
                    // that is no JSON value) names the field, when it is inside one.
                    let at = at_field(&path);
                    let path = if at.is_empty() { String::new() } else { path };
                    malformed(
                        "invalid_json",
                        format!("the body is not valid JSON{at}: {inner}"),
                        path,
                    )
                } else {
                    let msg = strip_position(&inner.to_string());
                    malformed("invalid_field", field_message(&path, &msg), path)
                }
            })?;
            de.end().map_err(|e| {
                malformed(
                    "invalid_json",
                    format!("the body is not valid JSON: {e}"),
                    String::new(),
                )
            })?;
            Ok(v)
        }
        Format::Msgpack => {
            // Where the body breaks, in the field it breaks in.
            let broken = |path: String, what: String| {
                let at = at_field(&path);
                malformed(
                    "invalid_msgpack",
                    format!("the body is not valid MessagePack{at}: {what}"),
                    path,
                )
            };
            let mut de = msgpack_reader(body);
            let v: T = serde_path_to_error::deserialize(&mut de).map_err(|e| {
                let path = path_text(e.path(), T::FIELDS);
                let inner = e.into_inner();
                match inner {
                    rmp_serde::decode::Error::Syntax(m)
                    | rmp_serde::decode::Error::Uncategorized(m) => {
                        if let Some(name) = missing_by_position(&m, &path, T::FIELDS) {
                            // As a map without the field is answered, not in the words of a Rust type.
                            return malformed(
                                "invalid_field",
                                field_message(&path, &format!("missing field `{name}`")),
                                path,
                            );
                        }
                        // In MessagePack's words rather than serde's.
                        let m = m
                            .replace("unit value", "nil (null)")
                            .replace("newtype struct", "an extension value")
                            .replace("struct Options", "a map of options");
                        // A row's time is not a feature value: say what it takes instead (a
                        // MessagePack timestamp, the usual way to send a time, arrives as an extension).
                        let m = match m.split_once(", expected") {
                            Some((head, _)) if path.ends_with(".event_timestamp") => format!(
                                "{head}, expected an RFC 3339 time (a string) or whole milliseconds since the Unix epoch; a MessagePack timestamp extension is not read"
                            ),
                            _ => m,
                        };
                        malformed("invalid_field", field_message(&path, &m), path)
                    }
                    // 0xc1 is no value at all: the body is broken there, not a value of the wrong type.
                    rmp_serde::decode::Error::TypeMismatch(rmp::Marker::Reserved) => broken(
                        path,
                        "the reserved byte 0xc1 stands where a value should".to_owned(),
                    ),
                    // A well-formed value of the wrong type where a number or boolean was read.
                    rmp_serde::decode::Error::TypeMismatch(marker) => malformed(
                        "invalid_field",
                        field_message(&path, &format!("invalid type: {}", marker_kind(marker))),
                        path,
                    ),
                    // An object written as an array (as encoders write structs) with more values than
                    // it has fields (`n` is the number it read).
                    rmp_serde::decode::Error::LengthMismatch(n) if path == "." => malformed(
                        "invalid_field",
                        format!(
                            "the body is an array of more values than the {n} fields of the request (write the request as a map to see which)"
                        ),
                        path,
                    ),
                    rmp_serde::decode::Error::LengthMismatch(n) => malformed(
                        "invalid_field",
                        field_message(
                            &path,
                            &format!(
                                "more values than the {n} fields it takes (write it as a map to see which)"
                            ),
                        ),
                        path,
                    ),
                    rmp_serde::decode::Error::Utf8Error(e) => {
                        broken(path, format!("a string that is not UTF-8 ({e})"))
                    }
                    // Named by the field the nesting is in, not by the hundred indexes into it.
                    rmp_serde::decode::Error::DepthLimitExceeded => broken(
                        without_trailing_indexes(&path).to_owned(),
                        format!("lists or maps nested more than {MAX_MSGPACK_DEPTH} levels deep"),
                    ),
                    // Reading from memory fails only at the end of the body: a value cut short, or
                    // a string, array or map length that promises more than follows.
                    rmp_serde::decode::Error::InvalidMarkerRead(_)
                    | rmp_serde::decode::Error::InvalidDataRead(_) => broken(
                        path,
                        format!(
                            "it ends (at byte {}) in the middle of a value: cut short, or a length that promises more than follows",
                            body.len()
                        ),
                    ),
                    other => malformed(
                        "invalid_msgpack",
                        format!("the body is not valid MessagePack: {other}"),
                        String::new(),
                    ),
                }
            })?;
            let extra = (body.len() as u64).saturating_sub(de.position());
            if extra > 0 {
                return Err(malformed(
                    "invalid_msgpack",
                    format!(
                        "the body is not valid MessagePack: {extra} bytes after the end of the request"
                    ),
                    String::new(),
                ));
            }
            Ok(v)
        }
    }
}

/// `context.hour_of_day` for `context.hour_of_day[0][0][0]`.
fn without_trailing_indexes(path: &str) -> &str {
    let mut p = path;
    while p.ends_with(']')
        && let Some(open) = p.rfind('[')
    {
        p = &p[..open];
    }
    p
}

/// ` in FIELD` for a message about where the body broke, or nothing at the top.
fn at_field(path: &str) -> String {
    if path.is_empty() || path == "." {
        String::new()
    } else {
        format!(" in {path}")
    }
}

/// A MessagePack map key that is not a string: the path of the map holding it (empty at the top), in
/// the terms of [`path_text`], and what the key is.
#[derive(Debug, PartialEq)]
struct KeyNotString {
    map: String,
    kind: &'static str,
}

/// A container open in [`msgpack_key_not_string`]'s pass: its length in items (a map's counts keys and
/// values), the items still to read, whether it is a map (keys at even counts), and where its latest
/// key's bytes lie.
#[derive(Clone, Copy)]
struct Open {
    len: u64,
    left: u64,
    map: bool,
    key: (usize, usize),
}

impl Open {
    fn new(len: u64, map: bool) -> Self {
        Open {
            len,
            left: len,
            map,
            key: (0, 0),
        }
    }
}

/// The first map key in the MessagePack `body` that is not a string, if any. One pass over the bytes,
/// no allocation for bodies nested up to 8 deep unless a key is found. A body that ends early, or nests
/// deeper than any request does, is left for the decoder to report.
fn msgpack_key_not_string(
    b: &[u8],
    fields: &'static [(&'static str, &'static [&'static str])],
) -> Option<KeyNotString> {
    const MAX_DEPTH: usize = 64;
    let mut open: SmallVec<[Open; 8]> = smallvec![Open::new(1, false)];
    let mut i = 0usize;
    while let Some(top) = open.last_mut() {
        if top.left == 0 {
            open.pop();
            continue;
        }
        let is_key = top.map && top.left % 2 == 0;
        top.left -= 1;
        // A body that ends here is left for the decoder.
        let &m = b.get(i)?;
        i += 1;
        if is_key && !matches!(m, 0xa0..=0xbf | 0xd9..=0xdb) {
            return Some(KeyNotString {
                map: msgpack_map_path(b, &open, fields),
                kind: marker_kind(rmp::Marker::from_u8(m)),
            });
        }
        // A big-endian length of `n` bytes at `i`.
        let len = |i: usize, n: usize| {
            b.get(i..i + n)
                .map(|s| s.iter().fold(0u64, |a, &x| a << 8 | u64::from(x)))
        };
        let (header, payload, container) = match m {
            0x80..=0x8f => (0, 0, Some((u64::from(m & 0x0f) * 2, true))),
            0x90..=0x9f => (0, 0, Some((u64::from(m & 0x0f), false))),
            0xa0..=0xbf => (0, u64::from(m & 0x1f), None),
            0xc4 | 0xd9 => (1, len(i, 1).unwrap_or(0), None),
            0xc5 | 0xda => (2, len(i, 2).unwrap_or(0), None),
            0xc6 | 0xdb => (4, len(i, 4).unwrap_or(0), None),
            0xc7 => (1, len(i, 1).unwrap_or(0) + 1, None),
            0xc8 => (2, len(i, 2).unwrap_or(0) + 1, None),
            0xc9 => (4, len(i, 4).unwrap_or(0) + 1, None),
            0xcc | 0xd0 => (0, 1, None),
            0xcd | 0xd1 | 0xd4 => (0, 2, None),
            0xd5 => (0, 3, None),
            0xca | 0xce | 0xd2 => (0, 4, None),
            0xd6 => (0, 5, None),
            0xcb | 0xcf | 0xd3 => (0, 8, None),
            0xd7 => (0, 9, None),
            0xd8 => (0, 17, None),
            0xdc => (2, 0, Some((len(i, 2).unwrap_or(0), false))),
            0xdd => (4, 0, Some((len(i, 4).unwrap_or(0), false))),
            0xde => (2, 0, Some((len(i, 2).unwrap_or(0) * 2, true))),
            0xdf => (4, 0, Some((len(i, 4).unwrap_or(0) * 2, true))),
            // Integers, nil, booleans, and the never-used 0xc1 (the decoder refuses it).
            _ => (0, 0, None),
        };
        let payload = usize::try_from(payload).unwrap_or(usize::MAX);
        let start = i.saturating_add(header);
        if is_key && let Some(top) = open.last_mut() {
            top.key = (start, payload);
        }
        i = start.saturating_add(payload);
        if let Some((n, map)) = container {
            if open.len() == MAX_DEPTH {
                return None;
            }
            open.push(Open::new(n, map));
        }
    }
    None
}

/// The path of the innermost container in `open` (the stack of [`msgpack_key_not_string`], its first
/// entry the body itself): each map is entered at its latest key, each array at the item being read;
/// at the top an array is a request written by position, its items named by `fields`.
fn msgpack_map_path(
    b: &[u8],
    open: &[Open],
    fields: &'static [(&'static str, &'static [&'static str])],
) -> String {
    // The containers that lead to the last one: the body's own (index 1) down.
    let leading = open
        .get(1..open.len().saturating_sub(1))
        .unwrap_or_default();
    let steps = leading.iter().map(|o| {
        if o.map {
            let (start, n) = o.key;
            let key = b.get(start..start.saturating_add(n)).unwrap_or_default();
            Step::Key(String::from_utf8_lossy(key))
        } else {
            // The item being read: `left` counts the ones after it.
            let index = o.len.saturating_sub(o.left).saturating_sub(1);
            Step::Index(usize::try_from(index).unwrap_or(usize::MAX))
        }
    });
    field_path(steps, fields)
}

/// The field a "missing field `x`" or "duplicate field `x`" error is about, under `path`: serde names
/// it only in the message, since the error is raised by the object that lacks or repeats it.
fn named_field(path: &str, message: &str) -> Option<String> {
    // serde's own words, and [`given_twice`]'s (whose error is raised at the map holding the name).
    let name = ["missing field `", "duplicate field `"]
        .iter()
        .find_map(|p| message.split_once(p))
        .and_then(|(_, rest)| rest.split('`').next())
        .or_else(|| {
            message
                .split_once("` is given twice")
                .and_then(|(before, _)| before.rsplit_once('`'))
                .map(|(_, name)| name)
        })?;
    Some(if path.is_empty() || path == "." {
        name.to_owned()
    } else {
        format!("{path}.{name}")
    })
}

/// The field that a request (or a field of it) written by position lacks, from serde's words for an array
/// with fewer values than the fields it needs (`invalid length 1, expected struct FeaturesRequest with 3
/// elements`: the value at index 1 is missing). `path` is where the array is: `.` at the top.
fn missing_by_position(
    message: &str,
    path: &str,
    fields: &'static [(&'static str, &'static [&'static str])],
) -> Option<&'static str> {
    let (n, _) = message
        .strip_prefix("invalid length ")?
        .split_once(", expected struct ")?;
    let n: usize = n.parse().ok()?;
    if path == "." {
        fields.get(n).map(|(name, _)| *name)
    } else {
        let (_, inner) = fields.iter().find(|(name, _)| *name == path)?;
        inner.get(n).copied()
    }
}

/// A request type's field names by position. MessagePack encoders write a struct as an array of its
/// fields by default (rmp-serde does), and an error there should name `options.deadline_ms`, not
/// `[3][2]`.
pub trait Positional {
    /// The top-level fields in order, each with its own fields in order when it is a struct.
    const FIELDS: &'static [(&'static str, &'static [&'static str])];
}

const OPTION_FIELDS: &[&str] = &["return_features", "timings", "deadline_ms"];

impl Positional for PredictRequest {
    const FIELDS: &'static [(&'static str, &'static [&'static str])] = &[
        ("entities", &[]),
        ("context", &[]),
        ("candidates", &[]),
        ("options", OPTION_FIELDS),
    ];
}

impl Positional for FeaturesRequest {
    const FIELDS: &'static [(&'static str, &'static [&'static str])] = &[
        ("entities", &[]),
        ("features", &[]),
        ("options", OPTION_FIELDS),
    ];
}

/// A field path as the error names it, `[i]` of a struct read by position replaced by the field's name.
/// It ends at a map key that could not be read (`?`): the field is that key's map. With no `fields`
/// it reads as `serde_path_to_error` prints a path.
pub(crate) fn path_text(
    path: &serde_path_to_error::Path,
    fields: &'static [(&'static str, &'static [&'static str])],
) -> String {
    use serde_path_to_error::Segment;
    let steps = path.iter().map_while(|segment| match segment {
        Segment::Seq { index } => Some(Step::Index(*index)),
        Segment::Map { key } | Segment::Enum { variant: key } => {
            Some(Step::Key(Cow::Borrowed(key.as_str())))
        }
        // A map key that could not be read (not UTF-8, say) has no name: the field is its map.
        Segment::Unknown => None,
    });
    let out = field_path(steps, fields);
    if out.is_empty() { ".".to_owned() } else { out }
}

/// One step down a field path: into a map at a key, or into an array at an index.
enum Step<'a> {
    Key(Cow<'a, str>),
    Index(usize),
}

/// A field path as errors name it (`candidates[1].item_id`), from its steps; empty for none. At the top
/// an index is a request written by position, named by `fields`, and an index into a field written by
/// position is named by that field's own fields.
fn field_path<'a>(
    steps: impl Iterator<Item = Step<'a>>,
    fields: &'static [(&'static str, &'static [&'static str])],
) -> String {
    let mut out = String::new();
    let mut inner: &'static [&'static str] = &[];
    for (depth, step) in steps.enumerate() {
        let name = match step {
            Step::Key(key) => {
                if depth == 0 {
                    inner = fields.iter().find(|(n, _)| *n == key).map_or(&[], |f| f.1);
                }
                key
            }
            Step::Index(index) => {
                let named = match depth {
                    0 => fields.get(index).map(|&(name, sub)| {
                        inner = sub;
                        name
                    }),
                    1 => inner.get(index).copied(),
                    _ => None,
                };
                let Some(name) = named else {
                    let _ = write!(out, "[{index}]");
                    continue;
                };
                Cow::Borrowed(name)
            }
        };
        if !out.is_empty() {
            out.push('.');
        }
        out.push_str(&name);
    }
    out
}

/// What a MessagePack value is, by its first byte, for "invalid type" messages.
fn marker_kind(m: rmp::Marker) -> &'static str {
    use rmp::Marker as M;
    match m {
        M::Null => "nil (null)",
        M::True | M::False => "a boolean",
        M::FixPos(_)
        | M::FixNeg(_)
        | M::U8
        | M::U16
        | M::U32
        | M::U64
        | M::I8
        | M::I16
        | M::I32
        | M::I64 => "an integer",
        M::F32 | M::F64 => "a float",
        M::FixStr(_) | M::Str8 | M::Str16 | M::Str32 => "a string",
        M::Bin8 | M::Bin16 | M::Bin32 => "binary data",
        M::FixArray(_) | M::Array16 | M::Array32 => "an array",
        M::FixMap(_) | M::Map16 | M::Map32 => "a map",
        M::FixExt1
        | M::FixExt2
        | M::FixExt4
        | M::FixExt8
        | M::FixExt16
        | M::Ext8
        | M::Ext16
        | M::Ext32 => "an extension value",
        M::Reserved => "a reserved byte (0xc1)",
    }
}

pub(crate) fn strip_position(m: &str) -> String {
    match m.rfind(" at line ") {
        Some(i) => m[..i].to_owned(),
        None => m.to_owned(),
    }
}

/// serde's words for a number of the wrong kind name the Rust type it was read into (`invalid value:
/// integer `-2`, expected usize`), and a field's name a "field identifier": those become words a person
/// writing a file or a variable can act on.
pub fn plain_types(m: &str) -> String {
    const PLAIN: [(&str, &str); 12] = [
        ("usize", "a whole number, 0 or more"),
        ("u64", "a whole number, 0 or more"),
        ("u32", "a whole number from 0 to 4294967295"),
        ("u16", "a whole number from 0 to 65535"),
        ("u8", "a whole number from 0 to 255"),
        ("isize", "a whole number"),
        ("i64", "a whole number"),
        ("i32", "a whole number from -2147483648 to 2147483647"),
        ("i16", "a whole number from -32768 to 32767"),
        ("i8", "a whole number from -128 to 127"),
        ("f64", "a number"),
        ("f32", "a number"),
    ];
    let mut out = String::with_capacity(m.len() + 16);
    let mut rest = m;
    while let Some(i) = rest.find("expected ") {
        let after = i + "expected ".len();
        out.push_str(&rest[..after]);
        rest = &rest[after..];
        let word_end = rest
            .find(|c: char| !c.is_ascii_alphanumeric() && c != '_')
            .unwrap_or(rest.len());
        if let Some((_, plain)) = PLAIN.iter().find(|(t, _)| *t == &rest[..word_end]) {
            out.push_str(plain);
            rest = &rest[word_end..];
        }
    }
    out.push_str(rest);
    // serde's word for the name of a struct's field, which a map key that is no text fails to be.
    out.replace("expected field identifier", "expected a field name")
}

fn field_message(path: &str, msg: &str) -> String {
    if path.is_empty() || path == "." {
        msg.to_owned()
    } else {
        format!("{path}: {msg}")
    }
}

/// An entity key as sent: a string or an integer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EntityKey {
    /// Kept inline up to 24 bytes, as most keys are: no allocation per key sent.
    Str(CompactString),
    Int(i64),
}

impl<'de> Deserialize<'de> for EntityKey {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = EntityKey;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an entity key (a string, or an integer for an int64 entity)")
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<EntityKey, E> {
                Ok(EntityKey::Str(CompactString::from(s)))
            }
            fn visit_i64<E: de::Error>(self, i: i64) -> Result<EntityKey, E> {
                Ok(EntityKey::Int(i))
            }
            fn visit_u64<E: de::Error>(self, u: u64) -> Result<EntityKey, E> {
                i64::try_from(u)
                    .map(EntityKey::Int)
                    .map_err(|_| E::custom(KEY_OUT_OF_RANGE))
            }
            fn visit_f64<E: de::Error>(self, f: f64) -> Result<EntityKey, E> {
                whole_key(f).map(EntityKey::Int).map_err(E::custom)
            }
        }
        d.deserialize_any(V)
    }
}

/// A key past int64, sent as an integer or as a float: the same words on every route.
pub const KEY_OUT_OF_RANGE: &str =
    "entity key out of int64 range (write it as a string if the entity's keys are strings)";

/// An integer key written as a float (`1e3`, or `1000.0` from an encoder that writes every number as
/// a double), taken as the integer while float64 holds it exactly, as an int64 context value is.
pub fn whole_key(f: f64) -> Result<i64, String> {
    use crate::value::FloatAsInt;
    match crate::value::float_as_int(f) {
        FloatAsInt::Exact(i) => Ok(i),
        FloatAsInt::OutOfRange => Err(KEY_OUT_OF_RANGE.to_owned()),
        FloatAsInt::LowerBound => Err("entity key out of int64 range, or -9223372036854775808 written as a float (past 2^53 a float cannot tell neighbouring integers apart): write it as an integer, or as a string if the entity's keys are strings".to_owned()),
        FloatAsInt::Inexact => Err(format!(
            "expected an entity key (a string, or an integer for an int64 entity), got {f:?} written as a float: past 2^53 a float cannot tell neighbouring integers apart, so write it as an integer"
        )),
        FloatAsInt::NotWhole => Err(format!(
            "expected an entity key (a string, or an integer for an int64 entity), got {f:?}, which is not a whole number"
        )),
    }
}

/// One key or a list of keys (`/v1/features`).
#[derive(Debug, Clone)]
pub struct EntityKeys {
    /// The keys held: all that were sent, unless the body's lists went past the key limit its reader
    /// was given ([`with_key_limit`]).
    pub keys: Vec<EntityKey>,
    /// Sent as one key rather than a list: an error about it names the field, not an index.
    pub scalar: bool,
    /// How many keys were sent, held or not.
    pub sent: usize,
}

impl EntityKeys {
    fn one(key: EntityKey) -> Self {
        // A single key is held whatever the limit (it is read already), and counted towards it.
        held_keys(1);
        Self {
            keys: vec![key],
            scalar: true,
            sent: 1,
        }
    }
}

thread_local! {
    /// Most keys the entity-key lists of the body being read on this thread hold in all; see
    /// [`with_key_limit`].
    static KEY_LIMIT: std::cell::Cell<usize> = const { std::cell::Cell::new(usize::MAX) };
    /// Keys held so far by the pass over the body now being read (each pass of [`parse_body`] starts
    /// again from 0).
    static KEYS_HELD: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// Runs `read` (a synchronous parse of a body with entity-key lists: `/v1/features`,
/// `/get-online-features`, `/v1/prefetch`) holding at most `limit` keys in all: past it keys are read,
/// checked and counted, not kept, so [`check_key_count`] refuses them with their true number. A key is
/// 24 bytes or more in memory and `"a",` four in the body.
pub fn with_key_limit<R>(limit: usize, read: impl FnOnce() -> R) -> R {
    KEYS_HELD.with(|h| h.set(0));
    scoped(&KEY_LIMIT, limit, read)
}

/// Counts `n` more keys held by the pass now reading.
fn held_keys(n: usize) {
    KEYS_HELD.with(|h| h.set(h.get().saturating_add(n)));
}

/// Runs `read` with `cell` set to `value`, then puts its old value back (also when `read` panics): a
/// reader's limit, set for one synchronous parse.
pub(crate) fn scoped<T: Copy + 'static, R>(
    cell: &'static std::thread::LocalKey<std::cell::Cell<T>>,
    value: T,
    read: impl FnOnce() -> R,
) -> R {
    struct Restore<T: Copy + 'static>(&'static std::thread::LocalKey<std::cell::Cell<T>>, T);
    impl<T: Copy + 'static> Drop for Restore<T> {
        fn drop(&mut self) {
            self.0.with(|c| c.set(self.1));
        }
    }
    let _restore = Restore(cell, cell.with(|c| c.replace(value)));
    read()
}

impl<'de> Deserialize<'de> for EntityKeys {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = EntityKeys;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an entity key or a list of entity keys")
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<EntityKeys, E> {
                Ok(EntityKeys::one(EntityKey::Str(CompactString::from(s))))
            }
            fn visit_i64<E: de::Error>(self, i: i64) -> Result<EntityKeys, E> {
                Ok(EntityKeys::one(EntityKey::Int(i)))
            }
            fn visit_u64<E: de::Error>(self, u: u64) -> Result<EntityKeys, E> {
                EntityKey::deserialize(de::value::U64Deserializer::new(u)).map(EntityKeys::one)
            }
            fn visit_f64<E: de::Error>(self, f: f64) -> Result<EntityKeys, E> {
                whole_key(f)
                    .map(|i| EntityKeys::one(EntityKey::Int(i)))
                    .map_err(E::custom)
            }
            fn visit_seq<A: de::SeqAccess<'de>>(self, seq: A) -> Result<EntityKeys, A::Error> {
                // The room the body's earlier keys left under the limit.
                let room = KEY_LIMIT
                    .with(std::cell::Cell::get)
                    .saturating_sub(KEYS_HELD.with(std::cell::Cell::get));
                let (keys, sent) = read_capped(seq, room)?;
                held_keys(keys.len());
                Ok(EntityKeys {
                    keys,
                    scalar: false,
                    sent,
                })
            }
        }
        d.deserialize_any(V)
    }
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Options {
    #[serde(default, deserialize_with = "flag_off")]
    pub return_features: bool,
    #[serde(default = "yes", deserialize_with = "flag_on")]
    pub timings: bool,
    /// At least 1: a deadline of 0 could only ever be missed.
    #[serde(default, deserialize_with = "positive_ms")]
    pub deadline_ms: Option<u64>,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            return_features: false,
            timings: true,
            deadline_ms: None,
        }
    }
}

fn yes() -> bool {
    true
}

/// An optional field sent as `null` reads as not sent, as most encoders write an unset optional.
fn null_default<'de, D: Deserializer<'de>, T: Deserialize<'de> + Default>(
    d: D,
) -> Result<T, D::Error> {
    Ok(Option::<T>::deserialize(d)?.unwrap_or_default())
}

/// A boolean option, `null` reading as `default`. Read through `deserialize_any`: MessagePack's
/// `deserialize_bool` answers a string with a decoding error ("wrong msgpack marker") that names no field.
fn flag<'de, D: Deserializer<'de>>(d: D, default: bool) -> Result<bool, D::Error> {
    struct Flag(bool);
    impl<'de> Visitor<'de> for Flag {
        type Value = bool;
        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("a boolean")
        }
        fn visit_bool<E: de::Error>(self, v: bool) -> Result<bool, E> {
            Ok(v)
        }
        // What JSON's `null` and MessagePack's nil read as through `deserialize_any`.
        fn visit_unit<E: de::Error>(self) -> Result<bool, E> {
            Ok(self.0)
        }
    }
    d.deserialize_any(Flag(default))
}

pub(crate) fn flag_off<'de, D: Deserializer<'de>>(d: D) -> Result<bool, D::Error> {
    flag(d, false)
}

fn flag_on<'de, D: Deserializer<'de>>(d: D) -> Result<bool, D::Error> {
    flag(d, true)
}

/// A whole number of milliseconds, at least 1 (a deadline of 0 could only ever be missed). `25.0` is
/// taken as 25, as an integer context field takes it: JavaScript and some encoders write every number
/// as a float. `null` is no deadline. A deadline past `limits.request_timeout` is cut to it later.
fn positive_ms<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    struct Ms;
    impl<'de> Visitor<'de> for Ms {
        type Value = Option<u64>;
        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("a whole number of milliseconds, at least 1")
        }
        // `null` (nil): no deadline.
        fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
            Ok(None)
        }
        fn visit_u64<E: de::Error>(self, ms: u64) -> Result<Self::Value, E> {
            if ms == 0 {
                Err(E::custom(
                    "expected a deadline of at least 1 millisecond, got 0",
                ))
            } else {
                Ok(Some(ms))
            }
        }
        fn visit_i64<E: de::Error>(self, ms: i64) -> Result<Self::Value, E> {
            match u64::try_from(ms) {
                Ok(ms) => self.visit_u64(ms),
                Err(_) => Err(E::custom(format_args!(
                    "expected a deadline of at least 1 millisecond, got {ms}"
                ))),
            }
        }
        fn visit_f64<E: de::Error>(self, ms: f64) -> Result<Self::Value, E> {
            // A huge one saturates, as a huge integer is taken: either is cut to the request timeout.
            if ms.is_finite() && ms.fract() == 0.0 && ms >= 0.0 {
                self.visit_u64(ms as u64)
            } else {
                Err(E::custom(format_args!(
                    "expected a whole number of milliseconds, at least 1, got {ms:?}"
                )))
            }
        }
    }
    d.deserialize_any(Ms)
}

/// The error for a field name sent twice in one object: every request and row refuses that rather
/// than letting the last one win.
pub fn given_twice<E: de::Error>(name: &str) -> E {
    E::custom(format_args!("`{name}` is given twice"))
}

/// A map whose names must differ: a name given twice is an error, not last-wins.
pub fn unique_names<'de, D: Deserializer<'de>, V: Deserialize<'de>>(
    d: D,
) -> Result<HashMap<String, V>, D::Error> {
    struct Unique<V>(std::marker::PhantomData<V>);
    impl<'de, V: Deserialize<'de>> Visitor<'de> for Unique<V> {
        type Value = HashMap<String, V>;
        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("an object")
        }
        fn visit_map<A: de::MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
            let mut out = HashMap::with_capacity(map.size_hint().unwrap_or(0).min(64));
            while let Some(name) = map.next_key::<String>()? {
                if out.contains_key(&name) {
                    return Err(given_twice(&name));
                }
                let v = map.next_value()?;
                out.insert(name, v);
            }
            Ok(out)
        }
    }
    d.deserialize_map(Unique(std::marker::PhantomData))
}

/// `options` as an object in JSON. serde would also fill the struct from an array, field by field
/// (`[true]` setting `return_features`); MessagePack encoders write structs as arrays by default, so
/// there both forms are read.
fn options_object<'de, D: Deserializer<'de>>(d: D) -> Result<Options, D::Error> {
    struct ObjectOnly;
    impl<'de> Visitor<'de> for ObjectOnly {
        type Value = Options;
        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("an object")
        }
        fn visit_map<A: de::MapAccess<'de>>(self, map: A) -> Result<Options, A::Error> {
            Options::deserialize(de::value::MapAccessDeserializer::new(map))
        }
    }
    struct Field(Options);
    impl<'de> Deserialize<'de> for Field {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            if d.is_human_readable() {
                d.deserialize_map(ObjectOnly).map(Field)
            } else {
                Options::deserialize(d).map(Field)
            }
        }
    }
    // `"options": null` is no options.
    Ok(Option::<Field>::deserialize(d)?.map_or_else(Options::default, |f| f.0))
}

/// A context value as sent: a feature value, or the shape of one that no feature type takes (an object, a
/// list holding something other than numbers). That shape is kept rather than refused while decoding, so
/// the error can be put in the field's terms: `["ios"]` for a string field is "expected string, got a
/// list", not a complaint that lists hold numbers.
#[derive(Debug, Clone, PartialEq)]
pub enum ContextValue {
    Value(Value),
    /// Boxed: rare, and the request's fields stay small inline.
    Unfit(Box<Unfit>),
}

/// A context value's shape that no feature type takes.
#[derive(Debug, Clone, PartialEq)]
pub struct Unfit {
    /// `a list`, `an object`, or a number that is not finite.
    what: &'static str,
    /// For a list: the first element that is not a float32 number, and what it is.
    element: Option<(usize, &'static str)>,
}

impl ContextValue {
    /// The value as `dtype`, or why it is not one.
    fn typed(self, dtype: Dtype) -> Result<Value, String> {
        match self {
            Self::Value(v) => dtype.coerce(v),
            Self::Unfit(u) => match (u.element, dtype) {
                (Some((i, kind)), Dtype::Float32List(_)) => Err(format!(
                    "expected {dtype}, got {} whose element {i} is {kind}",
                    u.what
                )),
                _ => Err(format!("expected {dtype}, got {}", u.what)),
            },
        }
    }
}

impl<'de> Deserialize<'de> for ContextValue {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        /// A list element: a number, or the kind of what was sent instead.
        enum Element {
            Number(f64),
            Other(&'static str),
        }
        impl<'de> Deserialize<'de> for Element {
            fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                struct E;
                impl<'de> Visitor<'de> for E {
                    type Value = Element;
                    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                        f.write_str("a number")
                    }
                    fn visit_i64<X: de::Error>(self, i: i64) -> Result<Element, X> {
                        Ok(Element::Number(i as f64))
                    }
                    fn visit_u64<X: de::Error>(self, u: u64) -> Result<Element, X> {
                        Ok(Element::Number(u as f64))
                    }
                    fn visit_f64<X: de::Error>(self, f: f64) -> Result<Element, X> {
                        Ok(Element::Number(f))
                    }
                    fn visit_bool<X: de::Error>(self, _: bool) -> Result<Element, X> {
                        Ok(Element::Other("a boolean"))
                    }
                    fn visit_str<X: de::Error>(self, _: &str) -> Result<Element, X> {
                        Ok(Element::Other("a string"))
                    }
                    fn visit_bytes<X: de::Error>(self, _: &[u8]) -> Result<Element, X> {
                        Ok(Element::Other("binary"))
                    }
                    fn visit_unit<X: de::Error>(self) -> Result<Element, X> {
                        Ok(Element::Other("null"))
                    }
                    fn visit_none<X: de::Error>(self) -> Result<Element, X> {
                        Ok(Element::Other("null"))
                    }
                    fn visit_seq<A: de::SeqAccess<'de>>(self, seq: A) -> Result<Element, A::Error> {
                        de::IgnoredAny.visit_seq(seq)?;
                        Ok(Element::Other("a list"))
                    }
                    fn visit_map<A: de::MapAccess<'de>>(self, map: A) -> Result<Element, A::Error> {
                        de::IgnoredAny.visit_map(map)?;
                        Ok(Element::Other("an object"))
                    }
                }
                d.deserialize_any(E)
            }
        }

        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = ContextValue;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("null, a boolean, a number, a string or a list of numbers")
            }
            // Scalars read as a stored value's do; only lists, objects and integers past int64 differ.
            fn visit_unit<E: de::Error>(self) -> Result<ContextValue, E> {
                ValueVisitor.visit_unit().map(ContextValue::Value)
            }
            fn visit_none<E: de::Error>(self) -> Result<ContextValue, E> {
                ValueVisitor.visit_none().map(ContextValue::Value)
            }
            fn visit_bool<E: de::Error>(self, b: bool) -> Result<ContextValue, E> {
                ValueVisitor.visit_bool(b).map(ContextValue::Value)
            }
            fn visit_i64<E: de::Error>(self, i: i64) -> Result<ContextValue, E> {
                ValueVisitor.visit_i64(i).map(ContextValue::Value)
            }
            fn visit_u64<E: de::Error>(self, u: u64) -> Result<ContextValue, E> {
                // Past int64 it is a number still: a float field takes it, an int64 field says it is
                // out of range.
                Ok(ContextValue::Value(
                    i64::try_from(u).map_or(Value::Float(u as f64), Value::Int),
                ))
            }
            fn visit_f64<E: de::Error>(self, f: f64) -> Result<ContextValue, E> {
                if !f.is_finite() {
                    // (MessagePack carries NaN and infinity; JSON cannot.) Kept, to be refused in the
                    // field's terms: for a string field, "expected string", not "expected a finite number".
                    return Ok(ContextValue::Unfit(Box::new(Unfit {
                        what: if f.is_nan() {
                            "NaN"
                        } else {
                            "an infinite number"
                        },
                        element: None,
                    })));
                }
                ValueVisitor.visit_f64(f).map(ContextValue::Value)
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<ContextValue, E> {
                ValueVisitor.visit_str(s).map(ContextValue::Value)
            }
            fn visit_bytes<E: de::Error>(self, _: &[u8]) -> Result<ContextValue, E> {
                // (MessagePack only: Python's `bytes` are packed as bin.) Refused in the field's terms.
                Ok(ContextValue::Unfit(Box::new(Unfit {
                    what: "binary data (MessagePack bin; text is sent as str)",
                    element: None,
                })))
            }
            fn visit_seq<A: de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> Result<ContextValue, A::Error> {
                // A declared length (MessagePack) is a claim: room for a modest list, grown as it arrives.
                let mut out = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(1024));
                while let Some(e) = seq.next_element::<Element>()? {
                    let kind = match e {
                        Element::Number(x) => match to_float32(x) {
                            Ok(f) => {
                                out.push(f);
                                continue;
                            }
                            Err(_) if x.is_nan() => "NaN",
                            Err(_) if x.is_infinite() => "an infinite number",
                            Err(_) => "a number outside the float32 range",
                        },
                        Element::Other(kind) => kind,
                    };
                    let i = out.len();
                    de::IgnoredAny.visit_seq(seq)?;
                    return Ok(ContextValue::Unfit(Box::new(Unfit {
                        what: "a list",
                        element: Some((i, kind)),
                    })));
                }
                Ok(ContextValue::Value(Value::List(out.into_boxed_slice())))
            }
            fn visit_map<A: de::MapAccess<'de>>(self, map: A) -> Result<ContextValue, A::Error> {
                de::IgnoredAny.visit_map(map)?;
                Ok(ContextValue::Unfit(Box::new(Unfit {
                    what: "an object",
                    element: None,
                })))
            }
        }
        d.deserialize_any(V)
    }
}

/// The 400 for `entities.{name}` naming no registered entity, listing those that are.
pub fn unregistered_entity(registry: &Registry, name: &str) -> ApiError {
    let known = crate::schema::known_names(registry.entities.keys().map(String::as_str));
    ApiError::invalid(
        "unknown_entity",
        format!("entities.{name}"),
        format!("entities.{name}: no entity `{name}` is registered (entities: {known})"),
    )
}

/// `POST /v1/models/{model}/predict`.
#[derive(Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PredictRequest {
    /// `null` reads as not sent, here and in every optional field below.
    #[serde(default, deserialize_with = "null_default")]
    pub entities: Fields<EntityKey>,
    #[serde(default, deserialize_with = "null_default")]
    pub context: Fields<ContextValue>,
    #[serde(default)]
    pub candidates: Option<Candidates>,
    #[serde(default, deserialize_with = "options_object")]
    pub options: Options,
}

/// A request object's fields in the order sent: `entities`, `context`, and each candidate. A handful of
/// fields, so a list searched in order is cheaper than a hash map (a ranking request has a hundred
/// candidates: a map each would be a hundred allocations and keyed hashes). A name sent twice is an error
/// rather than the last one silently winning.
#[derive(Debug, Clone, PartialEq)]
pub struct Fields<V>(SmallVec<[(CompactString, V); 4]>);

/// Most fields one request object may carry.
const MAX_FIELDS: usize = 1024;

impl<V> Default for Fields<V> {
    fn default() -> Self {
        Self(SmallVec::new())
    }
}

impl<V> Fields<V> {
    /// Fields read elsewhere ([`crate::predict_json`]), each name once.
    pub(crate) fn from_parts(fields: SmallVec<[(CompactString, V); 4]>) -> Self {
        Self(fields)
    }

    pub fn get(&self, name: &str) -> Option<&V> {
        self.0.iter().find(|(n, _)| n == name).map(|(_, v)| v)
    }

    pub fn contains_key(&self, name: &str) -> bool {
        self.get(name).is_some()
    }

    pub fn keys(&self) -> impl Iterator<Item = &str> {
        self.0.iter().map(|(n, _)| n.as_str())
    }

    pub fn iter(&self) -> impl Iterator<Item = (&str, &V)> {
        self.0.iter().map(|(n, v)| (n.as_str(), v))
    }

    pub fn iter_mut(&mut self) -> impl Iterator<Item = (&str, &mut V)> {
        self.0.iter_mut().map(|(n, v)| (n.as_str(), v))
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }
}

impl<'de, V: Deserialize<'de>> Deserialize<'de> for Fields<V> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct FieldsVisitor<V>(std::marker::PhantomData<V>);
        impl<'de, V: Deserialize<'de>> Visitor<'de> for FieldsVisitor<V> {
            type Value = Fields<V>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("an object")
            }
            fn visit_map<A: de::MapAccess<'de>>(self, mut map: A) -> Result<Fields<V>, A::Error> {
                // Up to four fields are held inline: no allocation for a typical object.
                let mut out: SmallVec<[(CompactString, V); 4]> =
                    SmallVec::with_capacity(map.size_hint().unwrap_or(0).min(16));
                // Past a few fields, duplicates are found with a set rather than by scanning.
                let mut seen: Option<std::collections::HashSet<CompactString>> = None;
                // Field names are short: kept inline, they cost no allocation each.
                while let Some(name) = map.next_key::<CompactString>()? {
                    if out.len() == MAX_FIELDS {
                        return Err(de::Error::custom(format_args!(
                            "more than {MAX_FIELDS} fields"
                        )));
                    }
                    let twice = match &mut seen {
                        Some(set) => !set.insert(name.clone()),
                        None => out.iter().any(|(n, _)| *n == name),
                    };
                    if twice {
                        return Err(given_twice(&name));
                    }
                    if seen.is_none() && out.len() == 16 {
                        let mut set: std::collections::HashSet<CompactString> =
                            out.iter().map(|(n, _)| n.clone()).collect();
                        set.insert(name.clone());
                        seen = Some(set);
                    }
                    let v = map.next_value()?;
                    out.push((name, v));
                }
                Ok(Fields(out))
            }
        }
        d.deserialize_map(FieldsVisitor(std::marker::PhantomData))
    }
}

/// A value read and checked as a tree of values would be (numbers in range, escapes, nesting depth) but
/// not kept: what the readers of long lists read past their limits. serde's `IgnoredAny` skips a JSON
/// number or string without checking it, so a body refused as malformed before would be taken.
pub(crate) struct Checked;

impl<'de> Deserialize<'de> for Checked {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Checked;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("any value")
            }
            fn visit_bool<E: de::Error>(self, _: bool) -> Result<Checked, E> {
                Ok(Checked)
            }
            fn visit_i64<E: de::Error>(self, _: i64) -> Result<Checked, E> {
                Ok(Checked)
            }
            fn visit_u64<E: de::Error>(self, _: u64) -> Result<Checked, E> {
                Ok(Checked)
            }
            fn visit_f64<E: de::Error>(self, _: f64) -> Result<Checked, E> {
                Ok(Checked)
            }
            fn visit_str<E: de::Error>(self, _: &str) -> Result<Checked, E> {
                Ok(Checked)
            }
            fn visit_bytes<E: de::Error>(self, _: &[u8]) -> Result<Checked, E> {
                Ok(Checked)
            }
            fn visit_unit<E: de::Error>(self) -> Result<Checked, E> {
                Ok(Checked)
            }
            fn visit_none<E: de::Error>(self) -> Result<Checked, E> {
                Ok(Checked)
            }
            fn visit_some<D2: Deserializer<'de>>(self, d: D2) -> Result<Checked, D2::Error> {
                Checked::deserialize(d)
            }
            fn visit_seq<A: de::SeqAccess<'de>>(self, mut seq: A) -> Result<Checked, A::Error> {
                while seq.next_element::<Checked>()?.is_some() {}
                Ok(Checked)
            }
            fn visit_map<A: de::MapAccess<'de>>(self, mut map: A) -> Result<Checked, A::Error> {
                while map.next_entry::<Checked, Checked>()?.is_some() {}
                Ok(Checked)
            }
        }
        d.deserialize_any(V)
    }
}

/// Reads a list, keeping its first `cap` elements and reading the rest as [`Checked`] values, kept
/// not: what a list with a limit is read with, so a long one costs no memory past the limit and is refused
/// with its true length. Returns the elements kept and how many were sent.
pub(crate) fn read_capped<'de, T: Deserialize<'de>, A: de::SeqAccess<'de>>(
    mut seq: A,
    cap: usize,
) -> Result<(Vec<T>, usize), A::Error> {
    let hint = seq.size_hint().unwrap_or(0);
    // A declared length (MessagePack) is a claim, not bytes that back it: room for a few, grown as they
    // arrive.
    let mut kept = Vec::with_capacity(hint.min(cap).min(64));
    while kept.len() < cap {
        match seq.next_element::<T>()? {
            Some(x) => kept.push(x),
            None => {
                let sent = kept.len();
                return Ok((kept, sent));
            }
        }
    }
    let mut sent = kept.len();
    while seq.next_element::<Checked>()?.is_some() {
        sent += 1;
    }
    Ok((kept, sent))
}

/// A request's candidates as read: every one of them, or, in a list longer than the limit the reader was
/// given ([`with_candidate_limit`]), the first `limit` of them and the count of the rest. A candidate is
/// some 200 bytes in memory (its fields inline) and `{},` three in the body: a 1 MiB body of empty
/// candidates, held whole, took 200 MB before the limit refused it.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Candidates {
    pub(crate) list: Vec<Fields<EntityKey>>,
    /// How many the request sent.
    pub(crate) sent: usize,
}

impl Candidates {
    /// Candidates all held.
    pub fn new(list: Vec<Fields<EntityKey>>) -> Self {
        let sent = list.len();
        Self { list, sent }
    }

    /// How many the request sent, held or not.
    pub fn sent(&self) -> usize {
        self.sent
    }
}

impl std::ops::Deref for Candidates {
    type Target = [Fields<EntityKey>];

    /// The candidates held.
    fn deref(&self) -> &Self::Target {
        &self.list
    }
}

thread_local! {
    /// Most candidates a predict body's reader holds on this thread; see [`with_candidate_limit`].
    static CANDIDATE_LIMIT: std::cell::Cell<usize> = const { std::cell::Cell::new(usize::MAX) };
}

/// Runs `read` (a synchronous parse of a predict body) holding at most `limit` candidates: the rest are
/// read, checked as JSON and counted, not kept, so [`PredictRequest::plan`] refuses the list with its
/// true length. serde gives a field's reader no arguments, hence a thread-local, set only for the call.
pub fn with_candidate_limit<R>(limit: usize, read: impl FnOnce() -> R) -> R {
    scoped(&CANDIDATE_LIMIT, limit, read)
}

impl<'de> Deserialize<'de> for Candidates {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct CandidatesVisitor;
        impl<'de> Visitor<'de> for CandidatesVisitor {
            type Value = Candidates;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a sequence")
            }
            fn visit_seq<A: de::SeqAccess<'de>>(self, seq: A) -> Result<Candidates, A::Error> {
                let (list, sent) = read_capped(seq, CANDIDATE_LIMIT.with(std::cell::Cell::get))?;
                Ok(Candidates { list, sent })
            }
        }
        d.deserialize_seq(CandidatesVisitor)
    }
}

/// `POST /v1/features`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FeaturesRequest {
    #[serde(deserialize_with = "unique_names")]
    pub entities: HashMap<String, EntityKeys>,
    /// `view` (all its features) or `view:feature`.
    pub features: FeatureRefs,
    #[serde(default, deserialize_with = "options_object")]
    pub options: Options,
}

/// Most feature references (`view` or `view:feature`) one `/v1/features` or `/get-online-features`
/// request may name. Each is a string in memory and `"v",` four bytes in the body, so a 1 MiB body of
/// repeated names held whole took some 25 MB before it was read.
pub const MAX_FEATURE_REFS: usize = 4096;

/// A request's `features` list as read: every reference, or, in a list longer than
/// [`MAX_FEATURE_REFS`], the first of them and the count of the rest.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct FeatureRefs {
    pub list: Vec<String>,
    /// How many the request sent, held or not.
    pub sent: usize,
}

impl FeatureRefs {
    /// The references, or 413 `too_many_features` when the list went past [`MAX_FEATURE_REFS`].
    pub fn checked(&self) -> Result<&[String], ApiError> {
        if self.sent > self.list.len() {
            return Err(ApiError::TooLarge {
                code: "too_many_features",
                message: format!(
                    "features: {} references, the limit is {MAX_FEATURE_REFS} (name a view alone for all of its features)",
                    self.sent
                ),
                field: Some("features".to_owned()),
            });
        }
        Ok(&self.list)
    }
}

impl<'de> Deserialize<'de> for FeatureRefs {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = FeatureRefs;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a list of `view` or `view:feature` names")
            }
            fn visit_seq<A: de::SeqAccess<'de>>(self, seq: A) -> Result<FeatureRefs, A::Error> {
                let (list, sent) = read_capped(seq, MAX_FEATURE_REFS)?;
                Ok(FeatureRefs { list, sent })
            }
        }
        d.deserialize_seq(V)
    }
}

/// What a predict request resolves to.
#[derive(Debug)]
///
/// Sized for a model of a few views and context fields, which then costs no allocation beyond its keys.
pub struct Plan {
    /// Output rows: the number of candidates, or 1.
    pub rows: usize,
    /// Per model view: one shared key, or one key per row.
    pub keys: SmallVec<[ViewKeys; 4]>,
    /// Per model view: whether its keys come from the candidates (one per row).
    pub per_row: SmallVec<[bool; 4]>,
    /// Per model context field: the value sent, typed; `None` when not sent.
    pub context: SmallVec<[Option<Value>; 8]>,
}

/// One view's keys: one shared key, or one per candidate.
pub type ViewKeys = SmallVec<[CompactString; 1]>;

/// Checks a key against its entity and the limits, returning it as a string (inline up to 24 bytes).
/// An error names `field`.
pub fn key_string(
    entity: &Entity,
    key: &EntityKey,
    field: &dyn fmt::Display,
    limits: &LimitsConfig,
) -> Result<CompactString, ApiError> {
    check_key(entity, key, limits).map_err(|reason| {
        ApiError::invalid(
            "invalid_entity_key",
            field.to_string(),
            format!("{field}: {reason}"),
        )
    })
}

/// [`key_string`] with the reason alone, for a caller that names the field itself (a row).
pub fn check_key(
    entity: &Entity,
    key: &EntityKey,
    limits: &LimitsConfig,
) -> Result<CompactString, String> {
    let s = match (entity.dtype, key) {
        (Dtype::Int64, EntityKey::Int(i)) => i.to_compact_string(),
        (Dtype::Int64, EntityKey::Str(_)) => {
            return Err(format!(
                "entity `{}` takes int64 keys, got a string",
                entity.name
            ));
        }
        (_, EntityKey::Int(_)) => {
            return Err(format!(
                "entity `{}` takes string keys, got an integer",
                entity.name
            ));
        }
        (_, EntityKey::Str(s)) => s.clone(),
    };
    if s.is_empty() {
        return Err("the key is empty".to_owned());
    }
    if s.len() > limits.max_key_bytes {
        return Err(format!(
            "the key is {} bytes, the limit is {}",
            s.len(),
            limits.max_key_bytes
        ));
    }
    if s.chars().any(char::is_control) {
        return Err("the key holds control characters".to_owned());
    }
    Ok(s)
}

impl PredictRequest {
    /// Resolves the request against `model`: which keys each view reads, and the typed context.
    /// Checks the request against `model` and the limits. Takes the context values out of the request.
    pub fn plan(&mut self, model: &Model, limits: &LimitsConfig) -> Result<Plan, ApiError> {
        let held = self.candidates.as_ref();
        let candidates = held.map(|c| &c[..]);
        if let Some(c) = held {
            if c.is_empty() {
                return Err(ApiError::invalid(
                    "empty_candidates",
                    "candidates",
                    "candidates: expected at least one candidate (leave the field out to score the entities alone)",
                ));
            }
            // A list cut short by its reader's limit is refused whatever this one is: its rows are not
            // all here.
            if c.sent() > limits.max_candidates || c.len() < c.sent() {
                return Err(ApiError::TooLarge {
                    code: "too_many_candidates",
                    message: format!(
                        "candidates: {} candidates, the limit is {}",
                        c.sent(),
                        limits.max_candidates.min(c.len())
                    ),
                    field: Some("candidates".to_owned()),
                });
            }
            // Candidates that name no entity would all be the same row: one score for N candidates.
            if c.iter().all(|cand| cand.is_empty()) {
                let known = entity_names(model);
                return Err(ApiError::invalid(
                    "missing_entity",
                    "candidates[0]",
                    format!(
                        "candidates[0]: the candidates name no entity: give each the keys that vary per candidate (model `{}` uses: {known}), or leave `candidates` out to score the entities alone",
                        model.name
                    ),
                ));
            }
        }
        let used = |name: &str| model.views.iter().any(|v| v.entity.name == name);
        // Of several unknown names the first in order is reported, the same each time.
        if let Some(name) = self.entities.keys().filter(|n| !used(n)).min() {
            return Err(unknown_entity(model, &format!("entities.{name}"), name));
        }
        if let Some(c) = candidates {
            for (i, cand) in c.iter().enumerate() {
                for name in cand.keys() {
                    if !used(name) {
                        return Err(unknown_entity(
                            model,
                            &format!("candidates[{i}].{name}"),
                            name,
                        ));
                    }
                }
            }
        }
        let mut rows = 1;
        let mut keys = SmallVec::with_capacity(model.views.len());
        let mut per_row = SmallVec::with_capacity(model.views.len());
        for view in &model.views {
            let (k, p) = self.view_keys(view, candidates, limits, &mut rows)?;
            keys.push(k);
            per_row.push(p);
        }
        let mut context: SmallVec<[Option<Value>; 8]> = smallvec![None; model.context.len()];
        // Of several bad fields the first in name order is reported, the same whatever order they came in.
        let mut bad: Option<(String, ApiError)> = None;
        for (name, value) in self.context.iter_mut() {
            if bad.as_ref().is_some_and(|(b, _)| b.as_str() < name) {
                continue;
            }
            let Some(i) = model.context_index(name) else {
                let known: Vec<_> = model.context.iter().map(|f| f.name.as_str()).collect();
                let e = ApiError::invalid(
                    "unknown_context_field",
                    format!("context.{name}"),
                    format!(
                        "context.{name}: model `{}` takes no context field `{name}` (it takes: {})",
                        model.name,
                        known.join(", ")
                    ),
                );
                bad = Some((name.to_owned(), e));
                continue;
            };
            let dtype = model.context[i].dtype;
            // Taken rather than cloned: the request is not read again.
            let sent = std::mem::replace(value, ContextValue::Value(Value::Null));
            match sent.typed(dtype) {
                Ok(v) => context[i] = Some(v),
                Err(e) => {
                    let e = ApiError::invalid(
                        "invalid_field",
                        format!("context.{name}"),
                        format!("context.{name}: {e}"),
                    );
                    bad = Some((name.to_owned(), e));
                }
            }
        }
        if let Some((_, e)) = bad {
            return Err(e);
        }
        Ok(Plan {
            rows,
            keys,
            per_row,
            context,
        })
    }

    fn view_keys(
        &self,
        view: &View,
        candidates: Option<&[Fields<EntityKey>]>,
        limits: &LimitsConfig,
        rows: &mut usize,
    ) -> Result<(ViewKeys, bool), ApiError> {
        let entity = &view.entity;
        let first_in_candidates =
            candidates.and_then(|c| c.iter().position(|m| m.contains_key(&entity.name)));
        let in_candidates = first_in_candidates.is_some();
        if let Some(k) = self.entities.get(&entity.name) {
            if let Some(i) = first_in_candidates {
                // The candidate is the place to name: `entities` holds one of each, a list may hold
                // a thousand candidates.
                let field = format!("candidates[{i}].{}", entity.name);
                return Err(ApiError::invalid(
                    "ambiguous_entity",
                    &field,
                    format!(
                        "{field}: entity `{}` is given both in `entities` and in `candidates`: give it in one place (in `entities` when every row shares it)",
                        entity.name
                    ),
                ));
            }
            return Ok((
                smallvec![key_string(
                    entity,
                    k,
                    &format_args!("entities.{}", entity.name),
                    limits,
                )?],
                false,
            ));
        }
        match candidates {
            Some(c) if in_candidates => {
                let mut out = SmallVec::with_capacity(c.len());
                for (i, cand) in c.iter().enumerate() {
                    // Field names are formatted only for an error: a ranking request has hundreds of keys.
                    let Some(k) = cand.get(&entity.name) else {
                        let field = format!("candidates[{i}].{}", entity.name);
                        return Err(ApiError::invalid(
                            "missing_entity",
                            &field,
                            format!(
                                "{field}: every candidate needs `{}` (view `{}` is keyed by it)",
                                entity.name, view.name
                            ),
                        ));
                    };
                    out.push(key_string(
                        entity,
                        k,
                        &format_args!("candidates[{i}].{}", entity.name),
                        limits,
                    )?);
                }
                *rows = c.len();
                Ok((out, true))
            }
            _ => Err(ApiError::invalid(
                "missing_entity",
                format!("entities.{}", entity.name),
                format!(
                    "entities.{}: model needs entity `{}` for view `{}`: send it in `entities` (or per candidate in `candidates`)",
                    entity.name, entity.name, view.name
                ),
            )),
        }
    }
}

/// The entities `model` uses, for error messages.
fn entity_names(model: &Model) -> String {
    crate::schema::known_names(model.views.iter().map(|v| v.entity.name.as_str()))
}

fn unknown_entity(model: &Model, field: &str, name: &str) -> ApiError {
    let known = entity_names(model);
    ApiError::invalid(
        "unknown_entity",
        field,
        format!(
            "{field}: model `{}` uses no entity `{name}` (it uses: {})",
            model.name, known
        ),
    )
}

/// Refuses a `charset` parameter other than UTF-8 (or its subset US-ASCII): hydrant reads every text
/// body as UTF-8, so a UTF-16 or Latin-1 body would otherwise be misread rather than refused.
pub fn utf8_charset(mime: &str) -> Result<(), ApiError> {
    for param in mime.split(';').skip(1) {
        let Some((name, value)) = param.split_once('=') else {
            continue;
        };
        if !name.trim().eq_ignore_ascii_case("charset") {
            continue;
        }
        let value = value.trim().trim_matches('"');
        if !(value.eq_ignore_ascii_case("utf-8")
            || value.eq_ignore_ascii_case("utf8")
            || value.eq_ignore_ascii_case("us-ascii"))
        {
            return Err(ApiError::UnsupportedCharset(value.to_owned()));
        }
    }
    Ok(())
}

/// The request's one `Content-Type`, `None` when it has none. One that is not visible ASCII names no
/// media type (415), and two or more are refused, since which one to believe would be a guess.
pub fn content_type(headers: &HeaderMap) -> Result<Option<&str>, ApiError> {
    let mut types = headers.get_all(header::CONTENT_TYPE).iter();
    match (types.next(), types.next()) {
        (None, _) => Ok(None),
        // A byte beyond ASCII names no media type; the error shows it as sent.
        (Some(v), None) => v.to_str().map(Some).map_err(|_| {
            ApiError::UnsupportedMediaType(String::from_utf8_lossy(v.as_bytes()).into_owned())
        }),
        (Some(_), Some(_)) => Err(ApiError::ConflictingContentTypes(
            headers
                .get_all(header::CONTENT_TYPE)
                .iter()
                .map(|v| String::from_utf8_lossy(v.as_bytes()))
                .collect::<Vec<_>>()
                .join("`, `"),
        )),
    }
}

/// The index of feature `name` in `view`, else 400 `unknown_feature` at `field` (`features[2]`).
pub fn feature_of(view: &View, name: &str, field: &str) -> Result<usize, ApiError> {
    view.feature_index(name).ok_or_else(|| {
        ApiError::invalid(
            "unknown_feature",
            field,
            format!("{field}: view `{}` has no feature `{name}`", view.name),
        )
    })
}

/// 400 `missing_entity`: the request asks for `view` but sends no keys of its entity.
pub fn view_keys_missing(view: &View) -> ApiError {
    let entity = &view.entity.name;
    ApiError::invalid(
        "missing_entity",
        format!("entities.{entity}"),
        format!(
            "entities.{entity}: view `{}` is keyed by `{entity}`: send its keys",
            view.name
        ),
    )
}

/// 400 `unknown_entity`: keys of entity `name` were sent, but no requested view is keyed by it.
pub fn entity_unused(name: &str) -> ApiError {
    ApiError::invalid(
        "unknown_entity",
        format!("entities.{name}"),
        format!("entities.{name}: none of the requested views is keyed by `{name}`"),
    )
}

/// 400 `unknown_view` for `field`, listing the registered views.
pub fn unknown_view(registry: &Registry, field: &str, name: &str) -> ApiError {
    let known = crate::schema::known_names(registry.views.keys().map(String::as_str));
    ApiError::invalid(
        "unknown_view",
        field,
        format!("{field}: no view `{name}` is registered (views: {known})"),
    )
}

/// Checks an entity's keys (at least one; `entities.<entity>[j]` in errors), returning them as strings.
pub fn entity_keys(
    entity: &Entity,
    keys: &EntityKeys,
    limits: &LimitsConfig,
) -> Result<Vec<CompactString>, ApiError> {
    if keys.keys.is_empty() {
        return Err(ApiError::invalid(
            "missing_entity",
            format!("entities.{}", entity.name),
            format!("entities.{}: expected at least one key", entity.name),
        ));
    }
    keys.keys
        .iter()
        .enumerate()
        .map(|(j, k)| {
            // A key sent alone is named as sent, without an index.
            let index = (!keys.scalar).then_some(j);
            let field = KeyField(&entity.name, index);
            key_string(entity, k, &field, limits)
        })
        .collect()
}

/// `entities.NAME[INDEX]`, or `entities.NAME` for a key sent alone: the field an entity key error names.
struct KeyField<'a>(&'a str, Option<usize>);

impl fmt::Display for KeyField<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.1 {
            Some(j) => write!(f, "entities.{}[{j}]", self.0),
            None => write!(f, "entities.{}", self.0),
        }
    }
}

/// Refuses a request carrying more entity keys, over all entities, than `limits.max_entities` (413).
pub fn check_key_count<'a>(
    entities: impl IntoIterator<Item = &'a EntityKeys>,
    limits: &LimitsConfig,
) -> Result<(), ApiError> {
    let (mut total, mut held) = (0usize, 0usize);
    for k in entities {
        total += k.sent;
        held += k.keys.len();
    }
    // Keys cut short by their reader's limit are refused whatever this one is: they are not all here.
    if total > limits.max_entities || held < total {
        return Err(ApiError::TooLarge {
            code: "too_many_entities",
            message: format!(
                "entities: {total} keys, the limit is {}",
                limits.max_entities.min(held)
            ),
            field: Some("entities".to_owned()),
        });
    }
    Ok(())
}

/// A resolved `/v1/features` request.
#[derive(Debug)]
pub struct FeaturesPlan {
    /// The views to read, each with the keys of its entity and the features asked for (indexes).
    pub views: Vec<(std::sync::Arc<View>, Vec<CompactString>, Vec<usize>)>,
}

impl FeaturesRequest {
    pub fn plan(
        &self,
        registry: &Registry,
        limits: &LimitsConfig,
    ) -> Result<FeaturesPlan, ApiError> {
        let features = self.features.checked()?;
        if features.is_empty() {
            return Err(ApiError::invalid(
                "invalid_field",
                "features",
                "features: expected at least one `view` or `view:feature`",
            ));
        }
        check_key_count(self.entities.values(), limits)?;
        if self.options.return_features {
            return Err(ApiError::invalid(
                "invalid_field",
                "options.return_features",
                "options.return_features: /v1/features always answers with the features; the option is for predict",
            ));
        }
        // A name that is no entity at all is the mistake to report, before any view misses its keys.
        let mut names: Vec<&String> = self.entities.keys().collect();
        names.sort();
        if let Some(name) = names
            .iter()
            .find(|n| !registry.entities.contains_key(n.as_str()))
        {
            return Err(unregistered_entity(registry, name));
        }
        let mut views: Vec<(std::sync::Arc<View>, Vec<CompactString>, Vec<usize>)> = Vec::new();
        // Per view in `views`: which of its features are asked for already (a name may come twice).
        let mut asked: Vec<Vec<bool>> = Vec::new();
        for (i, name) in features.iter().enumerate() {
            let field = || format!("features[{i}]");
            let (vname, fname) = match name.split_once(':') {
                Some((v, f)) => (v, Some(f)),
                None => (name.as_str(), None),
            };
            let Some(view) = registry.views.get(vname) else {
                return Err(unknown_view(registry, &field(), vname));
            };
            let idx = match views.iter().position(|(v, _, _)| v.name == vname) {
                Some(idx) => idx,
                None => {
                    let entity = &view.entity;
                    let keys = self
                        .entities
                        .get(&entity.name)
                        .ok_or_else(|| view_keys_missing(view))?;
                    let ks = entity_keys(entity, keys, limits)?;
                    views.push((view.clone(), ks, Vec::new()));
                    asked.push(vec![false; view.features.len()]);
                    views.len() - 1
                }
            };
            let (wanted, seen) = (&mut views[idx].2, &mut asked[idx]);
            let mut ask = |f: usize| {
                if !std::mem::replace(&mut seen[f], true) {
                    wanted.push(f);
                }
            };
            match fname {
                None => (0..view.features.len()).for_each(&mut ask),
                Some(f) => ask(feature_of(view, f, &field())?),
            }
        }
        for name in names {
            if !views.iter().any(|(v, _, _)| &v.entity.name == name) {
                return Err(entity_unused(name));
            }
        }
        Ok(FeaturesPlan { views })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rust_type_names_in_serde_messages_become_words() {
        assert_eq!(
            plain_types("invalid value: integer `-2`, expected usize"),
            "invalid value: integer `-2`, expected a whole number, 0 or more"
        );
        assert_eq!(
            plain_types("invalid type: string \"x\", expected u32"),
            "invalid type: string \"x\", expected a whole number from 0 to 4294967295"
        );
        assert_eq!(plain_types("expected f64 here"), "expected a number here");
        // Only whole words, and only Rust's number types.
        assert_eq!(plain_types("expected u64s"), "expected u64s");
        assert_eq!(plain_types("expected a boolean"), "expected a boolean");
        assert_eq!(plain_types("expected "), "expected ");
    }

    #[test]
    fn msgpack_map_keys_must_be_strings() {
        let scan = |b: &[u8]| msgpack_key_not_string(b, PredictRequest::FIELDS);
        let field = |e: &ApiError| match e {
            ApiError::Malformed { field, .. } => field.clone(),
            _ => None,
        };
        let found = |map: &str, kind| {
            Some(KeyNotString {
                map: map.to_owned(),
                kind,
            })
        };
        let named = rmp_serde::to_vec_named(&serde_json::json!({
            "entities": {"user_id": "u_1"},
            "context": {"hour_of_day": 7, "device": "ios", "w": [0.5, 2.5]},
            "options": {"timings": false, "deadline_ms": 70000},
        }))
        .expect("msgpack");
        assert_eq!(scan(&named), None);
        assert!(parse_body::<PredictRequest>(Format::Msgpack, &named).is_ok());
        // {0: {"user_id": "u_1"}}: serde would read key 0 as the first field, `entities`.
        let by_index = [
            0x81, 0x00, 0x81, 0xa7, b'u', b's', b'e', b'r', b'_', b'i', b'd', 0xa3, b'u', b'_',
            b'1',
        ];
        assert_eq!(scan(&by_index), found("", "an integer"));
        // A top-level field with an empty name is named too, as `""`, in both formats.
        let empty = serde_json::json!({"entities": {"user_id": "u_1"}, "": 1});
        for (format, body) in [
            (Format::Json, serde_json::to_vec(&empty).expect("json")),
            (
                Format::Msgpack,
                rmp_serde::to_vec_named(&empty).expect("msgpack"),
            ),
        ] {
            let e = parse_body::<PredictRequest>(format, &body).expect_err("unknown field");
            assert_eq!(field(&e).as_deref(), Some(""), "{format:?}: {e}");
        }
        let e = parse_body::<PredictRequest>(Format::Msgpack, &by_index).expect_err("integer key");
        assert_eq!(e.code(), "invalid_msgpack");
        assert_eq!(field(&e), None);
        assert!(
            e.to_string()
                .contains("a MessagePack map key is not a string (an integer)"),
            "{e}"
        );
        // ...also inside, where the map holding it is the field: {"options": {0: true}}.
        let inner = [
            0x81, 0xa7, b'o', b'p', b't', b'i', b'o', b'n', b's', 0x81, 0x00, 0xc3,
        ];
        assert_eq!(scan(&inner), found("options", "an integer"));
        let e = parse_body::<PredictRequest>(Format::Msgpack, &inner).expect_err("integer key");
        assert_eq!(field(&e).as_deref(), Some("options"));
        assert!(
            e.to_string()
                .contains("a MessagePack map key in options is not a string (an integer)"),
            "{e}"
        );
        // Deeper, after other keys and inside an array: the second candidate's map, keyed by nil.
        let deep = rmp_serde::to_vec_named(&serde_json::json!({
            "entities": {"user_id": "u_1"},
            "candidates": [{"item_id": "i_1"}, {"item_id": "i_2", "x": 1}],
        }))
        .expect("msgpack");
        let at = deep
            .windows(2)
            .rposition(|w| w == [0xa1, b'x'])
            .expect("the key x");
        let mut deep = deep;
        deep.splice(at..at + 2, [0xc0]);
        assert_eq!(scan(&deep), found("candidates[1]", "nil (null)"));
        // A request written by position names its fields: [{"user_id": "u_1"}, {}, [], [true, {1: 2}]]
        // holds the integer key in `options`' second field, `timings`.
        let positional = [
            0x94, 0x81, 0xa7, b'u', b's', b'e', b'r', b'_', b'i', b'd', 0xa3, b'u', b'_', b'1',
            0x80, 0x90, 0x92, 0xc3, 0x81, 0x01, 0x02,
        ];
        assert_eq!(scan(&positional), found("options.timings", "an integer"));
        // Strings, binary, extensions and every width of number are skipped correctly.
        let mut mixed = vec![
            0x92, 0xc4, 0x02, 0x00, 0x00, 0xd7, 0x01, 0, 0, 0, 0, 0, 0, 0, 0,
        ];
        mixed.extend([
            0x82, 0xd9, 0x01, b'a', 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0xa1, b'b', 0xcf,
        ]);
        mixed.extend([0u8; 8]);
        assert_eq!(scan(&mixed), None);
        // A body that ends early is left to the decoder.
        assert_eq!(scan(&[0x81, 0xa1]), None);
    }

    #[test]
    fn context_values_of_the_wrong_shape_are_named_in_the_fields_terms() {
        let typed = |json: &str, dtype: Dtype| {
            serde_json::from_str::<ContextValue>(json)
                .expect("decodes")
                .typed(dtype)
        };
        assert_eq!(
            typed("[0.5, 2]", Dtype::Float32List(2)),
            Ok(Value::List(vec![0.5, 2.0].into_boxed_slice()))
        );
        assert_eq!(
            typed(r#"[0.5, "x", [1]]"#, Dtype::Float32List(3)),
            Err("expected float32[3], got a list whose element 1 is a string".to_owned())
        );
        assert_eq!(
            typed(r#"["ios"]"#, Dtype::String),
            Err("expected string, got a list".to_owned())
        );
        assert_eq!(
            typed(r#"{"a": [1, {}]}"#, Dtype::Float32List(2)),
            Err("expected float32[2], got an object".to_owned())
        );
        assert_eq!(typed("null", Dtype::Int64), Ok(Value::Null));
        assert_eq!(
            typed("1e300", Dtype::Float32List(1)),
            Err("expected float32[1], got a number".to_owned())
        );
        // Elements are still checked against float32's range, in the field's terms.
        assert_eq!(
            typed("[1, 1e300]", Dtype::Float32List(2)),
            Err("expected float32[2], got a list whose element 1 is a number outside the float32 range".to_owned())
        );
        assert_eq!(
            typed("[1e300]", Dtype::String),
            Err("expected string, got a list".to_owned())
        );
        assert!(std::mem::size_of::<ContextValue>() <= 32);
        // The same through MessagePack, whose maps and lists decode through the same visitor.
        let packed = rmp_serde::to_vec(&serde_json::json!(["a", 1])).expect("msgpack");
        let v: ContextValue = rmp_serde::from_slice(&packed).expect("decodes");
        assert_eq!(
            v.typed(Dtype::Float32List(2)),
            Err("expected float32[2], got a list whose element 0 is a string".to_owned())
        );
        // MessagePack carries NaN and infinity, refused in the field's terms too.
        for (x, what) in [(f64::NAN, "NaN"), (f64::NEG_INFINITY, "an infinite number")] {
            let packed = rmp_serde::to_vec(&x).expect("msgpack");
            for dtype in [Dtype::String, Dtype::Float64] {
                let v: ContextValue = rmp_serde::from_slice(&packed).expect("decodes");
                assert_eq!(v.typed(dtype), Err(format!("expected {dtype}, got {what}")));
            }
        }
        // And bin, which is how Python's `bytes` are packed: named as what it is.
        let packed = [0xc4, 3, b'i', b'o', b's'];
        let v: ContextValue = rmp_serde::from_slice(&packed).expect("decodes");
        assert_eq!(
            v.typed(Dtype::String),
            Err(
                "expected string, got binary data (MessagePack bin; text is sent as str)"
                    .to_owned()
            )
        );
    }

    /// Past the reader's limit candidates are counted, not held; a type error past it is not looked at
    /// (the list is refused whole), a syntax error still is; plan refuses the list with its true length.
    #[test]
    fn candidates_past_the_limit_are_counted_not_held() {
        let read = |format, body: &[u8], limit| {
            with_candidate_limit(limit, || parse_body::<PredictRequest>(format, body))
        };
        let body = br#"{"entities": {"user_id": "u_1"}, "candidates": [{"item_id": "i_1"}, {"item_id": "i_2"}, {}, {"item_id": [1]}, {"item_id": "i_5"}]}"#;
        let req = read(Format::Json, body, 2).expect("reads");
        let c = req.candidates.as_ref().expect("candidates");
        assert_eq!((c.len(), c.sent()), (2, 5));
        assert_eq!(c[1].get("item_id"), Some(&EntityKey::Str("i_2".into())));
        // The limit holds for this call only.
        let e = parse_body::<PredictRequest>(Format::Json, body).expect_err("the list");
        assert!(
            matches!(&e, ApiError::Malformed { field: Some(f), .. } if f == "candidates[3].item_id"),
            "{e:?}"
        );
        // At or under the limit, all are held; a syntax error past it is still one.
        let c = read(Format::Json, br#"{"candidates": [{}, {}]}"#, 2)
            .expect("reads")
            .candidates
            .expect("candidates");
        assert_eq!((c.len(), c.sent()), (2, 2));
        assert!(
            read(
                Format::Json,
                br#"{"candidates": [{}, {}, {], "entities": {}}"#,
                2
            )
            .is_err()
        );
        // Past the limit values are still checked as JSON is: a number out of range, a broken escape.
        for bad in [
            &br#"{"candidates": [{}, {}, {"item_id": 1e400}]}"#[..],
            br#"{"candidates": [{}, {}, {"item_id": "\ud800"}]}"#,
        ] {
            let e = read(Format::Json, bad, 2).expect_err("malformed past the limit");
            assert!(
                matches!(
                    &e,
                    ApiError::Malformed {
                        code: "invalid_json",
                        ..
                    }
                ),
                "{e:?}"
            );
        }
        // MessagePack alike.
        let packed = rmp_serde::to_vec_named(&serde_json::json!({
            "candidates": (0..7).map(|i| serde_json::json!({"item_id": format!("i_{i}")})).collect::<Vec<_>>()
        }))
        .expect("msgpack");
        let c = read(Format::Msgpack, &packed, 3)
            .expect("reads")
            .candidates
            .expect("candidates");
        assert_eq!((c.len(), c.sent()), (3, 7));

        let registry = Registry::load_dir(
            std::path::Path::new("schemas"),
            std::path::Path::new("models"),
        )
        .expect("demo schemas");
        let limits = LimitsConfig {
            max_candidates: 2,
            ..LimitsConfig::default()
        };
        let mut req = read(Format::Json, body, 2).expect("reads");
        match req.plan(&registry.models["ctr"], &limits) {
            Err(ApiError::TooLarge { code, message, .. }) => {
                assert_eq!(code, "too_many_candidates");
                assert_eq!(message, "candidates: 5 candidates, the limit is 2");
            }
            other => panic!("expected a 413, got {other:?}"),
        }
        // A list cut at a lower limit than the plan's is refused too: its rows are not all there.
        let limits = LimitsConfig {
            max_candidates: 10,
            ..LimitsConfig::default()
        };
        let mut req = read(Format::Json, body, 2).expect("reads");
        assert!(matches!(
            req.plan(&registry.models["ctr"], &limits),
            Err(ApiError::TooLarge { .. })
        ));
    }

    /// The key limit is shared by a body's key lists: keys past it are counted, not held, and any list
    /// cut short is refused with the true total, whatever the limit it is checked against.
    #[test]
    fn entity_keys_past_the_limit_are_counted_not_held() {
        let body = br#"{"features": ["user_profile"], "entities": {"user_id": ["u_1", "u_2", "u_3"], "item_id": ["i_1", "i_2"]}}"#;
        let read = |limit| {
            with_key_limit(limit, || parse_body::<FeaturesRequest>(Format::Json, body))
                .expect("reads")
        };
        let counts = |req: &FeaturesRequest| {
            let mut c: Vec<(String, usize, usize)> = req
                .entities
                .iter()
                .map(|(n, k)| (n.clone(), k.keys.len(), k.sent))
                .collect();
            c.sort();
            c
        };
        let all = read(5);
        assert_eq!(
            counts(&all),
            [("item_id".into(), 2, 2), ("user_id".into(), 3, 3)]
        );
        let cut = read(4);
        let held: usize = cut.entities.values().map(|k| k.keys.len()).sum();
        let sent: usize = cut.entities.values().map(|k| k.sent).sum();
        assert_eq!((held, sent), (4, 5));
        let limits = |max_entities| LimitsConfig {
            max_entities,
            ..LimitsConfig::default()
        };
        assert!(check_key_count(all.entities.values(), &limits(5)).is_ok());
        for max in [4, 10] {
            match check_key_count(cut.entities.values(), &limits(max)) {
                Err(ApiError::TooLarge { code, message, .. }) => {
                    assert_eq!(code, "too_many_entities");
                    assert!(
                        message.starts_with("entities: 5 keys, the limit is 4"),
                        "{message}"
                    );
                }
                other => panic!("expected a 413, got {other:?}"),
            }
        }
        // A body read twice (its first pass fails, the second names the field) counts its keys afresh
        // in each pass: a bad key after the limit's worth of good ones is still the error.
        let e = with_key_limit(5, || {
            parse_body::<FeaturesRequest>(
                Format::Json,
                br#"{"features": ["user_profile"], "entities": {"user_id": ["u_1", "u_2", "u_3"], "item_id": ["i_1", [1]]}}"#,
            )
        })
        .expect_err("a list is no key");
        assert!(
            matches!(&e, ApiError::Malformed { field: Some(f), .. } if f == "entities.item_id[1]"),
            "{e:?}"
        );
        // Outside the call the reader holds every key again.
        let req = parse_body::<FeaturesRequest>(Format::Json, body).expect("reads");
        assert_eq!(counts(&req), counts(&all));
    }

    #[test]
    fn null_optional_fields_read_as_not_sent_and_deadlines_take_whole_floats() {
        let req = parse_body::<PredictRequest>(
            Format::Json,
            br#"{"entities": {"user_id": "u_1"}, "context": null, "candidates": null, "options": null}"#,
        )
        .expect("nulls");
        assert!(req.context.is_empty() && req.candidates.is_none());
        assert!(req.options.timings && !req.options.return_features);
        let req = parse_body::<PredictRequest>(
            Format::Json,
            br#"{"entities": {"user_id": "u_1"}, "options": {"timings": null, "return_features": null, "deadline_ms": null}}"#,
        )
        .expect("null options");
        assert!(req.options.timings && !req.options.return_features);
        assert_eq!(req.options.deadline_ms, None);

        let deadline = |ms: &str| {
            let body = format!(
                r#"{{"entities": {{"user_id": "u_1"}}, "options": {{"deadline_ms": {ms}}}}}"#
            );
            parse_body::<PredictRequest>(Format::Json, body.as_bytes())
                .map(|r| r.options.deadline_ms)
                .map_err(|e| e.to_string())
        };
        assert_eq!(deadline("25"), Ok(Some(25)));
        assert_eq!(deadline("25.0"), Ok(Some(25)));
        assert_eq!(deadline("2.5e1"), Ok(Some(25)));
        // Huge ones saturate, integer or float alike (the gateway cuts them to its request timeout).
        assert_eq!(deadline("18446744073709551615"), Ok(Some(u64::MAX)));
        assert_eq!(deadline("1e300"), Ok(Some(u64::MAX)));
        for (bad, says) in [
            ("0", "at least 1 millisecond, got 0"),
            ("0.0", "at least 1 millisecond, got 0"),
            ("-3", "at least 1 millisecond, got -3"),
            ("2.5", "whole number of milliseconds, at least 1, got 2.5"),
            // A tiny one is echoed as written, not as 300 digits.
            ("1e-300", "at least 1, got 1e-300"),
            ("\"soon\"", "expected a whole number of milliseconds"),
        ] {
            let e = deadline(bad).expect_err(bad);
            assert!(
                e.starts_with("options.deadline_ms: ") && e.contains(says),
                "{bad}: {e}"
            );
        }
        // The same in MessagePack, where a float is a float.
        let mp = rmp_serde::to_vec_named(&serde_json::json!({
            "entities": {"user_id": "u_1"},
            "options": {"deadline_ms": 40.0},
        }))
        .expect("msgpack");
        let req = parse_body::<PredictRequest>(Format::Msgpack, &mp).expect("msgpack");
        assert_eq!(req.options.deadline_ms, Some(40));
    }

    /// An integer key written as a float (`1e3`, or by an encoder that writes every number as a
    /// double) is the integer while float64 holds it exactly; past that, or with a fraction, the error
    /// says why, not "invalid type: floating point".
    #[test]
    fn entity_keys_written_as_whole_floats_are_integers() {
        let key = |k: &str| {
            let body = format!(r#"{{"entities": {{"user_id": {k}}}}}"#);
            parse_body::<PredictRequest>(Format::Json, body.as_bytes())
                .map(|r| {
                    r.entities
                        .get("user_id")
                        .cloned()
                        .into_iter()
                        .collect::<Vec<_>>()
                })
                .map_err(|e| e.to_string())
        };
        assert_eq!(key("1e3"), Ok(vec![EntityKey::Int(1000)]));
        assert_eq!(key("-1000.0"), Ok(vec![EntityKey::Int(-1000)]));
        assert_eq!(
            key("9007199254740991.0"),
            Ok(vec![EntityKey::Int(9_007_199_254_740_991)])
        );
        for (bad, says) in [
            ("1.5", "got 1.5, which is not a whole number"),
            ("9007199254740993.0", "so write it as an integer"),
            ("-9223372036854775809", "out of int64 range"),
            ("-9.223372036854775808e18", "written as a float"),
            ("-1e19", "out of int64 range"),
            ("18446744073709551616", "out of int64 range"),
        ] {
            let e = key(bad).expect_err(bad);
            assert!(
                e.starts_with("entities.user_id: ") && e.contains(says),
                "{bad}: {e}"
            );
        }
        // The same in MessagePack, where a float is a float, and for `/v1/features`' key lists.
        let mp = rmp_serde::to_vec_named(&serde_json::json!({
            "entities": {"item_id": [7.0, 8]},
            "features": ["item_stats"],
        }))
        .expect("msgpack");
        let req = parse_body::<FeaturesRequest>(Format::Msgpack, &mp).expect("msgpack");
        assert_eq!(
            req.entities["item_id"].keys,
            vec![EntityKey::Int(7), EntityKey::Int(8)]
        );
        assert!(!req.entities["item_id"].scalar);
    }

    #[test]
    fn a_msgpack_body_nested_past_the_limit_names_the_field() {
        // `{"entities": {"user_id": "u_1"}, "context": {"hour_of_day": [[[...1]]]}}`, 200 lists deep:
        // past the limit of 128 levels. (serde_json skips over a value it does not keep without
        // recursing, so in JSON the same body decodes, and the plan refuses the list.)
        let mut mp = vec![0x82, 0xa8];
        mp.extend_from_slice(b"entities");
        mp.extend(
            rmp_serde::to_vec_named(&serde_json::json!({"user_id": "u_1"})).expect("msgpack"),
        );
        mp.push(0xa7);
        mp.extend_from_slice(b"context");
        mp.extend([0x81, 0xab]);
        mp.extend_from_slice(b"hour_of_day");
        mp.extend(std::iter::repeat_n(0x91, 200));
        mp.push(0x01);
        let e = parse_body::<PredictRequest>(Format::Msgpack, &mp).expect_err("too deep");
        assert_eq!(e.code(), "invalid_msgpack", "{e}");
        let ApiError::Malformed { field, message, .. } = &e else {
            panic!("{e:?}")
        };
        assert_eq!(field.as_deref(), Some("context.hour_of_day"), "{message}");
        assert_eq!(
            message,
            "the body is not valid MessagePack in context.hour_of_day: lists or maps nested more than 128 levels deep"
        );
        // 100 levels are still a body (whose list the plan then refuses, as it does in JSON).
        let mut ok = mp.clone();
        let at = ok.iter().position(|&b| b == 0x91).expect("lists");
        ok.drain(at..at + 100);
        assert!(parse_body::<PredictRequest>(Format::Msgpack, &ok).is_ok());
    }

    /// In MessagePack a wrong-typed value is a field error naming the field, as in JSON, also where
    /// the encoder wrote the request (or its options) as an array of fields.
    #[test]
    fn a_request_written_by_position_with_too_few_values_names_the_missing_field() {
        fn check<T: DeserializeOwned + Positional + fmt::Debug>(
            body: serde_json::Value,
            field: &str,
        ) {
            let packed = rmp_serde::to_vec(&body).expect("msgpack");
            let e = parse_body::<T>(Format::Msgpack, &packed).expect_err("a missing field");
            assert_eq!(e.code(), "invalid_field", "{body}: {e}");
            let ApiError::Malformed {
                field: Some(named),
                message,
                ..
            } = &e
            else {
                panic!("{body}: no field named: {e:?}");
            };
            assert_eq!(named, field, "{body}: {message}");
            // Not serde's words for a Rust type, which a caller has never seen.
            assert!(!message.contains("struct"), "{body}: {message}");
            assert!(
                message.contains(&format!("`{}`", field.rsplit('.').next().unwrap_or(field))),
                "{body}: {message}"
            );
        }
        check::<FeaturesRequest>(serde_json::json!([]), "entities");
        check::<FeaturesRequest>(serde_json::json!([{"user_id": ["u_1"]}]), "features");
        check::<crate::feast::OnlineFeaturesRequest>(serde_json::json!([]), "entities");
        check::<crate::prefetch::PrefetchRequest>(serde_json::json!([]), "entities");
        check::<crate::loader::RowsRequest>(serde_json::json!([]), "rows");
    }

    #[test]
    fn msgpack_type_errors_name_the_field_in_map_and_array_form() {
        let mp = |v: serde_json::Value| rmp_serde::to_vec_named(&v).expect("msgpack");
        for (body, field, says) in [
            (
                serde_json::json!({"entities": {"user_id": "u_1"}, "options": {"timings": "no"}}),
                "options.timings",
                "expected a boolean",
            ),
            (
                serde_json::json!({"entities": {"user_id": "u_1"}, "options": {"return_features": [1]}}),
                "options.return_features",
                "expected a boolean",
            ),
            // Array form: [entities, context, candidates, [return_features, timings, deadline_ms]].
            (
                serde_json::json!([{"user_id": "u_1"}, {}, [{"item_id": "i_1"}], [false, true, 0]]),
                "options.deadline_ms",
                "at least 1 millisecond",
            ),
            (
                serde_json::json!([{"user_id": "u_1"}, {}, [{"item_id": "i_1"}], ["yes"]]),
                "options.return_features",
                "expected a boolean",
            ),
            (
                serde_json::json!([{"user_id": "u_1"}, {}, [{"item_id": 1.5}]]),
                "candidates[0].item_id",
                "",
            ),
        ] {
            let e = parse_body::<PredictRequest>(Format::Msgpack, &mp(body.clone()))
                .expect_err("a type error");
            assert_eq!(e.code(), "invalid_field", "{body}: {e}");
            let text = e.to_string();
            assert!(
                text.starts_with(&format!("{field}: ")) && text.contains(says),
                "{body}: {text}"
            );
        }
        // Feast's flag says what it takes, as predict's options do.
        let e = parse_body::<crate::feast::OnlineFeaturesRequest>(
            Format::Msgpack,
            &mp(serde_json::json!({"features": ["user_profile:age"], "entities": {"user_id": ["u_1"]}, "full_feature_names": "yes"})),
        )
        .expect_err("a string for a flag");
        assert_eq!(
            e.to_string(),
            "full_feature_names: invalid type: string \"yes\", expected a boolean"
        );
        // Bodies that are broken, or too long, at a field name the field.
        for (body, code, field, says) in [
            // Options as an array of 4 values: it has 3 fields.
            (
                [
                    &[0x82u8, 0xa8][..],
                    b"entities",
                    &[0x81, 0xa7],
                    b"user_id",
                    &[0xa3],
                    b"u_1",
                    &[0xa7],
                    b"options",
                    &[0x94, 0xc2, 0xc3, 0xc0, 0xc0],
                ]
                .concat(),
                "invalid_field",
                "options",
                "more values than the 3 fields it takes",
            ),
            // A key that is not UTF-8.
            (
                [
                    &[0x81u8, 0xa8][..],
                    b"entities",
                    &[0x81, 0xa7],
                    b"user_id",
                    &[0xa2, 0xff, 0xfe],
                ]
                .concat(),
                "invalid_msgpack",
                "entities.user_id",
                "a string that is not UTF-8",
            ),
            // An extension value for a key.
            (
                [
                    &[0x81u8, 0xa8][..],
                    b"entities",
                    &[0x81, 0xa7],
                    b"user_id",
                    &[0xd4, 0x01, 0x00],
                ]
                .concat(),
                "invalid_field",
                "entities.user_id",
                "an extension value",
            ),
            // The reserved byte where a value should be.
            (
                [&[0x81u8, 0xa8][..], b"entities", &[0xc1]].concat(),
                "invalid_msgpack",
                "entities",
                "the reserved byte 0xc1",
            ),
            // Cut short inside a string, and a string whose length promises more than follows.
            (
                [
                    &[0x82u8, 0xa8][..],
                    b"entities",
                    &[0x81, 0xa7],
                    b"user_id",
                    &[0xa4],
                    b"u_",
                ]
                .concat(),
                "invalid_msgpack",
                "in entities.user_id",
                "it ends (at byte 22) in the middle of a value",
            ),
            (
                [
                    &[0x81u8, 0xa8][..],
                    b"entities",
                    &[0x81, 0xa7],
                    b"user_id",
                    &[0xdb, 0x7f, 0xff, 0xff, 0xff],
                    b"u",
                ]
                .concat(),
                "invalid_msgpack",
                "in entities.user_id",
                "a length that promises more than follows",
            ),
        ] {
            let e = parse_body::<PredictRequest>(Format::Msgpack, &body).expect_err(says);
            let text = e.to_string();
            assert_eq!(e.code(), code, "{says}: {text}");
            assert!(text.contains(field) && text.contains(says), "{text}");
            assert!(!text.contains("newtype"), "{text}");
        }
        // A map key that is not UTF-8 has no name: the field is its map, not `entities.?`.
        let body = [
            &[0x81u8, 0xa8][..],
            b"entities",
            &[0x81, 0xa2, 0xff, 0xfe, 0xa3],
            b"u_1",
        ]
        .concat();
        let e = parse_body::<PredictRequest>(Format::Msgpack, &body).expect_err("key not UTF-8");
        assert_eq!(e.code(), "invalid_msgpack");
        assert!(
            matches!(&e, ApiError::Malformed { field: Some(f), .. } if f == "entities"),
            "{e:?}"
        );
        assert!(
            e.to_string()
                .contains("in entities: a string that is not UTF-8"),
            "{e}"
        );
        // A number where a map is read by serde's typed path (a u64 visitor meeting a string).
        let e = parse_body::<FeaturesRequest>(
            Format::Msgpack,
            &mp(serde_json::json!([{"user_id": ["u_1"]}, ["user_profile"], {"timings": 5}])),
        )
        .expect_err("timings: 5");
        assert!(e.to_string().starts_with("options.timings: "), "{e}");
        // A whole request written as an array of too many values says it is the body.
        let e = parse_body::<PredictRequest>(
            Format::Msgpack,
            &mp(serde_json::json!([{"user_id": "u_1"}, null, null, null, null])),
        )
        .expect_err("five values");
        assert!(
            e.to_string()
                .starts_with("the body is an array of more values than the 4 fields"),
            "{e}"
        );
    }

    #[test]
    fn a_body_that_is_not_an_object_says_so() {
        for body in [&b"null"[..], b" 12", b"\"x\""] {
            let e = parse_body::<PredictRequest>(Format::Json, body).expect_err("not an object");
            assert_eq!(e.code(), "invalid_json");
            assert!(e.to_string().contains("not a JSON object"), "{e}");
        }
        // A byte order mark before the object is skipped.
        let bom = parse_body::<PredictRequest>(
            Format::Json,
            b"\xef\xbb\xbf{\"entities\": {\"user_id\": \"u_1\"}}",
        )
        .expect("an object after a BOM");
        assert!(bom.entities.contains_key("user_id"));
        let e = parse_body::<PredictRequest>(Format::Msgpack, br#"{"entities": {}}"#)
            .expect_err("JSON as MessagePack");
        assert_eq!(e.code(), "invalid_msgpack");
        assert!(
            e.to_string().contains("JSON sent as application/msgpack"),
            "{e}"
        );
    }

    #[test]
    fn invalid_json_inside_a_field_names_the_field() {
        let field = |e: &ApiError| match e {
            ApiError::Malformed { field, .. } => field.clone(),
            _ => None,
        };
        for (body, path) in [
            (
                &br#"{"entities": {"user_id": "u_1"}, "context": {"hour_of_day": 1e309}}"#[..],
                "context.hour_of_day",
            ),
            (
                br#"{"entities": {"user_id": "u_1"}, "options": {"deadline_ms": -1e400}}"#,
                "options.deadline_ms",
            ),
            (
                br#"{"entities": {"user_id": "u_1"}, "candidates": [{"item_id": "i"}, {"item_id": tru}]}"#,
                "candidates[1].item_id",
            ),
            // A key may hold any character, `?` included.
            (
                br#"{"entities": {"user_id": "u_1"}, "context": {"why?": tru}}"#,
                "context.why?",
            ),
        ] {
            let e = parse_body::<PredictRequest>(Format::Json, body).expect_err(path);
            assert_eq!(e.code(), "invalid_json");
            assert_eq!(field(&e).as_deref(), Some(path), "{e}");
            assert!(e.to_string().contains(&format!("in {path}: ")), "{e}");
        }
        // Outside any field, or at the end of the body: no field to name.
        for body in [
            &br#"{"entities" {"user_id": "u_1"}}"#[..],
            br#"{"entities": {"user_id": "u_1"}"#,
        ] {
            let e = parse_body::<PredictRequest>(Format::Json, body).expect_err("syntax");
            assert_eq!(e.code(), "invalid_json");
            assert_eq!(field(&e), None, "{e}");
        }
    }

    #[test]
    fn a_json_array_is_not_a_request_but_a_msgpack_one_is() {
        let e = parse_body::<PredictRequest>(Format::Json, br#" [{"user_id": "u_1"}]"#)
            .expect_err("an array");
        assert_eq!(e.code(), "invalid_json");
        assert!(e.to_string().contains("expected a JSON object"), "{e}");
        // Nor is `options` an array.
        let e = parse_body::<PredictRequest>(
            Format::Json,
            br#"{"entities": {"user_id": "u_1"}, "options": [true]}"#,
        )
        .expect_err("options as an array");
        assert_eq!(
            e.to_string(),
            "options: invalid type: sequence, expected an object"
        );
        let ok = parse_body::<PredictRequest>(
            Format::Json,
            br#"{"entities": {"user_id": "u_1"}, "options": {"timings": false}}"#,
        )
        .expect("options as an object");
        assert!(!ok.options.timings && !ok.options.return_features);
        // The same request as an object is fine.
        let ok = parse_body::<PredictRequest>(Format::Json, br#"{"entities": {"user_id": "u_1"}}"#)
            .expect("an object");
        assert_eq!(ok.entities.keys().collect::<Vec<_>>(), ["user_id"]);
        // rmp-serde's default encoding of a struct is an array of its fields in order.
        #[derive(serde::Serialize)]
        struct Req {
            entities: std::collections::BTreeMap<&'static str, &'static str>,
            context: std::collections::BTreeMap<&'static str, i64>,
            candidates: Option<Vec<()>>,
            options: (bool, bool, Option<u64>),
        }
        let packed = rmp_serde::to_vec(&Req {
            entities: [("user_id", "u_1")].into(),
            context: [("hour_of_day", 7)].into(),
            candidates: None,
            options: (true, false, Some(25)),
        })
        .expect("msgpack");
        assert_eq!(packed[0] & 0xf0, 0x90, "a fixarray");
        let req = parse_body::<PredictRequest>(Format::Msgpack, &packed).expect("msgpack array");
        assert_eq!(
            req.entities.get("user_id"),
            Some(&EntityKey::Str("u_1".into()))
        );
        assert_eq!(
            req.context.get("hour_of_day"),
            Some(&ContextValue::Value(Value::Int(7)))
        );
        assert!(req.options.return_features && !req.options.timings);
        assert_eq!(req.options.deadline_ms, Some(25));
    }

    #[test]
    fn the_answer_format_follows_accept_preferences() {
        let pick = |accept: &str, request: Format| {
            let mut h = HeaderMap::new();
            h.insert(
                header::ACCEPT,
                header::HeaderValue::from_str(accept).expect("header"),
            );
            Format::of_response(&h, request).expect("acceptable")
        };
        assert_eq!(pick("application/msgpack", Format::Json), Format::Msgpack);
        assert_eq!(
            pick("application/msgpack;q=0, application/json", Format::Msgpack),
            Format::Json
        );
        assert_eq!(
            pick(
                "application/json;q=0.5, application/msgpack;q=0.9",
                Format::Json
            ),
            Format::Msgpack
        );
        assert_eq!(pick("*/*", Format::Msgpack), Format::Msgpack);
        assert_eq!(pick("text/html, */*;q=0.1", Format::Json), Format::Json);
        assert_eq!(pick("text/html", Format::Msgpack), Format::Msgpack);
        assert_eq!(
            pick("application/json;q=x", Format::Msgpack),
            Format::Msgpack
        );
        // q=0 refuses a type, also where only a wildcard would have allowed it.
        assert_eq!(pick("application/json;q=0", Format::Json), Format::Msgpack);
        assert_eq!(
            pick("application/json;q=0, */*", Format::Json),
            Format::Msgpack
        );
        assert_eq!(
            pick("application/msgpack, application/json", Format::Json),
            Format::Msgpack,
            "equal q: the first named"
        );
        let mut h = HeaderMap::new();
        for refuse_both in ["*/*;q=0", "application/json;q=0, application/msgpack;q=0"] {
            h.insert(
                header::ACCEPT,
                header::HeaderValue::from_static(refuse_both),
            );
            let e = Format::of_response(&h, Format::Json).expect_err(refuse_both);
            assert_eq!(e.status(), axum::http::StatusCode::NOT_ACCEPTABLE);
        }
        // `Q=0` is `q=0`.
        assert_eq!(pick("application/json;Q=0", Format::Json), Format::Msgpack);
        // Two `Accept` lines are one list, in order.
        let lines = |first: &'static str, second: &'static str| {
            let mut h = HeaderMap::new();
            h.append(header::ACCEPT, header::HeaderValue::from_static(first));
            h.append(header::ACCEPT, header::HeaderValue::from_static(second));
            Format::of_response(&h, Format::Json)
        };
        assert_eq!(
            lines("application/json;q=0.1", "application/msgpack").expect("acceptable"),
            Format::Msgpack
        );
        let e = lines("application/json;q=0", "application/msgpack;q=0").expect_err("both refused");
        assert_eq!(e.status(), axum::http::StatusCode::NOT_ACCEPTABLE);
        assert!(e.to_string().contains("application/msgpack;q=0"), "{e}");
    }

    #[test]
    fn the_usual_accept_lines_are_answered_as_the_whole_list_reads_them() {
        for accept in ["application/json", "*/*"] {
            for request in [Format::Json, Format::Msgpack] {
                let mut h = HeaderMap::new();
                h.insert(header::ACCEPT, header::HeaderValue::from_static(accept));
                let usual = Format::of_response(&h, request).expect("acceptable");
                let listed = Format::of_accept_list(&h, request).expect("acceptable");
                assert_eq!(usual, listed, "{accept} for a {request:?} request");
            }
        }
        // A second line makes it a list: `*/*` then `application/json;q=0` refuses JSON.
        let mut h = HeaderMap::new();
        h.append(header::ACCEPT, header::HeaderValue::from_static("*/*"));
        h.append(
            header::ACCEPT,
            header::HeaderValue::from_static("application/json;q=0"),
        );
        assert_eq!(
            Format::of_response(&h, Format::Json).expect("acceptable"),
            Format::Msgpack
        );
    }

    #[test]
    fn fields_keep_the_order_sent_and_refuse_a_name_given_twice() {
        let f: Fields<i64> = serde_json::from_str(r#"{"b": 1, "a": 2}"#).expect("fields");
        assert_eq!(f.keys().collect::<Vec<_>>(), ["b", "a"]);
        assert_eq!(
            (f.get("a"), f.get("c"), f.keys().count()),
            (Some(&2), None, 2)
        );
        let e =
            serde_json::from_str::<Fields<i64>>(r#"{"a": 1, "b": 2, "a": 3}"#).expect_err("twice");
        assert!(e.to_string().contains("`a` is given twice"), "{e}");
        // Past 16 fields the check uses a set; it still finds the duplicate.
        let mut many: String = (0..40).map(|i| format!("\"k{i}\": {i}, ")).collect();
        many.push_str("\"k3\": 0");
        let e = serde_json::from_str::<Fields<i64>>(&format!("{{{many}}}")).expect_err("twice");
        assert!(e.to_string().contains("`k3` is given twice"), "{e}");
        let too_many: Vec<String> = (0..=MAX_FIELDS).map(|i| format!("\"k{i}\": 0")).collect();
        let e = serde_json::from_str::<Fields<i64>>(&format!("{{{}}}", too_many.join(",")))
            .expect_err("too many");
        assert!(e.to_string().contains("more than 1024 fields"), "{e}");
        assert!(serde_json::from_str::<Fields<i64>>("[1]").is_err());
    }
}
