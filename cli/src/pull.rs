//! `keel pull`: downloads a stored checkpoint in chunks, verifies every file's sha256 and the
//! manifest, writes the folder atomically, then adds `metrics.jsonl` and `loss.png`.

use crate::client::Conn;
use anyhow::Context;
use keel_proto::checkpoint::{Manifest, check_plain_name};
use keel_proto::rpc::coordinator_client::CoordinatorClient;
use keel_proto::rpc::{FileChunk, GetJobRequest, PullCheckpointRequest};
use sha2::{Digest, Sha256};
use std::io::Write;
use std::path::{Path, PathBuf};

/// Arguments of `keel pull`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// The job id.
    pub job: String,
    /// Folder to write the checkpoint to (replaced if it holds an earlier pull).
    #[arg(long)]
    pub out: PathBuf,
    /// Step of the checkpoint; default: the latest.
    #[arg(long)]
    pub step: Option<u64>,
    #[command(flatten)]
    pub conn: Conn,
}

/// Pulls the checkpoint of `job` at `step` (latest if `None`) into `out`. Returns `out`.
///
/// Errors: no such job or checkpoint, a checksum mismatch, or `out` exists and is not an
/// earlier pull (no manifest.json in it).
pub async fn pull(
    client: &mut CoordinatorClient<keel_proto::auth::AuthChannel>,
    job: &str,
    step: Option<u64>,
    out: &Path,
) -> anyhow::Result<PathBuf> {
    let parent = match out.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    std::fs::create_dir_all(&parent).with_context(|| format!("creating {}", parent.display()))?;
    if out.exists() && !out.join(keel_proto::checkpoint::MANIFEST_FILE).is_file() {
        anyhow::bail!(
            "{} exists and is not a Keel checkpoint: not replacing it",
            out.display()
        );
    }
    let tmp = tempfile::Builder::new()
        .prefix(".keel-pull-")
        .tempdir_in(&parent)
        .with_context(|| format!("creating a temporary folder in {}", parent.display()))?;
    let stream = client
        .pull_checkpoint(PullCheckpointRequest {
            job_id: job.to_string(),
            step: step.unwrap_or(0),
        })
        .await
        .map_err(|s| anyhow::anyhow!("pulling {job}: {}", s.message()))?
        .into_inner();
    let files = receive_files(stream, tmp.path()).await?;
    let manifest = Manifest::read(tmp.path())?;
    manifest.verify(tmp.path())?;
    for name in manifest.files.keys() {
        if !files.contains(name) {
            anyhow::bail!("the manifest lists {name} but it was not received");
        }
    }
    let metrics = client
        .pull_metrics(GetJobRequest {
            job_id: job.to_string(),
        })
        .await
        .map_err(|s| anyhow::anyhow!("pulling the metrics of {job}: {}", s.message()))?
        .into_inner();
    receive_files(metrics, tmp.path()).await?;
    let metrics_path = tmp.path().join("metrics.jsonl");
    if let Err(e) = crate::plot::write_loss_png(&metrics_path, &tmp.path().join("loss.png")) {
        eprintln!("warning: no loss.png: {e:#}");
    }
    let dir = tmp.keep();
    if out.exists() {
        std::fs::remove_dir_all(out)
            .with_context(|| format!("removing the earlier {}", out.display()))?;
    }
    std::fs::rename(&dir, out).with_context(|| format!("renaming into {}", out.display()))?;
    std::fs::File::open(&parent).and_then(|f| f.sync_all()).ok();
    Ok(out.to_path_buf())
}

/// Writes a stream of file chunks into `dir`, checking offsets and each file's sha256, each
/// file fsynced. Returns the names written.
async fn receive_files(
    mut stream: tonic::Streaming<FileChunk>,
    dir: &Path,
) -> anyhow::Result<Vec<String>> {
    let mut names = Vec::new();
    let mut current: Option<(String, std::fs::File, Sha256, u64)> = None;
    while let Some(chunk) = stream
        .message()
        .await
        .map_err(|s| anyhow::anyhow!("transfer: {}", s.message()))?
    {
        check_plain_name(&chunk.name)?;
        if current.as_ref().is_none_or(|(n, ..)| *n != chunk.name) {
            if let Some((n, ..)) = &current {
                anyhow::bail!("{n}: the stream moved on before its last chunk");
            }
            let path = dir.join(&chunk.name);
            let file = std::fs::File::create(&path)
                .with_context(|| format!("creating {}", path.display()))?;
            current = Some((chunk.name.clone(), file, Sha256::new(), 0));
        }
        let Some((name, file, hasher, written)) = current.as_mut() else {
            continue;
        };
        if chunk.offset != *written {
            anyhow::bail!(
                "{name}: chunk at offset {} after {written} bytes",
                chunk.offset
            );
        }
        file.write_all(&chunk.data)?;
        hasher.update(&chunk.data);
        *written += chunk.data.len() as u64;
        if chunk.last {
            file.sync_all()?;
            let got = keel_proto::checkpoint::hex(&hasher.clone().finalize());
            if got != chunk.sha256 {
                anyhow::bail!(
                    "{name}: received sha256 {got}, the coordinator sent {}",
                    chunk.sha256
                );
            }
            names.push(name.clone());
            current = None;
        }
    }
    if let Some((n, ..)) = current {
        anyhow::bail!("{n}: the stream ended before its last chunk");
    }
    Ok(names)
}
