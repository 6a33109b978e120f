//! Feature values, their declared types, and the stored record format (MessagePack).
//!
//! A record is the MessagePack array `[schema_version, event_timestamp_ms, [value, ...], layout]` with the
//! values in the view's feature order, and `layout` a hash of that order (names and types), so records read
//! under a reordered view that kept its version are refused rather than read into the wrong features.
//! Records without `layout` (written before it existed) are read by version alone. Values are MessagePack
//! natives: nil, bool, int, float, string, or an array of floats for `float32[N]`. One record per entity
//! per view keeps a view to one GET.

use std::fmt;

use serde::de::{self, Deserializer, SeqAccess, Visitor};
use serde::ser::Serializer;
use serde::{Deserialize, Serialize};

/// A feature's declared type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dtype {
    Float32,
    Float64,
    Int64,
    Bool,
    String,
    /// A fixed-length float32 list, e.g. an embedding.
    Float32List(usize),
}

/// 2^63, the first whole float past int64's range (an integer past it arrives as a float).
const INT64_END: f64 = 9_223_372_036_854_775_808.0;

/// A whole float below 2^53, where float64 still holds every integer exactly, as the integer it is.
/// 2^53 and past it are `None`: `9007199254740993.0` parses to 2^53, so it may not be the number
/// written. Integers written as floats (`1e3`, or by an encoder that writes every number as a double)
/// are read through this wherever an integer is expected.
pub fn exact_integer(f: f64) -> Option<i64> {
    (f.fract() == 0.0 && f.abs() < 9_007_199_254_740_992.0).then_some(f as i64)
}

/// How a float reads where an int64 is expected: JSON numbers with a point or an exponent, integers past
/// what serde_json reads as `i64`/`u64`, and MessagePack floats arrive as floats.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum FloatAsInt {
    /// Whole and below 2^53 ([`exact_integer`]).
    Exact(i64),
    /// A fraction, NaN or an infinity.
    NotWhole,
    /// Past int64's range.
    OutOfRange,
    /// -2^63: int64's lower bound, and also where an integer just below the range rounds to.
    LowerBound,
    /// Whole, within the range, but at 2^53 or past it, where float64 cannot tell neighbouring integers
    /// apart.
    Inexact,
}

pub fn float_as_int(f: f64) -> FloatAsInt {
    if let Some(i) = exact_integer(f) {
        FloatAsInt::Exact(i)
    } else if f.fract() != 0.0 {
        // NaN and infinities too: their fraction is NaN.
        FloatAsInt::NotWhole
    } else if !(-INT64_END..INT64_END).contains(&f) {
        FloatAsInt::OutOfRange
    } else if f == -INT64_END {
        FloatAsInt::LowerBound
    } else {
        FloatAsInt::Inexact
    }
}

impl Dtype {
    /// Parses `float32`, `float64`, `int64`, `bool`, `string` or `float32[N]`.
    pub fn parse(s: &str) -> Result<Self, String> {
        let expected = "expected float32, float64, int64, bool, string or float32[N]";
        Ok(match s {
            "float32" => Self::Float32,
            "float64" => Self::Float64,
            "int64" => Self::Int64,
            "bool" => Self::Bool,
            "string" => Self::String,
            _ => {
                let n = s
                    .strip_prefix("float32[")
                    .and_then(|r| r.strip_suffix(']'))
                    .ok_or_else(|| format!("unknown dtype `{s}`: {expected}"))?;
                // Digits only, as the dtype is printed back: `float32[ 3 ]`, `[+3]` or `[03]` would
                // register as `float32[3]` and read back as something other than what was sent.
                let plain = !n.is_empty()
                    && n.bytes().all(|b| b.is_ascii_digit())
                    && !(n.len() > 1 && n.starts_with('0'));
                let n: usize = n.parse().ok().filter(|_| plain).ok_or_else(|| {
                    format!(
                        "`{s}`: the list length must be a positive integer in digits, without sign, spaces or leading zeros (e.g. float32[4])"
                    )
                })?;
                if n == 0 || n > 65_536 {
                    return Err(format!(
                        "`{s}`: the list length must be between 1 and 65536"
                    ));
                }
                Self::Float32List(n)
            }
        })
    }

    /// How many numbers the feature contributes before any transform.
    pub fn width(self) -> usize {
        match self {
            Self::Float32List(n) => n,
            _ => 1,
        }
    }

