//! `checkpoint`: a checkpoint folder checked and loaded as the coordinator checks a job's
//! `model.init_checkpoint` (`prepare_job::check_init_checkpoint`) and a worker loads one:
//! [`verify_dir`] (the manifest, then every listed file's size and sha256), the model's
//! `config.json` ([`BertConfig::from_json_file`]), [`load_safetensors`] against the config's
//! layout (shapes checked before the buffer is allocated), [`check_finite`], and the other
//! readers of safetensors files.

use keel_proto::checkpoint::{CONFIG_FILE, MANIFEST_FILE, MODEL_FILE, verify_dir};
use keel_proto::config::BertConfig;
use keel_proto::params::ParamLayout;
use keel_proto::weights::{check_finite, load_safetensors, load_tensors_f64, tensor_names};

/// Three parts: `manifest.json` and `config.json` (each length-prefixed, see
/// `split_prefixed` in this crate; an empty part is no file), then `model.safetensors` (the rest).
pub fn checkpoint(data: &[u8]) {
    let (manifest, rest) = crate::split_prefixed(data);
    let (config, model) = crate::split_prefixed(rest);
    let dir = crate::temp_dir();
    let write = |name: &str, bytes: &[u8]| {
        if !bytes.is_empty() {
            std::fs::write(dir.path().join(name), bytes).expect("writing a temporary file");
        }
    };
    write(MANIFEST_FILE, manifest);
    write(CONFIG_FILE, config);
    write(MODEL_FILE, model);
    let weights = dir.path().join(MODEL_FILE);
    let _ = verify_dir(dir.path());
    let _ = tensor_names(&weights);
    let _ = load_tensors_f64(&weights);
    let _ = check_finite(&weights);
    // Any valid config, up to its caps (billions of parameters): the loader checks every
    // shape against the file before it allocates, so a small file is refused, not allocated.
    if let Ok(config) = BertConfig::from_json_file(dir.path().join(CONFIG_FILE)) {
        let layout = ParamLayout::bert(&config, config.heads());
        if let Ok(values) = load_safetensors(&weights, &layout) {
            assert_eq!(values.len(), layout.total_len());
        }
    }
}
