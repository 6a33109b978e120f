//! A cached record's values, packed into one allocation.
//!
//! The feature cache holds every entity it has read, so what one record costs is what a million of
//! them cost. Held as a `Box<[Value]>`, the demo `user_profile` record took four allocations: the
//! slice (24 bytes a value), its string and its list, each rounded up by the allocator. [`Packed`]
//! holds the same values in one buffer:
//!
//! ```text
//! [n: u32][tag: u8; n][slot: u32; n][tail]
//! ```
//!
//! A tag says what value `i` is and how its slot reads: a boolean or null is its tag alone; an integer
//! that fits in an `i32`, and a float that float32 holds exactly (every value of a float32 feature), is
//! its slot; anything longer is in the tail, at the offset in its slot (8 bytes for a number, a `u32`
//! length and the bytes for a string or a list). So any value is read in constant time with one or
//! two loads, since the model's input is assembled by reading each feature of each entity in turn,
//! and a float reads back bit for bit as the `f64` that was packed.

use serde::ser::SerializeSeq;
use serde::{Serialize, Serializer};

use crate::value::Value;

const NULL: u8 = 0;
const FALSE: u8 = 1;
const TRUE: u8 = 2;
const INT32: u8 = 3;
const INT64: u8 = 4;
const FLOAT32: u8 = 5;
const FLOAT64: u8 = 6;
const STR: u8 = 7;
const LIST: u8 = 8;

/// Bytes before the tags: the count.
const HEAD: usize = 4;

/// A record's values in one buffer ([the module docs](self) give the layout).
#[derive(Clone, PartialEq, Eq)]
pub struct Packed(Box<[u8]>);

impl Packed {
    /// Packs `values`. Holds at most `u32::MAX` values of up to 4 GiB in all, far past any view's limits.
    pub fn new(values: &[Value]) -> Self {
        let n = values.len();
        let tail: usize = values.iter().map(|v| encoding(v).1).sum();
        let slots = HEAD + n;
        let mut out = Vec::with_capacity(slots + 4 * n + tail);
        out.resize(slots + 4 * n, 0u8);
        out[..HEAD].copy_from_slice(&u32::try_from(n).unwrap_or(u32::MAX).to_le_bytes());
        for (i, v) in values.iter().enumerate() {
            let (tag, _) = encoding(v);
            out[HEAD + i] = tag;
            let at = u32::try_from(out.len()).unwrap_or(u32::MAX).to_le_bytes();
            let slot = match v {
                Value::Null | Value::Bool(_) => [0; 4],
                Value::Int(x) if tag == INT32 => (*x as i32).to_le_bytes(),
                Value::Float(f) if tag == FLOAT32 => (*f as f32).to_le_bytes(),
                Value::Int(x) => {
                    out.extend_from_slice(&x.to_le_bytes());
                    at
                }
                Value::Float(f) => {
                    out.extend_from_slice(&f.to_le_bytes());
                    at
                }
                Value::Str(s) => {
                    out.extend_from_slice(
                        &u32::try_from(s.len()).unwrap_or(u32::MAX).to_le_bytes(),
                    );
                    out.extend_from_slice(s.as_bytes());
                    at
                }
                Value::List(l) => {
                    out.extend_from_slice(
                        &u32::try_from(l.len() * 4).unwrap_or(u32::MAX).to_le_bytes(),
                    );
                    for x in l.iter() {
                        out.extend_from_slice(&x.to_le_bytes());
                    }
                    at
                }
            };
            out[slots + 4 * i..slots + 4 * i + 4].copy_from_slice(&slot);
        }
        Self(out.into_boxed_slice())
    }

    /// How many values it holds.
    pub fn len(&self) -> usize {
        word(&self.0, 0) as usize
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The size of its one allocation.
    pub fn bytes(&self) -> usize {
        self.0.len()
    }

    /// Value `i`, or null past the end (as no caller asks: features are indexed by their view).
    pub fn get(&self, i: usize) -> ValueRef<'_> {
        let b = &*self.0;
        let n = self.len();
        debug_assert!(i < n, "value {i} of {n}");
        if i >= n {
            return ValueRef::Null;
        }
        let slot = word(b, HEAD + n + 4 * i);
        match b.get(HEAD + i).copied().unwrap_or(NULL) {
            FALSE => ValueRef::Bool(false),
            TRUE => ValueRef::Bool(true),
            INT32 => ValueRef::Int(i64::from(slot as i32)),
            FLOAT32 => ValueRef::Float(f64::from(f32::from_bits(slot))),
            INT64 => ValueRef::Int(i64::from_le_bytes(array(b, slot as usize))),
            FLOAT64 => ValueRef::Float(f64::from_le_bytes(array(b, slot as usize))),
            STR => ValueRef::Str(Text(counted(b, slot as usize))),
            LIST => ValueRef::List(Floats::Packed(counted(b, slot as usize))),
            _ => ValueRef::Null,
        }
    }

