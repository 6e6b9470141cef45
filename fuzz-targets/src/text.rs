//! `job_toml` and `vocab`: job files and tokenizer files.

use keel_proto::jobspec::JobSpec;
use keel_proto::tokenizer::KeelTokenizer;

/// Bytes of the input encoded with a loaded tokenizer, at most.
const MAX_ENCODED_BYTES: usize = 512;

/// The bytes (UTF-8, lossy) as a job file: [`JobSpec::from_toml_str`] (parse and validate, as
/// `keel submit` and the coordinator's `SubmitJob` do), then what the coordinator computes from
/// an accepted spec (its phases, their views and batch sizes); an accepted spec must survive
/// its own round trip through TOML (what `keel submit` sends).
pub fn job_toml(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    let Ok(spec) = JobSpec::from_toml_str(&text, "fuzz.toml") else {
        return;
    };
    spec.validate("fuzz.toml")
        .expect("an accepted spec validates again");
    let _ = spec.check_phases();
    for p in 0..spec.phase_count() {
        let steps = spec.phase_steps(p);
        let _ = spec.phase_at(steps.start);
        let _ = spec.phase_global_batch(p, 0);
    }
    let _ = spec.phase_views();
    let _ = spec.smallest_global_batch(0);
    for world in [1, 2, 7] {
        let _ = spec.global_batch(world);
    }
    let toml = spec.to_toml_string().expect("an accepted spec serialises");
    if let Err(e) = JobSpec::from_toml_str(&toml, "round-trip.toml") {
        panic!("an accepted spec does not read back from its own TOML: {e}\n{toml}");
    }
}

/// The first byte chooses lowercasing (bit 0) for `vocab.txt`; the rest is written as both a
/// `vocab.txt` ([`KeelTokenizer::from_vocab_file`]) and a `tokenizer.json`
/// ([`KeelTokenizer::from_tokenizer_json`]). A tokenizer that loads encodes a fixed text and a
/// prefix of the input, and decodes the ids back.
pub fn vocab(data: &[u8]) {
    let Some((&flags, file)) = data.split_first() else {
        return;
    };
    let dir = crate::temp_dir();
    let vocab_txt = dir.path().join("vocab.txt");
    let tokenizer_json = dir.path().join("tokenizer.json");
    std::fs::write(&vocab_txt, file).expect("writing a temporary file");
    std::fs::write(&tokenizer_json, file).expect("writing a temporary file");
    let sample = String::from_utf8_lossy(&file[..file.len().min(MAX_ENCODED_BYTES)]);
    for loaded in [
        KeelTokenizer::from_vocab_file(&vocab_txt, flags & 1 == 1),
        KeelTokenizer::from_tokenizer_json(&tokenizer_json),
    ] {
        let Ok(tokenizer) = loaded else {
            continue;
        };
        let _ = tokenizer.check_fits(tokenizer.vocab_size());
        let _ = tokenizer.vocab_hash();
        for text in [
            "In the beginning God created the heaven and the earth.",
            sample.as_ref(),
        ] {
            let ids = tokenizer.encode(text);
            let _ = tokenizer.decode(&ids);
            for &id in ids.iter().take(8) {
                let _ = tokenizer.id_to_token(id);
            }
        }
        let _ = tokenizer.encode_pair("Hello, world.", &sample);
    }
}
