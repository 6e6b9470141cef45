//! The BERT model config: Hugging Face's `config.json` (HF: `BertConfig`), its presets and checks.
//!
//! # Layout
//! - [`BertConfig`]: the serde image of `config.json`; unknown extra keys are tolerated, as HF does.
//! - [`BertConfig::preset`]: the model sizes of Turc et al. 2019 ("Well-Read Students Learn
//!   Better", table of compact BERTs) plus BERT base and large (Devlin et al. 2019, section 3).
//! - [`BertConfig::validate`]: the checks that make a config safe to build a model from.
//! - [`Heads`]: which heads sit on the encoder, as `architectures` names them.

use std::path::Path;

use serde::{Deserialize, Serialize};

/// Which heads sit on the encoder.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Heads {
    /// Masked-LM head only (HF: `BertForMaskedLM`; no pooler).
    MaskedLm,
    /// Masked-LM head plus pooler and next-sentence head (HF: `BertForPreTraining`).
    PreTraining,
}

impl Heads {
    /// The HF class name, as written in `config.json`'s `architectures`.
    pub fn architecture(self) -> &'static str {
        match self {
            Heads::MaskedLm => "BertForMaskedLM",
            Heads::PreTraining => "BertForPreTraining",
        }
    }
}

/// Errors of reading or checking a model config.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// A field holds a value the model cannot be built with.
    #[error("config field `{field}`: {reason}")]
    InvalidField {
        /// The config.json key.
        field: &'static str,
        /// What was wrong and what was expected.
        reason: String,
    },
    /// An unknown preset name.
    #[error(
        "unknown model preset `{name}` (expected one of tiny, mini, small, medium, base, large)"
    )]
    UnknownPreset {
        /// The name asked for.
        name: String,
    },
    /// The file could not be read.
    #[error("reading config {path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The cause.
        source: std::io::Error,
    },
    /// The file could not be read within Keel's bounds (not a regular file, too large).
    #[error("{0}")]
    Limit(Box<crate::limits::LimitError>),
    /// The file is not a valid BERT config.json.
    #[error("parsing config {path}: {source}")]
    Parse {
        /// The file.
        path: String,
        /// The cause (names the line and column).
        source: serde_json::Error,
    },
}

/// Caps on the sizes of a config, far above every published BERT (large: hidden 1024,
/// 24 layers, 16 heads, intermediate 4096, 512 positions; multilingual vocabularies of 250k)
/// and low enough that no product of them overflows 64 bits. Whether a model within the caps
/// fits a worker is [`crate::memory::estimate`]'s question.
pub const MAX_HIDDEN_SIZE: usize = 16_384;
/// Cap on `num_hidden_layers` (see [`MAX_HIDDEN_SIZE`]).
pub const MAX_LAYERS: usize = 256;
/// Cap on `num_attention_heads`.
pub const MAX_HEADS: usize = 256;
/// Cap on `intermediate_size` (4 x [`MAX_HIDDEN_SIZE`]).
pub const MAX_INTERMEDIATE_SIZE: usize = 65_536;
/// Cap on `vocab_size` (2^20 tokens).
pub const MAX_VOCAB_SIZE: usize = 1 << 20;
/// Cap on `max_position_embeddings` (attention is quadratic in the sequence length).
pub const MAX_POSITIONS: usize = 32_768;
/// Cap on `type_vocab_size` (BERT uses 2).
pub const MAX_TYPE_VOCAB_SIZE: usize = 1_024;

/// The activation of the feed-forward block and of the MLM head transform (`hidden_act`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum HiddenAct {
    /// Exact GELU, `x * Phi(x)` with the erf (Hendrycks & Gimpel 2016, section 2). HF: `gelu`.
    Gelu,
    /// The tanh approximation of GELU (Hendrycks & Gimpel 2016, section 2). HF: `gelu_new`.
    GeluNew,
    /// `max(0, x)`.
    Relu,
}

fn default_model_type() -> String {
    "bert".to_string()
}
fn default_true() -> bool {
    true
}
fn default_dtype() -> Option<String> {
    Some("float32".to_string())
}