    /// The zero value used as the default when a schema declares none.
    pub fn zero(self) -> Value {
        match self {
            Self::Float32 | Self::Float64 => Value::Float(0.0),
            Self::Int64 => Value::Int(0),
            Self::Bool => Value::Bool(false),
            Self::String => Value::Str(Box::from("")),
            Self::Float32List(n) => Value::List(vec![0.0; n].into_boxed_slice()),
        }
    }

    /// Checks `v` against this type and converts it to the canonical variant (an integer given for a float
    /// feature becomes a float). `Null` passes: a missing value is a status, not a type error.
    pub fn coerce(self, v: Value) -> Result<Value, String> {
        match (self, v) {
            (_, Value::Null) => Ok(Value::Null),
            // Kept as the float32 the model will see, so what is stored and shown is what is used.
            (Self::Float32, Value::Float(f)) => to_float32(f).map(|x| Value::Float(f64::from(x))),
            (Self::Float32, Value::Int(i)) => Ok(Value::Float(f64::from(i as f32))),
            (Self::Float64, Value::Float(f)) if !f.is_finite() => {
                Err(format!("expected a finite number, got {f}"))
            }
            (Self::Float64, Value::Float(f)) => Ok(Value::Float(f)),
            (Self::Float64, Value::Int(i)) => Ok(Value::Float(i as f64)),
            (Self::Int64, Value::Int(i)) => Ok(Value::Int(i)),
            (Self::Int64, Value::Float(f)) => match float_as_int(f) {
                FloatAsInt::Exact(i) => Ok(Value::Int(i)),
                FloatAsInt::NotWhole => Err(format!(
                    "expected int64, got {f:?}, which is not a whole number"
                )),
                // An integer past 2^63 arrives here as a float: echoing it would show it rounded.
                FloatAsInt::OutOfRange => Err("expected int64, got a number outside its range (-9223372036854775808 to 9223372036854775807)".to_owned()),
                FloatAsInt::LowerBound => Err("expected int64, got a number float64 reads as -2^63: an integer below int64's range (-9223372036854775808 to 9223372036854775807), or a whole number written as a float, which must be below 2^53 in magnitude (past it float64 cannot tell neighbouring integers apart)".to_owned()),
                FloatAsInt::Inexact => Err(format!(
                    "expected int64, got a number written as a float, {f} as float64 reads it: whole numbers written as floats must be below 2^53 in magnitude (past it float64 cannot tell neighbouring integers apart), and integers within ±2^63"
                )),
            },
            (Self::Bool, Value::Bool(b)) => Ok(Value::Bool(b)),
            (Self::String, Value::Str(s)) => Ok(Value::Str(s)),
            (Self::Float32List(n), Value::List(l)) if l.len() == n => Ok(Value::List(l)),
            (Self::Float32List(n), Value::List(l)) => Err(format!(
                "expected a list of {n} numbers, got {} numbers",
                l.len()
            )),
            (t, v) => Err(format!("expected {t}, got {}", v.kind())),
        }
    }

    /// Converts a JSON value for a feature of this type, so that a mistake is reported in the feature's
    /// terms: a list for a string feature is "expected string, got a list", not a complaint about its
    /// elements.
    pub fn from_json(self, v: &serde_json::Value) -> Result<Value, String> {
        match (self, v) {
            (t, serde_json::Value::Object(_)) => {
                return Err(format!("expected {t}, got an object"));
            }
            (Self::Float32List(_), _) | (_, serde_json::Value::Null) => {}
            (t, serde_json::Value::Array(_)) => return Err(format!("expected {t}, got a list")),
            _ => {}
        }
        self.coerce(Value::from_json(v)?)
    }
}

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Float32 => f.write_str("float32"),
            Self::Float64 => f.write_str("float64"),
            Self::Int64 => f.write_str("int64"),
            Self::Bool => f.write_str("bool"),
            Self::String => f.write_str("string"),
            Self::Float32List(n) => write!(f, "float32[{n}]"),
        }
    }
}

/// One feature value.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    Null,
    Bool(bool),
    Int(i64),
    Float(f64),
    Str(Box<str>),
    List(Box<[f32]>),
}

impl Value {
    pub fn is_null(&self) -> bool {
        matches!(self, Self::Null)
    }

