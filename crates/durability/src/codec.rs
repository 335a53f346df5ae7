//! The stored form of payloads, results and memos (§2.1).
//!
//! A value is stored as the text `{"kind":"value","value":<json>}`, and an
//! absent value (JavaScript's `undefined`) as `{"kind":"undefined"}`. The
//! envelope lets a reader tell "no value" from `null`, and keeps rows
//! interchangeable with the TypeScript library.
//!
//! JSON has no NaN or infinity, and `serde_json` silently writes them as
//! `null`, which would store a different value than the caller gave. So
//! [`encode`] walks the value first and rejects non-finite numbers with the
//! path where it found them. Object keys keep their insertion order
//! (`serde_json/preserve_order`), so decoding and encoding again gives the
//! same text. Numbers are written the way `serde_json` writes them (a float
//! `1.0` stays `1.0`, where JavaScript would write `1`); both libraries read
//! either form. Integers beyond 2^53 - 1 are stored exactly, but the
//! JavaScript library would read them rounded.
//!
//! Nesting is bounded too. `serde_json` refuses to read text nested deeper
//! than 128 arrays and objects (its recursion limit), while it writes any
//! depth; a value accepted deeper than that could never be read back, and a
//! value thousands of levels deep overflows the stack of whoever walks it
//! recursively. So [`encode`] and [`encode_value`] refuse a value nested
//! deeper than [`MAX_NESTING_DEPTH`] levels with [`CodecError::TooDeep`]
//! before anything is written. The limit is below the decoder's so that
//! every wrapper this crate puts around a stored value (the envelope here,
//! a cold log segment's three levels) still reads back. The walk that
//! checks it stops one level past the limit, so its own recursion is
//! bounded whatever the input.
//!
//! This module touches no storage.
//!
//! ```
//! use durability::codec::{decode, decode_as, encode, encode_value};
//! use serde_json::json;
//!
//! assert_eq!(encode(&json!({"b": 1, "a": [true]})).unwrap(), r#"{"kind":"value","value":{"b":1,"a":[true]}}"#);
//! assert_eq!(encode_value(None).unwrap(), r#"{"kind":"undefined"}"#);
//! assert_eq!(decode(r#"{"kind":"undefined"}"#).unwrap(), None);
//! assert_eq!(decode_as::<Vec<u8>>(r#"{"kind":"value","value":[1,2]}"#).unwrap(), vec![1, 2]);
//! assert!(encode(&f64::NAN).is_err());
//! let mut deep = json!(1);
//! for _ in 0..durability::codec::MAX_NESTING_DEPTH + 1 {
//!     deep = json!([deep]);
//! }
//! assert!(encode(&deep).is_err());
//! ```

use std::fmt::{self, Display};

use serde::de::DeserializeOwned;
use serde::ser;
use serde::{Deserialize, Serialize, Serializer};
use serde_json::Value;
use thiserror::Error;

/// The most arrays and objects a stored value may be nested in one another
/// (a scalar is depth 0, `[1]` is 1). `serde_json` reads at most 127 levels
/// of a whole stored text; the largest wrapper around a value (a cold log
/// segment, plus the envelope) takes 4 of them, and 100 leaves room for both.
pub const MAX_NESTING_DEPTH: usize = 100;

/// The bytes the stored envelope adds around a value's own JSON:
/// `{"kind":"value","value":` and `}`.
const VALUE_ENVELOPE_BYTES: usize = r#"{"kind":"value","value":}"#.len();

/// The length of a value's own JSON (what `serde_json::to_string` writes
/// for it) inside text [`encode`] returned; 0 for "no value". Limits count
/// this, not the envelope, which is private to the storage format.
pub fn body_bytes(stored: &str) -> usize {
    stored.len().saturating_sub(VALUE_ENVELOPE_BYTES)
}

