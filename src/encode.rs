//! Stage `encode`: writes response bodies in the negotiated format (JSON or MessagePack) and adds the
//! `Server-Timing` header.
//!
//! Bodies are written field by field so the encode stage can time itself: every field but `timings_us` is
//! written and timed, then `timings_us` (with that encode time) is appended.

use axum::body::{Body, Bytes};
use axum::http::{HeaderName, HeaderValue, header};
use axum::response::Response;
use serde::Serialize;
use serde_json::ser::{CompactFormatter, Formatter};

use crate::decode::Format;
use crate::hydrate::CacheOutcome;
use crate::telemetry::{Stage, Timings};

/// A map-shaped body written one field at a time.
pub struct BodyWriter {
    format: Format,
    buf: Vec<u8>,
    first: bool,
}

impl BodyWriter {
    /// Starts a body of exactly `fields` fields (MessagePack writes the count up front).
    pub fn new(format: Format, fields: u32, capacity: usize) -> Self {
        let mut buf = Vec::with_capacity(capacity);
        match format {
            Format::Json => buf.push(b'{'),
            Format::Msgpack => {
                let _ = rmp::encode::write_map_len(&mut buf, fields);
            }
        }
        Self {
            format,
            buf,
            first: true,
        }
    }

    pub fn field<T: Serialize + ?Sized>(&mut self, key: &str, value: &T) {
        if self.json_key(key) {
            // Writing plain data into a Vec cannot fail.
            let _ = serde_json::to_writer(&mut self.buf, value);
        } else {
            self.msgpack_value(value);
        }
    }

    /// [`field`](Self::field) for a value whose JSON is written by hand ([`WriteJson`]).
    pub fn fast_field<T: WriteJson + ?Sized>(&mut self, key: &str, value: &T) {
        if self.json_key(key) {
            value.write_json(&mut self.buf);
        } else {
            self.msgpack_value(value);
        }
    }

    /// Starts a field: in JSON writes the separator and `"key":` and answers true; in MessagePack writes
    /// the key and answers false, for the caller to write the value.
    fn json_key(&mut self, key: &str) -> bool {
        let first = std::mem::replace(&mut self.first, false);
        match self.format {
            Format::Json => {
                // Field names are hydrant's own, plain lowercase words: nothing to escape.
                debug_assert!(key.bytes().all(|b| b.is_ascii_lowercase() || b == b'_'));
                self.buf.reserve(key.len() + 4);
                self.buf
                    .extend_from_slice(if first { &b"\""[..] } else { &b",\""[..] });
                self.buf.extend_from_slice(key.as_bytes());
                self.buf.extend_from_slice(b"\":");
                true
            }
            Format::Msgpack => {
                let _ = rmp::encode::write_str(&mut self.buf, key);
                false
            }
        }
    }

    fn msgpack_value<T: Serialize + ?Sized>(&mut self, value: &T) {
        let _ = value.serialize(&mut rmp_serde::Serializer::new(&mut self.buf).with_struct_map());
    }

    pub fn finish(mut self) -> Vec<u8> {
        if self.format == Format::Json {
            self.buf.push(b'}');
        }
        self.buf
    }
}

/// `timings_us` as it appears in bodies.
#[derive(Serialize)]
pub struct TimingsBody {
    decode: u64,
    hydrate: u64,
    assemble: u64,
    queue: u64,
    infer: u64,
    postprocess: u64,
    encode: u64,
    total: u64,
}

impl From<&Timings> for TimingsBody {
    fn from(t: &Timings) -> Self {
        Self {
            decode: t.get(Stage::Decode),
            hydrate: t.get(Stage::Hydrate),
            assemble: t.get(Stage::Assemble),
            queue: t.get(Stage::Queue),
            infer: t.get(Stage::Infer),
            postprocess: t.get(Stage::Postprocess),
            encode: t.get(Stage::Encode),
            total: t.total_us,
        }
    }
}

/// A value whose JSON is written by hand, byte for byte what serde_json writes for its `Serialize`.
/// serde_json scans every string it writes for characters to escape, the names of a predict answer's
/// fields included: about 120 instructions a string, two dozen strings an answer, which made that scan
/// the encode stage's largest cost on the hot path (`scripts/bench-instructions.sh`).
pub trait WriteJson: Serialize {
    fn write_json(&self, buf: &mut Vec<u8>);
}

