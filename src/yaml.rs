//! A bound on what a YAML text's aliases expand to, checked before it is read into values.
//!
//! An alias (`*a`) stands for a copy of its anchored node (`&a`), and serde_yaml builds that copy every
//! time: a 128 KiB schema body with one anchor of 16,000 items and 13,000 aliases of it would build
//! some 200 million values, gigabytes, before anything could look at it; one anchored string of 64 KiB
//! named by 20,000 aliases, 1.3 GB of text. serde_yaml's own guard counts alias jumps, not what each
//! jump copies, so it stops neither. The check walks the text's documents without building anything and
//! stops as soon as what it met passes the budget.

use std::cell::Cell;
use std::fmt;

use serde::de::{
    DeserializeSeed, Deserializer, EnumAccess, MapAccess, SeqAccess, VariantAccess, Visitor,
};

/// What a text may expand to beyond twice its length: each value counts 1, and a string or byte string
/// 1 more per byte. Without aliases a text holds at most a value per byte or so (`1,` in a flow list) and
/// at most its own length in text (escapes and folding only shorten it), so it stays within twice its
/// length; anchors repeated within a document (a cache policy written once, named by each view of a file
/// of many) have room to spare.
pub const SLACK: usize = 65_536;

/// Why `text` is refused, or `None` when what it holds, aliases expanded, stays within twice its length
/// plus [`SLACK`]. A syntax error is not this check's to report: it answers `None`, and reading the text
/// then says what is wrong where.
pub fn expansion_problem(text: &str) -> Option<String> {
    let budget = text.len().saturating_mul(2).saturating_add(SLACK);
    let count = Count {
        left: &Cell::new(budget),
        over: &Cell::new(false),
    };
    for doc in serde_yaml::Deserializer::from_str(text) {
        if count.deserialize(doc).is_err() {
            break;
        }
    }
    count.over.get().then(|| {
        format!(
            "its aliases (`*name`) expand it past {budget} (a value counts 1, and text 1 more a byte; the bound is twice its {} bytes, plus {SLACK}): repeat a large anchored node fewer times, or write it out",
            text.len()
        )
    })
}

/// Counts the values of one document against what is left of the budget.
#[derive(Clone, Copy)]
struct Count<'c> {
    left: &'c Cell<usize>,
    over: &'c Cell<bool>,
}

impl Count<'_> {
    /// Takes `cost` from what is left.
    fn take<E: serde::de::Error>(self, cost: usize) -> Result<(), E> {
        match self.left.get().checked_sub(cost) {
            Some(left) => {
                self.left.set(left);
                Ok(())
            }
            None => {
                self.over.set(true);
                Err(E::custom("past the budget of values"))
            }
        }
    }
}