/// Why a value could not be encoded, or stored text could not be decoded.
#[derive(Debug, Clone, PartialEq, Error)]
#[non_exhaustive]
pub enum CodecError {
    /// A NaN or infinite number; JSON cannot hold it.
    #[error("value is not JSON: non-finite number {value} at {path}")]
    NonFinite { path: String, value: f64 },
    /// Arrays and objects nested deeper than [`MAX_NESTING_DEPTH`]: the
    /// stored text could not be read back.
    #[error(
        "value is nested deeper than the limit of {limit} levels of arrays and objects at {path}"
    )]
    TooDeep { path: String, limit: usize },
    /// Something else JSON cannot hold (a map with non-string keys, a
    /// `Serialize` impl that failed).
    #[error("value is not JSON: {detail}")]
    NotJson { detail: String },
    /// Stored text that is not JSON at all.
    #[error("stored value is not JSON: {detail}")]
    Malformed { detail: String },
    /// Stored JSON that is neither `{"kind":"undefined"}` nor
    /// `{"kind":"value","value":...}`.
    #[error("stored value is not a durability value envelope: {detail}")]
    Envelope { detail: String },
    /// A stored value that does not have the type the reader asked for.
    #[error("stored value does not have the expected type: {detail}")]
    Type { detail: String },
}

/// The stored envelope. `Undefined` is JavaScript's `undefined`: no value.
/// Unknown extra keys are ignored, as the reference library's schema does.
#[derive(Serialize, Deserialize)]
#[serde(tag = "kind")]
enum Stored<V> {
    #[serde(rename = "undefined")]
    Undefined,
    #[serde(rename = "value")]
    Value { value: V },
}

/// Encodes a JSON value, or `None` for "no value". A `serde_json::Value`
/// cannot hold a non-finite number, so this fails only for a value nested
/// deeper than [`MAX_NESTING_DEPTH`].
pub fn encode_value(value: Option<&Value>) -> Result<String, CodecError> {
    let stored = match value {
        None => Stored::Undefined,
        Some(value) => {
            check(value)?;
            Stored::Value { value }
        }
    };
    serde_json::to_string(&stored).map_err(|error| CodecError::NotJson {
        detail: error.to_string(),
    })
}

/// Encodes any serializable value as `{"kind":"value","value":...}`.
///
/// Rejects NaN and infinities anywhere in the value, nesting deeper than
/// [`MAX_NESTING_DEPTH`], and anything else JSON cannot represent. To store
/// "no value", use [`encode_value`]`(None)`.
pub fn encode<T: Serialize + ?Sized>(value: &T) -> Result<String, CodecError> {
    check(value)?;
    let stored = Stored::Value { value };
    serde_json::to_string(&stored).map_err(|error| CodecError::NotJson {
        detail: error.to_string(),
    })
}

/// Decodes stored text: `Some(value)`, or `None` for `{"kind":"undefined"}`.
pub fn decode(text: &str) -> Result<Option<Value>, CodecError> {
    // Parse to a Value first so that text which is not JSON and JSON of the
    // wrong shape are told apart in the error.
    let parsed: Value = serde_json::from_str(text).map_err(|error| CodecError::Malformed {
        detail: error.to_string(),
    })?;
    match serde_json::from_value::<Stored<Value>>(parsed) {
        Ok(Stored::Undefined) => Ok(None),
        Ok(Stored::Value { value }) => Ok(Some(value)),
        Err(error) => Err(CodecError::Envelope {
            detail: error.to_string(),
        }),
    }
}

/// Decodes stored text into `T`. "No value" decodes like JSON `null`, so it
/// becomes `()` or `None` and is an error for types that need a value.
pub fn decode_as<T: DeserializeOwned>(text: &str) -> Result<T, CodecError> {
    let value = decode(text)?.unwrap_or(Value::Null);
    serde_json::from_value(value).map_err(|error| CodecError::Type {
        detail: error.to_string(),
    })
}

