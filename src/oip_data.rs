//! An infer request's `data`, read as it streams in rather than as a tree of JSON values.
//!
//! Read as `serde_json::Value`, each number of `data` took some 40 bytes for the two (`0,`) it takes in the
//! body, and all of them were held before the shape was checked: a 1 MiB body raised the gateway's peak
//! memory by 52 MB. [`TensorData`] keeps the numbers as float32 in row-major order, at most as many as the
//! largest shape the model can take ([`with_shape`]), and counts the rest. The checks on `data` still
//! come after every other check of the request, in the words and the order they had: the reader only
//! notes the first problem it meets, and where, and [`TensorData::into_buffer`] reports it once the
//! shape, and so the number of elements expected, is known.

use std::cell::Cell;
use std::fmt;

use serde::Deserialize;
use serde::de::{self, DeserializeSeed, Deserializer, Visitor};

use crate::decode::Checked;

thread_local! {
    /// The model's rows while a tensor's `data` is read on this thread: the most numbers it holds, and
    /// the width of a row; see [`with_shape`].
    static SHAPE: Cell<Shape> = const { Cell::new(Shape { cap: usize::MAX, width: 0 }) };
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Shape {
    cap: usize,
    /// 0: not given (every list of rows is then refused by `into_buffer`).
    width: usize,
}

/// Runs `read` (a synchronous parse of an infer request) for a model whose rows are `width` numbers,
/// holding at most `cap` numbers per tensor: the rest are read, checked and counted, not kept. `cap` is
/// the most any shape the request may send can need (rows up to the limit, times `width`): a tensor
/// with more is refused whatever its shape.
pub fn with_shape<R>(cap: usize, width: usize, read: impl FnOnce() -> R) -> R {
    crate::decode::scoped(&SHAPE, Shape { cap, width }, read)
}

/// A tensor's `data`: its numbers, and the first problem met reading them.
#[derive(Debug, Default)]
pub struct TensorData {
    /// The numbers as float32, in order, up to the cap.
    values: Vec<f32>,
    /// Numbers read, held or not (before the first problem).
    numbers: usize,
    /// The first problem, and how many numbers came before it.
    problem: Option<(usize, Problem)>,
    /// The row width the rows were checked against, when `data` was a list of rows.
    row_width: Option<usize>,
}

#[derive(Debug)]
enum Problem {
    /// `data` is not a list: the value, as JSON.
    NotAList(String),
    /// A list of rows with an element that is not one.
    RowNotAList(usize),
    /// A row of another width.
    RowWidth { row: usize, len: usize },
    /// A row holding a list: data nested deeper than rows of numbers.
    Nested { row: usize, element: usize },
    /// An element that is not a number: the element, as JSON.
    NotANumber(String),
    /// A number beyond float32.
    Range(String),
}

impl TensorData {
    /// Puts the numbers in `out` for a tensor of `limit` elements in rows of `width`, or says what is
    /// wrong with `data`: the first of its problems in row-major order, or that it has more elements
    /// than `limit`, whichever comes first. (A tensor with fewer is the caller's to refuse.)
    pub fn into_buffer(
        &self,
        out: &mut Vec<f32>,
        limit: usize,
        width: usize,
    ) -> Result<(), String> {
        let too_many = || format!("more elements than the shape's {limit}");
        if let Some((before, problem)) = &self.problem {
            // An element past the limit is found before a problem after it; a number beyond float32
            // is checked for the limit first, a row before any of its elements.
            let limit_first = match problem {
                Problem::NotAList(_) => false,
                Problem::Range(_) => *before >= limit,
                _ => *before > limit,
            };
            if limit_first {
                return Err(too_many());
            }
            return Err(match problem {
                Problem::NotAList(v) => format!("expected a list of numbers, found {v}"),
                Problem::RowNotAList(i) => format!("row {i} is not a list"),
                Problem::RowWidth { row, len } => {
                    format!("row {row} has {len} elements; the shape's rows have {width}")
                }
                Problem::Nested { row, element } => format!(
                    "row {row} element {element} is a list: data is a list of numbers, or of rows of numbers, and nests no deeper"
                ),
                // Every element before it is a number, and every row before its row has the
                // shape's width: `before` is its row-major index.
                Problem::NotANumber(v) => match self.row_width {
                    Some(_) if width > 0 => format!(
                        "row {} element {} is not a number: found {v}",
                        before / width,
                        before % width
                    ),
                    _ => format!("element {before} is not a number: found {v}"),
                },
                Problem::Range(e) => e.clone(),
            });
        }
        // More than were held can only be more than the limit (the cap is at least any limit).
        if self.numbers > limit || self.values.len() < self.numbers {
            return Err(too_many());
        }
        if self.row_width.is_some_and(|w| w != width) {
            return Err(format!(
                "rows were read for a width other than the shape's {width}"
            ));
        }
        out.extend_from_slice(&self.values);
        Ok(())
    }

    /// Takes one number, or notes that it is beyond float32.
    fn number(&mut self, x: f64, cap: usize) -> Option<(usize, Problem)> {
        match crate::value::to_float32(x) {
            Ok(f) => {
                if self.values.len() < cap {
                    self.values.push(f);
                }
                self.numbers += 1;
                None
            }
            Err(e) => Some((self.numbers, Problem::Range(e))),
        }
    }
}

impl<'de> Deserialize<'de> for TensorData {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let mut data = TensorData::default();
        d.deserialize_any(Top(&mut data))?;
        Ok(data)
    }
}

