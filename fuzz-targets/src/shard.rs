//! `shard`: the shard reader ([`ShardReader::from_bytes`], what [`ShardReader::open`] does
//! with a file's bytes), then every accessor over what it accepted.

use std::path::Path;

use keel_proto::shard::{HEADER_LEN, ShardReader};

/// Sequences read back per input, at most.
const MAX_SEQUENCES: usize = 4096;

/// The first byte chooses whether the checksums are set right before reading (bit 0: so that
/// mutated shards get past the checksums to the header and record checks); the rest is the
/// shard file.
pub fn shard(data: &[u8]) {
    let Some((&flags, file)) = data.split_first() else {
        return;
    };
    let mut bytes = file.to_vec();
    if flags & 1 == 1 && bytes.len() >= HEADER_LEN {
        let payload = crc32c::crc32c(&bytes[HEADER_LEN..]);
        bytes[72..76].copy_from_slice(&payload.to_le_bytes());
        let header = crc32c::crc32c(&bytes[..76]);
        bytes[76..80].copy_from_slice(&header.to_le_bytes());
    }
    let Ok(reader) = ShardReader::from_bytes(Path::new("fuzz.shard"), bytes) else {
        return;
    };
    let _ = (reader.num_tokens(), reader.has_nsp(), reader.vocab_hash());
    for i in 0..reader.len().min(MAX_SEQUENCES) {
        let _ = reader.get(i);
        let _ = reader.source_index(i);
        if let Ok(global) = reader.global_index(i) {
            let _ = reader.find_global(global);
        }
    }
    let _ = reader.get(reader.len());
    let _ = reader.find_global(u64::MAX);
    for sequence in reader.iter().take(MAX_SEQUENCES) {
        assert_eq!(sequence.ids.len(), sequence.token_type_ids.len());
    }
}