/// Walks `value` through serde without producing anything, failing at the
/// first non-finite float or at the first container one level past
/// [`MAX_NESTING_DEPTH`]. One extra pass, proportional to the value's size;
/// its recursion never goes deeper than the limit.
fn check<T: Serialize + ?Sized>(value: &T) -> Result<(), CodecError> {
    let path = |mut path: Vec<String>| {
        path.reverse();
        format!("${}", path.concat())
    };
    value
        .serialize(FiniteCheck { depth: 0 })
        .map_err(|error| match error {
            CheckError::NonFinite { value, path: at } => CodecError::NonFinite {
                path: path(at),
                value,
            },
            CheckError::TooDeep { path: at } => CodecError::TooDeep {
                path: path(at),
                limit: MAX_NESTING_DEPTH,
            },
            CheckError::Custom(detail) => CodecError::NotJson { detail },
        })
}

/// Why the walk stopped. The path is collected innermost first while the
/// error travels outwards.
#[derive(Debug)]
enum CheckError {
    NonFinite { value: f64, path: Vec<String> },
    TooDeep { path: Vec<String> },
    Custom(String),
}

impl Display for CheckError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CheckError::NonFinite { value, .. } => write!(f, "non-finite number {value}"),
            CheckError::TooDeep { .. } => {
                write!(f, "nested deeper than {MAX_NESTING_DEPTH} levels")
            }
            CheckError::Custom(detail) => f.write_str(detail),
        }
    }
}

impl std::error::Error for CheckError {}

impl ser::Error for CheckError {
    fn custom<M: Display>(msg: M) -> Self {
        CheckError::Custom(msg.to_string())
    }
}

impl CheckError {
    fn at(self, segment: impl FnOnce() -> String) -> Self {
        match self {
            CheckError::NonFinite { value, mut path } => {
                path.push(segment());
                CheckError::NonFinite { value, path }
            }
            CheckError::TooDeep { mut path } => {
                path.push(segment());
                CheckError::TooDeep { path }
            }
            other => other,
        }
    }
}

fn check_float(value: f64) -> Result<(), CheckError> {
    if value.is_finite() {
        Ok(())
    } else {
        Err(CheckError::NonFinite {
            value,
            path: Vec::new(),
        })
    }
}

fn key_segment<K: Serialize + ?Sized>(key: &K) -> String {
    match serde_json::to_value(key) {
        Ok(Value::String(key)) => format!("[{key:?}]"),
        Ok(other) => format!("[{other}]"),
        Err(_) => "[?]".to_owned(),
    }
}

/// The walk at one value; `depth` is how many arrays and objects enclose
/// it.
#[derive(Clone, Copy)]
struct FiniteCheck {
    depth: usize,
}

impl FiniteCheck {
    /// The walk inside a container opened here (the value's JSON is an
    /// array or an object), refused one level past the limit, before any
    /// element is visited.
    fn open(self) -> Result<FiniteCheck, CheckError> {
        let depth = self.depth + 1;
        if depth > MAX_NESTING_DEPTH {
            return Err(CheckError::TooDeep { path: Vec::new() });
        }
        Ok(FiniteCheck { depth })
    }

    fn seq(self) -> Result<SeqCheck, CheckError> {
        Ok(SeqCheck {
            index: 0,
            inner: self.open()?,
        })
    }

    fn fields(self) -> Result<FieldCheck, CheckError> {
        Ok(FieldCheck {
            inner: self.open()?,
        })
    }

    /// A variant with content is written `{"Variant": content}`: one more
    /// object around the content.
    fn variant(self, variant: &'static str) -> Result<FiniteCheck, CheckError> {
        self.open()
            .map_err(|error| error.at(|| format!(".{variant}")))
    }
}

/// Walks the elements of a sequence, tuple or tuple variant.
struct SeqCheck {
    index: usize,
    inner: FiniteCheck,
}

impl SeqCheck {
    fn element<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), CheckError> {
        let index = self.index;
        self.index += 1;
        value
            .serialize(self.inner)
            .map_err(|error| error.at(|| format!("[{index}]")))
    }
}

/// Walks the fields of a struct or struct variant, and the entries of a map.
struct FieldCheck {
    inner: FiniteCheck,
}

