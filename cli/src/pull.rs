//! `keel pull`: downloads a stored checkpoint in chunks, verifies every file's sha256 and the
//! manifest, writes the folder atomically, then adds `metrics.jsonl`, `loss.png` and the
//! job's TensorBoard event files (`events.out.tfevents.*`).

use crate::conn::Conn;
use crate::output::errln;
use anyhow::Context;
use keel_proto::checkpoint::{Manifest, check_plain_name};
use keel_proto::metrics::METRICS_FILE;
use keel_proto::rpc::coordinator_client::CoordinatorClient;
use keel_proto::rpc::{FileChunk, GetJobRequest, PullCheckpointRequest};
use keel_proto::transfer::Receiver;
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
    client: &mut CoordinatorClient<keel_net::auth::AuthChannel>,
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
        .with_context(|| format!("pulling {job}"))?
        .into_inner();
    let files = receive_files(stream, tmp.path(), None).await?;
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
        .with_context(|| format!("pulling the metrics of {job}"))?
        .into_inner();
    receive_files(metrics, tmp.path(), Some(Only::Name(METRICS_FILE))).await?;
    match client
        .pull_tensorboard(GetJobRequest {
            job_id: job.to_string(),
        })
        .await
    {
        Ok(events) => {
            receive_files(events.into_inner(), tmp.path(), Some(Only::EventFiles)).await?;
        }
        // A coordinator from before TensorBoard files: the pull is whole without them.
        Err(e) if e.code() == tonic::Code::Unimplemented => {
            errln!("warning: no TensorBoard event files: the coordinator does not serve them");
        }
        Err(e) => {
            return Err(e).with_context(|| format!("pulling the TensorBoard files of {job}"));
        }
    }
    let metrics_path = tmp.path().join(METRICS_FILE);
    if let Err(e) = crate::plot::write_loss_png(&metrics_path, &tmp.path().join("loss.png")) {
        errln!("warning: no loss.png: {e:#}");
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

/// The files a stream other than a checkpoint's may carry.
#[derive(Debug, Clone, Copy)]
enum Only<'a> {
    /// This one name (the metrics stream).
    Name(&'a str),
    /// TensorBoard event files (`events.out.tfevents.*`).
    EventFiles,
}

impl Only<'_> {
    /// Whether a file named `name` may be written.
    fn accepts(self, name: &str) -> bool {
        match self {
            Only::Name(only) => name == only,
            Only::EventFiles => keel_proto::tensorboard::is_event_file_name(name),
        }
    }
}

impl std::fmt::Display for Only<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Only::Name(name) => f.write_str(name),
            Only::EventFiles => write!(
                f,
                "TensorBoard event files ({}*)",
                keel_proto::tensorboard::EVENT_FILE_PREFIX
            ),
        }
    }
}