    /// A word for error messages.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Null => "null",
            Self::Bool(_) => "a boolean",
            Self::Int(_) => "an integer",
            Self::Float(_) => "a number",
            Self::Str(_) => "a string",
            Self::List(_) => "a list",
        }
    }

    /// Converts a JSON value (request context, loader rows, schema defaults).
    pub fn from_json(v: &serde_json::Value) -> Result<Self, String> {
        use serde_json::Value as J;
        Ok(match v {
            J::Null => Self::Null,
            J::Bool(b) => Self::Bool(*b),
            J::Number(n) => match n.as_i64() {
                Some(i) => Self::Int(i),
                None => Self::Float(n.as_f64().ok_or("number out of range")?),
            },
            J::String(s) => Self::Str(s.as_str().into()),
            J::Array(items) => {
                let mut out = Vec::with_capacity(items.len());
                for (i, x) in items.iter().enumerate() {
                    let f = x
                        .as_f64()
                        .ok_or_else(|| format!("list element {i} is not a number"))?;
                    out.push(list_element(i, f)?);
                }
                Self::List(out.into_boxed_slice())
            }
            J::Object(_) => {
                return Err("expected a scalar or a list of numbers, got an object".into());
            }
        })
    }

    /// Converts a YAML value (schema defaults and transform parameters).
    pub fn from_yaml(v: &serde_yaml::Value) -> Result<Self, String> {
        // JSON has no NaN or infinity: converted, `.nan` would turn into null and be misreported.
        if let serde_yaml::Value::Number(n) = v
            && n.as_f64().is_some_and(|f| !f.is_finite())
        {
            return Err(format!("expected a finite number, got {n}"));
        }
        let json = serde_json::to_value(v).map_err(|e| e.to_string())?;
        Self::from_json(&json)
    }
}

impl Serialize for Value {
    /// As the same value read from a cached record does ([`crate::packed::ValueRef`]).
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        crate::packed::ValueRef::from(self).serialize(s)
    }
}

impl<'de> Deserialize<'de> for Value {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(ValueVisitor)
    }
}

/// Reads a [`Value`]; the request context's reader hands its scalars to it too.
pub(crate) struct ValueVisitor;
impl<'de> Visitor<'de> for ValueVisitor {
    type Value = Value;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("nil, a boolean, a number, a string or a list of numbers")
    }
    fn visit_unit<E: de::Error>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }
    fn visit_none<E: de::Error>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }
    fn visit_bool<E: de::Error>(self, b: bool) -> Result<Value, E> {
        Ok(Value::Bool(b))
    }
    fn visit_i64<E: de::Error>(self, i: i64) -> Result<Value, E> {
        Ok(Value::Int(i))
    }
    fn visit_u64<E: de::Error>(self, u: u64) -> Result<Value, E> {
        i64::try_from(u)
            .map(Value::Int)
            .map_err(|_| E::custom("integer out of int64 range"))
    }
    fn visit_f64<E: de::Error>(self, f: f64) -> Result<Value, E> {
        if f.is_finite() {
            Ok(Value::Float(f))
        } else {
            Err(E::custom(format_args!("expected a finite number, got {f}")))
        }
    }
    fn visit_str<E: de::Error>(self, s: &str) -> Result<Value, E> {
        Ok(Value::Str(s.into()))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        // A declared length (MessagePack, a stored record) is a claim that a damaged record can make too.
        let mut out = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(4096));
        while let Some(ListNumber(x)) = seq.next_element()? {
            out.push(list_element(out.len(), x).map_err(de::Error::custom)?);
        }
        Ok(Value::List(out.into_boxed_slice()))
    }
}

/// A list element: a number, and an error that says lists hold only numbers (a plain `f64` would say
/// "expected f64", which reads oddly for `["ios"]`).
struct ListNumber(f64);

impl<'de> Deserialize<'de> for ListNumber {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct N;
        impl Visitor<'_> for N {
            type Value = ListNumber;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a number (a list holds numbers only)")
            }
            fn visit_i64<E: de::Error>(self, i: i64) -> Result<ListNumber, E> {
                Ok(ListNumber(i as f64))
            }
            fn visit_u64<E: de::Error>(self, u: u64) -> Result<ListNumber, E> {
                Ok(ListNumber(u as f64))
            }
            fn visit_f64<E: de::Error>(self, f: f64) -> Result<ListNumber, E> {
                Ok(ListNumber(f))
            }
        }
        d.deserialize_any(N)
    }
}