/// Writes `s` as a JSON string. Text with no `"`, `\` or control character, as every name hydrant
/// checks is, needs no escaping and is copied; anything else is escaped by serde_json.
pub fn push_json_str(buf: &mut Vec<u8>, s: &str) {
    if s.bytes().all(|b| b >= 0x20 && b != b'"' && b != b'\\') {
        buf.reserve(s.len() + 2);
        buf.push(b'"');
        buf.extend_from_slice(s.as_bytes());
        buf.push(b'"');
    } else {
        // Writing into a Vec cannot fail.
        let _ = serde_json::to_writer(&mut *buf, s);
    }
}

/// Writes a JSON array: `item` writes each element, with commas between.
pub fn push_json_array<T>(
    buf: &mut Vec<u8>,
    items: impl IntoIterator<Item = T>,
    mut item: impl FnMut(&mut Vec<u8>, T),
) {
    buf.push(b'[');
    for (i, x) in items.into_iter().enumerate() {
        if i > 0 {
            buf.push(b',');
        }
        item(buf, x);
    }
    buf.push(b']');
}

/// Writes a JSON object from `(name, value)` members: `value` writes each value.
pub fn push_json_object<'n, T>(
    buf: &mut Vec<u8>,
    members: impl IntoIterator<Item = (&'n str, T)>,
    mut value: impl FnMut(&mut Vec<u8>, T),
) {
    buf.push(b'{');
    for (i, (name, x)) in members.into_iter().enumerate() {
        if i > 0 {
            buf.push(b',');
        }
        push_json_str(buf, name);
        buf.push(b':');
        value(buf, x);
    }
    buf.push(b'}');
}

/// Writes `n` in decimal, with serde_json's own number formatter.
pub fn push_json_uint(buf: &mut Vec<u8>, n: u64) {
    // Writing into a Vec cannot fail.
    let _ = CompactFormatter.write_u64(buf, n);
}

/// Writes `x` as serde_json does, with its own number formatter (the shortest text that reads back as
/// the same float32), and `null` for NaN and the infinities, which JSON has no number for.
pub fn push_json_f32(buf: &mut Vec<u8>, x: f32) {
    if x.is_finite() {
        let _ = CompactFormatter.write_f32(buf, x);
    } else {
        buf.extend_from_slice(b"null");
    }
}

impl WriteJson for str {
    fn write_json(&self, buf: &mut Vec<u8>) {
        push_json_str(buf, self);
    }
}

impl WriteJson for String {
    fn write_json(&self, buf: &mut Vec<u8>) {
        push_json_str(buf, self);
    }
}

impl WriteJson for u32 {
    fn write_json(&self, buf: &mut Vec<u8>) {
        push_json_uint(buf, u64::from(*self));
    }
}

impl WriteJson for bool {
    fn write_json(&self, buf: &mut Vec<u8>) {
        buf.extend_from_slice(if *self { b"true" } else { b"false" });
    }
}

/// Writes an object of whole numbers from `(token, number)` pairs, each token the member's separator,
/// quoted name and colon as literal bytes (`{"hits":`, `,"stale":`): copied in a move or two, with no
/// string to scan.
fn push_json_numbers(buf: &mut Vec<u8>, members: &[(&[u8], u64)]) {
    for (token, n) in members {
        buf.extend_from_slice(token);
        push_json_uint(buf, *n);
    }
    buf.push(b'}');
}

impl WriteJson for TimingsBody {
    fn write_json(&self, buf: &mut Vec<u8>) {
        push_json_numbers(
            buf,
            &[
                (b"{\"decode\":", self.decode),
                (b",\"hydrate\":", self.hydrate),
                (b",\"assemble\":", self.assemble),
                (b",\"queue\":", self.queue),
                (b",\"infer\":", self.infer),
                (b",\"postprocess\":", self.postprocess),
                (b",\"encode\":", self.encode),
                (b",\"total\":", self.total),
            ],
        );
    }
}

impl WriteJson for CacheOutcome {
    fn write_json(&self, buf: &mut Vec<u8>) {
        push_json_numbers(
            buf,
            &[
                (b"{\"hits\":", u64::from(self.hits)),
                (b",\"stale\":", u64::from(self.stale)),
                (b",\"misses\":", u64::from(self.misses)),
            ],
        );
    }
}

/// The `Server-Timing` response header.
pub const SERVER_TIMING: HeaderName = HeaderName::from_static("server-timing");

/// `v` as `Bytes` without a second allocation. `Bytes::from(Vec)` allocates a reference-count block
/// whenever the length is short of the capacity; trimming first does not (the allocator shrinks a block
/// in place when the new size is at least half the old one, as it is for bodies and headers written
/// into a fitting guess).
pub fn into_bytes(v: Vec<u8>) -> Bytes {
    Bytes::from(v.into_boxed_slice())
}

