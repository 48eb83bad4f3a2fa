//! Reading protobuf fields without decoding them: the varint, the key
//! (field number and wire type), the length-delimited value, and skipping a
//! value of any wire type. Two walks are built on them: [`Fields`], the
//! flat walk of a message's fields that the inbound scan reads (groups
//! refused), and the answer scan of `judge_stream` (groups skipped, as
//! prost does).

/// Wire types.
pub(crate) const VARINT: u8 = 0;
pub(crate) const I64: u8 = 1;
pub(crate) const LEN: u8 = 2;
pub(crate) const SGROUP: u8 = 3;
pub(crate) const EGROUP: u8 = 4;
pub(crate) const I32: u8 = 5;

/// How deep groups may nest: as prost's recursion limit.
const MAX_DEPTH: u32 = 100;

/// Why a message's bytes could not be walked.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Malformed {
    #[error("truncated message")]
    Truncated,
    #[error("varint longer than 10 bytes")]
    Varint,
    #[error("invalid field key")]
    Key,
    #[error("invalid wire type {0}")]
    WireType(u8),
    #[error("groups nested too deep")]
    Depth,
    #[error("unmatched end of group")]
    EndGroup,
}

/// Reads a varint off the front of `bytes`.
#[inline]
pub(crate) fn varint(bytes: &mut &[u8]) -> Result<u64, Malformed> {
    let mut value = 0u64;
    for i in 0..10 {
        let (&byte, rest) = bytes.split_first().ok_or(Malformed::Truncated)?;
        *bytes = rest;
        value |= u64::from(byte & 0x7f) << (7 * i);
        if byte < 0x80 {
            return Ok(value);
        }
    }
    Err(Malformed::Varint)
}

/// Reads a field's key: its number (not 0, within `u32`) and wire type.
#[inline]
pub(crate) fn key(bytes: &mut &[u8]) -> Result<(u32, u8), Malformed> {
    let key = varint(bytes)?;
    let number = u32::try_from(key >> 3).map_err(|_| Malformed::Key)?;
    if number == 0 {
        return Err(Malformed::Key);
    }
    Ok((number, (key & 7) as u8))
}

/// Takes `n` bytes off the front of `bytes`.
#[inline]
pub(crate) fn take<'a>(bytes: &mut &'a [u8], n: usize) -> Result<&'a [u8], Malformed> {
    if bytes.len() < n {
        return Err(Malformed::Truncated);
    }
    let (head, rest) = bytes.split_at(n);
    *bytes = rest;
    Ok(head)
}

/// Reads the contents of a length-delimited field, after its key.
#[inline]
pub(crate) fn length_delimited<'a>(bytes: &mut &'a [u8]) -> Result<&'a [u8], Malformed> {
    let len = varint(bytes)?;
    take(
        bytes,
        usize::try_from(len).map_err(|_| Malformed::Truncated)?,
    )
}

/// Skips the value of field `number`, of `wire_type`; a group up to its
/// end, `depth` groups deep.
pub(crate) fn skip(
    bytes: &mut &[u8],
    number: u32,
    wire_type: u8,
    depth: u32,
) -> Result<(), Malformed> {
    match wire_type {
        VARINT => varint(bytes).map(drop),
        I64 => take(bytes, 8).map(drop),
        LEN => length_delimited(bytes).map(drop),
        I32 => take(bytes, 4).map(drop),
        SGROUP => {
            if depth >= MAX_DEPTH {
                return Err(Malformed::Depth);
            }
            loop {
                let (inner, inner_type) = key(bytes)?;
                if inner_type == EGROUP {
                    return if inner == number {
                        Ok(())
                    } else {
                        Err(Malformed::EndGroup)
                    };
                }
                skip(bytes, inner, inner_type, depth + 1)?;
            }
        }
        EGROUP => Err(Malformed::EndGroup),
        other => Err(Malformed::WireType(other)),
    }
}

/// The fields of a protobuf message, flat: (number, contents of a
/// length-delimited field), without decoding them. A group is refused, as
/// is a field number 0; a number past `u32` is passed on (the caller knows
/// no such field). The errors are short texts, shown to the message's
/// sender. After an error the walk ends.
pub(crate) struct Fields<'a>(pub(crate) &'a [u8]);

impl<'a> Iterator for Fields<'a> {
    type Item = Result<(u64, Option<&'a [u8]>), &'static str>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.0.is_empty() {
            return None;
        }
        let item = self.field();
        if item.is_err() {
            self.0 = &[];
        }
        Some(item)
    }
}

impl<'a> Fields<'a> {
    fn field(&mut self) -> Result<(u64, Option<&'a [u8]>), &'static str> {
        const BAD_VARINT: &str = "invalid varint";
        const PAST_END: &str = "field runs past the end of the message";
        let key = varint(&mut self.0).map_err(|_| BAD_VARINT)?;
        let number = key >> 3;
        if number == 0 {
            return Err("field number 0");
        }
        let value = match (key & 7) as u8 {
            VARINT => {
                varint(&mut self.0).map_err(|_| BAD_VARINT)?;
                None
            }
            I64 => {
                take(&mut self.0, 8).map_err(|_| PAST_END)?;
                None
            }
            LEN => {
                let len = varint(&mut self.0).map_err(|_| BAD_VARINT)?;
                let len = usize::try_from(len).map_err(|_| "length overflow")?;
                Some(take(&mut self.0, len).map_err(|_| PAST_END)?)
            }
            I32 => {
                take(&mut self.0, 4).map_err(|_| PAST_END)?;
                None
            }
            _ => return Err("unsupported wire type"),
        };
        Ok((number, value))
    }
}
