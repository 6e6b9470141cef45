//! The prepare pipeline (`keel prepare`): corpus -> vocabulary -> tokenised documents ->
//! instances -> shuffled, balanced shards + heldout shard + `manifest.json`.
//!
//! Steps:
//! 1. Resolve the inputs to files.
//! 2. Train a WordPiece vocabulary on them (one pass) or load the given one.
//! 3. Tokenise the corpus in parallel into a spill file of documents (drops lines that
//!    tokenise to nothing; errors on invalid UTF-8 or bad JSON lines).
//! 4. Build instances (MLM packing or BERT's NSP builder) in corpus order into a second spill.
//! 5. Shuffle the instances with the seed; the first `round(S * heldout_fraction)` of the
//!    shuffled order form `heldout.keel` (with `heldout_by_document`: the instances of the
//!    held-out documents, `super::build_instances`), the rest are the training sequences
//!    `0..N` in that order, cut into `--shards` contiguous ranges of about equal token count.
//! 6. Save the tokenizer files and `manifest.json` (last, so a folder with a manifest is
//!    complete).
//!
//! Memory: the spills hold the corpus on disk; in memory stay an 8-byte offset per document
//! and per instance, the permutation (8 bytes per instance), one shard writer's index (40 bytes
//! per sequence), and what the vocabulary trainer keeps (its word counts). Every random choice
//! comes from ChaCha8 streams derived from the seed, so the same corpus, settings and seed give
//! byte-identical shards whatever `--threads` is.

pub use super::error::PrepareError;
use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use indicatif::{ProgressBar, ProgressStyle};
use keel_proto::shard::{Sequence, ShardWriter};
use keel_proto::tokenizer::{KeelTokenizer, TrainOptions};
use rand::SeedableRng;
use rand::seq::SliceRandom;
use rand_chacha::ChaCha8Rng;

use super::build_instances::{build_instances, heldout_documents};
use super::corpus::{CorpusError, DocumentReader, resolve_inputs};
use super::instance::Instance;
use super::manifest::{
    CorpusStats, MANIFEST_VERSION, Objective, PrepareTimings, PreparedManifest, ShardEntry,
};
pub use super::prepare_options::{PrepareOptions, VocabSource};
use super::spill::Spill;
use super::tokenize::tokenize_corpus;

/// File name of training shard `i`.
pub fn shard_file_name(i: usize) -> String {
    format!("shard-{i:05}.keel")
}

/// File name of the heldout shard.
pub const HELDOUT_FILE: &str = "heldout.keel";
/// File name of the manifest.
pub const MANIFEST_FILE: &str = "manifest.json";

fn validate(o: &PrepareOptions) -> Result<(), PrepareError> {
    let bad = |field, reason: String| Err(PrepareError::InvalidOption { field, reason });
    if o.corpus.is_empty() {
        return bad("corpus", "give at least one file, directory or glob".into());
    }
    if o.max_seq_length < 8 || o.max_seq_length > 65_536 {
        return bad(
            "max_seq_length",
            format!("{} is not in 8..=65536", o.max_seq_length),
        );
    }
    if o.shards == 0 {
        return bad("shards", "must be at least 1".into());
    }
    if !(0.0..=0.5).contains(&o.heldout_fraction) {
        return bad(
            "heldout_fraction",
            format!("{} is not in [0, 0.5]", o.heldout_fraction),
        );
    }
    if !(0.0..=1.0).contains(&o.short_seq_prob) {
        return bad(
            "short_seq_prob",
            format!("{} is not in [0, 1]", o.short_seq_prob),
        );
    }
    if o.threads == 0 {
        return bad("threads", "must be at least 1".into());
    }
    if let VocabSource::Train { vocab_size, .. } = o.vocab
        && let Some(model) = o.model_vocab_size
    {
        keel_proto::tokenizer::check_fits(vocab_size, model)?;
    }
    Ok(())
}

