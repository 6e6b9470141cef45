//! `keel fill-mask`: the top-k tokens and probabilities for each [MASK] of a text, from a
//! checkpoint folder, like the `transformers` fill-mask pipeline.

use crate::output::outln;
use anyhow::Context;
use keel_model::Bert;
use keel_proto::config::BertConfig;
use keel_proto::params::ParamLayout;
use keel_proto::tokenizer::KeelTokenizer;
use std::path::PathBuf;

/// Arguments of `keel fill-mask`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Checkpoint folder (HF layout: config.json, model.safetensors, tokenizer files). When it
    /// holds a manifest.json (Keel wrote it) every file is verified against it first.
    #[arg(long)]
    pub checkpoint: PathBuf,
    /// How many candidates per [MASK].
    #[arg(long, default_value_t = 5)]
    pub top_k: usize,
    /// Print JSON (a list per [MASK] of {score, token, token_str, sequence}).
    #[arg(long)]
    pub json: bool,
    /// The text, with one or more [MASK].
    pub text: String,
}

/// One candidate for one [MASK].
#[derive(Debug, Clone, serde::Serialize)]
pub struct Candidate {
    /// Probability (softmax over the vocabulary).
    pub score: f64,
    /// Token id.
    pub token: u32,
    /// The token.
    pub token_str: String,
    /// The text with this [MASK] filled in.
    pub sequence: String,
}

/// Runs `keel fill-mask`.
///
/// Errors: an unreadable checkpoint or a text with no [MASK].
pub fn run(args: Args) -> anyhow::Result<()> {
    if args.top_k == 0 {
        anyhow::bail!("--top-k must be at least 1");
    }
    let results = fill_mask(&args.checkpoint, &args.text, args.top_k)?;
    if args.json {
        outln!("{}", serde_json::to_string_pretty(&results)?);
        return Ok(());
    }
    for (i, candidates) in results.iter().enumerate() {
        outln!("[MASK] #{}:", i + 1);
        for c in candidates {
            outln!("  {:>7.4}  {:<16} {}", c.score, c.token_str, c.sequence);
        }
    }
    Ok(())
}