    /// The values in order.
    pub fn iter(&self) -> impl ExactSizeIterator<Item = ValueRef<'_>> {
        (0..self.len()).map(|i| self.get(i))
    }
}

impl std::fmt::Debug for Packed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

/// The tag a value is packed under, and its length in the tail.
fn encoding(v: &Value) -> (u8, usize) {
    match v {
        Value::Null => (NULL, 0),
        Value::Bool(false) => (FALSE, 0),
        Value::Bool(true) => (TRUE, 0),
        Value::Int(x) if i32::try_from(*x).is_ok() => (INT32, 0),
        Value::Int(_) => (INT64, 8),
        // Bit for bit: -0.0 stays -0.0.
        Value::Float(f) if f64::from(*f as f32).to_bits() == f.to_bits() => (FLOAT32, 0),
        Value::Float(_) => (FLOAT64, 8),
        Value::Str(s) => (STR, 4 + s.len()),
        Value::List(l) => (LIST, 4 + l.len() * 4),
    }
}

/// The `N` bytes of `b` at `at` (which it has: the layout says so), or zeros.
fn array<const N: usize>(b: &[u8], at: usize) -> [u8; N] {
    b.get(at..)
        .and_then(|b| b.first_chunk::<N>())
        .copied()
        .unwrap_or([0; N])
}

/// The little-endian `u32` at `at`.
fn word(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(array(b, at))
}

/// The bytes after the `u32` count of them at `at`.
fn counted(b: &[u8], at: usize) -> &[u8] {
    let len = word(b, at) as usize;
    b.get(at + 4..at + 4 + len).unwrap_or_default()
}

/// A value read in place: from a [`Packed`] record, or borrowed from a [`Value`] (a default, a context
/// value), so that one code path transforms and writes both.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ValueRef<'a> {
    Null,
    Bool(bool),
    Int(i64),
    Float(f64),
    Str(Text<'a>),
    List(Floats<'a>),
}

/// A string value's bytes, UTF-8 since they were packed from a `str`. The transforms read the bytes
/// (`one_hot` compares them, `hash_bucket` hashes them), so the hot path never validates them again.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Text<'a>(&'a [u8]);

impl<'a> Text<'a> {
    pub fn as_bytes(self) -> &'a [u8] {
        self.0
    }

    pub fn as_str(self) -> &'a str {
        std::str::from_utf8(self.0).unwrap_or_default()
    }
}

impl std::fmt::Debug for Text<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Debug::fmt(self.as_str(), f)
    }
}

impl ValueRef<'_> {
    pub fn is_null(&self) -> bool {
        matches!(self, Self::Null)
    }

    pub fn to_value(&self) -> Value {
        match *self {
            Self::Null => Value::Null,
            Self::Bool(b) => Value::Bool(b),
            Self::Int(i) => Value::Int(i),
            Self::Float(f) => Value::Float(f),
            Self::Str(s) => Value::Str(s.as_str().into()),
            Self::List(l) => Value::List(l.iter().collect()),
        }
    }
}

impl<'a> From<&'a Value> for ValueRef<'a> {
    fn from(v: &'a Value) -> Self {
        match v {
            Value::Null => Self::Null,
            Value::Bool(b) => Self::Bool(*b),
            Value::Int(i) => Self::Int(*i),
            Value::Float(f) => Self::Float(*f),
            Value::Str(s) => Self::Str(Text(s.as_bytes())),
            Value::List(l) => Self::List(Floats::Plain(l)),
        }
    }
}

impl Serialize for ValueRef<'_> {
    /// [`Value`] serializes through this too.
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match *self {
            Self::Null => s.serialize_unit(),
            Self::Bool(b) => s.serialize_bool(b),
            Self::Int(i) => s.serialize_i64(i),
            Self::Float(f) => s.serialize_f64(f),
            Self::Str(v) => s.serialize_str(v.as_str()),
            Self::List(l) => {
                let mut seq = s.serialize_seq(Some(l.len()))?;
                for x in l.iter() {
                    seq.serialize_element(&x)?;
                }
                seq.end()
            }
        }
    }
}