fn progress_bar(show: bool, len: u64, message: &'static str) -> ProgressBar {
    if !show || !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(len);
    if let Ok(style) = ProgressStyle::with_template(
        "{msg:>12} [{elapsed_precise}] {wide_bar} {bytes}/{total_bytes} {binary_bytes_per_sec} ETA {eta}",
    ) {
        bar.set_style(style);
    }
    bar.set_message(message);
    bar
}

fn train_vocab(
    files: &[PathBuf],
    options: &PrepareOptions,
    vocab_size: usize,
    lowercase: bool,
    total_bytes: u64,
) -> Result<KeelTokenizer, PrepareError> {
    let bar = progress_bar(options.show_progress, total_bytes, "vocabulary");
    let failure: Arc<Mutex<Option<CorpusError>>> = Arc::new(Mutex::new(None));
    let sink = Arc::clone(&failure);
    let bar_in = bar.clone();
    let lines = DocumentReader::new(files.to_vec(), options.skip_invalid_lines)
        .map_while(move |doc| match doc {
            Ok(doc) => {
                bar_in.inc(doc.bytes);
                Some(doc.sentences)
            }
            Err(e) => {
                if let Ok(mut slot) = sink.lock() {
                    *slot = Some(e);
                }
                None
            }
        })
        .flatten();
    let tokenizer = KeelTokenizer::train(
        &TrainOptions {
            vocab_size,
            lowercase,
            ..TrainOptions::new(vocab_size)
        },
        lines,
    );
    bar.finish_and_clear();
    if let Ok(mut slot) = failure.lock()
        && let Some(e) = slot.take()
    {
        return Err(e.into());
    }
    Ok(tokenizer?)
}

fn load_or_train(
    files: &[PathBuf],
    options: &PrepareOptions,
    total_bytes: u64,
) -> Result<KeelTokenizer, PrepareError> {
    let tokenizer = match &options.vocab {
        VocabSource::Train {
            vocab_size,
            lowercase,
        } => train_vocab(files, options, *vocab_size, *lowercase, total_bytes)?,
        VocabSource::File { path, lowercase } => {
            if path.extension().is_some_and(|e| e == "json") {
                KeelTokenizer::from_tokenizer_json(path)?
            } else {
                KeelTokenizer::from_vocab_file(path, *lowercase)?
            }
        }
    };
    if let Some(model) = options.model_vocab_size {
        tokenizer.check_fits(model)?;
    }
    Ok(tokenizer)
}

/// Derives an independent ChaCha8 stream for one purpose from the seed.
fn rng_for(seed: u64, stream: u64) -> ChaCha8Rng {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    rng.set_stream(stream);
    rng
}

const STREAM_NSP: u64 = 1;
const STREAM_SHUFFLE: u64 = 2;

/// Start index of each shard over `lengths` (token counts in training order), so that each
/// shard holds about `total / shards` tokens and at least one sequence.
fn shard_starts(lengths: &[u64], shards: usize) -> Vec<usize> {
    let n = lengths.len();
    let total: u64 = lengths.iter().sum();
    let mut starts = vec![0usize];
    let mut cum = 0u64;
    let mut s = 1usize;
    for (g, len) in lengths.iter().enumerate() {
        while s < shards && cum >= (total as u128 * s as u128 / shards as u128) as u64 {
            let lo = starts[s - 1] + 1;
            let hi = n - (shards - s);
            starts.push(g.clamp(lo, hi));
            s += 1;
        }
        cum += len;
    }
    while s < shards {
        let lo = starts[s - 1] + 1;
        starts.push(lo.min(n - (shards - s)));
        s += 1;
    }
    starts
}

