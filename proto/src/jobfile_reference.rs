//! The job file's reference tables (`docs/job-file.md`), made from the code's own definitions.
//!
//! The keys of each section come from the spec types themselves (serde's list of the fields a
//! `deny_unknown_fields` struct accepts), and every default from deserializing a job that names
//! only the required keys (so from the `default_*` functions of [`crate::jobspec`] and its
//! siblings). What this file adds is the words: each key's type, allowed values and meaning,
//! in [`KEYS`]. The tests fail when a section has a key [`KEYS`] does not describe (or the
//! reverse), and when the tables committed in `docs/job-file.md` differ from
//! [`reference_markdown`]; `KEEL_WRITE_DOCS=1 cargo test -p keel-proto job_file_reference`
//! rewrites them.
//!
//! # Layout
//! - [`KeyDoc`], [`KEYS`]: the words for every key.
//! - [`section_keys`]: a section's keys as the code defines them.
//! - [`defaults`]: every key's default as the code computes it.
//! - [`reference_markdown`]: the tables.

use crate::diloco::DilocoSpec;
use crate::jobspec::{ClusterSpec, DataTable, JobFile, ModelTable, TrainSpec};
use crate::phases::PhaseSpec;
use serde::de::DeserializeOwned;
use std::collections::BTreeMap;

/// One job-file key, described for people.
#[derive(Debug, Clone, Copy)]
pub struct KeyDoc {
    /// The section: `data`, `model`, `train`, `cluster`, `phase` or `diloco`.
    pub section: &'static str,
    /// The key inside its section.
    pub key: &'static str,
    /// The TOML type.
    pub ty: &'static str,
    /// What to write as the default when the code has none to show (a required key, or an
    /// optional one whose absence means something); `None`: the code's default.
    pub default: Option<&'static str>,
    /// Allowed values, as the validation checks them (empty: any value of the type).
    pub allowed: &'static str,
    /// What it does.
    pub meaning: &'static str,
}

const fn k(
    section: &'static str,
    key: &'static str,
    ty: &'static str,
    default: Option<&'static str>,
    allowed: &'static str,
    meaning: &'static str,
) -> KeyDoc {
    KeyDoc {
        section,
        key,
        ty,
        default,
        allowed,
        meaning,
    }
}

/// The sections in the order of the reference, each with a line saying what it is.
pub const SECTIONS: [(&str, &str); 6] = [
    (
        "data",
        "Where the text is and how it becomes masked sequences.",
    ),
    (
        "model",
        "Which BERT: exactly one of `preset`, `config`, `init_checkpoint`.",
    ),
    ("train", "Optimisation, arithmetic and checkpoints."),
    (
        "cluster",
        "How many workers, and when a loss or a stall ends the job. The whole table is optional.",
    ),
    (
        "phase",
        "Optional and repeatable: each `[[phase]]` starts a later training phase and changes the keys it names; the others stay the previous phase's.",
    ),
    (
        "diloco",
        "Optional: low-communication training (DiLoCo). Without it a job trains synchronously.",
    ),
];