/// A visitor's methods for the values that are neither numbers nor lists: each quotes the value it was
/// given (for a message, see [`Preview`]) and hands the text to `$on`.
macro_rules! as_json {
    ($on:expr) => {
        fn visit_bool<E: de::Error>(self, v: bool) -> Result<Self::Value, E> {
            Ok($on(self, quote(|p| p.visit_bool::<E>(v))?))
        }
        fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
            Ok($on(self, quote(|p| p.visit_str::<E>(v))?))
        }
        fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
            Ok($on(self, quote(|p| p.visit_unit::<E>())?))
        }
        fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
            Ok($on(self, quote(|p| p.visit_none::<E>())?))
        }
        fn visit_map<A: de::MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
            Ok($on(self, quote(|p| p.visit_map(map))?))
        }
    };
}

/// The text [`Preview`] writes of one value.
fn quote<E>(write: impl FnOnce(Preview<'_>) -> Result<(), E>) -> Result<String, E> {
    let mut text = String::new();
    write(Preview(&mut text))?;
    Ok(text)
}

/// Writes a list or a map into `out` between `open` and `close`: its elements while there is room, each
/// written by `next(Some(out))` (false once there are no more), then the rest read past by `next(None)`
/// and shown as `,…`. With no room left even for `open`, the whole of it is read past and shown as `…`.
fn elements<E>(
    out: &mut String,
    (open, close): (char, char),
    mut next: impl FnMut(Option<&mut String>) -> Result<bool, E>,
) -> Result<(), E> {
    if out.len() >= PREVIEW {
        while next(None)? {}
        out.push('…');
        return Ok(());
    }
    out.push(open);
    let first = out.len();
    while out.len() < PREVIEW {
        // The comma goes in before the element is known to exist, and is taken back after the last.
        let mark = out.len();
        if mark > first {
            out.push(',');
        }
        if !next(Some(&mut *out))? {
            out.truncate(mark);
            out.push(close);
            return Ok(());
        }
    }
    let mut more = false;
    while next(None)? {
        more = true;
    }
    if more {
        out.push_str(",…");
    }
    out.push(close);
    Ok(())
}

/// How much of a wrong value a message quotes, in bytes of JSON text: past it, the value is read and
/// checked, not kept, and the quote ends in `…`. A whole list or object quoted as a JSON tree cost 17
/// times the body's size in memory, and a message as long as the body.
const PREVIEW: usize = 64;

/// Writes the value it reads into its string as JSON text, up to about [`PREVIEW`] bytes.
struct Preview<'a>(&'a mut String);

