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
//! ```

use std::fmt::{self, Display};

use serde::de::DeserializeOwned;
use serde::ser;
use serde::{Deserialize, Serialize, Serializer};
use serde_json::Value;
use thiserror::Error;

/// Why a value could not be encoded, or stored text could not be decoded.
#[derive(Debug, Clone, PartialEq, Error)]
#[non_exhaustive]
pub enum CodecError {
    /// A NaN or infinite number; JSON cannot hold it.
    #[error("value is not JSON: non-finite number {value} at {path}")]
    NonFinite { path: String, value: f64 },
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
/// cannot hold a non-finite number, so this only fails if serialization
/// itself fails.
pub fn encode_value(value: Option<&Value>) -> Result<String, CodecError> {
    let stored = match value {
        None => Stored::Undefined,
        Some(value) => Stored::Value { value },
    };
    serde_json::to_string(&stored).map_err(|error| CodecError::NotJson {
        detail: error.to_string(),
    })
}

/// Encodes any serializable value as `{"kind":"value","value":...}`.
///
/// Rejects NaN and infinities anywhere in the value, and anything else JSON
/// cannot represent. To store "no value", use [`encode_value`]`(None)`.
pub fn encode<T: Serialize + ?Sized>(value: &T) -> Result<String, CodecError> {
    check_finite(value)?;
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
/// first non-finite float. One extra pass, proportional to the value's size.
fn check_finite<T: Serialize + ?Sized>(value: &T) -> Result<(), CodecError> {
    value.serialize(FiniteCheck).map_err(|error| match error {
        CheckError::NonFinite { value, mut path } => {
            path.reverse();
            CodecError::NonFinite {
                path: format!("${}", path.concat()),
                value,
            }
        }
        CheckError::Custom(detail) => CodecError::NotJson { detail },
    })
}

/// Why the finiteness walk stopped. The path is collected innermost first
/// while the error travels outwards.
#[derive(Debug)]
enum CheckError {
    NonFinite { value: f64, path: Vec<String> },
    Custom(String),
}

impl Display for CheckError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CheckError::NonFinite { value, .. } => write!(f, "non-finite number {value}"),
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

#[derive(Clone, Copy)]
struct FiniteCheck;

/// Walks the elements of a sequence, tuple or tuple variant.
struct SeqCheck {
    index: usize,
}

impl SeqCheck {
    fn element<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), CheckError> {
        let index = self.index;
        self.index += 1;
        value
            .serialize(FiniteCheck)
            .map_err(|error| error.at(|| format!("[{index}]")))
    }
}

/// Walks the fields of a struct or struct variant, and the entries of a map.
struct FieldCheck;

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
            .serialize(self)
            .map_err(|error| error.at(|| format!(".{variant}")))
    }
    fn serialize_seq(self, _: Option<usize>) -> Result<SeqCheck, CheckError> {
        Ok(SeqCheck { index: 0 })
    }
    fn serialize_tuple(self, _: usize) -> Result<SeqCheck, CheckError> {
        Ok(SeqCheck { index: 0 })
    }
    fn serialize_tuple_struct(self, _: &'static str, _: usize) -> Result<SeqCheck, CheckError> {
        Ok(SeqCheck { index: 0 })
    }
    fn serialize_tuple_variant(
        self,
        _: &'static str,
        _: u32,
        _: &'static str,
        _: usize,
    ) -> Result<SeqCheck, CheckError> {
        Ok(SeqCheck { index: 0 })
    }
    fn serialize_map(self, _: Option<usize>) -> Result<FieldCheck, CheckError> {
        Ok(FieldCheck)
    }
    fn serialize_struct(self, _: &'static str, _: usize) -> Result<FieldCheck, CheckError> {
        Ok(FieldCheck)
    }
    fn serialize_struct_variant(
        self,
        _: &'static str,
        _: u32,
        _: &'static str,
        _: usize,
    ) -> Result<FieldCheck, CheckError> {
        Ok(FieldCheck)
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
        key.serialize(FiniteCheck)
    }
    fn serialize_value<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), CheckError> {
        // Only reached by maps that split keys from values; the key is gone
        // by now, so the path names the entry without it.
        value
            .serialize(FiniteCheck)
            .map_err(|error| error.at(|| "[<key>]".to_owned()))
    }
    fn serialize_entry<K: Serialize + ?Sized, V: Serialize + ?Sized>(
        &mut self,
        key: &K,
        value: &V,
    ) -> Result<(), CheckError> {
        key.serialize(FiniteCheck)?;
        value
            .serialize(FiniteCheck)
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
            .serialize(FiniteCheck)
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
            .serialize(FiniteCheck)
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
