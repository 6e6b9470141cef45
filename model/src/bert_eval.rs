//! The model's eval forwards (`impl Bert` continued): the losses of a batch without gradients,
//! the MLM logits of one sequence (`keel fill-mask`), and everything HF returns (parity tests).
//! Each weight is read by one GEMM here, so no bf16 copy of the parameters is made up front:
//! each GEMM rounds its weight itself (the same bits).

use ndarray::Array2;

use super::super::bf16_shared::Flat;
use super::super::loss::cross_entropy;
use super::{Bert, ForwardOutputs, Tokens};
use crate::batch::Batch;
use crate::{Element, LossSums, ModelError};

impl<A: Element> Bert<A> {
    /// Eval-mode losses (no dropout, no gradients).
    ///
    /// Errors: as [`Bert::forward_backward`].
    pub fn forward_loss(&mut self, params: &[A], batch: &Batch) -> Result<LossSums<A>, ModelError> {
        self.check_buffer("params", params.len())?;
        self.check_batch(batch, false)?;
        let tok = self.tokens(batch)?;
        // Each weight is read once here: its GEMM rounds it (no copy made up front).
        let params = Flat::plain(params);
        let g = self.gemms;
        self.encode(
            params,
            &tok,
            None,
            &batch.masked_positions,
            self.unpad,
            false,
        );
        let (b, v) = (tok.b, self.config.vocab_size);
        let last = self.layers.len();
        let st = &mut self.state;
        let mut sums = LossSums::default();
        let m = batch.masked_positions.len();
        if m > 0 {
            self.mlm.forward(
                g,
                &mut st.mlm,
                &st.hidden[last],
                st.packing.positions(),
                params,
            );
            let ce = cross_entropy(&mut st.mlm.logits[..m * v], &batch.masked_labels, v, None);
            sums.mlm_loss_sum = ce.loss_sum;
            sums.mlm_count = m;
            sums.mlm_correct = ce.correct;
        }
        if let (Some(nsp), Some(labels)) = (&self.nsp, &batch.next_sentence_labels) {
            nsp.forward(
                g,
                &mut st.nsp,
                &st.hidden[last],
                st.packing.firsts(),
                params,
            );
            let ce = cross_entropy(&mut st.nsp.logits[..b * 2], labels, 2, None);
            sums.nsp_loss_sum = ce.loss_sum;
            sums.nsp_count = b;
            sums.nsp_correct = ce.correct;
        }
        Ok(sums)
    }

    /// MLM logits `[positions.len(), v]` of one unpadded sequence at the given token
    /// positions (for `keel fill-mask`). `input_ids`, `token_type_ids`: `[t]`.
    ///
    /// Errors: [`ModelError::BufferLength`], [`ModelError::ShapeMismatch`],
    /// [`ModelError::OutOfRange`], [`ModelError::SequenceTooLong`].
    pub fn mlm_logits(
        &mut self,
        params: &[A],
        input_ids: &[u32],
        token_type_ids: &[u32],
        positions: &[usize],
    ) -> Result<Array2<A>, ModelError> {
        self.check_buffer("params", params.len())?;
        let params = Flat::plain(params);
        let t = input_ids.len();
        let mask = vec![1u8; t];
        self.check_tokens(input_ids, token_type_ids, &mask, 1, t)?;
        for (index, &p) in positions.iter().enumerate() {
            if p >= t {
                return Err(ModelError::OutOfRange {
                    field: "positions",
                    index,
                    value: p,
                    limit: t,
                });
            }
        }
        let tok = Tokens {
            ids: input_ids,
            types: token_type_ids,
            mask: &mask,
            b: 1,
            t,
        };
        self.encode(params, &tok, None, positions, None, false);
        Ok(self.head_logits(params, positions))
    }

    /// MLM logits `[m, v]` at `positions` of the last `encode`d batch (positions checked).
    fn head_logits(&mut self, params: Flat<'_, A>, positions: &[usize]) -> Array2<A> {
        let (m, v) = (positions.len(), self.config.vocab_size);
        if m == 0 {
            return Array2::zeros((0, v));
        }
        let st = &mut self.state;
        self.mlm.forward(
            self.gemms,
            &mut st.mlm,
            &st.hidden[self.layers.len()],
            positions,
            params,
        );
        Array2::from_shape_vec((m, v), st.mlm.logits[..m * v].to_vec()).expect("m * v logits")
    }

    /// Eval forward keeping everything HF returns (hidden states of every layer, MLM logits at
    /// every position, NSP logits), for parity tests.
    ///
    /// Errors: as [`Bert::forward_loss`].
    pub fn forward_outputs(
        &mut self,
        params: &[A],
        batch: &Batch,
    ) -> Result<ForwardOutputs<A>, ModelError> {
        self.check_buffer("params", params.len())?;
        let params = Flat::plain(params);
        let tok = self.tokens(batch)?;
        // Every row, padding too: HF returns them all.
        self.encode(params, &tok, None, &[], None, true);
        let (b, t, c) = (tok.b, tok.t, self.config.hidden_size);
        let n = b * t;
        let hidden_states = self.state.hidden[..=self.layers.len()]
            .iter()
            .map(|h| Array2::from_shape_vec((n, c), h[..n * c].to_vec()).expect("n * c hidden"))
            .collect();
        let all: Vec<usize> = (0..n).collect();
        let last = self.layers.len();
        let logits = self.head_logits(params, &all);
        let seq_relationship_logits = match &self.nsp {
            Some(nsp) => {
                let st = &mut self.state;
                let g = self.gemms;
                nsp.forward(
                    g,
                    &mut st.nsp,
                    &st.hidden[last],
                    st.packing.firsts(),
                    params,
                );
                Some(
                    Array2::from_shape_vec((b, 2), self.state.nsp.logits[..b * 2].to_vec())
                        .expect("b * 2 logits"),
                )
            }
            None => None,
        };
        Ok(ForwardOutputs {
            hidden_states,
            logits,
            seq_relationship_logits,
        })
    }
}