impl Preview<'_> {
    fn room(&self) -> bool {
        self.0.len() < PREVIEW
    }

    fn push(&mut self, text: &str) {
        if self.room() {
            self.0.push_str(text);
        }
    }
}

impl<'de> DeserializeSeed<'de> for Preview<'_> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Preview<'_> {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a value")
    }
    fn visit_bool<E: de::Error>(mut self, v: bool) -> Result<(), E> {
        self.push(if v { "true" } else { "false" });
        Ok(())
    }
    fn visit_i64<E: de::Error>(mut self, v: i64) -> Result<(), E> {
        self.push(&v.to_string());
        Ok(())
    }
    fn visit_u64<E: de::Error>(mut self, v: u64) -> Result<(), E> {
        self.push(&v.to_string());
        Ok(())
    }
    fn visit_f64<E: de::Error>(mut self, v: f64) -> Result<(), E> {
        self.push(&serde_json::Value::from(v).to_string());
        Ok(())
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<(), E> {
        if self.room() {
            let quoted = serde_json::Value::from(&*crate::error::clipped(v, PREVIEW)).to_string();
            self.0.push_str(&quoted);
        }
        Ok(())
    }
    fn visit_unit<E: de::Error>(mut self) -> Result<(), E> {
        self.push("null");
        Ok(())
    }
    fn visit_none<E: de::Error>(self) -> Result<(), E> {
        self.visit_unit()
    }
    fn visit_seq<A: de::SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        elements(self.0, ('[', ']'), |out| match out {
            Some(out) => Ok(seq.next_element_seed(Preview(out))?.is_some()),
            None => Ok(seq.next_element::<Checked>()?.is_some()),
        })
    }
    fn visit_map<A: de::MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        elements(self.0, ('{', '}'), |out| match out {
            Some(out) => {
                if map.next_key_seed(Preview(&mut *out))?.is_none() {
                    return Ok(false);
                }
                out.push(':');
                map.next_value_seed(Preview(out))?;
                Ok(true)
            }
            None => Ok(map.next_entry::<Checked, Checked>()?.is_some()),
        })
    }
}

/// A visitor's methods for numbers: each hands the number, as f64, to `$on`.
macro_rules! as_number {
    ($on:expr) => {
        fn visit_i64<E: de::Error>(self, v: i64) -> Result<Self::Value, E> {
            Ok($on(self, v as f64))
        }
        fn visit_u64<E: de::Error>(self, v: u64) -> Result<Self::Value, E> {
            Ok($on(self, v as f64))
        }
        fn visit_f64<E: de::Error>(self, v: f64) -> Result<Self::Value, E> {
            Ok($on(self, v))
        }
    };
}

/// `data` itself: a list, or a problem.
struct Top<'a>(&'a mut TensorData);

impl Top<'_> {
    fn not_a_list(self, v: String) {
        self.0.problem = Some((0, Problem::NotAList(v)));
    }
}

impl<'de> Visitor<'de> for Top<'_> {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a list of numbers")
    }
    as_json!(Top::not_a_list);
    // A number is quoted as it was sent (`1`, not `1.0`).
    fn visit_i64<E: de::Error>(self, v: i64) -> Result<(), E> {
        self.not_a_list(quote(|p| p.visit_i64::<E>(v))?);
        Ok(())
    }
    fn visit_u64<E: de::Error>(self, v: u64) -> Result<(), E> {
        self.not_a_list(quote(|p| p.visit_u64::<E>(v))?);
        Ok(())
    }
    fn visit_f64<E: de::Error>(self, v: f64) -> Result<(), E> {
        self.not_a_list(quote(|p| p.visit_f64::<E>(v))?);
        Ok(())
    }
    fn visit_seq<A: de::SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        let shape = SHAPE.with(Cell::get);
        let data = self.0;
        // A list of rows when its first element is a list; else a flat list of numbers.
        let mut rows: Option<bool> = None;
        let mut index = 0;
        loop {
            if data.problem.is_some() {
                if seq.next_element::<crate::decode::Checked>()?.is_none() {
                    return Ok(());
                }
                continue;
            }
            let item = Item {
                data,
                rows: &mut rows,
                index,
                shape,
            };
            if seq.next_element_seed(item)?.is_none() {
                return Ok(());
            }
            index += 1;
        }
    }
}

