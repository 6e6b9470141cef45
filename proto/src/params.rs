//! The flat parameter layout: every BERT tensor as a named view into one `[f32]` buffer.
//!
//! Weights, gradients and optimizer moments all share this layout, so the all-reduce, the
//! optimizer and the checkpoint each walk one slice.
//!
//! # Layout
//! Tensors in HF state-dict order with HF names (HF: `BertForMaskedLM.state_dict()`, tied
//! `cls.predictions.decoder.*` left out because they are `bert.embeddings.word_embeddings.weight`
//! and `cls.predictions.bias`):
//! 1. `bert.embeddings.{word,position,token_type}_embeddings.weight`, `bert.embeddings.LayerNorm.{weight,bias}`
//! 2. for each layer `l`: `bert.encoder.layer.{l}.attention.self.{query,key,value}.{weight,bias}`,
//!    `...attention.output.dense.*`, `...attention.output.LayerNorm.*`, `...intermediate.dense.*`,
//!    `...output.dense.*`, `...output.LayerNorm.*`
//! 3. PreTraining only: `bert.pooler.dense.{weight,bias}`
//! 4. `cls.predictions.bias`, `cls.predictions.transform.dense.*`, `cls.predictions.transform.LayerNorm.*`
//! 5. PreTraining only: `cls.seq_relationship.{weight,bias}`
//!
//! Linear weights are `[out, in]` (PyTorch's `nn.Linear`), embeddings `[rows, hidden]`.

use crate::config::BertConfig;
// Which heads sit on the encoder is the model config's (`architectures`); a layout is made
// for one, and `keel_proto::params::Heads` keeps naming it.
pub use crate::config::Heads;

/// One named tensor in the flat buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParamView {
    /// HF state-dict name, e.g. `bert.encoder.layer.0.attention.self.query.weight`.
    pub name: String,
    /// PyTorch shape, e.g. `[out, in]` for a Linear weight.
    pub shape: Vec<usize>,
    /// Start in the flat buffer (elements).
    pub offset: usize,
    /// Number of elements (product of `shape`).
    pub len: usize,
    /// Whether weight decay (and LAMB's trust ratio) applies: false for biases and LayerNorm
    /// parameters, as in BERT's optimizer (Devlin et al. 2019, `optimization.py`) and HF's
    /// `no_decay = ["bias", "LayerNorm.weight"]`.
    pub decay: bool,
}

impl ParamView {
    /// The elements `offset..offset + len` (for slicing weights, grads, moments).
    pub fn range(&self) -> std::ops::Range<usize> {
        self.offset..self.offset + self.len
    }
}

/// The named views of a flat parameter buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParamLayout {
    entries: Vec<ParamView>,
    total_len: usize,
}

impl ParamLayout {
    /// The layout of a BERT with the given heads (see the module docs for the order).
    /// The config is assumed valid ([`BertConfig::validate`]).
    pub fn bert(config: &BertConfig, heads: Heads) -> ParamLayout {
        let c = config.hidden_size;
        let f = config.intermediate_size;
        let mut b = Builder::default();
        b.push(
            "bert.embeddings.word_embeddings.weight",
            &[config.vocab_size, c],
        );
        b.push(
            "bert.embeddings.position_embeddings.weight",
            &[config.max_position_embeddings, c],
        );
        b.push(
            "bert.embeddings.token_type_embeddings.weight",
            &[config.type_vocab_size, c],
        );
        b.layer_norm("bert.embeddings.LayerNorm", c);
        for l in 0..config.num_hidden_layers {
            let p = format!("bert.encoder.layer.{l}");
            b.linear(&format!("{p}.attention.self.query"), c, c);
            b.linear(&format!("{p}.attention.self.key"), c, c);
            b.linear(&format!("{p}.attention.self.value"), c, c);
            b.linear(&format!("{p}.attention.output.dense"), c, c);
            b.layer_norm(&format!("{p}.attention.output.LayerNorm"), c);
            b.linear(&format!("{p}.intermediate.dense"), f, c);
            b.linear(&format!("{p}.output.dense"), c, f);
            b.layer_norm(&format!("{p}.output.LayerNorm"), c);
        }
        if heads == Heads::PreTraining {
            b.linear("bert.pooler.dense", c, c);
        }
        b.push("cls.predictions.bias", &[config.vocab_size]);
        b.linear("cls.predictions.transform.dense", c, c);
        b.layer_norm("cls.predictions.transform.LayerNorm", c);
        if heads == Heads::PreTraining {
            b.linear("cls.seq_relationship", 2, c);
        }
        ParamLayout {
            total_len: b.offset,
            entries: b.entries,
        }
    }