/// Every key of every section.
pub const KEYS: &[KeyDoc] = &[
    k(
        "data",
        "corpus",
        "list of strings",
        Some("required"),
        "at least one",
        "files, folders or globs of UTF-8 text in BERT's layout (a blank line between documents), `.gz`, or `.jsonl` with a `text` field",
    ),
    k(
        "data",
        "vocab_size",
        "integer",
        Some("one of `vocab_size`, `vocab` required"),
        "100 to 1,000,000",
        "train a WordPiece vocabulary of this size on the corpus (every character of the corpus is kept, so a CJK corpus can give more entries; the same corpus gives the same vocabulary)",
    ),
    k(
        "data",
        "vocab",
        "path",
        Some("one of `vocab_size`, `vocab` required"),
        "a `vocab.txt` or `tokenizer.json`",
        "use this vocabulary instead of training one (training is deterministic: the same corpus and settings give the same vocabulary)",
    ),
    k(
        "data",
        "lowercase",
        "bool",
        None,
        "",
        "uncased: lowercase and strip accents",
    ),
    k(
        "data",
        "objective",
        "string",
        None,
        "`\"mlm\"`, `\"mlm+nsp\"`",
        "masked LM with RoBERTa-style full-sentence packing, or masked LM plus next-sentence prediction on BERT's sentence pairs",
    ),
    k(
        "data",
        "max_seq_length",
        "integer",
        None,
        "8 to 8,192; at most 512 with `model.preset`",
        "tokens per sequence, `[CLS]` and `[SEP]` included",
    ),
    k(
        "data",
        "masked_lm_prob",
        "float",
        None,
        "strictly between 0 and 1",
        "share of tokens predicted (80% `[MASK]`, 10% random, 10% unchanged)",
    ),
    k(
        "data",
        "max_predictions_per_seq",
        "integer",
        None,
        "1 to `max_seq_length`",
        "predicted tokens per sequence at most",
    ),
    k(
        "data",
        "whole_word_masking",
        "bool",
        None,
        "",
        "mask all word pieces of a word together",
    ),
    k(
        "data",
        "dupe_factor",
        "integer",
        None,
        "",
        "static masking with this many masks per sequence; 0 = dynamic masking (a fresh mask each epoch)",
    ),
    k(
        "data",
        "heldout_fraction",
        "float",
        None,
        "0 to 0.5 (excluded)",
        "share of sequences kept for evaluation",
    ),
    k(
        "data",
        "shards",
        "integer",
        None,
        "",
        "training shards the corpus is split into; 0 = one per worker",
    ),
    k(
        "model",
        "preset",
        "string",
        Some("one of `preset`, `config`, `init_checkpoint` required"),
        "`tiny`, `mini`, `small`, `medium`, `base`, `large`",
        "a BERT size (the vocabulary size comes from the vocabulary)",
    ),
    k(
        "model",
        "config",
        "path",
        Some("one of `preset`, `config`, `init_checkpoint` required"),
        "an HF `config.json`",
        "any BERT configuration",
    ),
    k(
        "model",
        "init_checkpoint",
        "path",
        Some("one of `preset`, `config`, `init_checkpoint` required"),
        "an HF checkpoint folder (`config.json` + `model.safetensors`)",
        "continue pretraining from these weights (verified against its `manifest.json` when it has one, and checked for shapes and NaN/Inf)",
    ),
    k(
        "model",
        "dropout",
        "float",
        Some("the config's"),
        "0 to 1 (excluded)",
        "overrides the hidden and attention dropout",
    ),
    k(
        "train",
        "micro_batch_size",
        "integer",
        Some("required"),
        "1 to 65,536",
        "sequences per micro-batch per worker",
    ),
    k(
        "train",
        "gradient_accumulation_steps",
        "integer",
        None,
        "1 to 65,536",
        "micro-batches per step; global batch = workers x `micro_batch_size` x this, fixed by the first generation",
    ),
    k(
        "train",
        "max_steps",
        "integer",
        Some("required"),
        "at least 1",
        "optimizer steps (all phases together)",
    ),
    k(
        "train",
        "optimizer",
        "string",
        None,
        "`\"adamw\"`, `\"lamb\"`",
        "AdamW (as `torch.optim.AdamW`) or LAMB (You et al. 2019)",
    ),
    k(
        "train",
        "learning_rate",
        "float",
        None,
        "above 0, below 10",
        "peak learning rate",
    ),
    k(
        "train",
        "warmup_steps",
        "integer",
        None,
        "at most `max_steps`",
        "linear warmup from 0",
    ),
    k(
        "train",
        "schedule",
        "string",
        None,
        "`\"linear\"`, `\"poly\"`, `\"constant\"`",
        "after warmup: linear or polynomial decay to 0 at the last step, or constant",
    ),
    k(
        "train",
        "poly_power",
        "float",
        None,
        "above 0",
        "power of the `poly` schedule",
    ),
    k(
        "train",
        "weight_decay",
        "float",
        None,
        "0 to 1 (excluded)",
        "decoupled weight decay, not on biases and LayerNorm",
    ),
    k(
        "train",
        "adam_beta1",
        "float",
        None,
        "0 to 1 (excluded)",
        "Adam's beta1",
    ),
    k(
        "train",
        "adam_beta2",
        "float",
        None,
        "0 to 1 (excluded)",
        "Adam's beta2",
    ),
    k(
        "train",
        "adam_epsilon",
        "float",
        None,
        "above 0",
        "Adam's epsilon",
    ),
    k(
        "train",
        "max_grad_norm",
        "float",
        None,
        "0 or more; 0 = off",
        "global-norm gradient clipping",
    ),
    k(
        "train",
        "seed",
        "integer",
        None,
        "",
        "initial weights, masking, dropout and the data's shuffle",
    ),
    k(
        "train",
        "checkpoint_every",
        "integer",
        None,
        "",
        "steps between checkpoints; 0 = only the final one",
    ),
    k(
        "train",
        "eval_every",
        "integer",
        None,
        "",
        "steps between held-out evaluations; 0 = only at the end",
    ),
    k(
        "train",
        "keep_checkpoints",
        "integer",
        None,
        "at least 1",
        "periodic checkpoints kept (the final one always is)",
    ),
    k(
        "train",
        "max_skipped_steps",
        "integer",
        None,
        "",
        "steps with a non-finite loss or gradient are skipped (no update); one more than this fails the job",
    ),
    k(
        "train",
        "precision",
        "string",
        None,
        "`\"auto\"`, `\"bf16\"`, `\"fp32\"`",
        "GEMM arithmetic. `bf16`: every GEMM takes bf16-rounded inputs and accumulates in fp32 (weights, optimizer, LayerNorm, softmax and the all-reduce stay fp32), through oneDNN where the CPU runs it natively, else an exact emulation. `auto`: bf16 only when every worker reports native bf16 that pays (AMX-BF16, or AVX512_BF16 where the worker's start-up race finds oneDNN's bf16 at least 1.2x OpenBLAS fp32), else fp32. Decided once per job, shown by `keel status`, kept on resume",
    ),
    k(
        "train",
        "allreduce_dtype",
        "string",
        None,
        "`\"fp32\"`, `\"bf16\"`",
        "how gradients travel on the ring: `bf16` sends half the bytes, each hop adding into its fp32 buffer and rounding only what it sends; replicas stay identical. For links slower than the step's compute",
    ),
    k(
        "train",
        "bucket_mib",
        "integer",
        None,
        "1 to 1,024",
        "gradient bucket size, MiB of fp32: each bucket is one ring all-reduce started as soon as backward finishes it, and pays the ring's per-hop latency 2 (W - 1) times, so worlds of 32 and more want 64 or more; another size sums in another order (results differ by rounding)",
    ),
    k(
        "train",
        "shard_optimizer",
        "bool",
        None,
        "not with `[diloco]`",
        "ZeRO stage 1: each of the W ranks keeps the optimizer moments of 1/W of the weights and updates only those; the gradient all-reduce becomes a reduce-scatter and the updated weights an all-gather (the same bytes). Equal to unsharded training to rounding; the same checkpoint files. A lost worker takes its share with it, so the job goes on from its newest checkpoint",
    ),
    k(
        "cluster",
        "min_workers",
        "integer",
        None,
        "at least 1",
        "the job starts with at least this many workers, and after a loss goes on with at least this many",
    ),
    k(
        "cluster",
        "max_workers",
        "integer",
        None,
        "`min_workers` to 4,096",
        "at most this many workers take part; a new worker makes a job below it grow",
    ),
    k(
        "cluster",
        "peer_timeout_seconds",
        "float",
        None,
        "0.5 to 3,600",
        "a worker silent this long is lost (a closed connection is noticed at once)",
    ),
    k(
        "cluster",
        "max_recoveries",
        "integer",
        None,
        "",
        "new generations after losses before the job fails; 0 = fail at the first loss, naming the worker and step",
    ),
    k(
        "cluster",
        "replacement_timeout_seconds",
        "float",
        None,
        "1 to 604,800",
        "below `min_workers` after a loss, wait this long for a replacement before failing",
    ),
    k(
        "cluster",
        "progress_timeout_seconds",
        "float",
        None,
        "1 to 604,800",
        "a running job whose step does not advance this long is stalled: re-formed without the workers that never started the generation or lag behind (a recovery), or failed naming them. Must cover a generation's first step (data fetch included), an evaluation and checkpoint staging",
    ),
    k(
        "phase",
        "start_step",
        "integer",
        Some("required"),
        "increasing from section to section, below `train.max_steps`; with `[diloco]` a multiple of `inner_steps`",
        "the phase's first step, 0-based",
    ),
    k(
        "phase",
        "max_seq_length",
        "integer",
        Some("the previous phase's"),
        "as `data.max_seq_length`",
        "tokens per sequence",
    ),
    k(
        "phase",
        "max_predictions_per_seq",
        "integer",
        Some("the previous phase's"),
        "as `data.max_predictions_per_seq`",
        "predicted tokens per sequence at most",
    ),
    k(
        "phase",
        "micro_batch_size",
        "integer",
        Some("the previous phase's"),
        "as `train.micro_batch_size`",
        "sequences per micro-batch per worker",
    ),
    k(
        "phase",
        "gradient_accumulation_steps",
        "integer",
        Some("the previous phase's"),
        "as `train.gradient_accumulation_steps`",
        "micro-batches per step",
    ),
    k(
        "phase",
        "learning_rate",
        "float",
        Some("the previous phase's"),
        "as `train.learning_rate`",
        "the phase's peak learning rate",
    ),
    k(
        "phase",
        "warmup_steps",
        "integer",
        Some("the previous phase's"),
        "",
        "linear warmup from 0 at the phase's first step",
    ),
    k(
        "diloco",
        "inner_steps",
        "integer",
        Some("required"),
        "at least 1; `train.max_steps`, `eval_every` and `checkpoint_every` must be multiples of it",
        "H, local optimizer steps per outer step (no gradient all-reduce between them)",
    ),
    k(
        "diloco",
        "outer_learning_rate",
        "float",
        None,
        "",
        "the outer step's learning rate (the paper's value)",
    ),
    k(
        "diloco",
        "outer_momentum",
        "float",
        None,
        "0 to 1 (excluded)",
        "the outer step's Nesterov momentum (the paper's value)",
    ),
];