/// A BERT config, field for field HF's `config.json` (HF: `transformers.BertConfig`).
///
/// Sizes are counts (tokens, channels); probabilities are in `[0, 1)`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BertConfig {
    /// HF class names the weights are for, e.g. `["BertForMaskedLM"]`.
    #[serde(default)]
    pub architectures: Option<Vec<String>>,
    /// Always `"bert"`.
    #[serde(default = "default_model_type")]
    pub model_type: String,
    /// WordPiece vocabulary size (rows of the word embeddings).
    pub vocab_size: usize,
    /// Hidden size `c`.
    pub hidden_size: usize,
    /// Number of encoder layers `L`.
    pub num_hidden_layers: usize,
    /// Attention heads `h` per layer; `hidden_size / h` is the head size `d`.
    pub num_attention_heads: usize,
    /// Feed-forward inner size (4 x hidden in BERT).
    pub intermediate_size: usize,
    /// Feed-forward and MLM-transform activation.
    pub hidden_act: HiddenAct,
    /// Dropout after the embeddings and after each attention output and feed-forward output.
    pub hidden_dropout_prob: f64,
    /// Dropout on the attention probabilities.
    pub attention_probs_dropout_prob: f64,
    /// Rows of the position embeddings: the longest sequence (tokens) the model takes.
    pub max_position_embeddings: usize,
    /// Rows of the token-type (segment) embeddings.
    pub type_vocab_size: usize,
    /// Standard deviation of the normal initialisation of weights.
    pub initializer_range: f64,
    /// Epsilon added to the variance in every LayerNorm.
    pub layer_norm_eps: f64,
    /// Id of `[PAD]`; its word-embedding row is initialised to zero.
    #[serde(default)]
    pub pad_token_id: u32,
    /// Only `"absolute"` (or absent, as transformers 5 writes it) is supported.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub position_embedding_type: Option<String>,
    /// The decoder of the MLM head is the word embeddings (always true for Keel).
    #[serde(default = "default_true")]
    pub tie_word_embeddings: bool,
    /// HF writes it; BERT is an encoder, so false.
    #[serde(default)]
    pub is_decoder: bool,
    /// HF writes it; false.
    #[serde(default)]
    pub add_cross_attention: bool,
    /// HF writes it; Keel never uses a cache.
    #[serde(default = "default_true")]
    pub use_cache: bool,
    /// HF writes it; null (the classifier uses `hidden_dropout_prob`).
    #[serde(default)]
    pub classifier_dropout: Option<f64>,
    /// HF writes it; null for BERT.
    #[serde(default)]
    pub bos_token_id: Option<u32>,
    /// HF writes it; null for BERT.
    #[serde(default)]
    pub eos_token_id: Option<u32>,
    /// Storage dtype of the weights; Keel writes `"float32"`.
    #[serde(default = "default_dtype")]
    pub dtype: Option<String>,
    /// The `transformers` version the file claims to be written by.
    #[serde(default)]
    pub transformers_version: Option<String>,
}

impl BertConfig {
    /// A preset size with the given vocabulary (tokens): `tiny` (L2 H128 A2), `mini` (L4 H256 A4),
    /// `small` (L4 H512 A8), `medium` (L8 H512 A8) from Turc et al. 2019, `base` (L12 H768 A12)
    /// and `large` (L24 H1024 A16) from Devlin et al. 2019; intermediate = 4 x hidden, max 512
    /// positions, dropout 0.1, exact GELU, `layer_norm_eps` 1e-12.
    ///
    /// Errors: [`ConfigError::UnknownPreset`]; [`ConfigError::InvalidField`] for a zero vocab.
    pub fn preset(name: &str, vocab_size: usize) -> Result<BertConfig, ConfigError> {
        let (layers, hidden, heads) = match name {
            "tiny" => (2, 128, 2),
            "mini" => (4, 256, 4),
            "small" => (4, 512, 8),
            "medium" => (8, 512, 8),
            "base" => (12, 768, 12),
            "large" => (24, 1024, 16),
            _ => {
                return Err(ConfigError::UnknownPreset {
                    name: name.to_string(),
                });
            }
        };
        let config = BertConfig {
            architectures: Some(vec![Heads::MaskedLm.architecture().to_string()]),
            model_type: default_model_type(),
            vocab_size,
            hidden_size: hidden,
            num_hidden_layers: layers,
            num_attention_heads: heads,
            intermediate_size: 4 * hidden,
            hidden_act: HiddenAct::Gelu,
            hidden_dropout_prob: 0.1,
            attention_probs_dropout_prob: 0.1,
            max_position_embeddings: 512,
            type_vocab_size: 2,
            initializer_range: 0.02,
            layer_norm_eps: 1e-12,
            pad_token_id: 0,
            position_embedding_type: None,
            tie_word_embeddings: true,
            is_decoder: false,
            add_cross_attention: false,
            use_cache: true,
            classifier_dropout: None,
            bos_token_id: None,
            eos_token_id: None,
            dtype: default_dtype(),
            transformers_version: None,
        };
        config.validate()?;
        Ok(config)
    }

    /// Head size `d = hidden_size / num_attention_heads` (channels).
    pub fn head_size(&self) -> usize {
        self.hidden_size / self.num_attention_heads.max(1)
    }