/// Writes a stream of file chunks into `dir`, checking offsets and each file's sha256, each
/// file fsynced. Returns the names written. When the stream starts with `manifest.json` (as
/// coordinators since the manifest-first order send it), every later file must be listed in
/// it, announce its recorded size, and is stopped at the first byte past that size, before
/// the byte is written; the manifest itself may not pass
/// [`keel_proto::limits::MAX_RECORD_BYTES`]. A stream with the manifest last is checked after
/// the transfer, by [`Manifest::verify`], as before. Names come from the server: only plain names
/// (no directory part, no `..`) are accepted, each once, so nothing is written outside `dir`;
/// with `only`, those names alone (so the metrics and event streams cannot replace a verified
/// file).
///
/// Errors: a bad, unexpected or repeated name, a chunk out of order, a checksum mismatch, a stream error.
async fn receive_files<S>(
    mut stream: S,
    dir: &Path,
    only: Option<Only<'_>>,
) -> anyhow::Result<Vec<String>>
where
    S: futures::Stream<Item = Result<FileChunk, tonic::Status>> + Unpin,
{
    use futures::StreamExt;
    let mut receiver = Receiver::into_dir(dir);
    // The manifest, once received first; then every file's recorded size is its bound.
    let mut manifest: Option<Manifest> = None;
    let manifest_name = keel_proto::checkpoint::MANIFEST_FILE;
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.context("receiving files from the coordinator")?;
        check_plain_name(&chunk.name)
            .with_context(|| format!("the coordinator sent a file named {:?}", chunk.name))?;
        if let Some(only) = only
            && !only.accepts(&chunk.name)
        {
            anyhow::bail!(
                "the coordinator sent {:?} where only {only} was expected",
                chunk.name
            );
        }
        // A new file (a chunk of another while one is open is refused by `accept`).
        if receiver.current().is_none() {
            if receiver.received().iter().any(|f| f.name == chunk.name) {
                anyhow::bail!("{}: the coordinator sent this file twice", chunk.name);
            }
            // A manifest from before sizes were recorded bounds nothing: checked afterwards.
            if let Some(m) = manifest.as_ref().filter(|m| !m.sizes.is_empty()) {
                let Some(&size) = m.sizes.get(&chunk.name) else {
                    anyhow::bail!(
                        "{}: the coordinator sent a file its manifest does not list with a size",
                        chunk.name
                    );
                };
                if chunk.size != size {
                    anyhow::bail!(
                        "{}: the coordinator announces {} bytes but the manifest records {size}",
                        chunk.name,
                        chunk.size
                    );
                }
            }
        }
        let name = chunk.name.clone();
        let bound = if name == manifest_name && only.is_none() {
            Some(keel_proto::limits::MAX_RECORD_BYTES)
        } else {
            manifest
                .as_ref()
                .and_then(|m| m.sizes.get(name.as_str()).copied())
        };
        let so_far = if receiver.starts_file(&chunk) {
            0
        } else {
            receiver.written()
        };
        let end = so_far + chunk.data.len() as u64;
        if let Some(bound) = bound
            && end > bound
        {
            anyhow::bail!(
                "{name}: the coordinator sent more than the {bound} bytes recorded for it \
                 (stopped at byte {bound}, before writing past it)"
            );
        }
        let first = receiver.received().is_empty();
        if receiver.accept(chunk).await?.is_some()
            && first
            && name == manifest_name
            && only.is_none()
        {
            manifest = Some(Manifest::read(dir)?);
        }
    }
    Ok(receiver
        .finish()?
        .into_iter()
        .map(|file| file.name)
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn whole_file(name: &str, data: &[u8]) -> Result<FileChunk, tonic::Status> {
        Ok(keel_proto::transfer::whole_file_chunk(name, data, None))
    }

    async fn receive(
        chunks: Vec<Result<FileChunk, tonic::Status>>,
        dir: &Path,
    ) -> anyhow::Result<Vec<String>> {
        receive_files(futures::stream::iter(chunks), dir, None).await
    }

    #[tokio::test]
    async fn names_from_the_server_stay_inside_the_folder() {
        let root = tempfile::tempdir().unwrap();
        let out = root.path().join("out");
        std::fs::create_dir(&out).unwrap();
        let names = receive(vec![whole_file("config.json", b"{}")], &out)
            .await
            .unwrap();
        assert_eq!(names, ["config.json"]);
        let bad_names = ["../evil", "/tmp/evil", "a/b", "..", ".", "", "a\\b"];
        for bad in bad_names {
            let err = receive(vec![whole_file(bad, b"x")], &out)
                .await
                .unwrap_err();
            let text = format!("{err:#}");
            assert!(text.contains("plain file name"), "{bad:?}: {text}");
        }
        assert!(!root.path().join("evil").exists());
        let mut left: Vec<String> = std::fs::read_dir(&out)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        left.sort();
        assert_eq!(left, ["config.json"]);
    }

    #[tokio::test]
    async fn a_repeated_file_or_a_bad_checksum_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let twice = vec![whole_file("a.bin", b"1"), whole_file("a.bin", b"2")];
        let err = receive(twice, dir.path()).await.unwrap_err();
        assert!(err.to_string().contains("twice"), "{err}");
        let mut chunk = whole_file("b.bin", b"data").unwrap();
        chunk.sha256 = keel_proto::checkpoint::sha256_hex(b"other");
        let err = receive(vec![Ok(chunk)], dir.path()).await.unwrap_err();
        assert!(err.to_string().contains("b.bin"), "{err}");
    }

    #[tokio::test]
    async fn the_metrics_stream_cannot_replace_a_checkpoint_file() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("model.safetensors"), b"verified").unwrap();
        let chunks = vec![whole_file("model.safetensors", b"evil")];
        let stream = futures::stream::iter(chunks);
        let err = receive_files(stream, dir.path(), Some(Only::Name(METRICS_FILE)))
            .await
            .unwrap_err();
        assert!(err.to_string().contains("only metrics.jsonl"), "{err}");
        let kept = std::fs::read(dir.path().join("model.safetensors")).unwrap();
        assert_eq!(kept, b"verified");
    }

    #[tokio::test]
    async fn the_event_stream_carries_event_files_only() {
        let dir = tempfile::tempdir().unwrap();
        let chunks = vec![
            whole_file("events.out.tfevents.1700000000.host", b"a"),
            whole_file("events.out.tfevents.1700000000.host.1", b"b"),
        ];
        let names = receive_files(
            futures::stream::iter(chunks),
            dir.path(),
            Some(Only::EventFiles),
        )
        .await
        .unwrap();
        assert_eq!(names.len(), 2);
        let chunks = vec![whole_file("metrics.jsonl", b"evil")];
        let err = receive_files(
            futures::stream::iter(chunks),
            dir.path(),
            Some(Only::EventFiles),
        )
        .await
        .unwrap_err();
        assert!(err.to_string().contains("TensorBoard event files"), "{err}");
    }

    #[tokio::test]
    async fn after_a_manifest_first_a_file_stops_at_the_first_byte_past_its_size() {
        let dir = tempfile::tempdir().unwrap();
        let manifest = Manifest {
            files: [("model.safetensors".to_string(), "0".repeat(64))].into(),
            sizes: [("model.safetensors".to_string(), 4)].into(),
        };
        let text = serde_json::to_vec(&manifest).unwrap();
        // The chunk announces the recorded size but carries one byte more.
        let mut chunk = whole_file("model.safetensors", b"12345").unwrap();
        chunk.size = 4;
        let err = receive(
            vec![whole_file("manifest.json", &text), Ok(chunk)],
            dir.path(),
        )
        .await
        .unwrap_err()
        .to_string();
        assert!(err.contains("more than the 4 bytes recorded"), "{err}");
        let written =
            std::fs::metadata(dir.path().join("model.safetensors")).map_or(0, |m| m.len());
        assert_eq!(written, 0, "nothing of the oversized chunk was written");
        // A file the manifest does not list is refused before it is created.
        let dir = tempfile::tempdir().unwrap();
        let err = receive(
            vec![
                whole_file("manifest.json", &text),
                whole_file("extra.bin", b"x"),
            ],
            dir.path(),
        )
        .await
        .unwrap_err()
        .to_string();
        assert!(err.contains("does not list"), "{err}");
        assert!(!dir.path().join("extra.bin").exists());
    }
}
