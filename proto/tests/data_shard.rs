//! Shard format: round trip, u16/u32 ids, and detection of truncation and corruption.

use std::path::Path;

use keel_proto::shard::{HEADER_LEN, Sequence, ShardError, ShardReader, ShardWriter};

fn sequences(n: u64, max_id: u32, nsp: bool) -> Vec<Sequence> {
    (0..n)
        .map(|g| {
            let len = 3 + (g as usize * 7) % 40;
            let ids: Vec<u32> = (0..len)
                .map(|k| {
                    ((g as u32)
                        .wrapping_mul(2654435761)
                        .wrapping_add(k as u32 * 40503))
                        % max_id
                })
                .collect();
            let b = if nsp { len / 2 } else { len };
            Sequence {
                global_index: 1000 + g * 3,
                token_type_ids: (0..len).map(|k| u32::from(k >= b)).collect(),
                ids,
                nsp_label: nsp.then_some((g % 2) as u32),
            }
        })
        .collect()
}

fn write(path: &Path, seqs: &[Sequence], vocab_size: usize) -> u32 {
    let mut w = ShardWriter::create(path, [7u8; 32], vocab_size).unwrap();
    for (i, s) in seqs.iter().enumerate() {
        w.push(s, i as u64 * 10).unwrap();
    }
    w.finish().unwrap()
}

#[test]
fn round_trip_narrow_and_wide_ids() {
    let dir = tempfile::tempdir().unwrap();
    for (vocab, nsp) in [(30_522usize, false), (100_000, true)] {
        let seqs = sequences(300, vocab as u32, nsp);
        let path = dir.path().join(format!("s{vocab}.keel"));
        let crc = write(&path, &seqs, vocab);
        let r = ShardReader::open(&path).unwrap();
        assert_eq!(r.len(), seqs.len());
        assert_eq!(r.checksum(), crc);
        assert_eq!(r.vocab_hash(), [7u8; 32]);
        assert_eq!(r.has_nsp(), nsp);
        let tokens: usize = seqs.iter().map(|s| s.ids.len()).sum();
        assert_eq!(r.num_tokens(), tokens as u64);
        for (i, s) in seqs.iter().enumerate() {
            assert_eq!(&r.get(i).unwrap(), s);
            assert_eq!(r.source_index(i).unwrap(), i as u64 * 10);
            assert_eq!(r.find_global(s.global_index).as_ref(), Some(s));
        }
        assert!(r.find_global(1).is_none());
        assert!(matches!(
            r.get(300),
            Err(ShardError::IndexOutOfRange { .. })
        ));
        // u16 storage when the vocabulary fits: 2 bytes per token.
        let size = std::fs::metadata(&path).unwrap().len() as usize;
        let width = if vocab <= 65_536 { 2 } else { 4 };
        assert_eq!(size, HEADER_LEN + tokens * width + seqs.len() * 40);
    }
}

#[test]
fn truncated_shard_is_detected() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.keel");
    write(&path, &sequences(50, 1000, false), 1000);
    let bytes = std::fs::read(&path).unwrap();
    for cut in [bytes.len() - 1, bytes.len() / 2, HEADER_LEN, 10] {
        std::fs::write(&path, &bytes[..cut]).unwrap();
        let err = ShardReader::open(&path).unwrap_err();
        assert!(matches!(err, ShardError::Truncated { .. }), "{cut}: {err}");
        let msg = err.to_string();
        assert!(msg.contains("s.keel") && msg.contains("truncated"), "{msg}");
    }
}

#[test]
fn flipped_bytes_are_detected_anywhere() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.keel");
    write(&path, &sequences(50, 1000, true), 1000);
    let bytes = std::fs::read(&path).unwrap();
    let step = (bytes.len() / 97).max(1);
    for at in (8..bytes.len()).step_by(step) {
        let mut bad = bytes.clone();
        bad[at] ^= 0x10;
        let err = ShardReader::from_bytes(&path, bad).unwrap_err();
        assert!(
            matches!(err, ShardError::ChecksumMismatch { .. }),
            "byte {at}: {err}"
        );
        assert!(err.to_string().contains("corrupted"));
    }
    let mut bad = bytes.clone();
    bad[0] = b'X';
    assert!(matches!(
        ShardReader::from_bytes(&path, bad),
        Err(ShardError::BadMagic { .. })
    ));
}

#[test]
fn writer_rejects_malformed_sequences_and_leaves_no_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.keel");
    let mut w = ShardWriter::create(&path, [0; 32], 1000).unwrap();
    let bad_types = Sequence {
        global_index: 0,
        ids: vec![1, 2, 3],
        token_type_ids: vec![0, 1, 0],
        nsp_label: None,
    };
    assert!(matches!(
        w.push(&bad_types, 0),
        Err(ShardError::InvalidSequence { .. })
    ));
    let too_big = Sequence {
        global_index: 1,
        ids: vec![70_000],
        token_type_ids: vec![0],
        nsp_label: None,
    };
    assert!(w.push(&too_big, 0).is_err());
    drop(w);
    let left: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
    assert!(left.is_empty(), "an unfinished writer must not leave files");
}