    /// Checks that a model can be built from this config.
    ///
    /// Errors: [`ConfigError::InvalidField`] naming the first offending field: a zero size,
    /// a size over its cap ([`MAX_HIDDEN_SIZE`] and the others below it),
    /// `hidden_size` not divisible by `num_attention_heads`, a probability outside `[0, 1)`,
    /// a negative or non-finite `initializer_range` / `layer_norm_eps`, `pad_token_id` outside
    /// the vocabulary, a non-absolute position embedding, a decoder config, untied embeddings.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let invalid =
            |field: &'static str, reason: String| Err(ConfigError::InvalidField { field, reason });
        for (field, value) in [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("intermediate_size", self.intermediate_size),
            ("max_position_embeddings", self.max_position_embeddings),
            ("type_vocab_size", self.type_vocab_size),
        ] {
            if value == 0 {
                return invalid(field, "must be positive".to_string());
            }
        }
        for (field, value, cap) in [
            ("vocab_size", self.vocab_size, MAX_VOCAB_SIZE),
            ("hidden_size", self.hidden_size, MAX_HIDDEN_SIZE),
            ("num_hidden_layers", self.num_hidden_layers, MAX_LAYERS),
            ("num_attention_heads", self.num_attention_heads, MAX_HEADS),
            (
                "intermediate_size",
                self.intermediate_size,
                MAX_INTERMEDIATE_SIZE,
            ),
            (
                "max_position_embeddings",
                self.max_position_embeddings,
                MAX_POSITIONS,
            ),
            ("type_vocab_size", self.type_vocab_size, MAX_TYPE_VOCAB_SIZE),
        ] {
            if value > cap {
                return invalid(field, format!("{value} is more than Keel's cap of {cap}"));
            }
        }
        if !self.hidden_size.is_multiple_of(self.num_attention_heads) {
            return invalid(
                "hidden_size",
                format!(
                    "{} is not divisible by num_attention_heads {}",
                    self.hidden_size, self.num_attention_heads
                ),
            );
        }
        for (field, p) in [
            ("hidden_dropout_prob", self.hidden_dropout_prob),
            (
                "attention_probs_dropout_prob",
                self.attention_probs_dropout_prob,
            ),
        ] {
            if !(0.0..1.0).contains(&p) {
                return invalid(field, format!("{p} is not a probability in [0, 1)"));
            }
        }
        if !(self.initializer_range.is_finite() && self.initializer_range >= 0.0) {
            return invalid(
                "initializer_range",
                format!("{} must be finite and >= 0", self.initializer_range),
            );
        }
        if !(self.layer_norm_eps.is_finite() && self.layer_norm_eps > 0.0) {
            return invalid(
                "layer_norm_eps",
                format!("{} must be finite and > 0", self.layer_norm_eps),
            );
        }
        if self.pad_token_id as usize >= self.vocab_size {
            return invalid(
                "pad_token_id",
                format!(
                    "{} is outside the vocabulary of {}",
                    self.pad_token_id, self.vocab_size
                ),
            );
        }
        if self.model_type != "bert" {
            return invalid(
                "model_type",
                format!("`{}` is not \"bert\"", self.model_type),
            );
        }
        if let Some(kind) = self.position_embedding_type.as_deref()
            && kind != "absolute"
        {
            return invalid(
                "position_embedding_type",
                format!("`{kind}` is not supported (only \"absolute\")"),
            );
        }
        if self.is_decoder || self.add_cross_attention {
            return invalid("is_decoder", "Keel trains BERT encoders only".to_string());
        }
        if !self.tie_word_embeddings {
            return invalid(
                "tie_word_embeddings",
                "the MLM decoder must be tied to the word embeddings".to_string(),
            );
        }
        Ok(())
    }

    /// Reads and validates a `config.json`.
    ///
    /// Only a regular file of at most [`crate::limits::MAX_CONFIG_BYTES`] is read.
    ///
    /// Errors: [`ConfigError::Limit`] (unreadable, not a regular file, too large),
    /// [`ConfigError::Parse`] (with line and column), or the
    /// [`ConfigError::InvalidField`] of [`BertConfig::validate`].
    pub fn from_json_file(path: impl AsRef<Path>) -> Result<BertConfig, ConfigError> {
        let path = path.as_ref();
        let text = crate::limits::read_bounded_to_string(
            path,
            crate::limits::MAX_CONFIG_BYTES,
            "a model config",
        )
        .map_err(|e| ConfigError::Limit(Box::new(e)))?;
        let config: BertConfig =
            serde_json::from_str(&text).map_err(|source| ConfigError::Parse {
                path: path.display().to_string(),
                source,
            })?;
        config.validate()?;
        Ok(config)
    }

    /// This config with `architectures` set for the given heads (`BertForMaskedLM` or
    /// `BertForPreTraining`).
    pub fn with_heads(&self, heads: Heads) -> BertConfig {
        BertConfig {
            architectures: Some(vec![heads.architecture().to_string()]),
            ..self.clone()
        }
    }

    /// The heads named by `architectures` (`BertForPreTraining` -> PreTraining; otherwise,
    /// including absent, MaskedLm).
    pub fn heads(&self) -> Heads {
        match &self.architectures {
            Some(archs) if archs.iter().any(|a| a == Heads::PreTraining.architecture()) => {
                Heads::PreTraining
            }
            _ => Heads::MaskedLm,
        }
    }

    /// The `config.json` text a checkpoint carries: keys sorted, 2-space indent, trailing
    /// newline, as `save_pretrained` writes it.
    pub fn to_json_pretty(&self) -> String {
        // serde_json's Map is a BTreeMap: going through Value sorts the keys like HF.
        let value = match serde_json::to_value(self) {
            Ok(v) => v,
            // Serialising a plain struct of numbers and strings cannot fail.
            Err(_) => serde_json::Value::Null,
        };
        let mut text = serde_json::to_string_pretty(&value).unwrap_or_default();
        text.push('\n');
        text
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_are_valid_and_sized() {
        for (name, l, h, a) in [
            ("tiny", 2, 128, 2),
            ("mini", 4, 256, 4),
            ("small", 4, 512, 8),
            ("medium", 8, 512, 8),
            ("base", 12, 768, 12),
            ("large", 24, 1024, 16),
        ] {
            let c = BertConfig::preset(name, 30522).unwrap();
            assert_eq!(
                (c.num_hidden_layers, c.hidden_size, c.num_attention_heads),
                (l, h, a)
            );
            assert_eq!(c.intermediate_size, 4 * h);
        }
        assert!(matches!(
            BertConfig::preset("huge", 10),
            Err(ConfigError::UnknownPreset { .. })
        ));
    }

    #[test]
    fn validate_names_the_field() {
        let mut c = BertConfig::preset("tiny", 100).unwrap();
        c.num_attention_heads = 3;
        match c.validate() {
            Err(ConfigError::InvalidField { field, .. }) => assert_eq!(field, "hidden_size"),
            other => panic!("{other:?}"),
        }
        let mut c = BertConfig::preset("tiny", 100).unwrap();
        c.hidden_dropout_prob = 1.0;
        match c.validate() {
            Err(ConfigError::InvalidField { field, .. }) => {
                assert_eq!(field, "hidden_dropout_prob")
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn sizes_over_their_caps_name_the_field() {
        for (field, set) in [
            (
                "hidden_size",
                (|c: &mut BertConfig| c.hidden_size = 1 << 20) as fn(&mut BertConfig),
            ),
            ("num_hidden_layers", |c| c.num_hidden_layers = 1 << 40),
            ("num_attention_heads", |c| c.num_attention_heads = 1 << 62),
            ("vocab_size", |c| c.vocab_size = 1 << 30),
            ("max_position_embeddings", |c| {
                c.max_position_embeddings = 1 << 20
            }),
            ("intermediate_size", |c| c.intermediate_size = usize::MAX),
        ] {
            let mut c = BertConfig::preset("tiny", 100).unwrap();
            set(&mut c);
            match c.validate() {
                Err(ConfigError::InvalidField { field: got, reason }) => {
                    assert_eq!(got, field);
                    assert!(reason.contains("cap"), "{reason}");
                }
                other => panic!("{field}: {other:?}"),
            }
        }
    }

    #[test]
    fn unknown_activation_is_an_error_and_extra_keys_are_tolerated() {
        let c = BertConfig::preset("tiny", 100).unwrap();
        let mut v = serde_json::to_value(&c).unwrap();
        v["some_future_key"] = serde_json::json!(3);
        let back: BertConfig = serde_json::from_value(v.clone()).unwrap();
        assert_eq!(back, c);
        v["hidden_act"] = serde_json::json!("silu");
        assert!(serde_json::from_value::<BertConfig>(v).is_err());
    }

    #[test]
    fn json_round_trip_with_sorted_keys() {
        let c = BertConfig::preset("mini", 30522)
            .unwrap()
            .with_heads(Heads::PreTraining);
        let text = c.to_json_pretty();
        let back: BertConfig = serde_json::from_str(&text).unwrap();
        assert_eq!(back, c);
        assert_eq!(back.heads(), Heads::PreTraining);
        let a = text.find("\"add_cross_attention\"").unwrap();
        let v = text.find("\"vocab_size\"").unwrap();
        assert!(a < v);
    }
}