impl Serializer for FiniteCheck {
    type Ok = ();
    type Error = CheckError;
    type SerializeSeq = SeqCheck;
    type SerializeTuple = SeqCheck;
    type SerializeTupleStruct = SeqCheck;
    type SerializeTupleVariant = SeqCheck;
    type SerializeMap = FieldCheck;
    type SerializeStruct = FieldCheck;
    type SerializeStructVariant = FieldCheck;

    fn serialize_bool(self, _: bool) -> Result<(), CheckError> {
        Ok(())
    }
    fn serialize_i8(self, _: i8) -> Result<(), CheckError> {
        Ok(())
    }
    fn serialize_i16(self, _: i16) -> Result<(), CheckError> {
        Ok(())
    }
    fn serialize_i32(self, _: i32) -> Result<(), CheckError> {
        Ok(())
    }
    fn serialize_i64(self, _: i64) -> Result<(), CheckError> {
        Ok(())
    }
    fn serialize_i128(self, _: i128) -> Result<(), CheckError> {
        Ok(())
    }
    fn serialize_u8(self, _: u8) -> Result<(), CheckError> {
        Ok(())
    }
    fn serialize_u16(self, _: u16) -> Result<(), CheckError> {
        Ok(())
    }
    fn serialize_u32(self, _: u32) -> Result<(), CheckError> {
        Ok(())
    }
    fn serialize_u64(self, _: u64) -> Result<(), CheckError> {
        Ok(())
    }
    fn serialize_u128(self, _: u128) -> Result<(), CheckError> {
        Ok(())
    }
    fn serialize_f32(self, value: f32) -> Result<(), CheckError> {
        check_float(f64::from(value))
    }
    fn serialize_f64(self, value: f64) -> Result<(), CheckError> {
        check_float(value)
    }
    fn serialize_char(self, _: char) -> Result<(), CheckError> {
        Ok(())
    }
    fn serialize_str(self, _: &str) -> Result<(), CheckError> {
        Ok(())
    }
    fn serialize_bytes(self, _: &[u8]) -> Result<(), CheckError> {
        Ok(())
    }
    fn serialize_none(self) -> Result<(), CheckError> {
        Ok(())
    }
    fn serialize_some<T: Serialize + ?Sized>(self, value: &T) -> Result<(), CheckError> {
        value.serialize(self)
    }
    fn serialize_unit(self) -> Result<(), CheckError> {
        Ok(())
    }
    fn serialize_unit_struct(self, _: &'static str) -> Result<(), CheckError> {
        Ok(())
    }
    fn serialize_unit_variant(
        self,
        _: &'static str,
        _: u32,
        _: &'static str,
    ) -> Result<(), CheckError> {
        Ok(())
    }
    fn serialize_newtype_struct<T: Serialize + ?Sized>(
        self,
        _: &'static str,
        value: &T,
    ) -> Result<(), CheckError> {
        value.serialize(self)
    }
    fn serialize_newtype_variant<T: Serialize + ?Sized>(
        self,
        _: &'static str,
        _: u32,
        variant: &'static str,
        value: &T,
    ) -> Result<(), CheckError> {
        value
            .serialize(self.variant(variant)?)
            .map_err(|error| error.at(|| format!(".{variant}")))
    }
    fn serialize_seq(self, _: Option<usize>) -> Result<SeqCheck, CheckError> {
        self.seq()
    }
    fn serialize_tuple(self, _: usize) -> Result<SeqCheck, CheckError> {
        self.seq()
    }
    fn serialize_tuple_struct(self, _: &'static str, _: usize) -> Result<SeqCheck, CheckError> {
        self.seq()
    }
    fn serialize_tuple_variant(
        self,
        _: &'static str,
        _: u32,
        variant: &'static str,
        _: usize,
    ) -> Result<SeqCheck, CheckError> {
        self.variant(variant)?
            .seq()
            .map_err(|error| error.at(|| format!(".{variant}")))
    }
    fn serialize_map(self, _: Option<usize>) -> Result<FieldCheck, CheckError> {
        self.fields()
    }
    fn serialize_struct(self, _: &'static str, _: usize) -> Result<FieldCheck, CheckError> {
        self.fields()
    }
    fn serialize_struct_variant(
        self,
        _: &'static str,
        _: u32,
        variant: &'static str,
        _: usize,
    ) -> Result<FieldCheck, CheckError> {
        self.variant(variant)?
            .fields()
            .map_err(|error| error.at(|| format!(".{variant}")))
    }
}

