//! TFRecord framing, the container of a TensorBoard event file: each record is
//! `u64 length (little-endian) | u32 masked CRC32C of the length bytes | data | u32 masked
//! CRC32C of the data`, as `tensorflow/core/lib/io/record_writer.cc` writes it and
//! `tensorboard/compat/tensorflow_stub/pywrap_tensorflow.py` (`PyRecordReader_New`) reads it.

/// The constant TensorFlow adds to a rotated CRC (`kMaskDelta` in `crc32c.h`).
const MASK_DELTA: u32 = 0xa282_ead8;

/// Bytes a record adds around its data: the length (8), its CRC (4) and the data's CRC (4).
pub const RECORD_OVERHEAD_BYTES: usize = 16;

/// TensorFlow's masked CRC32C of `data`: the CRC rotated right by 15 bits plus
/// `MASK_DELTA` (so that a CRC over bytes that contain CRCs stays well mixed).
pub fn masked_crc32c(data: &[u8]) -> u32 {
    let crc = crc32c::crc32c(data);
    crc.rotate_right(15).wrapping_add(MASK_DELTA)
}

/// Appends one framed record holding `data` to `out`.
pub fn frame_record(data: &[u8], out: &mut Vec<u8>) {
    let len = (data.len() as u64).to_le_bytes();
    out.reserve(RECORD_OVERHEAD_BYTES + data.len());
    out.extend_from_slice(&len);
    out.extend_from_slice(&masked_crc32c(&len).to_le_bytes());
    out.extend_from_slice(data);
    out.extend_from_slice(&masked_crc32c(data).to_le_bytes());
}

/// Errors reading framed records back.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RecordError {
    /// The bytes end inside a record (a write cut short).
    #[error("record at byte {offset} is cut short")]
    Truncated {
        /// Where the record starts.
        offset: usize,
    },
    /// A stored CRC does not match the bytes it covers.
    #[error("record at byte {offset}: the CRC of its {part} does not match")]
    Crc {
        /// Where the record starts.
        offset: usize,
        /// `"length"` or `"data"`.
        part: &'static str,
    },
}

/// Splits `bytes` into the data of its framed records, checking both CRCs of each (the
/// reader the tests and [`super::EventFile`]'s own checks use; TensorBoard has its own).
///
/// Errors: [`RecordError`] at the first record that is cut short or fails a CRC.
pub fn read_records(bytes: &[u8]) -> Result<Vec<&[u8]>, RecordError> {
    let mut records = Vec::new();
    let mut at = 0;
    while at < bytes.len() {
        let truncated = RecordError::Truncated { offset: at };
        let header = bytes.get(at..at + 12).ok_or(truncated.clone())?;
        let (len_bytes, len_crc) = header.split_at(8);
        if masked_crc32c(len_bytes).to_le_bytes() != len_crc {
            return Err(RecordError::Crc {
                offset: at,
                part: "length",
            });
        }
        let mut len = [0u8; 8];
        len.copy_from_slice(len_bytes);
        let len = usize::try_from(u64::from_le_bytes(len)).map_err(|_| truncated.clone())?;
        let start = at + 12;
        let end = start.checked_add(len).ok_or(truncated.clone())?;
        let data = bytes.get(start..end).ok_or(truncated.clone())?;
        let crc = bytes.get(end..end + 4).ok_or(truncated)?;
        if masked_crc32c(data).to_le_bytes() != crc {
            return Err(RecordError::Crc {
                offset: at,
                part: "data",
            });
        }
        records.push(data);
        at = end + 4;
    }
    Ok(records)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc32c_check_value_and_its_mask() {
        // The CRC-32C check value (RFC 3720, B.4): "123456789" -> 0xE3069283.
        assert_eq!(crc32c::crc32c(b"123456789"), 0xE306_9283);
        // Masked as TensorFlow's crc32c::Mask does, ((crc >> 15) | (crc << 17)) + 0xa282ead8,
        // computed separately (mod 2^32).
        assert_eq!(masked_crc32c(b"123456789"), 0xC78A_B0E5);
    }

    #[test]
    fn frames_round_trip_and_damage_is_found() {
        let mut out = Vec::new();
        frame_record(b"hello", &mut out);
        frame_record(b"", &mut out);
        assert_eq!(out.len(), 2 * RECORD_OVERHEAD_BYTES + 5);
        assert_eq!(&out[0..8], &5u64.to_le_bytes());
        assert_eq!(read_records(&out).unwrap(), vec![&b"hello"[..], &b""[..]]);

        let mut damaged = out.clone();
        damaged[13] ^= 1;
        assert_eq!(
            read_records(&damaged),
            Err(RecordError::Crc {
                offset: 0,
                part: "data"
            })
        );
        assert_eq!(
            read_records(&out[..out.len() - 1]),
            Err(RecordError::Truncated { offset: 21 })
        );
    }
}
