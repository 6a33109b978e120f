//! Stage `assemble`: turns hydrated features and the request context into the model's row-major input
//! buffer, through each slot's transforms.
//!
//! A missing value (entity not found, null, outside `max_age`, store failure) takes the slot's
//! `fill_missing` value when it has one, else the feature's declared default, before the transforms run.
//! Transforms compute in f64 and the result is stored as f32. The buffer comes from the caller (a pool), so
//! a request does not allocate its input.

use crate::hydrate::Resolved;
use crate::packed::ValueRef;
use crate::schema::{Model, Slot, Source, Transform};
use crate::value::Value;
use smallvec::SmallVec;

/// FNV-1a, 64-bit: the documented, stable hash behind `hash_bucket`.
pub fn fnv1a64(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// A context value that the model's float32 input cannot hold once transformed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Overflow {
    /// The slot (`model.slots`), whose source is a context field.
    pub slot: usize,
    /// The context field (`model.context`).
    pub context: usize,
}

/// Fills `buf` with `rows` rows of `model.width` columns.
///
/// `views[i]` holds the resolutions of `model.views[i]`: one (shared by all rows) or one per row.
/// `context[i]` is the request's value for `model.context[i]`, `None` when not sent.
/// Sets, per slot, whether any row used a default or fill value.
///
/// A value whose transformed result is beyond float32 (a float64 of 1e39, say) would reach the model as
/// infinity. From the store, such a value is treated as unusable: the slot takes its fill or default and
/// is reported as defaulted. From the request's context, it is the caller's to fix: [`Overflow`] names it.
/// (Defaults and fill values are checked when the schema loads, so they always transform to finite numbers.)
pub fn assemble(
    model: &Model,
    views: &[Vec<Resolved>],
    context: &[Option<Value>],
    rows: usize,
    buf: &mut Vec<f32>,
    defaulted: &mut Vec<bool>,
) -> Result<(), Overflow> {
    buf.clear();
    buf.resize(rows * model.width, 0.0);
    defaulted.clear();
    defaulted.resize(model.slots.len(), false);
    let width = model.width;
    if rows == 0 {
        return Ok(());
    }
    // The first row writes every slot.
    for (si, slot) in model.slots.iter().enumerate() {
        fill_slot(si, slot, views, context, 0, &mut buf[..width], defaulted)?;
    }
    if rows == 1 {
        return Ok(());
    }
    // The slots of the context and of a view resolved once for all rows (the user of a ranking request)
    // are the same in every row: each later row starts as a copy of the first, and only the slots that
    // differ by row are written again.
    let per_row: SmallVec<[usize; 16]> = (0..model.slots.len())
        .filter(|&si| match model.slots[si].source {
            Source::View { view, .. } => views[view].len() != 1,
            Source::Context { .. } => false,
        })
        .collect();
    for r in 1..rows {
        let (done, todo) = buf.split_at_mut(r * width);
        let row = &mut todo[..width];
        row.copy_from_slice(&done[..width]);
        for &si in &per_row {
            // Every column of the slot is written (a shorter list's others as 0), so nothing of the
            // first row's value is left.
            fill_slot(si, &model.slots[si], views, context, r, row, defaulted)?;
        }
    }
    Ok(())
}

/// Writes slot `si` of row `r` into `row`, from the row's value or, when it is missing, null or beyond
/// float32 once transformed, from the slot's fallback (and marks the slot defaulted). A context value
/// beyond float32 is the caller's to fix: [`Overflow`].
#[inline(always)]
fn fill_slot(
    si: usize,
    slot: &Slot,
    views: &[Vec<Resolved>],
    context: &[Option<Value>],
    r: usize,
    row: &mut [f32],
    defaulted: &mut [bool],
) -> Result<(), Overflow> {
    let raw = match slot.source {
        Source::View { view, feature } => {
            let per_view = &views[view];
            let resolved = if per_view.len() == 1 {
                &per_view[0]
            } else {
                &per_view[r]
            };
            resolved.found().map(|f| f.values.get(feature))
        }
        Source::Context { index } => context[index].as_ref().map(ValueRef::from),
    };
    let out = &mut row[slot.offset..slot.offset + slot.width];
    if let Some(v) = raw
        && !v.is_null()
    {
        write_slot(slot, v, out);
        if out.iter().all(|x| x.is_finite()) {
            return Ok(());
        }
        if let Source::Context { index } = slot.source {
            return Err(Overflow {
                slot: si,
                context: index,
            });
        }
    }
    defaulted[si] = true;
    write_slot(slot, slot.fallback().into(), out);
    Ok(())
}