/// A 200 response with the body, its content type and `Server-Timing`.
pub fn respond(format: Format, body: Vec<u8>, timings: &Timings) -> Response {
    let mut resp = Response::new(Body::from(into_bytes(body)));
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static(format.content_type()),
    );
    if let Ok(v) = HeaderValue::from_maybe_shared(into_bytes(timings.server_timing())) {
        h.insert(SERVER_TIMING, v);
    }
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    fn serde(v: &impl Serialize) -> String {
        serde_json::to_string(v).unwrap_or_default()
    }

    fn fast(v: &(impl WriteJson + ?Sized)) -> String {
        let mut buf = Vec::new();
        v.write_json(&mut buf);
        String::from_utf8(buf).unwrap_or_default()
    }

    #[test]
    fn strings_are_written_as_serde_json_writes_them() {
        for s in [
            "",
            "score",
            "PRESENT",
            "out:0",
            "a b",
            "q\"uote",
            "back\\slash",
            "tab\there",
            "line\nbreak",
            "\u{1}",
            "\u{1f}",
            "\u{7f}",
            "café",
            "🦀 crab",
            "</script>",
        ] {
            assert_eq!(fast(s), serde(&s), "{s:?}");
            assert_eq!(fast(&s.to_owned()), serde(&s), "{s:?}");
        }
    }

    #[test]
    fn numbers_are_written_as_serde_json_writes_them() {
        for x in [
            0.0f32,
            -0.0,
            1.0,
            -1.0,
            0.1,
            0.499_365_12,
            1e7,
            1.5e-7,
            f32::MIN_POSITIVE,
            1e-45,
            f32::MAX,
            f32::MIN,
            f32::NAN,
            f32::INFINITY,
            f32::NEG_INFINITY,
        ] {
            let mut buf = Vec::new();
            push_json_f32(&mut buf, x);
            assert_eq!(String::from_utf8_lossy(&buf), serde(&x), "{x}");
        }
        for n in [0u32, 7, 10, 999, 1000, u32::MAX] {
            assert_eq!(fast(&n), serde(&n));
        }
        for n in [0u64, 1, 123_456_789, u64::MAX] {
            let mut buf = Vec::new();
            push_json_uint(&mut buf, n);
            assert_eq!(String::from_utf8_lossy(&buf), serde(&n));
        }
        assert_eq!(fast(&true), "true");
        assert_eq!(fast(&false), "false");
    }

    #[test]
    fn timings_and_cache_outcomes_are_written_as_serde_json_writes_them() {
        let mut t = Timings::default();
        for (i, stage) in Stage::ALL.into_iter().enumerate() {
            t.set(stage, (i as u64 + 1) * 1001);
        }
        t.total_us = u64::MAX;
        let body = TimingsBody::from(&t);
        assert_eq!(fast(&body), serde(&body));
        let c = CacheOutcome {
            hits: 3,
            stale: 0,
            misses: u32::MAX,
        };
        assert_eq!(fast(&c), serde(&c));
    }

    /// A body of hand-written fields is, byte for byte, what serde writes for the same struct, in both
    /// formats (JSON with serde_json, MessagePack with rmp-serde's named fields).
    #[test]
    fn fast_fields_make_the_body_serde_makes() {
        #[derive(Serialize)]
        struct Answer<'a> {
            model: &'a str,
            model_version: u32,
            degraded: bool,
            cache: CacheOutcome,
            timings_us: TimingsBody,
        }
        let mut t = Timings::default();
        t.set(Stage::Queue, 1234);
        t.total_us = 99_999;
        let want = Answer {
            model: "ctr",
            model_version: 7,
            degraded: true,
            cache: CacheOutcome {
                hits: 1,
                stale: 2,
                misses: 3,
            },
            timings_us: TimingsBody::from(&t),
        };
        for format in [Format::Json, Format::Msgpack] {
            let mut w = BodyWriter::new(format, 5, 16);
            w.fast_field("model", want.model);
            w.fast_field("model_version", &want.model_version);
            w.fast_field("degraded", &want.degraded);
            w.fast_field("cache", &want.cache);
            w.fast_field("timings_us", &TimingsBody::from(&t));
            let serde = match format {
                Format::Json => serde_json::to_vec(&want).unwrap_or_default(),
                Format::Msgpack => rmp_serde::to_vec_named(&want).unwrap_or_default(),
            };
            assert!(!serde.is_empty());
            assert_eq!(w.finish(), serde, "{format:?}");
        }
    }
}