/// The top-`k` candidates for each [MASK] of `text`, in order.
///
/// Errors: the folder's `manifest.json` (when it has one) does not match its files (naming
/// the file: missing, truncated or altered), the checkpoint cannot be loaded, or `text` has
/// no [MASK].
pub fn fill_mask(
    dir: &std::path::Path,
    text: &str,
    k: usize,
) -> anyhow::Result<Vec<Vec<Candidate>>> {
    if !dir.is_dir() {
        anyhow::bail!(
            "{}: no such checkpoint folder (give a folder from `keel pull --out` or \
             `save_pretrained`)",
            dir.display()
        );
    }
    // A folder Keel wrote carries a manifest: refuse it when a file was truncated or altered.
    // A folder from `save_pretrained` has none and is read as it is.
    keel_proto::checkpoint::verify_dir(dir)
        .with_context(|| format!("checking the checkpoint {}", dir.display()))?;
    let tokenizer = KeelTokenizer::from_tokenizer_json(&dir.join("tokenizer.json"))
        // The tokenizer's error names the file (with the folder): no second mention here.
        .context("loading the tokenizer")?;
    let config = BertConfig::from_json_file(dir.join("config.json"))?;
    let heads = config.heads();
    let layout = ParamLayout::bert(&config, heads);
    // The weights' shapes are compared with the config before anything the size of the model
    // is allocated: a config.json that does not describe them is refused naming the tensor
    // and the config fields.
    let params = keel_proto::weights::load_safetensors(dir.join("model.safetensors"), &layout)
        .with_context(|| {
            format!(
                "{} does not describe the weights",
                dir.join("config.json").display()
            )
        })?;
    let mut model = Bert::<f32>::new(&config, heads)?;
    let special = tokenizer.special();
    let mut ids = vec![special.cls];
    ids.extend(tokenizer.encode(text));
    ids.push(special.sep);
    let positions: Vec<usize> = ids
        .iter()
        .enumerate()
        .filter(|(_, id)| **id == special.mask)
        .map(|(i, _)| i)
        .collect();
    anyhow::ensure!(!positions.is_empty(), "the text has no [MASK]");
    let types = vec![0u32; ids.len()];
    let logits = model.mlm_logits(&params, &ids, &types, &positions)?;
    let mut out = Vec::new();
    for (row, &pos) in logits.rows().into_iter().zip(&positions) {
        let max = row.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
        let exp: Vec<f64> = row.iter().map(|&x| f64::from(x - max).exp()).collect();
        let total: f64 = exp.iter().sum();
        let mut order: Vec<usize> = (0..exp.len()).collect();
        order.sort_by(|&a, &b| exp[b].total_cmp(&exp[a]));
        let candidates = order
            .into_iter()
            .take(k)
            .map(|id| {
                let mut filled = ids.clone();
                filled[pos] = id as u32;
                Candidate {
                    score: exp[id] / total,
                    token: id as u32,
                    token_str: tokenizer.id_to_token(id as u32).unwrap_or_default(),
                    sequence: tokenizer.decode(&filled[1..filled.len() - 1]),
                }
            })
            .collect();
        out.push(candidates);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use keel_proto::checkpoint::commit_dir;

    const FIXTURE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../fixtures/bert-micro-mlm");

    /// The fixture's config and weights committed as Keel commits checkpoints (with a manifest).
    fn committed_checkpoint(root: &std::path::Path) -> PathBuf {
        let tmp = root.join(".tmp");
        std::fs::create_dir(&tmp).unwrap();
        for name in ["config.json", "model.safetensors"] {
            std::fs::copy(format!("{FIXTURE}/{name}"), tmp.join(name)).unwrap();
        }
        let dir = root.join("ckpt");
        commit_dir(&tmp, &dir).unwrap();
        dir
    }

    fn refusal(dir: &std::path::Path) -> String {
        format!("{:#}", fill_mask(dir, "a [MASK]", 3).unwrap_err())
    }

    #[test]
    fn a_missing_folder_or_tokenizer_is_named_once() {
        let root = tempfile::tempdir().unwrap();
        let missing = root.path().join("no-ckpt");
        let text = refusal(&missing);
        assert_eq!(text.matches("no-ckpt").count(), 1, "{text}");
        assert!(text.contains("no such checkpoint folder"), "{text}");
        let empty = root.path().join("empty");
        std::fs::create_dir(&empty).unwrap();
        let text = refusal(&empty);
        assert_eq!(text.matches("empty").count(), 1, "{text}");
        assert!(text.contains("tokenizer.json"), "{text}");
    }

    /// A folder without a manifest whose config.json sits at the documented caps (a model of
    /// 6.7 TB) beside a small model: refused naming the file and the fields, not an abort on
    /// "memory allocation of 6741396684800 bytes failed".
    #[test]
    fn a_config_at_the_caps_beside_small_weights_is_refused_before_allocating() {
        use keel_proto::config as caps;
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("ckpt");
        std::fs::create_dir(&dir).unwrap();
        std::fs::copy(
            format!("{FIXTURE}/model.safetensors"),
            dir.join("model.safetensors"),
        )
        .unwrap();
        let vocab = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../fixtures/wordpiece/vocab.txt"
        );
        KeelTokenizer::from_vocab_file(std::path::Path::new(vocab), true)
            .unwrap()
            .save(&dir)
            .unwrap();
        let mut config: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(format!("{FIXTURE}/config.json")).unwrap(),
        )
        .unwrap();
        for (field, value) in [
            ("hidden_size", caps::MAX_HIDDEN_SIZE),
            ("num_hidden_layers", caps::MAX_LAYERS),
            ("num_attention_heads", caps::MAX_HEADS),
            ("intermediate_size", caps::MAX_INTERMEDIATE_SIZE),
            ("vocab_size", caps::MAX_VOCAB_SIZE),
            ("max_position_embeddings", caps::MAX_POSITIONS),
        ] {
            config[field] = value.into();
        }
        std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
        assert!(!dir.join("manifest.json").exists());
        let text = refusal(&dir);
        for part in [
            "config.json",
            "model.safetensors",
            "bert.embeddings.word_embeddings.weight",
            "vocab_size, hidden_size",
            "[512, 64]",
        ] {
            assert!(text.contains(part), "{part:?} not in {text}");
        }
    }

    #[test]
    fn truncated_altered_or_missing_files_are_refused_naming_the_file() {
        let root = tempfile::tempdir().unwrap();
        let dir = committed_checkpoint(root.path());
        let model = dir.join("model.safetensors");
        let good = std::fs::read(&model).unwrap();

        std::fs::write(&model, &good[..good.len() / 2]).unwrap();
        let text = refusal(&dir);
        assert!(
            text.contains("model.safetensors") && text.contains("truncated"),
            "{text}"
        );

        let mut flipped = good.clone();
        let last = flipped.len() - 1;
        flipped[last] ^= 0x40;
        std::fs::write(&model, &flipped).unwrap();
        let text = refusal(&dir);
        assert!(
            text.contains("model.safetensors") && text.contains("sha256"),
            "{text}"
        );

        std::fs::remove_file(dir.join("config.json")).unwrap();
        let text = refusal(&dir);
        assert!(
            text.contains("config.json") && text.contains("missing"),
            "{text}"
        );
    }
}