/// The row that every slot's fallback makes: what a request is scored on when none of its entities is
/// found and it sends no context.
pub fn fallback_row(model: &Model) -> Vec<f32> {
    let mut row = vec![0f32; model.width];
    for slot in &model.slots {
        write_slot(
            slot,
            slot.fallback().into(),
            &mut row[slot.offset..slot.offset + slot.width],
        );
    }
    row
}

/// Whether `slot`'s fallback (its fill value, else its default) transforms to a number beyond float32.
pub fn fallback_overflows(slot: &Slot) -> bool {
    let mut out = vec![0f32; slot.width];
    write_slot(slot, slot.fallback().into(), &mut out);
    !out.iter().all(|x| x.is_finite())
}

/// Applies `slot`'s transforms to `value`, writing all `slot.width` numbers of `out`.
pub fn write_slot(slot: &Slot, value: ValueRef<'_>, out: &mut [f32]) {
    match value {
        ValueRef::Str(s) => {
            // Validation guarantees a one_hot or hash_bucket turns the string into numbers.
            let Some(at) = slot
                .steps
                .iter()
                .position(|t| matches!(t, Transform::OneHot { .. } | Transform::HashBucket { .. }))
            else {
                out.fill(0.0);
                return;
            };
            match &slot.steps[at] {
                Transform::OneHot { vocabulary } => {
                    for (i, o) in out.iter_mut().enumerate() {
                        *o = if vocabulary
                            .get(i)
                            .is_some_and(|w| w.as_bytes() == s.as_bytes())
                        {
                            1.0
                        } else {
                            0.0
                        };
                    }
                }
                Transform::HashBucket { buckets } => {
                    out[0] = (fnv1a64(s.as_bytes()) % buckets) as f32
                }
                _ => {}
            }
            let rest = &slot.steps[at + 1..];
            if !rest.is_empty() {
                for o in out.iter_mut() {
                    *o = numeric(rest, f64::from(*o)) as f32;
                }
            }
        }
        ValueRef::List(l) => {
            let mut values = l.iter();
            // A list shorter than its slot leaves the slot's other columns 0.
            for o in out.iter_mut() {
                *o = values
                    .next()
                    .map_or(0.0, |x| numeric(&slot.steps, f64::from(x)) as f32);
            }
        }
        ValueRef::Bool(b) => out[0] = numeric(&slot.steps, if b { 1.0 } else { 0.0 }) as f32,
        ValueRef::Int(i) => out[0] = numeric(&slot.steps, i as f64) as f32,
        ValueRef::Float(f) => out[0] = numeric(&slot.steps, f) as f32,
        ValueRef::Null => out.fill(0.0),
    }
}

