//! A predict request's JSON in its usual shape, read by hand.
//!
//! serde's derived decoding of a predict body was the largest single cost of a hot-path request (about
//! 6,000 instructions for ~120 bytes; `scripts/bench-instructions.sh`). The usual body is small and
//! plain: `entities`, `context`, `candidates` and `options`, with strings free of escapes, integers and
//! booleans. This reads exactly that and answers `None` for anything else (escapes, floats, lists, an
//! option out of range, an unknown or repeated field, a syntax error), which then goes to serde, so every
//! error and every unusual input is decoded as before. Whatever it does read, it reads as serde does: a test compares the two on
//! thousands of generated bodies.

use compact_str::CompactString;
use smallvec::SmallVec;

use crate::decode::{Candidates, ContextValue, EntityKey, Fields, Options, PredictRequest};
use crate::value::Value;

/// Fields one object may carry here; more goes to serde (which allows 1,024).
const MAX_FIELDS: usize = 16;

/// `body` as a predict request, or `None` to leave it to serde. A list of more than `max_candidates`
/// candidates is left to serde too, which holds no more of them than that
/// ([`crate::decode::with_candidate_limit`]).
pub fn parse(body: &[u8], max_candidates: usize) -> Option<PredictRequest> {
    // Checked once as a whole: a string then ends at an ASCII quote, so slicing it out needs only the
    // boundary check of `str::get`, not another pass over its bytes. A body that is not UTF-8 is
    // serde's to refuse.
    let text = std::str::from_utf8(body).ok()?;
    let mut p = Reader {
        s: text,
        b: body,
        i: 0,
    };
    let (mut entities, mut context, mut candidates, mut options) = (None, None, None, None);
    p.object(|p, key| {
        match key {
            "entities" if entities.is_none() => {
                entities = Some(p.or_null(|p| p.fields(Reader::entity_key))?);
            }
            "context" if context.is_none() => {
                context = Some(p.or_null(|p| p.fields(Reader::context_value))?);
            }
            "candidates" if candidates.is_none() => {
                // `null` is no list (serde's default for the `Option`), not an empty one.
                candidates = Some(if p.null()? {
                    None
                } else {
                    Some(p.candidates(max_candidates)?)
                });
            }
            "options" if options.is_none() => {
                options = Some(p.or_null(Reader::options)?);
            }
            // An unknown field, or one given twice: serde's to refuse.
            _ => return None,
        }
        Some(())
    })?;
    p.skip_space();
    if p.i != body.len() {
        return None;
    }
    Some(PredictRequest {
        entities: entities.unwrap_or_default(),
        context: context.unwrap_or_default(),
        candidates: candidates.flatten(),
        options: options.unwrap_or_default(),
    })
}

/// Most candidates room is made for before the first is read (more still grow the list).
const RESERVED_CANDIDATES: usize = 1024;

struct Reader<'a> {
    /// The body, known to be UTF-8.
    s: &'a str,
    /// `s`'s bytes.
    b: &'a [u8],
    i: usize,
}

impl<'a> Reader<'a> {
    fn skip_space(&mut self) {
        while let Some(b' ' | b'\t' | b'\n' | b'\r') = self.b.get(self.i) {
            self.i += 1;
        }
    }

    /// The next byte after white space, not taken.
    fn peek(&mut self) -> Option<u8> {
        self.skip_space();
        self.b.get(self.i).copied()
    }

    /// Takes `c`, after white space, if it is next.
    fn consume(&mut self, c: u8) -> Option<()> {
        (self.peek()? == c).then(|| self.i += 1)
    }

    /// After a member: `,` (true, another follows) or `end` (false).
    fn next_or_end(&mut self, end: u8) -> Option<bool> {
        let c = self.peek()?;
        self.i += 1;
        match c {
            b',' => Some(true),
            c if c == end => Some(false),
            _ => None,
        }
    }

    fn word(&mut self, w: &[u8]) -> Option<()> {
        self.skip_space();
        let rest = self.b.get(self.i..)?;
        rest.starts_with(w).then(|| self.i += w.len())
    }

    /// Takes a `null` if one is next.
    fn null(&mut self) -> Option<bool> {
        if self.peek()? == b'n' {
            self.word(b"null")?;
            Some(true)
        } else {
            Some(false)
        }
    }

    /// `null` as the default, as the `null_default` fields read it.
    fn or_null<T: Default>(&mut self, read: impl FnOnce(&mut Self) -> Option<T>) -> Option<T> {
        if self.null()? {
            Some(T::default())
        } else {
            read(self)
        }
    }