/// `f` as float32 (rounded to the nearest): finite and within float32's range, or why not. A value that
/// rounds to ±`f32::MAX`, such as `3.4028235e38` as Rust and numpy print it, is in range.
pub(crate) fn to_float32(f: f64) -> Result<f32, String> {
    let x = f as f32;
    if f.is_finite() && x.is_finite() {
        Ok(x)
    } else {
        Err(format!(
            "{f:e} is outside the float32 range (±{:e})",
            f32::MAX
        ))
    }
}

/// A list element as float32, or an error naming element `i`.
fn list_element(i: usize, f: f64) -> Result<f32, String> {
    to_float32(f).map_err(|e| format!("list element {i}: {e}"))
}

/// A stored record: what one key holds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Record {
    /// The view version the values were written under.
    pub schema_version: u32,
    /// When the values were true (milliseconds since the Unix epoch); `max_age` is measured from it.
    pub event_ts_ms: i64,
    #[serde(deserialize_with = "values_reserving_little")]
    pub values: Vec<Value>,
    /// The view's [`layout`] when written; 0 for records written before layouts existed.
    #[serde(default)]
    pub layout: u32,
}

/// A record's values, read as [`crate::decode::read_capped`] reads a list (room for a few up front, grown
/// as values arrive), every one kept. The declared length is a claim a damaged record makes too: serde's
/// own reading of a list reserves up to 1 MiB on it, for a record that may be 8 bytes long.
fn values_reserving_little<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<Value>, D::Error> {
    struct Values;
    impl<'de> Visitor<'de> for Values {
        type Value = Vec<Value>;
        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("a sequence")
        }
        fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Vec<Value>, A::Error> {
            crate::decode::read_capped(seq, usize::MAX).map(|(values, _)| values)
        }
    }
    d.deserialize_seq(Values)
}

/// A hash of a view's features in order (FNV-1a over each name and type): two views with the same
/// version but features reordered, renamed or retyped have different layouts.
pub fn layout<'a>(features: impl IntoIterator<Item = (&'a str, Dtype)>) -> u32 {
    let mut h: u32 = 0x811c_9dc5;
    let mut eat = |bytes: &[u8]| {
        for b in bytes {
            h ^= u32::from(*b);
            h = h.wrapping_mul(0x0100_0193);
        }
    };
    for (name, dtype) in features {
        eat(name.as_bytes());
        eat(b"\0");
        eat(dtype.to_string().as_bytes());
        eat(b"\n");
    }
    // 0 is reserved for "no layout recorded".
    h.max(1)
}

impl Record {
    /// Encodes as a compact MessagePack array.
    pub fn encode(&self) -> Vec<u8> {
        // Serializing plain data into a Vec cannot fail.
        rmp_serde::to_vec(self).unwrap_or_default()
    }

    /// Decodes a stored record, which must be the whole of `bytes`: a record followed by other bytes
    /// was not written by hydrant, as a record with an element too many was not.
    pub fn decode(bytes: &[u8]) -> Result<Self, String> {
        let mut rest = bytes;
        let record = Self::deserialize(&mut rmp_serde::Deserializer::new(&mut rest))
            .map_err(|e| format!("not a valid record: {e}"))?;
        if !rest.is_empty() {
            return Err(format!(
                "not a valid record: {} bytes follow it",
                rest.len()
            ));
        }
        Ok(record)
    }
}

