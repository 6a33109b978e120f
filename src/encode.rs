//! Stage `encode`: writes response bodies in the negotiated format (JSON or MessagePack) and adds the
//! `Server-Timing` header.
//!
//! Bodies are written field by field so the encode stage can time itself: every field but `timings_us` is
//! written and timed, then `timings_us` (with that encode time) is appended.

use axum::body::{Body, Bytes};
use axum::http::{HeaderName, HeaderValue, header};
use axum::response::Response;
use serde::Serialize;

use crate::decode::Format;
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
        match self.format {
            Format::Json => {
                if !self.first {
                    self.buf.push(b',');
                }
                // Writing plain data into a Vec cannot fail.
                let _ = serde_json::to_writer(&mut self.buf, key);
                self.buf.push(b':');
                let _ = serde_json::to_writer(&mut self.buf, value);
            }
            Format::Msgpack => {
                let _ = rmp::encode::write_str(&mut self.buf, key);
                let _ = value
                    .serialize(&mut rmp_serde::Serializer::new(&mut self.buf).with_struct_map());
            }
        }
        self.first = false;
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
    if let Ok(v) = HeaderValue::from_maybe_shared(into_bytes(timings.server_timing().into_bytes()))
    {
        h.insert(SERVER_TIMING, v);
    }
    resp
}
