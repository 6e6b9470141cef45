//! `keel prepare`: tokenise a corpus into training shards (like BERT's
//! `create_pretraining_data.py`). Prints one JSON summary line on stdout, with the throughput
//! (`mb_per_s`, megabytes of text per second over the whole run): run it with `--threads 1`
//! and `--threads 2` as the prepare benchmark.

use crate::output::outln;
use std::path::PathBuf;

use anyhow::Context;
use keel_coordinator::data::{Objective, PrepareOptions, VocabSource, prepare};

/// Arguments of `keel prepare`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Corpus files, directories or glob patterns (text with one sentence per line and blank
    /// lines between documents, or `.jsonl` with a `text` field; optionally `.gz`).
    #[arg(long, num_args = 1.., required = true)]
    corpus: Vec<PathBuf>,
    /// Train a WordPiece vocabulary of this many tokens.
    #[arg(long, conflicts_with = "vocab", required_unless_present = "vocab")]
    vocab_size: Option<usize>,
    /// Use this vocabulary (`vocab.txt`, or a `tokenizer.json`).
    #[arg(long)]
    vocab: Option<PathBuf>,
    /// Keep case and accents (default: lowercase and strip accents, "uncased").
    #[arg(long)]
    cased: bool,
    /// `mlm` (full-sentence packing) or `mlm+nsp` (BERT sentence pairs).
    #[arg(long, default_value = "mlm", value_parser = parse_objective)]
    objective: Objective,
    /// Tokens per sequence, `[CLS]`/`[SEP]` included.
    #[arg(long, default_value_t = 128)]
    max_seq_length: usize,
    /// Number of training shards (balanced by tokens).
    #[arg(long, default_value_t = 1)]
    shards: usize,
    /// Seed of instance building, shuffling and the heldout split.
    #[arg(long, default_value_t = 12345)]
    seed: u64,
    /// Output folder.
    #[arg(long)]
    out: PathBuf,
    /// Fraction of sequences kept for evaluation (`heldout.keel`).
    #[arg(long, default_value_t = 0.01)]
    heldout_fraction: f64,
    /// Tokenizer threads.
    #[arg(long, default_value_t = 1)]
    threads: usize,
    /// Skip (and count) lines that are not valid UTF-8 instead of failing.
    #[arg(long)]
    skip_invalid_lines: bool,
    /// NSP: probability of a shorter target length.
    #[arg(long, default_value_t = 0.1)]
    short_seq_prob: f64,
    /// Refuse a vocabulary larger than this (the model's vocab_size).
    #[arg(long)]
    model_vocab_size: Option<usize>,
}

fn parse_objective(s: &str) -> Result<Objective, String> {
    match s {
        "mlm" => Ok(Objective::Mlm),
        "mlm+nsp" => Ok(Objective::MlmNsp),
        other => Err(format!(
            "unknown objective {other:?}: expected mlm or mlm+nsp"
        )),
    }
}

/// Runs `keel prepare`.
pub fn run(args: Args) -> anyhow::Result<()> {
    let vocab = match (args.vocab, args.vocab_size) {
        (Some(path), _) => VocabSource::File {
            path,
            lowercase: !args.cased,
        },
        (None, Some(vocab_size)) => VocabSource::Train {
            vocab_size,
            lowercase: !args.cased,
        },
        (None, None) => anyhow::bail!("give --vocab-size N or --vocab FILE"),
    };
    let mut options = PrepareOptions::new(args.corpus, vocab, args.objective, args.out.clone());
    options.max_seq_length = args.max_seq_length;
    options.shards = args.shards;
    options.seed = args.seed;
    options.heldout_fraction = args.heldout_fraction;
    options.threads = args.threads;
    options.skip_invalid_lines = args.skip_invalid_lines;
    options.short_seq_prob = args.short_seq_prob;
    options.model_vocab_size = args.model_vocab_size;
    options.show_progress = true;
    let manifest =
        prepare(&options).with_context(|| format!("preparing {}", args.out.display()))?;
    let t = manifest.timings;
    let mb = manifest.corpus.bytes as f64 / 1e6;
    let summary = serde_json::json!({
        "out": args.out.display().to_string(),
        "objective": manifest.objective.as_str(),
        "threads": args.threads,
        "corpus_mb": mb,
        "documents": manifest.corpus.documents,
        "sentences": manifest.corpus.sentences,
        "corpus_tokens": manifest.corpus.tokens,
        "dropped_lines": manifest.corpus.dropped_lines,
        "skipped_invalid_lines": manifest.corpus.skipped_invalid_lines,
        "vocab_size": manifest.vocab_size,
        "train_sequences": manifest.total_sequences,
        "heldout_sequences": manifest.heldout.sequences,
        "shards": manifest.shards.len(),
        "train_vocab_s": t.train_vocab_s,
        "tokenize_s": t.tokenize_s,
        "write_s": t.write_s,
        "total_s": t.total_s,
        "mb_per_s": mb / t.total_s.max(1e-9),
        "tokenize_mb_per_s": mb / t.tokenize_s.max(1e-9),
    });
    outln!("{summary}");
    Ok(())
}
