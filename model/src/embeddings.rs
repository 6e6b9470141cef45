//! The input embeddings (Devlin et al. 2019, section 3.2, figure 2; HF: `BertEmbeddings`):
//! `x = dropout(LN(word[id] + position[col] + token_type[tt]))`.
//!
//! Shapes: `input_ids`, `token_type_ids` `[b, t]`; `word` `[v, c]`, `position` `[max_pos, c]`,
//! `token_type` `[types, c]`; output `[n, c]`, one row per row of the batch's
//! [`Packing`] (`n = b * t`, or only the real tokens when padding is left out).

use super::pass_profile::{Pass, bytes, region};
use keel_proto::config::BertConfig;
use keel_proto::params::EmbeddingParams;

use super::Element;
use super::dropout::{self, DropoutKey, Site};
use super::layernorm::LayerNorm;
use super::lookup_grads::LookupGrads;
use super::packing::Packing;

/// Offsets of the embedding tables and their LayerNorm.
#[derive(Debug, Clone)]
pub(crate) struct Embeddings {
    word: usize,
    position: usize,
    token_type: usize,
    ln: LayerNorm,
    c: usize,
    /// `hidden_dropout_prob`.
    p: f64,
}

/// What the backward needs: the LayerNorm's normalised input and inverse std.
#[derive(Debug, Default)]
pub(crate) struct EmbeddingsCache<A> {
    /// `[n, c]`.
    pub xhat: Vec<A>,
    /// `[n]`.
    pub rstd: Vec<A>,
}

/// Fewest rows of the lookup worth a thread of their own.
const MIN_ROWS: usize = 256;

/// The token inputs of one batch.
pub(crate) struct TokenInputs<'a> {
    /// `[b, t]`.
    pub input_ids: &'a [u32],
    /// `[b, t]`.
    pub token_type_ids: &'a [u32],
    /// Sequences `b`.
    pub b: usize,
    /// Tokens per sequence `t`.
    pub t: usize,
    /// Training-mode dropout: key and sample ids `[b]`.
    pub dropout: Option<(DropoutKey, &'a [u64])>,
    /// The rows computed (`[n]` indices into the `[b, t]` batch).
    pub packing: &'a Packing,
}

impl Embeddings {
    /// The embeddings of a model for `config`, over their tensors `params`.
    pub fn new(config: &BertConfig, params: &EmbeddingParams) -> Embeddings {
        Embeddings {
            word: params.word.offset,
            position: params.position.offset,
            token_type: params.token_type.offset,
            ln: LayerNorm::new(&params.layer_norm, config.layer_norm_eps),
            c: config.hidden_size,
            p: config.hidden_dropout_prob,
        }
    }

    /// Writes `out` `[n, c]`; `sum` is `[n, c]` scratch.
    pub fn forward<A: Element>(
        &self,
        out: &mut [A],
        cache: &mut EmbeddingsCache<A>,
        sum: &mut [A],
        inputs: &TokenInputs<'_>,
        params: &[A],
    ) {
        let (c, n) = (self.c, inputs.packing.rows());
        let lookups = region(Pass::Embeddings, bytes::<A>(3 * n * c), bytes::<A>(n * c));
        // Rows are independent: cut among the model's threads.
        let index = inputs.packing.padded_index();
        super::parallel::zip_units(&mut sum[..n * c], c, index, 1, n, MIN_ROWS, |dst, index| {
            for (dst, &at) in dst.chunks_exact_mut(c).zip(index) {
                let col = at % inputs.t;
                let w = self.word + inputs.input_ids[at] as usize * c;
                let p = self.position + col * c;
                let tt = self.token_type + inputs.token_type_ids[at] as usize * c;
                for (i, o) in dst.iter_mut().enumerate() {
                    *o = params[w + i] + params[p + i] + params[tt + i];
                }
            }
        });
        drop(lookups);
        let xhat = super::element::grow(&mut cache.xhat, n * c);
        let rstd = super::element::grow(&mut cache.rstd, n);
        self.ln.forward(
            &mut out[..n * c],
            xhat,
            rstd,
            &sum[..n * c],
            None,
            params,
            n,
        );
        self.dropout(out, inputs);
    }

    fn dropout<A: Element>(&self, x: &mut [A], inputs: &TokenInputs<'_>) {
        if let Some((key, ids)) = inputs.dropout {
            dropout::apply_sequences(
                x,
                self.c,
                inputs.packing,
                key,
                &ids[..inputs.b],
                0,
                Site::Embeddings,
                self.p,
            );
        }
    }

    /// Given `dout` `[n, c]` (overwritten): accumulates the table and LayerNorm gradients.
    /// `dsum` is `[n, c]` scratch. With `lookup`, the word-embedding rows go there (`[u, c]`)
    /// instead of into `grads`.
    #[allow(clippy::too_many_arguments)]
    pub fn backward<A: Element>(
        &self,
        dout: &mut [A],
        dsum: &mut [A],
        cache: &EmbeddingsCache<A>,
        inputs: &TokenInputs<'_>,
        params: &[A],
        grads: &mut [A],
        mut lookup: Option<&mut LookupGrads<A>>,
    ) {
        let (c, n) = (self.c, inputs.packing.rows());
        self.dropout(dout, inputs);
        self.ln.backward(
            &mut dsum[..n * c],
            &dout[..n * c],
            &cache.xhat,
            &cache.rstd,
            params,
            grads,
            n,
        );
        let _scatter = region(
            Pass::Embeddings,
            bytes::<A>(4 * n * c),
            bytes::<A>(3 * n * c),
        );
        for (r, &at) in inputs.packing.padded_index().iter().enumerate() {
            let col = at % inputs.t;
            let d = &dsum[r * c..(r + 1) * c];
            let id = inputs.input_ids[at];
            let word_row = match lookup.as_deref_mut() {
                Some(lookup) => lookup.row_mut(id),
                None => {
                    let w = self.word + id as usize * c;
                    &mut grads[w..w + c]
                }
            };
            for (g, &v) in word_row.iter_mut().zip(d) {
                *g += v;
            }
            for table in [
                self.position + col * c,
                self.token_type + inputs.token_type_ids[at] as usize * c,
            ] {
                for (g, &v) in grads[table..table + c].iter_mut().zip(d) {
                    *g += v;
                }
            }
        }
    }
}