fn write_shard(
    path: &Path,
    tokenizer: &KeelTokenizer,
    instances: &Spill,
    order: &[u64],
    first_global: u64,
) -> Result<ShardEntry, PrepareError> {
    let mut writer = ShardWriter::create(path, tokenizer.vocab_hash(), tokenizer.vocab_size())?;
    for (k, &source) in order.iter().enumerate() {
        let inst = Instance::from_words(&instances.read(source as usize)?);
        let seq = Sequence {
            global_index: first_global + k as u64,
            token_type_ids: inst.token_type_ids(),
            ids: inst.ids,
            nsp_label: inst.nsp_label,
        };
        writer.push(&seq, source)?;
    }
    let sequences = writer.len();
    let tokens = writer.num_tokens();
    let checksum = writer.finish()?;
    Ok(ShardEntry {
        file: path
            .file_name()
            .map(|n| n.to_string_lossy().to_string())
            .unwrap_or_default(),
        sequences,
        tokens,
        first_global_index: first_global,
        checksum,
    })
}

fn remove_stale_shards(dir: &Path, keep: usize) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().to_string();
        if let Some(num) = name
            .strip_prefix("shard-")
            .and_then(|r| r.strip_suffix(".keel"))
            .and_then(|n| n.parse::<usize>().ok())
            && num >= keep
        {
            let _ = std::fs::remove_file(entry.path());
        }
    }
}