impl ser::SerializeSeq for SeqCheck {
    type Ok = ();
    type Error = CheckError;
    fn serialize_element<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), CheckError> {
        self.element(value)
    }
    fn end(self) -> Result<(), CheckError> {
        Ok(())
    }
}

impl ser::SerializeTuple for SeqCheck {
    type Ok = ();
    type Error = CheckError;
    fn serialize_element<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), CheckError> {
        self.element(value)
    }
    fn end(self) -> Result<(), CheckError> {
        Ok(())
    }
}

impl ser::SerializeTupleStruct for SeqCheck {
    type Ok = ();
    type Error = CheckError;
    fn serialize_field<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), CheckError> {
        self.element(value)
    }
    fn end(self) -> Result<(), CheckError> {
        Ok(())
    }
}

impl ser::SerializeTupleVariant for SeqCheck {
    type Ok = ();
    type Error = CheckError;
    fn serialize_field<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), CheckError> {
        self.element(value)
    }
    fn end(self) -> Result<(), CheckError> {
        Ok(())
    }
}

impl ser::SerializeMap for FieldCheck {
    type Ok = ();
    type Error = CheckError;
    fn serialize_key<T: Serialize + ?Sized>(&mut self, key: &T) -> Result<(), CheckError> {
        key.serialize(self.inner)
    }
    fn serialize_value<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), CheckError> {
        // Only reached by maps that split keys from values; the key is gone
        // by now, so the path names the entry without it.
        value
            .serialize(self.inner)
            .map_err(|error| error.at(|| "[<key>]".to_owned()))
    }
    fn serialize_entry<K: Serialize + ?Sized, V: Serialize + ?Sized>(
        &mut self,
        key: &K,
        value: &V,
    ) -> Result<(), CheckError> {
        key.serialize(self.inner)?;
        value
            .serialize(self.inner)
            .map_err(|error| error.at(|| key_segment(key)))
    }
    fn end(self) -> Result<(), CheckError> {
        Ok(())
    }
}

impl ser::SerializeStruct for FieldCheck {
    type Ok = ();
    type Error = CheckError;
    fn serialize_field<T: Serialize + ?Sized>(
        &mut self,
        name: &'static str,
        value: &T,
    ) -> Result<(), CheckError> {
        value
            .serialize(self.inner)
            .map_err(|error| error.at(|| format!(".{name}")))
    }
    fn end(self) -> Result<(), CheckError> {
        Ok(())
    }
}

impl ser::SerializeStructVariant for FieldCheck {
    type Ok = ();
    type Error = CheckError;
    fn serialize_field<T: Serialize + ?Sized>(
        &mut self,
        name: &'static str,
        value: &T,
    ) -> Result<(), CheckError> {
        value
            .serialize(self.inner)
            .map_err(|error| error.at(|| format!(".{name}")))
    }
    fn end(self) -> Result<(), CheckError> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use serde_json::json;

    use super::*;

    #[derive(Serialize, Deserialize, Debug, PartialEq)]
    struct Reading {
        sensor: String,
        samples: Vec<f64>,
    }

    #[derive(Serialize)]
    enum Shape {
        Circle { radius: f32 },
        Point(f64),
    }

    #[test]
    fn encodes_compact_json_in_insertion_order() {
        let value = json!({"z": 1, "a": {"y": null, "b": "x"}, "m": [1.5, false]});
        assert_eq!(
            encode_value(Some(&value)).unwrap(),
            r#"{"kind":"value","value":{"z":1,"a":{"y":null,"b":"x"},"m":[1.5,false]}}"#
        );
    }

