//! `keel fill-mask`: the top-k tokens and probabilities for each [MASK] of a text, from a
//! checkpoint folder, like the `transformers` fill-mask pipeline.

use anyhow::Context;
use keel_proto::config::BertConfig;
use keel_proto::params::ParamLayout;
use keel_proto::tokenizer::KeelTokenizer;
use keel_worker::model::Bert;
use std::path::PathBuf;

/// Arguments of `keel fill-mask`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Checkpoint folder (HF layout: config.json, model.safetensors, tokenizer files).
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
        println!("{}", serde_json::to_string_pretty(&results)?);
        return Ok(());
    }
    for (i, candidates) in results.iter().enumerate() {
        println!("[MASK] #{}:", i + 1);
        for c in candidates {
            println!("  {:>7.4}  {:<16} {}", c.score, c.token_str, c.sequence);
        }
    }
    Ok(())
}

/// The top-`k` candidates for each [MASK] of `text`, in order.
///
/// Errors: the checkpoint cannot be loaded, or `text` has no [MASK].
pub fn fill_mask(
    dir: &std::path::Path,
    text: &str,
    k: usize,
) -> anyhow::Result<Vec<Vec<Candidate>>> {
    let tokenizer = KeelTokenizer::from_tokenizer_json(&dir.join("tokenizer.json"))
        .with_context(|| format!("loading the tokenizer of {}", dir.display()))?;
    let config = BertConfig::from_json_file(dir.join("config.json"))?;
    let heads = config.heads();
    let layout = ParamLayout::bert(&config, heads);
    let params = keel_proto::weights::load_safetensors(dir.join("model.safetensors"), &layout)?;
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