/// The keys of one section as its spec type defines them: the fields serde lists when it
/// refuses an unknown one (every section is `deny_unknown_fields`).
pub fn section_keys(section: &str) -> Vec<String> {
    fn fields<T: DeserializeOwned>() -> Vec<String> {
        let err = match toml::from_str::<T>("zz_not_a_key = 0") {
            Err(e) => e.to_string(),
            Ok(_) => return Vec::new(),
        };
        let list = err
            .split("expected one of")
            .nth(1)
            .or_else(|| err.split("expected").nth(1))
            .unwrap_or("");
        list.split('`')
            .skip(1)
            .step_by(2)
            .map(str::to_string)
            .collect()
    }
    match section {
        "data" => fields::<DataTable>(),
        "model" => fields::<ModelTable>(),
        "train" => fields::<TrainSpec>(),
        "cluster" => fields::<ClusterSpec>(),
        "phase" => fields::<PhaseSpec>(),
        "diloco" => fields::<DilocoSpec>(),
        _ => Vec::new(),
    }
}

/// A job that names only what has no default.
const MINIMAL_JOB: &str = r#"
[data]
corpus = ["c"]
[model]
[train]
micro_batch_size = 1
max_steps = 1
[diloco]
inner_steps = 1
"#;

/// Every key's default as the code computes it, keyed `section.key`, written as TOML would
/// write the value; keys whose default is "absent" are left out.
pub fn defaults() -> BTreeMap<String, String> {
    // As written, before validation: a job naming only what has no default has no
    // vocabulary and no model source, which a `JobSpec` must have.
    let spec: JobFile = toml::from_str(MINIMAL_JOB).expect("the minimal job parses");
    let value = serde_json::to_value(&spec).expect("a spec serializes");
    let mut out = BTreeMap::new();
    for (section, _) in SECTIONS {
        let Some(table) = value.get(section).and_then(|v| v.as_object()) else {
            continue;
        };
        for (key, v) in table {
            let text = match v {
                serde_json::Value::Null
                | serde_json::Value::Array(_)
                | serde_json::Value::Object(_) => continue,
                serde_json::Value::String(s) => format!("\"{s}\""),
                serde_json::Value::Bool(b) => b.to_string(),
                serde_json::Value::Number(n) => match n.as_f64() {
                    Some(f) if n.is_f64() => format_float(f),
                    _ => n.to_string(),
                },
            };
            out.insert(format!("{section}.{key}"), text);
        }
    }
    out
}