impl<'de> DeserializeSeed<'de> for Count<'_> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Count<'_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("any YAML value")
    }

    fn visit_bool<E: serde::de::Error>(self, _: bool) -> Result<(), E> {
        self.take(1)
    }

    fn visit_i64<E: serde::de::Error>(self, _: i64) -> Result<(), E> {
        self.take(1)
    }

    fn visit_u64<E: serde::de::Error>(self, _: u64) -> Result<(), E> {
        self.take(1)
    }

    fn visit_i128<E: serde::de::Error>(self, _: i128) -> Result<(), E> {
        self.take(1)
    }

    fn visit_u128<E: serde::de::Error>(self, _: u128) -> Result<(), E> {
        self.take(1)
    }

    fn visit_f64<E: serde::de::Error>(self, _: f64) -> Result<(), E> {
        self.take(1)
    }

    fn visit_str<E: serde::de::Error>(self, s: &str) -> Result<(), E> {
        self.take(s.len().saturating_add(1))
    }

    fn visit_bytes<E: serde::de::Error>(self, b: &[u8]) -> Result<(), E> {
        self.take(b.len().saturating_add(1))
    }

    fn visit_unit<E: serde::de::Error>(self) -> Result<(), E> {
        self.take(1)
    }

    fn visit_none<E: serde::de::Error>(self) -> Result<(), E> {
        self.take(1)
    }

    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        self.deserialize(d)
    }

    fn visit_newtype_struct<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        self.deserialize(d)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        self.take(1)?;
        while seq.next_element_seed(self)?.is_some() {}
        Ok(())
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        self.take(1)?;
        while map.next_key_seed(self)?.is_some() {
            map.next_value_seed(self)?;
        }
        Ok(())
    }

    /// A tagged value (`!name value`): the tag, then the value.
    fn visit_enum<A: EnumAccess<'de>>(self, data: A) -> Result<(), A::Error> {
        let ((), value) = data.variant_seed(self)?;
        value.newtype_variant_seed(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A document with one anchored list of `items` numbers and a list of `aliases` aliases of it.
    fn bomb(items: usize, aliases: usize) -> String {
        let mut s = String::from("kind: view\nname: x\na: &a\n");
        s.extend(std::iter::repeat_n("- 1\n", items));
        s.push_str("b:\n");
        s.extend(std::iter::repeat_n("- *a\n", aliases));
        s
    }

    #[test]
    fn aliases_that_multiply_a_large_anchor_are_refused_before_they_are_built() {
        let text = bomb(16_000, 13_000);
        assert!(text.len() < 128 << 10, "{} bytes", text.len());
        let started = std::time::Instant::now();
        let why = expansion_problem(&text).expect("refused");
        // The walk stops at the budget: nowhere near the 208 million values the text stands for.
        assert!(started.elapsed() < std::time::Duration::from_secs(5));
        assert!(why.contains("aliases (`*name`) expand it past"), "{why}");
        assert!(
            why.contains(&format!("twice its {} bytes", text.len())),
            "{why}"
        );
    }

    #[test]
    fn aliases_of_one_long_string_are_refused_by_its_length() {
        // Few values, but each alias a copy of 64 KiB: 1.4 GB of text from 128 KiB.
        let mut text = format!(
            "kind: entity\nname: e\ns: &a \"{}\"\nl:\n",
            "x".repeat(64 << 10)
        );
        text.extend(std::iter::repeat_n("- *a\n", 12_000));
        assert!(text.len() < 128 << 10, "{} bytes", text.len());
        assert!(expansion_problem(&text).is_some());
    }

    #[test]
    fn texts_without_aliases_and_modest_aliases_pass() {
        // The densest text without aliases: a flow list of one-digit numbers, two bytes a value.
        let dense = format!("[{}1]", "1,".repeat(500_000));
        assert_eq!(expansion_problem(&dense), None);
        let block = "- 1\n".repeat(250_000);
        assert_eq!(expansion_problem(&block), None);
        // A text that is all one long string, and many short ones.
        let long = format!("a: \"{}\"\n", "x".repeat(1 << 20));
        assert_eq!(expansion_problem(&long), None);
        let short = "- ab\n".repeat(200_000);
        assert_eq!(expansion_problem(&short), None);
        // A policy written once and named by fifty views of one document (anchors do not reach across
        // documents).
        let mut shared = String::from(
            "policies:\n  p: &policy {ttl: 5m, refresh_after: 1m, negative_ttl: 30s}\nviews:\n",
        );
        for i in 0..50 {
            shared.push_str(&format!("  - {{name: v{i}, cache: *policy}}\n"));
        }
        assert!(
            serde_yaml::from_str::<serde_yaml::Value>(&shared).is_ok(),
            "the aliases resolve"
        );
        assert_eq!(expansion_problem(&shared), None);
        // Tags and nulls are values like any other.
        assert_eq!(expansion_problem("a: !tagged {b: ~}\nc:\n"), None);
    }

    #[test]
    fn a_syntax_error_is_left_to_the_reader() {
        assert_eq!(expansion_problem("a: [1, 2\nb: *missing\n"), None);
        assert_eq!(expansion_problem("a: *undefined\n"), None);
    }

    #[test]
    fn the_budget_counts_every_document_of_the_text() {
        // Each document alone stays inside the budget; together they do not.
        let one = bomb(1_000, 60);
        assert_eq!(expansion_problem(&one), None);
        let three = [one.as_str(); 3].join("---\n");
        assert!(expansion_problem(&three).is_some());
    }
}