    #[test]
    fn body_bytes_is_the_length_of_the_values_own_json() {
        for value in [json!(1), json!("é"), json!({"a": [1, 2.5, null]})] {
            let own = serde_json::to_string(&value).unwrap().len();
            assert_eq!(body_bytes(&encode(&value).unwrap()), own);
        }
        assert_eq!(body_bytes(&encode_value(None).unwrap()), 0);
    }

    #[test]
    fn undefined_and_null_are_different_stored_values() {
        assert_eq!(encode_value(None).unwrap(), r#"{"kind":"undefined"}"#);
        assert_eq!(encode(&()).unwrap(), r#"{"kind":"value","value":null}"#);
        assert_eq!(decode(r#"{"kind":"undefined"}"#).unwrap(), None);
        assert_eq!(
            decode(r#"{"kind":"value","value":null}"#).unwrap(),
            Some(Value::Null)
        );
    }

    #[test]
    fn decoding_then_encoding_is_byte_stable() {
        let stored = r#"{"kind":"value","value":{"b":[1,2.5,"x"],"a":{"d":true,"c":null}}}"#;
        let value = decode(stored).unwrap();
        assert_eq!(encode_value(value.as_ref()).unwrap(), stored);
    }

    #[test]
    fn typed_values_round_trip() {
        let reading = Reading {
            sensor: "t1".into(),
            samples: vec![1.0, -2.5],
        };
        let stored = encode(&reading).unwrap();
        assert_eq!(decode_as::<Reading>(&stored).unwrap(), reading);
    }

    #[test]
    fn undefined_decodes_as_unit_and_none_but_not_as_a_number() {
        let stored = encode_value(None).unwrap();
        assert!(decode_as::<()>(&stored).is_ok());
        assert_eq!(decode_as::<Option<u8>>(&stored).unwrap(), None);
        assert!(matches!(
            decode_as::<u8>(&stored),
            Err(CodecError::Type { .. })
        ));
    }

    #[test]
    fn non_finite_numbers_are_rejected_with_their_path() {
        let reading = Reading {
            sensor: "t1".into(),
            samples: vec![1.0, f64::NAN],
        };
        match encode(&reading) {
            Err(CodecError::NonFinite { path, value }) => {
                assert_eq!(path, "$.samples[1]");
                assert!(value.is_nan());
            }
            other => panic!("expected NonFinite, got {other:?}"),
        }
        assert!(matches!(
            encode(&f64::INFINITY),
            Err(CodecError::NonFinite { ref path, .. }) if path == "$"
        ));
        let mut map = BTreeMap::new();
        map.insert("a b", f64::NEG_INFINITY);
        assert!(matches!(
            encode(&map),
            Err(CodecError::NonFinite { ref path, .. }) if path == "$[\"a b\"]"
        ));
        assert!(matches!(
            encode(&Shape::Circle { radius: f32::NAN }),
            Err(CodecError::NonFinite { ref path, .. }) if path == "$.radius"
        ));
        assert!(matches!(
            encode(&Some(Shape::Point(f64::NAN))),
            Err(CodecError::NonFinite { ref path, .. }) if path == "$.Point"
        ));
    }

    #[test]
    fn values_json_cannot_hold_are_rejected() {
        let mut map = BTreeMap::new();
        map.insert((1, 2), "tuple key");
        assert!(matches!(encode(&map), Err(CodecError::NotJson { .. })));
    }

    /// `[[...[1]...]]`, `depth` arrays deep.
    fn nested(depth: usize) -> Value {
        let mut value = json!(1);
        for _ in 0..depth {
            value = Value::Array(vec![value]);
        }
        value
    }

    /// Takes a deep value apart one level at a time: the derived drop of a
    /// `Value` recurses once per level.
    fn dismantle(mut value: Value) {
        while let Value::Array(mut items) = value {
            value = items.pop().unwrap_or(Value::Null);
        }
    }

    /// A value `depth` levels deep that exists only while it is serialized:
    /// each level is a one-field struct variant holding the next.
    enum Chain {
        Link(usize),
        End,
    }

    impl Serialize for Chain {
        fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
            use serde::ser::SerializeStructVariant;
            match self {
                Chain::End => serializer.serialize_unit_variant("Chain", 1, "End"),
                Chain::Link(left) => {
                    let mut link = serializer.serialize_struct_variant("Chain", 0, "Link", 1)?;
                    let next = if *left > 1 {
                        Chain::Link(left - 1)
                    } else {
                        Chain::End
                    };
                    link.serialize_field("next", &next)?;
                    link.end()
                }
            }
        }
    }

    #[test]
    fn nesting_up_to_the_limit_round_trips_and_one_level_more_is_refused() {
        let deepest = nested(MAX_NESTING_DEPTH);
        let stored = encode(&deepest).unwrap();
        assert_eq!(decode(&stored).unwrap().as_ref(), Some(&deepest));
        assert_eq!(encode_value(Some(&deepest)).unwrap(), stored);
        let too_deep = nested(MAX_NESTING_DEPTH + 1);
        let expected = CodecError::TooDeep {
            path: format!("${}", "[0]".repeat(MAX_NESTING_DEPTH)),
            limit: MAX_NESTING_DEPTH,
        };
        assert_eq!(encode(&too_deep), Err(expected.clone()));
        assert_eq!(encode_value(Some(&too_deep)), Err(expected.clone()));
        assert!(expected.to_string().contains("limit of 100 levels"));
        dismantle(deepest);
        dismantle(too_deep);
    }

    #[test]
    fn an_enum_variant_counts_the_object_it_is_written_in() {
        // Chain::Link(n) is written {"Link":{"next":...}}: two levels each.
        let fits = Chain::Link(MAX_NESTING_DEPTH / 2);
        let stored = encode(&fits).unwrap();
        assert!(decode(&stored).is_ok());
        assert!(matches!(
            encode(&Chain::Link(MAX_NESTING_DEPTH / 2 + 1)),
            Err(CodecError::TooDeep { .. })
        ));
    }

    #[test]
    fn everything_the_encoder_accepts_the_decoder_reads_back_even_inside_a_cold_segment() {
        // The deepest accepted value inside the deepest wrapper this crate
        // writes: `{"records":[{"body":<value>}]}` around the envelope's
        // content.
        let value = nested(MAX_NESTING_DEPTH);
        let segment = json!({"records": [{"body": value.clone()}]});
        let text = serde_json::to_string(&segment).unwrap();
        assert!(serde_json::from_str::<Value>(&text).is_ok());
        dismantle(segment);
        dismantle(value);
    }

    #[test]
    fn a_value_thousands_of_levels_deep_is_refused_without_deep_recursion() {
        // On a thread with a small stack: before the bound, the check and
        // serde_json's writer recursed once per level and overflowed it,
        // aborting the whole process.
        let outcome = std::thread::Builder::new()
            .stack_size(256 * 1024)
            .spawn(|| {
                let deep = nested(10_000);
                let value_result = encode(&deep);
                let typed_result = encode(&Chain::Link(10_000));
                dismantle(deep);
                (value_result, typed_result)
            })
            .unwrap()
            .join()
            .unwrap();
        assert!(matches!(
            outcome.0,
            Err(CodecError::TooDeep { limit: 100, .. })
        ));
        assert!(matches!(
            outcome.1,
            Err(CodecError::TooDeep { limit: 100, .. })
        ));
    }

    #[test]
    fn stored_text_of_the_wrong_shape_is_an_error() {
        assert!(matches!(
            decode("not json"),
            Err(CodecError::Malformed { .. })
        ));
        for text in [
            "42",
            r#"{"kind":"other"}"#,
            r#"{"value":1}"#,
            r#"{"kind":"value"}"#,
        ] {
            assert!(
                matches!(decode(text), Err(CodecError::Envelope { .. })),
                "{text} decoded"
            );
        }
    }
}
