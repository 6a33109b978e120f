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
    for r in 0..rows {
        let (done, todo) = buf.split_at_mut(r * width);
        let row = &mut todo[..width];
        // The slots of the context and of a view resolved once for all rows (the user of a ranking
        // request) are the same in every row: written for the first, copied to the rest.
        let first = (r > 0).then(|| &done[..width]);
        for (si, slot) in model.slots.iter().enumerate() {
            let shared = match slot.source {
                Source::View { view, .. } => views[view].len() == 1,
                Source::Context { .. } => true,
            };
            if let Some(first) = first
                && shared
            {
                let at = slot.offset..slot.offset + slot.width;
                row[at.clone()].copy_from_slice(&first[at]);
                continue;
            }
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
            match raw {
                Some(v) if !v.is_null() => {
                    write_slot(slot, v, out);
                    if out.iter().all(|x| x.is_finite()) {
                        continue;
                    }
                    if let Source::Context { index } = slot.source {
                        return Err(Overflow {
                            slot: si,
                            context: index,
                        });
                    }
                }
                _ => {}
            }
            defaulted[si] = true;
            write_slot(slot, slot.fallback().into(), out);
        }
    }
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

/// Applies `slot`'s transforms to `value`, writing `slot.width` numbers into `out`.
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
                    for (o, word) in out.iter_mut().zip(vocabulary.iter()) {
                        *o = if word.as_bytes() == s.as_bytes() {
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
            for (o, x) in out.iter_mut().zip(l.iter()) {
                *o = numeric(&slot.steps, f64::from(x)) as f32;
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
