//! `keel inspect`: print the sequences of a prepared folder (or of one shard file) as JSON
//! lines: `global_index`, `shard`, `ids`, `tokens`, `token_type_ids`, `nsp_label`.

use std::path::{Path, PathBuf};

use anyhow::Context;
use keel_coordinator::data::PreparedData;
use keel_proto::shard::ShardReader;
use keel_proto::tokenizer::KeelTokenizer;

/// Arguments of `keel inspect`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// A prepared folder (all training shards, then `heldout.keel`), or one `.keel` file
    /// (tokens are then looked up in the `tokenizer.json` beside it, if any).
    path: PathBuf,
    /// Print at most this many sequences.
    #[arg(long)]
    limit: Option<usize>,
}

fn print_shard(
    name: &str,
    reader: &ShardReader,
    tokenizer: Option<&KeelTokenizer>,
    remaining: &mut usize,
) -> anyhow::Result<()> {
    use std::io::Write;
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    for i in 0..reader.len() {
        if *remaining == 0 {
            break;
        }
        *remaining -= 1;
        let seq = reader.get(i)?;
        let tokens: Option<Vec<String>> = tokenizer.map(|t| {
            seq.ids
                .iter()
                .map(|&id| t.id_to_token(id).unwrap_or_else(|| format!("<{id}?>")))
                .collect()
        });
        let line = serde_json::json!({
            "shard": name,
            "global_index": seq.global_index,
            "ids": seq.ids,
            "tokens": tokens,
            "token_type_ids": seq.token_type_ids,
            "nsp_label": seq.nsp_label,
        });
        if writeln!(out, "{line}").is_err() {
            // Reader went away (e.g. `| head`): stop quietly.
            *remaining = 0;
            break;
        }
    }
    Ok(())
}

fn tokenizer_beside(path: &Path) -> Option<KeelTokenizer> {
    let json = path.parent()?.join("tokenizer.json");
    KeelTokenizer::from_tokenizer_json(&json).ok()
}

/// Runs `keel inspect`.
pub fn run(args: Args) -> anyhow::Result<()> {
    let mut remaining = args.limit.unwrap_or(usize::MAX);
    if args.path.is_dir() {
        let prepared = PreparedData::open(&args.path)
            .with_context(|| format!("opening {}", args.path.display()))?;
        for i in 0..prepared.num_shards() {
            let reader = prepared.open_shard(i)?;
            let name = prepared.manifest().shards[i].file.clone();
            print_shard(&name, &reader, Some(prepared.tokenizer()), &mut remaining)?;
        }
        let reader = prepared.open_heldout()?;
        print_shard(
            &prepared.manifest().heldout.file,
            &reader,
            Some(prepared.tokenizer()),
            &mut remaining,
        )?;
    } else {
        let reader = ShardReader::open(&args.path)?;
        let name = args
            .path
            .file_name()
            .map(|n| n.to_string_lossy().to_string())
            .unwrap_or_default();
        let tokenizer = tokenizer_beside(&args.path);
        print_shard(&name, &reader, tokenizer.as_ref(), &mut remaining)?;
    }
    Ok(())
}