/// Milliseconds since the Unix epoch, now.
pub fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_layout_changes_with_the_order_names_and_types_of_the_features() {
        use Dtype::*;
        let base = layout([("category", String), ("brand", String), ("price", Float64)]);
        assert_eq!(
            base,
            layout([("category", String), ("brand", String), ("price", Float64)])
        );
        for other in [
            layout([("brand", String), ("category", String), ("price", Float64)]),
            layout([("category", String), ("brand2", String), ("price", Float64)]),
            layout([("category", String), ("brand", String), ("price", Float32)]),
            layout([("category", String), ("brand", String)]),
            // Names are delimited: moving a letter between names is another layout.
            layout([("categor", String), ("ybrand", String), ("price", Float64)]),
        ] {
            assert_ne!(base, other);
        }
        assert_ne!(
            layout([("e", Float32List(4))]),
            layout([("e", Float32List(8))])
        );
    }

    #[test]
    fn an_int64_refusal_says_why() {
        let e = Dtype::Int64
            .coerce(Value::Float(0.5))
            .expect_err("fraction");
        assert!(e.contains("not a whole number"), "{e}");
        let e = Dtype::Int64
            .coerce(Value::Float(1e16))
            .expect_err("past 2^53");
        assert!(e.contains("2^53"), "{e}");
        assert_eq!(Dtype::Int64.coerce(Value::Float(42.0)), Ok(Value::Int(42)));
        // An integer past int64 (JSON `9223372036854775808`) is not echoed rounded.
        let big: serde_json::Value = serde_json::from_str("9223372036854775808").expect("json");
        let e = Dtype::Int64.from_json(&big).expect_err("past 2^63");
        assert!(
            e.contains("outside its range") && !e.contains("9223372036854776000"),
            "{e}"
        );
        assert_eq!(
            Dtype::Int64.from_json(&serde_json::json!(i64::MIN)),
            Ok(Value::Int(i64::MIN))
        );
        // -2^63 as a float is int64's lower bound: not "outside its range", but it may be where an
        // integer below the range rounded to, and is past 2^53 as a float.
        for text in ["-9.223372036854775808e18", "-9223372036854775809"] {
            let low: serde_json::Value = serde_json::from_str(text).expect("json");
            let e = Dtype::Int64.from_json(&low).expect_err("-2^63 as a float");
            assert!(
                e.contains("-2^63") && e.contains("2^53") && !e.contains("outside its range"),
                "{text}: {e}"
            );
        }
        let below: serde_json::Value = serde_json::from_str("-1e19").expect("json");
        let e = Dtype::Int64.from_json(&below).expect_err("below -2^63");
        assert!(e.contains("outside its range"), "{e}");
    }

    #[test]
    fn from_json_names_the_feature_type_for_lists_and_objects() {
        let list = serde_json::json!(["us"]);
        assert_eq!(
            Dtype::String.from_json(&list),
            Err("expected string, got a list".to_owned())
        );
        assert_eq!(
            Dtype::Int64.from_json(&serde_json::json!({"a": 1})),
            Err("expected int64, got an object".to_owned())
        );
        assert_eq!(
            Dtype::Float32List(2).from_json(&serde_json::json!({"0": 1})),
            Err("expected float32[2], got an object".to_owned())
        );
        assert_eq!(
            Dtype::Float32List(2).from_json(&serde_json::json!([1, 2.5])),
            Ok(Value::List(vec![1.0, 2.5].into_boxed_slice()))
        );
        assert_eq!(
            Dtype::String.from_json(&serde_json::Value::Null),
            Ok(Value::Null)
        );
    }

    #[test]
    fn a_record_followed_by_other_bytes_is_not_one() {
        let record = Record {
            schema_version: 1,
            event_ts_ms: 5,
            values: vec![Value::Int(3)],
            layout: 7,
        };
        let mut bytes = record.encode();
        assert_eq!(Record::decode(&bytes), Ok(record));
        bytes.extend_from_slice(b"\xc1junk");
        assert_eq!(
            Record::decode(&bytes),
            Err("not a valid record: 5 bytes follow it".to_owned())
        );
    }

    #[test]
    fn records_round_trip_through_messagepack() {
        let r = Record {
            schema_version: 3,
            event_ts_ms: 1_700_000_000_123,
            values: vec![
                Value::Int(31),
                Value::Str("de".into()),
                Value::Bool(true),
                Value::Float(12.5),
                Value::Null,
                Value::List(vec![0.25, -1.0].into_boxed_slice()),
            ],
            layout: 7,
        };
        let bytes = r.encode();
        assert_eq!(Record::decode(&bytes).expect("decodes"), r);
        // A record written before layouts existed (three elements) reads with layout 0.
        let legacy =
            rmp_serde::to_vec(&(3u32, 1_700_000_000_123i64, vec![Value::Int(31)])).expect("encode");
        assert_eq!(Record::decode(&legacy).expect("legacy").layout, 0);
        assert!(Record::decode(b"\xc1garbage").is_err());
        assert!(Record::decode(&bytes[..bytes.len() - 2]).is_err());
    }

    #[test]
    fn coerce_checks_types_and_list_length() {
        assert_eq!(Dtype::Float32.coerce(Value::Int(2)), Ok(Value::Float(2.0)));
        assert!(Dtype::Int64.coerce(Value::Float(2.5)).is_err());
        // Whole floats below 2^53 are integers. From 2^53 float64 no longer holds every integer:
        // `9007199254740993.0` parses to 2^53, so 2^53 itself may be a rounded number.
        assert_eq!(
            Dtype::Int64.coerce(Value::Float(9_007_199_254_740_991.0)),
            Ok(Value::Int(9_007_199_254_740_991))
        );
        let e = Dtype::Int64
            .coerce(Value::Float(
                "9007199254740993.0".parse().expect("a float64"),
            ))
            .expect_err("rounded on parsing");
        assert!(e.contains("below 2^53"), "{e}");
        assert!(Dtype::Int64.coerce(Value::Float(2e16)).is_err());
        assert!(Dtype::String.coerce(Value::Int(1)).is_err());
        let e = Dtype::Float32List(4)
            .coerce(Value::List(vec![1.0].into_boxed_slice()))
            .expect_err("wrong length");
        assert!(e.contains("4"), "{e}");
        assert_eq!(Dtype::Bool.coerce(Value::Null), Ok(Value::Null));
        // float32 holds up to ±3.4e38: a larger value would reach the model as infinity.
        let e = Dtype::Float32
            .coerce(Value::Float(1e300))
            .expect_err("too large");
        assert!(e.contains("outside the float32 range"), "{e}");
        assert_eq!(
            Dtype::Float32.coerce(Value::Float(-3.0e38)),
            Ok(Value::Float(f64::from(-3.0e38f32)))
        );
        // float32's largest value as Rust and numpy print it rounds to it, so it is in range.
        assert_eq!(
            Dtype::Float32.coerce(Value::Float(3.4028235e38)),
            Ok(Value::Float(f64::from(f32::MAX)))
        );
        // A float32 feature holds what the model will see, whether sent as JSON or MessagePack.
        assert_eq!(
            Dtype::Float32.coerce(Value::Float(0.1)),
            Ok(Value::Float(f64::from(0.1f32)))
        );
        assert_eq!(
            Dtype::Float32.coerce(Value::Int(16_777_217)),
            Ok(Value::Float(16_777_216.0))
        );
        assert_eq!(
            Dtype::Float64.coerce(Value::Int(16_777_217)),
            Ok(Value::Float(16_777_217.0))
        );
        assert!(Dtype::Float64.coerce(Value::Float(1e300)).is_ok());
        assert!(Dtype::Float64.coerce(Value::Float(f64::NAN)).is_err());
        let e = Value::from_json(&serde_json::json!([0.5, -1e300])).expect_err("too large");
        assert!(e.starts_with("list element 1:"), "{e}");
    }

    #[test]
    fn a_list_of_strings_is_refused_saying_lists_hold_numbers() {
        let e = serde_json::from_str::<Value>(r#"["ios"]"#).expect_err("strings");
        assert!(e.to_string().contains("a list holds numbers only"), "{e}");
        assert_eq!(
            serde_json::from_str::<Value>("[1, 2.5]").expect("numbers"),
            Value::List(vec![1.0, 2.5].into_boxed_slice())
        );
    }

    #[test]
    fn messagepack_non_finite_and_out_of_range_numbers_are_refused() {
        let nan = rmp_serde::to_vec(&f64::NAN).expect("encode");
        assert!(rmp_serde::from_slice::<Value>(&nan).is_err());
        let inf = rmp_serde::to_vec(&f64::INFINITY).expect("encode");
        assert!(rmp_serde::from_slice::<Value>(&inf).is_err());
        let list = rmp_serde::to_vec(&[0.5f64, 1e300]).expect("encode");
        let e = rmp_serde::from_slice::<Value>(&list).expect_err("too large");
        assert!(e.to_string().contains("list element 1"), "{e}");
        let ok = rmp_serde::to_vec(&[0.5f64, -2.0]).expect("encode");
        assert_eq!(
            rmp_serde::from_slice::<Value>(&ok).expect("decodes"),
            Value::List(vec![0.5, -2.0].into_boxed_slice())
        );
    }

    #[test]
    fn dtype_parse_names_the_problem() {
        assert_eq!(Dtype::parse("float32[8]"), Ok(Dtype::Float32List(8)));
        assert!(
            Dtype::parse("flaot32")
                .expect_err("typo")
                .contains("unknown dtype")
        );
        assert!(Dtype::parse("float32[0]").is_err());
        assert!(Dtype::parse("float32[x]").is_err());
        for odd in [
            "float32[+3]",
            "float32[ 3 ]",
            "float32[03]",
            "float32[]",
            "float32[-1]",
        ] {
            let e = Dtype::parse(odd).expect_err(odd);
            assert!(e.contains("in digits"), "{odd}: {e}");
        }
        assert_eq!(Dtype::parse("float32[10]"), Ok(Dtype::Float32List(10)));
    }
}