    /// A string with no escape and no control character.
    fn string(&mut self) -> Option<&'a str> {
        self.consume(b'"')?;
        let start = self.i;
        loop {
            match *self.b.get(self.i)? {
                b'"' => break,
                b'\\' | 0..=0x1f => return None,
                _ => self.i += 1,
            }
        }
        let s = self.s.get(start..self.i)?;
        self.i += 1;
        Some(s)
    }

    /// An integer of at most 18 digits, not `-0` (which JSON readers take as a float), with no fraction
    /// or exponent.
    fn integer(&mut self) -> Option<i64> {
        self.skip_space();
        let negative = self.b.get(self.i) == Some(&b'-');
        if negative {
            self.i += 1;
        }
        let start = self.i;
        let mut n: i64 = 0;
        while let Some(&c @ b'0'..=b'9') = self.b.get(self.i) {
            // A 19th digit could take `n` past int64: such a number is serde's to read.
            if self.i - start == 18 {
                return None;
            }
            n = n * 10 + i64::from(c - b'0');
            self.i += 1;
        }
        let digits = self.i - start;
        let leading_zero = digits > 1 && self.b[start] == b'0';
        if digits == 0 || leading_zero || (negative && n == 0) {
            return None;
        }
        if let Some(b'.' | b'e' | b'E') = self.b.get(self.i) {
            return None;
        }
        Some(if negative { -n } else { n })
    }

    fn entity_key(&mut self) -> Option<EntityKey> {
        if self.peek()? == b'"' {
            Some(EntityKey::Str(CompactString::from(self.string()?)))
        } else {
            self.integer().map(EntityKey::Int)
        }
    }

    fn context_value(&mut self) -> Option<ContextValue> {
        let v = match self.peek()? {
            b'"' => Value::Str(self.string()?.into()),
            b't' => self.word(b"true").map(|()| Value::Bool(true))?,
            b'f' => self.word(b"false").map(|()| Value::Bool(false))?,
            b'n' => self.word(b"null").map(|()| Value::Null)?,
            b'-' | b'0'..=b'9' => Value::Int(self.integer()?),
            _ => return None,
        };
        Some(ContextValue::Value(v))
    }

    /// Walks an object: takes `{`, then for each member its name and `:`, and `member` reads the value;
    /// then `}`.
    fn object(&mut self, mut member: impl FnMut(&mut Self, &'a str) -> Option<()>) -> Option<()> {
        self.consume(b'{')?;
        if self.peek()? == b'}' {
            self.i += 1;
            return Some(());
        }
        loop {
            let name = self.string()?;
            self.consume(b':')?;
            member(self, name)?;
            if !self.next_or_end(b'}')? {
                return Some(());
            }
        }
    }

    /// Walks an array: takes `[`, `item` reads each element, then `]`.
    fn array(&mut self, mut item: impl FnMut(&mut Self) -> Option<()>) -> Option<()> {
        self.consume(b'[')?;
        if self.peek()? == b']' {
            self.i += 1;
            return Some(());
        }
        loop {
            item(self)?;
            if !self.next_or_end(b']')? {
                return Some(());
            }
        }
    }

    /// An object of names to values, each name once.
    fn fields<V>(&mut self, value: impl Fn(&mut Self) -> Option<V>) -> Option<Fields<V>> {
        let mut out: SmallVec<[(CompactString, V); 4]> = SmallVec::new();
        self.object(|p, name| {
            let v = value(p)?;
            if out.len() == MAX_FIELDS || out.iter().any(|(n, _)| n == name) {
                return None;
            }
            out.push((CompactString::from(name), v));
            Some(())
        })?;
        Some(Fields::from_parts(out))
    }

    /// `true`, `false`, or `null` for `default`.
    fn flag(&mut self, default: bool) -> Option<bool> {
        match self.peek()? {
            b't' => self.word(b"true").map(|()| true),
            b'f' => self.word(b"false").map(|()| false),
            b'n' => self.word(b"null").map(|()| default),
            _ => None,
        }
    }

    /// The `options` object, each option once. A deadline of 0 or less, or one written as a float, is
    /// serde's to refuse or read.
    fn options(&mut self) -> Option<Options> {
        let d = Options::default();
        let (mut features, mut timings, mut deadline) = (None, None, None);
        self.object(|p, name| {
            match name {
                "return_features" if features.is_none() => {
                    features = Some(p.flag(d.return_features)?);
                }
                "timings" if timings.is_none() => timings = Some(p.flag(d.timings)?),
                "deadline_ms" if deadline.is_none() => {
                    deadline = Some(if p.null()? {
                        None
                    } else {
                        Some(u64::try_from(p.integer()?).ok().filter(|&ms| ms > 0)?)
                    });
                }
                _ => return None,
            }
            Some(())
        })?;
        Some(Options {
            return_features: features.unwrap_or(d.return_features),
            timings: timings.unwrap_or(d.timings),
            deadline_ms: deadline.unwrap_or(d.deadline_ms),
        })
    }

    fn candidates(&mut self, limit: usize) -> Option<Candidates> {
        // Each entry is some 200 bytes (its fields inline): grown by doubling, a hundred candidates were
        // copied about twice each, a sixth of reading a ranking body. Past the first few, room is made
        // at once for as many as the rest of the body has objects, up to a bound.
        let mut out = Vec::with_capacity(4);
        let mut reserved = false;
        self.array(|p| {
            if out.len() == limit {
                return None;
            }
            if out.len() == out.capacity() && !reserved {
                reserved = true;
                let objects = p.b.get(p.i..)?.iter().filter(|&&c| c == b'{').count();
                out.reserve(objects.min(RESERVED_CANDIDATES).min(limit));
            }
            out.push(p.fields(Reader::entity_key)?);
            Some(())
        })?;
        Some(Candidates::new(out))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn serde(body: &str) -> Option<PredictRequest> {
        serde_json::from_slice(body.as_bytes()).ok()
    }

    #[test]
    fn the_usual_bodies_are_read_as_serde_reads_them() {
        for body in [
            r#"{"entities": {"user_id": "u_42"}, "context": {"hour_of_day": 13, "device": "ios"}, "candidates": [{"item_id": "i_7"}]}"#,
            r#"{"entities":{"user_id":"u_1"},"candidates":[{"item_id":"i_1"},{"item_id":"i_2"},{"item_id":3}]}"#,
            r#"{"entities": {"user_id": 42}, "context": {"premium": true, "country": null, "offset": -3}}"#,
            r#"{"context": null, "entities": null, "candidates": null}"#,
            r#"{"candidates": [], "entities": {}}"#,
            "{}",
            " \t\r\n{ \"entities\" : { \"user_id\" : \"é🦀\" } } \n",
            r#"{"entities": {"user_id": "u_42"}, "candidates": [{"item_id": "i_7"}], "options": {"timings": true}}"#,
            r#"{"options": {"timings": false, "return_features": true, "deadline_ms": 25}}"#,
            r#"{"options": {"timings": null, "return_features": null, "deadline_ms": null}}"#,
            r#"{"options": {}, "entities": {"user_id": "u_1"}}"#,
            r#"{"options": null}"#,
            r#"{"options": {"deadline_ms": 999999999999999999}}"#,
        ] {
            let fast = parse(body.as_bytes(), usize::MAX);
            assert!(fast.is_some(), "{body}");
            assert_eq!(fast, serde(body), "{body}");
        }
    }

    #[test]
    fn anything_unusual_is_left_to_serde() {
        for body in [
            r#"{"entities": {"user_id": "u\"1"}}"#,
            r#"{"options": {"timings": false}, "options": {"timings": true}}"#,
            r#"{"options": {"timings": false, "timings": true}}"#,
            r#"{"options": {"timings": 1}}"#,
            r#"{"options": {"timings": "yes"}}"#,
            r#"{"options": {"deadline_ms": 0}}"#,
            r#"{"options": {"deadline_ms": -5}}"#,
            r#"{"options": {"deadline_ms": 25.0}}"#,
            r#"{"options": {"deadline_ms": "25"}}"#,
            r#"{"options": {"verbose": true}}"#,
            r#"{"options": [true]}"#,
            r#"{"entities": {"user_id": "u_1"}, "entities": {"user_id": "u_2"}}"#,
            r#"{"entities": {"user_id": "u_1", "user_id": "u_2"}}"#,
            r#"{"entities": {"user_id": "u_1"}, "extra": 1}"#,
            r#"{"context": {"x": 1.5}}"#,
            r#"{"context": {"x": 1e3}}"#,
            r#"{"context": {"x": -0}}"#,
            r#"{"context": {"x": 007}}"#,
            r#"{"context": {"x": 1234567890123456789}}"#,
            r#"{"context": {"x": 99999999999999999999999}}"#,
            r#"{"context": {"x": -99999999999999999999999}}"#,
            r#"{"context": {"x": [1, 2]}}"#,
            r#"{"entities": {"user_id": "u_1"},}"#,
            r#"{"entities": {"user_id": "u_1"}} x"#,
            r#"{"entities": {"user_id": "u_1"}"#,
            "\u{feff}{}",
            "[]",
            "",
        ] {
            assert_eq!(parse(body.as_bytes(), usize::MAX), None, "{body}");
        }
    }

    /// Generated bodies, plain and broken: whenever the reader takes one, serde reads the same request.
    #[test]
    fn what_the_reader_takes_serde_reads_the_same() {
        let mut rng = fastrand::Rng::with_seed(0x6879_6472);
        let strings = [
            "u_1", "i_7", "", "ios", "é", "a b", "q\\\"x", "tab\\t", "\\u0041",
        ];
        let numbers = [
            "0",
            "7",
            "-3",
            "-0",
            "12",
            "007",
            "1.5",
            "2e3",
            "999999999999999999",
            "1e400",
        ];
        let scalar = |rng: &mut fastrand::Rng| -> String {
            match rng.usize(0..7) {
                0 | 1 => format!("\"{}\"", strings[rng.usize(0..strings.len())]),
                2 | 3 => numbers[rng.usize(0..numbers.len())].to_owned(),
                4 => ["true", "false", "null"][rng.usize(0..3)].to_owned(),
                5 => "[1, 2.5]".to_owned(),
                _ => "{}".to_owned(),
            }
        };
        let names = [
            "user_id",
            "item_id",
            "device",
            "hour_of_day",
            "x",
            "user_id",
        ];
        // An object of up to 3 members, names drawn from `names`, values made by `value`.
        let object_of = |rng: &mut fastrand::Rng,
                         names: &[&str],
                         value: &dyn Fn(&mut fastrand::Rng) -> String|
         -> String {
            let members: Vec<String> = (0..rng.usize(0..4))
                .map(|_| format!("\"{}\": {}", names[rng.usize(0..names.len())], value(rng)))
                .collect();
            format!("{{{}}}", members.join(", "))
        };
        let object = |rng: &mut fastrand::Rng| object_of(rng, &names, &scalar);
        let option_names = [
            "timings",
            "return_features",
            "deadline_ms",
            "timings",
            "other",
        ];
        let option_values = [
            "true", "false", "null", "0", "1", "25", "-1", "2.0", "\"x\"", "{}",
        ];
        let option_value =
            |rng: &mut fastrand::Rng| option_values[rng.usize(0..option_values.len())].to_owned();
        let options = |rng: &mut fastrand::Rng| object_of(rng, &option_names, &option_value);
        let keys = [
            "entities",
            "context",
            "candidates",
            "options",
            "entities",
            "other",
        ];
        let mut taken = 0;
        for _ in 0..20_000 {
            let n = rng.usize(0..4);
            let members: Vec<String> = (0..n)
                .map(|_| {
                    let key = keys[rng.usize(0..keys.len())];
                    let value = match (key, rng.usize(0..6)) {
                        (_, 0) => "null".to_owned(),
                        ("candidates", _) => {
                            let c: Vec<String> =
                                (0..rng.usize(0..5)).map(|_| object(&mut rng)).collect();
                            format!("[{}]", c.join(","))
                        }
                        ("options", _) => options(&mut rng),
                        (_, 1) => scalar(&mut rng),
                        _ => object(&mut rng),
                    };
                    format!("\"{key}\":{value}")
                })
                .collect();
            let mut body = format!("{{{}}}", members.join(",")).into_bytes();
            // Sometimes broken: cut short (even inside a character), or a byte changed.
            match rng.usize(0..8) {
                0 => body.truncate(rng.usize(0..=body.len())),
                1 if !body.is_empty() => {
                    let at = rng.usize(0..body.len());
                    body[at] = b" ,:{}[]\"0-x\xff"[rng.usize(0..12)];
                }
                _ => {}
            }
            // Half the time a candidate limit of 1 to 3, which both readers must keep to.
            let limit = if rng.bool() {
                usize::MAX
            } else {
                rng.usize(1..4)
            };
            let serde = || -> Option<PredictRequest> {
                crate::decode::with_candidate_limit(limit, || serde_json::from_slice(&body).ok())
            };
            match parse(&body, limit) {
                Some(fast) => {
                    taken += 1;
                    assert_eq!(Some(fast), serde(), "{}", String::from_utf8_lossy(&body));
                }
                // Past the limit serde holds `limit` of them and counts the rest.
                None => {
                    if let Some(c) = serde().and_then(|r| r.candidates) {
                        assert!(c.len() <= limit && c.len() <= c.sent());
                        assert!(c.len() == c.sent() || c.len() == limit);
                    }
                }
            }
        }
        // Enough of the generated bodies are plain for the comparison to mean something.
        assert!(taken > 2_000, "only {taken} bodies were read by hand");
    }
}