/// A list of float32s: little-endian bytes in a [`Packed`] record, or a slice.
#[derive(Debug, Clone, Copy)]
pub enum Floats<'a> {
    Packed(&'a [u8]),
    Plain(&'a [f32]),
}

impl Floats<'_> {
    pub fn len(&self) -> usize {
        match self {
            Self::Packed(b) => b.len() / 4,
            Self::Plain(l) => l.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn iter(&self) -> FloatsIter<'_> {
        match self {
            Self::Packed(b) => FloatsIter::Packed(b.chunks_exact(4)),
            Self::Plain(l) => FloatsIter::Plain(l.iter()),
        }
    }
}

/// The elements of [`Floats`].
pub enum FloatsIter<'a> {
    Packed(std::slice::ChunksExact<'a, u8>),
    Plain(std::slice::Iter<'a, f32>),
}

impl Iterator for FloatsIter<'_> {
    type Item = f32;

    fn next(&mut self) -> Option<f32> {
        match self {
            Self::Packed(c) => c.next().map(|c| f32::from_le_bytes(array(c, 0))),
            Self::Plain(l) => l.next().copied(),
        }
    }
}

impl PartialEq for Floats<'_> {
    /// Element by element, as `f32`s compare, whichever way each side holds them.
    fn eq(&self, other: &Self) -> bool {
        self.len() == other.len() && self.iter().eq(other.iter())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn round_trip(values: Vec<Value>) -> Packed {
        let p = Packed::new(&values);
        assert_eq!(p.len(), values.len());
        assert_eq!(p.iter().map(|v| v.to_value()).collect::<Vec<_>>(), values);
        for (i, v) in values.iter().enumerate() {
            assert_eq!(p.get(i), ValueRef::from(v), "value {i}");
        }
        p
    }

    #[test]
    fn every_kind_of_value_reads_back_as_packed() {
        let p = round_trip(vec![
            Value::Int(31),
            Value::Str("us".into()),
            Value::Bool(true),
            Value::Float(12.345678),
            Value::List(vec![0.1, -0.2, 3.4e38, f32::MIN_POSITIVE].into_boxed_slice()),
            Value::Null,
            Value::Bool(false),
            Value::Int(i64::MIN),
            Value::Int(i64::MAX),
            Value::Int(i64::from(i32::MIN)),
            Value::Int(i64::from(i32::MAX) + 1),
            Value::Float(-0.0),
            Value::Float(f64::from(0.1f32)),
            Value::Float(0.1),
            Value::Float(f64::MAX),
            Value::Float(1e-310),
            Value::Str("".into()),
            Value::Str("naïve \"quoted\", 日本語\n".into()),
            Value::List(Vec::new().into_boxed_slice()),
        ]);
        // -0.0 keeps its sign.
        assert!(matches!(p.get(11), ValueRef::Float(f) if f.to_bits() == (-0.0f64).to_bits()));
        // Small integers and float32-exact floats fit in their slot; the rest take 8 bytes more.
        let tail = |v: Value| Packed::new(&[v]).bytes() - HEAD - 1 - 4;
        assert_eq!(tail(Value::Int(-5)), 0);
        assert_eq!(tail(Value::Int(1 << 40)), 8);
        assert_eq!(tail(Value::Float(1.5)), 0);
        assert_eq!(tail(Value::Float(0.1)), 8);
        assert_eq!(tail(Value::Bool(true)), 0);
        assert_eq!(tail(Value::Null), 0);
        assert_eq!(tail(Value::Str("abc".into())), 4 + 3);
    }

    #[test]
    fn the_demo_user_record_takes_one_small_allocation() {
        // age, country, is_premium, avg_session_minutes, embedding: the count, 5 tags, 5 slots, and in
        // the tail the string and the list, each after its length.
        let p = round_trip(vec![
            Value::Int(34),
            Value::Str("de".into()),
            Value::Bool(false),
            Value::Float(7.25),
            Value::List(vec![0.1, 0.2, 0.3, 0.4].into_boxed_slice()),
        ]);
        assert_eq!(p.bytes(), 4 + 5 + 5 * 4 + (4 + 2) + (4 + 16));
    }

    #[test]
    fn long_strings_and_lists_read_back_whole() {
        let long = "x".repeat(70_000);
        let p = round_trip(vec![
            Value::Str(long.as_str().into()),
            Value::Int(7),
            Value::List(vec![1.0; 20_000].into_boxed_slice()),
            Value::Str("tail".into()),
            Value::Float(0.1),
        ]);
        assert_eq!(
            p.bytes(),
            4 + 5 + 5 * 4 + (4 + 70_000) + (4 + 80_000) + (4 + 4) + 8
        );
    }

    #[test]
    fn no_values() {
        let p = round_trip(Vec::new());
        assert!(p.is_empty());
        assert_eq!(p.bytes(), HEAD);
    }

    #[test]
    fn values_serialize_as_their_unpacked_selves() {
        let values = vec![
            Value::Int(-3),
            Value::Float(2.5),
            Value::Float(0.1),
            Value::Str("a\"b".into()),
            Value::List(vec![1.5, -0.25].into_boxed_slice()),
            Value::Null,
            Value::Bool(true),
        ];
        let p = Packed::new(&values);
        let packed: Vec<ValueRef> = p.iter().collect();
        assert_eq!(
            serde_json::to_string(&packed).expect("json"),
            serde_json::to_string(&values).expect("json")
        );
        assert_eq!(
            rmp_serde::to_vec(&packed).expect("msgpack"),
            rmp_serde::to_vec(&values).expect("msgpack")
        );
    }
}