    /// All tensors in layout order.
    pub fn entries(&self) -> &[ParamView] {
        &self.entries
    }

    /// Total number of elements (parameters) in the flat buffer.
    pub fn total_len(&self) -> usize {
        self.total_len
    }

    /// The view with this HF name, if any.
    pub fn find(&self, name: &str) -> Option<&ParamView> {
        self.entries.iter().find(|e| e.name == name)
    }
}

/// Appends views one after the other.
#[derive(Default)]
struct Builder {
    entries: Vec<ParamView>,
    offset: usize,
}

impl Builder {
    fn push(&mut self, name: &str, shape: &[usize]) {
        let len = shape.iter().product();
        let decay = !(name.ends_with(".bias") || name.contains("LayerNorm"));
        self.entries.push(ParamView {
            name: name.to_string(),
            shape: shape.to_vec(),
            offset: self.offset,
            len,
            decay,
        });
        self.offset += len;
    }

    fn linear(&mut self, prefix: &str, out: usize, inp: usize) {
        self.push(&format!("{prefix}.weight"), &[out, inp]);
        self.push(&format!("{prefix}.bias"), &[out]);
    }

    fn layer_norm(&mut self, prefix: &str, c: usize) {
        self.push(&format!("{prefix}.weight"), &[c]);
        self.push(&format!("{prefix}.bias"), &[c]);
    }
}

/// The config fields that give the shape of the tensor named `name` in [`ParamLayout::bert`],
/// for messages ("[vocab_size, hidden_size]"): a shape that does not match names what in the
/// config to look at.
pub fn config_fields(name: &str) -> &'static str {
    let last = |suffix: &str| name.ends_with(suffix);
    if last("word_embeddings.weight") {
        "[vocab_size, hidden_size]"
    } else if last("position_embeddings.weight") {
        "[max_position_embeddings, hidden_size]"
    } else if last("token_type_embeddings.weight") {
        "[type_vocab_size, hidden_size]"
    } else if name == "cls.predictions.bias" {
        "[vocab_size]"
    } else if last("intermediate.dense.weight") {
        "[intermediate_size, hidden_size]"
    } else if last("intermediate.dense.bias") {
        "[intermediate_size]"
    } else if last(".output.dense.weight") && !name.contains("attention") {
        "[hidden_size, intermediate_size]"
    } else if name.starts_with("cls.seq_relationship") {
        if last(".weight") {
            "[2, hidden_size]"
        } else {
            "[2]"
        }
    } else if last(".bias") || name.contains("LayerNorm") {
        "[hidden_size]"
    } else {
        "[hidden_size, hidden_size]"
    }
}

/// What a missing tensor says about the config, for messages: an encoder layer the file does
/// not have means `num_hidden_layers` is larger than the model's.
pub fn missing_hint(name: &str) -> &'static str {
    if name.starts_with("bert.encoder.layer.") {
        " (the model config's num_hidden_layers is larger than the weights')"
    } else {
        ""
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn views_tile_the_buffer_and_decay_flags_follow_names() {
        let config = BertConfig::preset("tiny", 1000).unwrap();
        for heads in [Heads::MaskedLm, Heads::PreTraining] {
            let layout = ParamLayout::bert(&config, heads);
            let mut next = 0;
            for e in layout.entries() {
                assert_eq!(e.offset, next, "{}", e.name);
                assert_eq!(e.len, e.shape.iter().product::<usize>());
                next += e.len;
                let no_decay = e.name.ends_with(".bias") || e.name.contains("LayerNorm");
                assert_eq!(e.decay, !no_decay, "{}", e.name);
            }
            assert_eq!(next, layout.total_len());
            assert_eq!(
                layout.find("bert.pooler.dense.weight").is_some(),
                heads == Heads::PreTraining
            );
        }
        // BERT-tiny with vocab 1000: 2 layers of 4*128*128+4*128 + 2*(128*512)+512+128 + 4*128.
        let layout = ParamLayout::bert(&config, Heads::MaskedLm);
        let per_layer =
            4 * (128 * 128 + 128) + 2 * 128 + (512 * 128 + 512) + (128 * 512 + 128) + 2 * 128;
        let emb = (1000 + 512 + 2) * 128 + 2 * 128;
        let head = 1000 + 128 * 128 + 128 + 2 * 128;
        assert_eq!(layout.total_len(), emb + 2 * per_layer + head);
    }
}