/// Runs the whole pipeline (see the module docs) and returns the manifest it wrote.
///
/// Errors: `InvalidOption`, `Corpus` (missing file, invalid UTF-8 with file and byte offset,
/// bad JSON line with line number), `EmptyCorpus` (no text, or nothing tokenises), `TooSmall`
/// (fewer sequences than shards, or NSP with one document), `Tokenizer` (vocabulary larger
/// than `model_vocab_size`, training/loading failures), `Shard`, `Spill`, `Io`.
pub fn prepare(options: &PrepareOptions) -> Result<PreparedManifest, PrepareError> {
    let started = Instant::now();
    validate(options)?;
    let files = resolve_inputs(&options.corpus)?;
    let total_bytes: u64 = files
        .iter()
        .filter_map(|f| std::fs::metadata(f).ok())
        .map(|m| m.len())
        .sum();
    std::fs::create_dir_all(&options.out_dir).map_err(|source| PrepareError::Io {
        path: options.out_dir.clone(),
        source,
    })?;

    // A manifest left from an earlier run would describe shards about to be replaced: remove
    // it first, so that a folder with a manifest is always a complete, consistent one.
    let old_manifest = options.out_dir.join(MANIFEST_FILE);
    if old_manifest.exists() {
        std::fs::remove_file(&old_manifest).map_err(|source| PrepareError::Io {
            path: old_manifest.clone(),
            source,
        })?;
    }

    let t0 = Instant::now();
    let tokenizer = load_or_train(&files, options, total_bytes)?;
    let train_vocab_s = match options.vocab {
        VocabSource::Train { .. } => t0.elapsed().as_secs_f64(),
        VocabSource::File { .. } => 0.0,
    };
    tracing::info!(vocab_size = tokenizer.vocab_size(), "vocabulary ready");

    let t1 = Instant::now();
    let bar = progress_bar(options.show_progress, total_bytes, "tokenizing");
    let (docs, stats) = tokenize_corpus(
        files.clone(),
        options.skip_invalid_lines,
        &tokenizer,
        options.threads,
        &options.out_dir,
        &bar,
    )?;
    bar.finish_and_clear();
    let tokenize_s = t1.elapsed().as_secs_f64();
    if stats.lines == 0 {
        return Err(PrepareError::EmptyCorpus {
            reason: format!(
                "no text lines in {}",
                files
                    .iter()
                    .map(|f| f.display().to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        });
    }
    if stats.tokens == 0 {
        return Err(PrepareError::EmptyCorpus {
            reason: format!(
                "all {} lines tokenise to nothing (whitespace, control or zero-width characters)",
                stats.lines
            ),
        });
    }

    let t2 = Instant::now();
    let held_docs = if options.heldout_by_document {
        let min_docs = match options.objective {
            Objective::Mlm => 1,
            Objective::MlmNsp => 2,
        };
        let sizes: Vec<u64> = (0..docs.len()).map(|d| docs.words(d)).collect();
        heldout_documents(&sizes, options.heldout_fraction, options.seed, min_docs)?
    } else {
        Vec::new()
    };
    let mut nsp_rng = rng_for(options.seed, STREAM_NSP);
    let (instances, lengths, held_flags) =
        build_instances(&docs, options, &tokenizer, &held_docs, &mut nsp_rng)?;
    drop(docs);
    let s = instances.len() as u64;
    let mut order: Vec<u64> = (0..s).collect();
    order.shuffle(&mut rng_for(options.seed, STREAM_SHUFFLE));
    let (held, train): (Vec<u64>, Vec<u64>) = if options.heldout_by_document {
        order.iter().partition(|&&i| held_flags[i as usize])
    } else {
        let mut heldout = (s as f64 * options.heldout_fraction).round() as u64;
        if options.heldout_fraction > 0.0 {
            heldout = heldout.max(1);
        }
        let (held, train) = order.split_at(heldout.min(s) as usize);
        (held.to_vec(), train.to_vec())
    };
    let (heldout, n) = (held.len(), train.len() as u64);
    if n < options.shards as u64 {
        return Err(PrepareError::TooSmall {
            reason: format!(
                "{s} sequences of at most {} tokens ({heldout} held out) cannot fill {} shards; \
                 use fewer shards, a smaller heldout fraction or more text",
                options.max_seq_length, options.shards
            ),
        });
    }
    let train_lengths: Vec<u64> = train
        .iter()
        .map(|&i| u64::from(lengths[i as usize]))
        .collect();
    let starts = shard_starts(&train_lengths, options.shards);
    let mut shards = Vec::with_capacity(options.shards);
    for (k, &start) in starts.iter().enumerate() {
        let end = starts.get(k + 1).copied().unwrap_or(train.len());
        let path = options.out_dir.join(shard_file_name(k));
        shards.push(write_shard(
            &path,
            &tokenizer,
            &instances,
            &train[start..end],
            start as u64,
        )?);
    }
    let heldout_entry = write_shard(
        &options.out_dir.join(HELDOUT_FILE),
        &tokenizer,
        &instances,
        &held,
        0,
    )?;
    drop(instances);
    remove_stale_shards(&options.out_dir, options.shards);
    tokenizer.save(&options.out_dir)?;
    let write_s = t2.elapsed().as_secs_f64();

    let manifest = PreparedManifest {
        version: MANIFEST_VERSION,
        objective: options.objective,
        max_seq_length: options.max_seq_length,
        seed: options.seed,
        short_seq_prob: options.short_seq_prob,
        heldout_fraction: options.heldout_fraction,
        lowercase: tokenizer.lowercase(),
        vocab_size: tokenizer.vocab_size(),
        vocab_hash: tokenizer.vocab_hash_hex(),
        special: tokenizer.special(),
        corpus: CorpusStats {
            files: files.iter().map(|f| f.display().to_string()).collect(),
            bytes: stats.read.bytes,
            documents: stats.documents,
            sentences: stats.sentences,
            tokens: stats.tokens,
            dropped_lines: stats.dropped_lines,
            skipped_invalid_lines: stats.read.skipped_invalid_lines,
        },
        total_sequences: n,
        total_tokens: shards.iter().map(|e| e.tokens).sum(),
        shards,
        heldout: heldout_entry,
        timings: PrepareTimings {
            train_vocab_s,
            tokenize_s,
            write_s,
            total_s: started.elapsed().as_secs_f64(),
        },
    };
    let json = serde_json::to_string_pretty(&manifest).map_err(|e| PrepareError::BadManifest {
        path: options.out_dir.join(MANIFEST_FILE),
        reason: e.to_string(),
    })?;
    let manifest_path = options.out_dir.join(MANIFEST_FILE);
    keel_proto::atomic::write_atomic(
        &manifest_path,
        json.as_bytes(),
        keel_proto::atomic::Access::Everyone,
    )
    .map_err(|e| PrepareError::Io {
        path: e.path,
        source: e.source,
    })?;
    Ok(manifest)
}