/// `0.0001` as `1e-4`, `30.0` as `30.0`, `0.15` as `0.15`: as a float in TOML.
fn format_float(f: f64) -> String {
    if f != 0.0 && f.abs() < 1e-3 {
        return format!("{f:e}");
    }
    if f.fract() == 0.0 {
        return format!("{f:.1}");
    }
    format!("{f}")
}

/// The reference tables: one per section, in [`SECTIONS`] order, each key with its type,
/// default, allowed values and meaning.
pub fn reference_markdown() -> String {
    let defaults = defaults();
    let mut out = String::new();
    for (i, (section, intro)) in SECTIONS.iter().enumerate() {
        if i > 0 {
            out.push('\n');
        }
        let title = if *section == "phase" {
            "[[phase]]".to_string()
        } else {
            format!("[{section}]")
        };
        out.push_str(&format!("### `{title}`\n\n{intro}\n\n"));
        out.push_str("| key | type | default | allowed | meaning |\n|---|---|---|---|---|\n");
        for doc in KEYS.iter().filter(|d| d.section == *section) {
            let default = match doc.default {
                Some(text) => text.to_string(),
                None => match defaults.get(&format!("{section}.{}", doc.key)) {
                    Some(v) => format!("`{v}`"),
                    None => "none".to_string(),
                },
            };
            out.push_str(&format!(
                "| `{}` | {} | {} | {} | {} |\n",
                doc.key,
                doc.ty,
                default,
                if doc.allowed.is_empty() {
                    "any"
                } else {
                    doc.allowed
                },
                doc.meaning
            ));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;
    use std::path::PathBuf;

    #[test]
    fn every_key_of_the_code_is_described_and_no_other() {
        for (section, _) in SECTIONS {
            let code: BTreeSet<String> = section_keys(section).into_iter().collect();
            assert!(!code.is_empty(), "no keys read for [{section}]");
            let described: BTreeSet<String> = KEYS
                .iter()
                .filter(|d| d.section == section)
                .map(|d| d.key.to_string())
                .collect();
            assert_eq!(
                code, described,
                "[{section}]: the keys the code accepts (left) and the keys KEYS describes (right) differ"
            );
        }
    }

    #[test]
    fn defaults_come_from_the_code() {
        let d = defaults();
        assert_eq!(d["train.learning_rate"], "1e-4");
        assert_eq!(d["data.masked_lm_prob"], "0.15");
        assert_eq!(d["train.precision"], "\"auto\"");
        assert_eq!(d["cluster.peer_timeout_seconds"], "30.0");
        assert_eq!(d["diloco.outer_momentum"], "0.9");
        for doc in KEYS.iter().filter(|d| d.default.is_none()) {
            assert!(
                d.contains_key(&format!("{}.{}", doc.section, doc.key)),
                "{}.{} has neither a default in the code nor one written in KEYS",
                doc.section,
                doc.key
            );
        }
    }

    /// `docs/job-file.md` holds [`reference_markdown`] between its markers. With
    /// `KEEL_WRITE_DOCS=1` the test writes it there instead of failing.
    #[test]
    fn job_file_reference_in_the_docs_is_what_the_code_makes() {
        let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../docs/job-file.md");
        let text = std::fs::read_to_string(&path).expect("docs/job-file.md");
        let (begin, end) = (
            "<!-- generated: job-file reference -->\n",
            "<!-- /generated -->",
        );
        let start = text.find(begin).expect("begin marker") + begin.len();
        let stop = start + text[start..].find(end).expect("end marker");
        let want = reference_markdown();
        if text[start..stop] == want {
            return;
        }
        if std::env::var_os("KEEL_WRITE_DOCS").is_some() {
            let new = format!("{}{}{}", &text[..start], want, &text[stop..]);
            std::fs::write(&path, new).expect("write docs/job-file.md");
            return;
        }
        panic!(
            "docs/job-file.md's tables differ from what the code makes; run \
             `KEEL_WRITE_DOCS=1 cargo test -p keel-proto job_file_reference` and commit the file"
        );
    }
}
