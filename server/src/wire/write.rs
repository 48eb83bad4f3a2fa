//! Writing protobuf fields by hand, byte for byte as prost writes them: a
//! singular field at its default value is left out, each string of a
//! repeated field is written, a message is its key, its length and its
//! fields. With each writer, the bytes it writes, so that a message's
//! length can be known before it is written (no buffer to copy from).

use prost::Message;
use prost::bytes::BufMut;
use prost::encoding::{WireType, encode_key, encode_varint, encoded_len_varint, key_len};

/// The bytes of the key and the length of a length-delimited field `tag`
/// whose contents are `len` bytes.
#[inline]
pub(crate) fn header_len(tag: u32, len: usize) -> usize {
    key_len(tag) + encoded_len_varint(len as u64)
}

/// Writes the key and the length of a length-delimited field `tag` whose
/// `len` bytes of contents are written next.
#[inline]
pub(crate) fn header(tag: u32, len: usize, buf: &mut impl BufMut) {
    encode_key(tag, WireType::LengthDelimited, buf);
    encode_varint(len as u64, buf);
}

/// The bytes of a length-delimited field `tag` of `body` bytes of
/// contents (a nested message written by hand).
#[inline]
pub(crate) fn nested_len(tag: u32, body: usize) -> usize {
    header_len(tag, body) + body
}

/// The bytes of the string field `tag`; a `singular` one is left out when
/// empty.
#[inline]
pub(crate) fn string_len(tag: u32, text: &str, singular: bool) -> usize {
    if singular && text.is_empty() {
        return 0;
    }
    header_len(tag, text.len()) + text.len()
}

/// Writes the string field `tag`; a `singular` one is left out when
/// empty.
#[inline]
pub(crate) fn string(tag: u32, text: &str, singular: bool, buf: &mut impl BufMut) {
    if singular && text.is_empty() {
        return;
    }
    header(tag, text.len(), buf);
    buf.put_slice(text.as_bytes());
}

/// The bytes of the singular varint field `tag` (left out at 0).
#[inline]
pub(crate) fn varint_len(tag: u32, value: u64) -> usize {
    if value == 0 {
        return 0;
    }
    key_len(tag) + encoded_len_varint(value)
}

/// Writes the singular varint field `tag` (left out at 0).
#[inline]
pub(crate) fn varint(tag: u32, value: u64, buf: &mut impl BufMut) {
    if value == 0 {
        return;
    }
    encode_key(tag, WireType::Varint, buf);
    encode_varint(value, buf);
}

/// The bytes of the message field `tag` holding `message`.
#[inline]
pub(crate) fn message_len(tag: u32, message: &impl Message) -> usize {
    prost::encoding::message::encoded_len(tag, message)
}

/// Writes the message field `tag` holding `message`, encoded by prost.
#[inline]
pub(crate) fn message(tag: u32, message: &impl Message, buf: &mut impl BufMut) {
    prost::encoding::message::encode(tag, message, buf);
}