/// Runs the numeric steps on one number.
fn numeric(steps: &[Transform], mut x: f64) -> f64 {
    for t in steps {
        x = match t {
            Transform::Identity | Transform::OneHot { .. } | Transform::HashBucket { .. } => x,
            Transform::Standardize { mean, std } => (x - mean) / std,
            // Defined for counts and durations; negative inputs are clamped to 0 so the model never sees NaN.
            Transform::Log1p => x.max(0.0).ln_1p(),
            Transform::Clip { min, max } => x.clamp(*min, *max),
            Transform::Bucketize { boundaries } => {
                boundaries.iter().filter(|b| x >= **b).count() as f64
            }
        };
    }
    x
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::value::Dtype;

    fn slot(dtype: Dtype, steps: Vec<Transform>, width: usize) -> Slot {
        Slot {
            label: "v:f".into(),
            source: Source::Context { index: 0 },
            dtype,
            fill: None,
            default: dtype.zero(),
            steps,
            offset: 0,
            width,
        }
    }

    fn run(s: &Slot, v: Value) -> Vec<f32> {
        let mut out = vec![f32::NAN; s.width];
        write_slot(s, (&v).into(), &mut out);
        out
    }

    #[test]
    fn a_context_value_beyond_float32_once_transformed_is_named_not_sent() {
        use std::path::{Path, PathBuf};
        let registry = crate::schema::Registry::compile(
            &[(
                PathBuf::from("m.yaml"),
                "kind: model\nname: m\nversion: 1\nfile: m.onnx\noutputs: [score]\ncontext:\n  - {name: n, dtype: int64, default: 0}\n  - {name: x, dtype: float64, default: 2}\ninputs:\n  - feature: context:n\n  - feature: context:x\n".into(),
            )],
            Path::new("."),
        )
        .expect("schema");
        let model = &registry.models["m"];
        let (mut buf, mut flags) = (Vec::new(), Vec::new());
        let context = |x: f64| [Some(Value::Int(7)), Some(Value::Float(x))];
        let r = assemble(model, &[], &context(1e39), 1, &mut buf, &mut flags);
        assert_eq!(
            r,
            Err(Overflow {
                slot: 1,
                context: 1
            })
        );
        // In range: written as sent; a value not sent takes its default.
        let r = assemble(model, &[], &context(-3e38), 1, &mut buf, &mut flags);
        assert_eq!(r, Ok(()));
        assert_eq!(buf, vec![7.0, -3e38f32]);
        assert_eq!(flags, vec![false, false]);
        let r = assemble(
            model,
            &[],
            &[None, Some(Value::Float(1.5))],
            1,
            &mut buf,
            &mut flags,
        );
        assert_eq!(r, Ok(()));
        assert_eq!(buf, vec![0.0, 1.5]);
        assert_eq!(flags, vec![true, false]);
    }

    /// A ranking request's rows, assembled together (later rows copied from the first, then their own
    /// slots written), are the rows each candidate gets assembled alone: with the user shared, items
    /// found, missing, not found or holding a list shorter than its slot, and the context sent or not.
    #[test]
    fn rows_assembled_together_equal_each_row_assembled_alone() {
        use crate::cache::{Entry, Found};
        use crate::hydrate::Status;
        use crate::packed::Packed;
        use std::path::Path;
        use std::sync::Arc;
        let registry = crate::schema::Registry::load_dir(Path::new("schemas"), Path::new("models"))
            .expect("demo schemas");
        let model = &registry.models["ctr"];
        let user_view = &registry.views["user_profile"];
        let item_view = &registry.views["item_stats"];
        let stats = Arc::new(crate::telemetry::ViewStats::default());
        let found = |view, values: Vec<Value>| Resolved {
            entry: Some(Arc::new(Entry::new(
                0,
                Some(Found {
                    event_ts_ms: 0,
                    values: Packed::new(&values),
                }),
                view,
                4,
                stats.clone(),
            ))),
            status: Status::Present,
        };
        let item = |cat: &str, price: f64, emb: Vec<f32>| {
            found(
                item_view,
                vec![
                    Value::Str(cat.into()),
                    Value::Str("brand_3".into()),
                    Value::Float(price),
                    Value::Null,
                    Value::Int(250),
                    Value::List(emb.into_boxed_slice()),
                ],
            )
        };
        let user = || {
            found(
                user_view,
                vec![
                    Value::Int(31),
                    Value::Bool(true),
                    Value::Float(12.5),
                    Value::Str("de".into()),
                    Value::List(vec![0.25, -0.5, 0.75, 1.0].into_boxed_slice()),
                ],
            )
        };
        let missing = |status| Resolved {
            entry: None,
            status,
        };
        let items = || {
            vec![
                item("tech", 99.0, vec![1.0, 2.0, 3.0, 4.0]),
                missing(Status::NotFound),
                // A list shorter than its slot: the slot's other columns are 0, not the row above's.
                item("food", 5.0, vec![-1.0]),
                missing(Status::Defaulted),
                item("sports", 0.0, vec![0.5, 0.5, 0.5, 0.5]),
            ]
        };
        for context in [
            vec![Some(Value::Int(20)), Some(Value::Str("ios".into()))],
            vec![None, None],
        ] {
            let views = [vec![user()], items()];
            let rows = views[1].len();
            let (mut together, mut flags) = (Vec::new(), Vec::new());
            assemble(model, &views, &context, rows, &mut together, &mut flags).expect("assembles");
            let mut alone = Vec::new();
            let mut any_defaulted = vec![false; model.slots.len()];
            for r in 0..rows {
                let one = [vec![user()], vec![items().swap_remove(r)]];
                let (mut buf, mut f) = (Vec::new(), Vec::new());
                assemble(model, &one, &context, 1, &mut buf, &mut f).expect("assembles");
                alone.extend_from_slice(&buf);
                for (a, b) in any_defaulted.iter_mut().zip(&f) {
                    *a |= *b;
                }
            }
            assert_eq!(together.len(), rows * model.width);
            assert_eq!(together, alone);
            assert_eq!(flags, any_defaulted);
            // The short list's row: its first column as sent, the other three 0.
            let emb = model
                .slots
                .iter()
                .find(|s| s.label == "item_stats:embedding")
                .expect("slot");
            let at = 2 * model.width + emb.offset;
            assert_eq!(&together[at..at + 4], &[-1.0, 0.0, 0.0, 0.0]);
        }
    }

    #[test]
    fn fnv1a_matches_the_reference_values() {
        assert_eq!(fnv1a64(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a64(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a64(b"brand_45") % 16, 8);
    }

    #[test]
    fn transforms_compute_what_the_schema_language_documents() {
        let s = slot(
            Dtype::Int64,
            vec![Transform::Standardize {
                mean: 40.0,
                std: 12.0,
            }],
            1,
        );
        assert_eq!(run(&s, Value::Int(52)), vec![1.0]);
        let s = slot(Dtype::Float32, vec![Transform::Log1p], 1);
        assert_eq!(run(&s, Value::Float(std::f64::consts::E - 1.0)), vec![1.0]);
        assert_eq!(run(&s, Value::Float(-5.0)), vec![0.0]);
        let s = slot(
            Dtype::Float32,
            vec![Transform::Clip { min: 0.0, max: 0.5 }],
            1,
        );
        assert_eq!(run(&s, Value::Float(0.7)), vec![0.5]);
        let s = slot(
            Dtype::Int64,
            vec![Transform::Bucketize {
                boundaries: vec![10.0, 100.0],
            }],
            1,
        );
        assert_eq!(run(&s, Value::Int(9)), vec![0.0]);
        assert_eq!(run(&s, Value::Int(10)), vec![1.0]);
        assert_eq!(run(&s, Value::Int(1000)), vec![2.0]);
        let s = slot(
            Dtype::String,
            vec![Transform::OneHot {
                vocabulary: vec!["a".into(), "b".into(), "c".into()],
            }],
            3,
        );
        assert_eq!(run(&s, Value::Str("b".into())), vec![0.0, 1.0, 0.0]);
        assert_eq!(run(&s, Value::Str("zz".into())), vec![0.0, 0.0, 0.0]);
        let s = slot(
            Dtype::String,
            vec![Transform::HashBucket { buckets: 16 }],
            1,
        );
        assert_eq!(run(&s, Value::Str("brand_45".into())), vec![8.0]);
        let s = slot(
            Dtype::Float32List(2),
            vec![Transform::Clip {
                min: -1.0,
                max: 1.0,
            }],
            2,
        );
        assert_eq!(
            run(&s, Value::List(vec![3.0, -0.5].into_boxed_slice())),
            vec![1.0, -0.5]
        );
        let s = slot(Dtype::Bool, vec![], 1);
        assert_eq!(run(&s, Value::Bool(true)), vec![1.0]);
    }
}