/// One element of `data`: a row, or a number.
struct Item<'a> {
    data: &'a mut TensorData,
    rows: &'a mut Option<bool>,
    index: usize,
    shape: Shape,
}

impl<'de> DeserializeSeed<'de> for Item<'_> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl Item<'_> {
    /// A value that is not a list, given as JSON.
    fn not_a_list(self, v: String) {
        let before = self.data.numbers;
        if *self.rows.get_or_insert(false) {
            self.data.problem = Some((before, Problem::RowNotAList(self.index)));
        } else {
            self.data.problem = Some((before, Problem::NotANumber(v)));
        }
    }

    fn number(self, x: f64) {
        if *self.rows.get_or_insert(false) {
            self.data.problem = Some((self.data.numbers, Problem::RowNotAList(self.index)));
        } else if let Some(p) = self.data.number(x, self.shape.cap) {
            self.data.problem = Some(p);
        }
    }
}

impl<'de> Visitor<'de> for Item<'_> {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a number or a row of numbers")
    }
    as_json!(Item::not_a_list);
    as_number!(Item::number);
    fn visit_seq<A: de::SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        if !*self.rows.get_or_insert(true) {
            // A list inside a flat list of numbers.
            self.not_a_list(quote(|p| p.visit_seq(seq))?);
            return Ok(());
        }
        // A row: its numbers, and its first problem, which stands only if the row has the width (a
        // row of another width is refused before any of its elements is looked at).
        let data = self.data;
        data.row_width = Some(self.shape.width);
        let before = data.numbers;
        let mut first: Option<(usize, Problem)> = None;
        let mut len = 0usize;
        loop {
            if first.is_some() {
                if seq.next_element::<crate::decode::Checked>()?.is_none() {
                    break;
                }
            } else if seq
                .next_element_seed(Element {
                    data: &mut *data,
                    problem: &mut first,
                    cap: self.shape.cap,
                })?
                .is_none()
            {
                break;
            }
            len += 1;
        }
        // A list in a row is the first thing to say of it: counted as one element, it would make the
        // row's width look wrong.
        if let Some((at, Problem::NotANumber(v))) = &first
            && v.starts_with('[')
        {
            data.problem = Some((
                before,
                Problem::Nested {
                    row: self.index,
                    element: at - before,
                },
            ));
        } else if len != self.shape.width {
            data.problem = Some((
                before,
                Problem::RowWidth {
                    row: self.index,
                    len,
                },
            ));
        } else if first.is_some() {
            data.problem = first;
        }
        Ok(())
    }
}

/// A number of a row.
struct Element<'a> {
    data: &'a mut TensorData,
    problem: &'a mut Option<(usize, Problem)>,
    cap: usize,
}

impl<'de> DeserializeSeed<'de> for Element<'_> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl Element<'_> {
    fn not_a_number(self, v: String) {
        *self.problem = Some((self.data.numbers, Problem::NotANumber(v)));
    }

    fn number(self, x: f64) {
        if let Some(p) = self.data.number(x, self.cap) {
            *self.problem = Some(p);
        }
    }
}

impl<'de> Visitor<'de> for Element<'_> {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a number")
    }
    as_json!(Element::not_a_number);
    as_number!(Element::number);
    fn visit_seq<A: de::SeqAccess<'de>>(self, seq: A) -> Result<(), A::Error> {
        self.not_a_number(quote(|p| p.visit_seq(seq))?);
        Ok(())
    }
}
