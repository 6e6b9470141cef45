//! The word embeddings' gradient, kept in two parts so that most of it can be all-reduced early.
//!
//! The word-embedding matrix `[v, c]` is tied to the MLM decoder, so its gradient is the sum of
//! the decoder's share (dense, every row, final right after the MLM head's backward, the first
//! thing backward does) and the lookup's share (only the rows of tokens in the batch, final at
//! the very end of backward). With one buffer, the whole `[v, c]` gradient can only be
//! all-reduced once backward is over, and the step waits for it. Kept apart, the dense decoder
//! share goes to the ring while the encoder's backward runs, and only the lookup share of the
//! rows some rank used, `[u, c]` with `u` the union of the ranks' token ids, waits for the end.
//!
//! The rows are the same on every rank: they come from an all-reduced presence vector `[v]`.

use super::{Element, ModelError};

/// Lookup-gradient rows of one step: which token ids, and their gradients `[u, c]`.
#[derive(Debug, Clone, Default)]
pub struct LookupGrads<A> {
    /// Token ids with a row here, ascending.
    ids: Vec<u32>,
    /// `index[id]` = row of `id` in `grads`, or [`NO_ROW`].
    index: Vec<u32>,
    /// `[ids.len(), hidden]` gradient rows.
    grads: Vec<A>,
    /// Hidden size `c`.
    hidden: usize,
}

/// Marks a token id without a row.
const NO_ROW: u32 = u32::MAX;

impl<A: Element> LookupGrads<A> {
    /// Rows for every token id whose entry of `presence` (`[v]`, e.g. a sum over ranks of 0/1
    /// flags) is positive, all zero.
    pub fn from_presence(presence: &[f32], hidden: usize) -> Self {
        let ids: Vec<u32> = (0u32..)
            .zip(presence)
            .filter(|&(_, &p)| p > 0.0)
            .map(|(id, _)| id)
            .collect();
        let mut index = vec![NO_ROW; presence.len()];
        for (row, &id) in (0u32..).zip(&ids) {
            index[id as usize] = row;
        }
        LookupGrads {
            grads: vec![A::zero(); ids.len() * hidden],
            ids,
            index,
            hidden,
        }
    }

    /// The token ids with a row, ascending (`[u]`).
    pub fn ids(&self) -> &[u32] {
        &self.ids
    }

    /// The gradient rows, `[u, hidden]`, in the order of [`LookupGrads::ids`].
    pub fn grads(&self) -> &[A] {
        &self.grads
    }

    /// Takes the gradient rows `[u, hidden]` out (e.g. to sum them over ranks), leaving none.
    pub fn take_grads(&mut self) -> Vec<A> {
        std::mem::take(&mut self.grads)
    }

    /// Puts gradient rows `[u, hidden]` back (e.g. their sum over ranks).
    ///
    /// Errors: [`ModelError::BufferLength`] if `rows` is not `[u, hidden]`.
    pub fn set_grads(&mut self, rows: Vec<A>) -> Result<(), ModelError> {
        let expected = self.ids.len() * self.hidden;
        if rows.len() != expected {
            return Err(ModelError::BufferLength {
                buffer: "lookup grads",
                expected,
                got: rows.len(),
            });
        }
        self.grads = rows;
        Ok(())
    }

    /// Adds row `i` into `word_grads[ids[i]]`, for every row: `word_grads` is the flat
    /// `[v, hidden]` word-embedding gradient.
    ///
    /// Errors: [`ModelError::BufferLength`] if `word_grads` is not `[v, hidden]`, or if the
    /// rows were taken out and not put back.
    pub fn add_into(&self, word_grads: &mut [A]) -> Result<(), ModelError> {
        let expected = self.index.len() * self.hidden;
        if self.grads.len() != self.ids.len() * self.hidden {
            return Err(ModelError::BufferLength {
                buffer: "lookup grads",
                expected: self.ids.len() * self.hidden,
                got: self.grads.len(),
            });
        }
        if word_grads.len() != expected {
            return Err(ModelError::BufferLength {
                buffer: "word-embedding grads",
                expected,
                got: word_grads.len(),
            });
        }
        let c = self.hidden;
        for (&id, row) in self.ids.iter().zip(self.grads.chunks_exact(c)) {
            let dst = &mut word_grads[id as usize * c..(id as usize + 1) * c];
            for (g, &x) in dst.iter_mut().zip(row) {
                *g += x;
            }
        }
        Ok(())
    }

    /// Checks that every id of `input_ids` has a row and that the rows are `hidden` wide.
    ///
    /// Errors: [`ModelError::LookupRowMissing`] naming the first id without a row (or beyond
    /// the presence vector), [`ModelError::BufferLength`] for another hidden size.
    pub(crate) fn check(&self, input_ids: &[u32], hidden: usize) -> Result<(), ModelError> {
        if hidden != self.hidden {
            return Err(ModelError::BufferLength {
                buffer: "lookup grads",
                expected: self.ids.len() * hidden,
                got: self.grads.len(),
            });
        }
        match input_ids
            .iter()
            .find(|&&id| self.index.get(id as usize).is_none_or(|&r| r == NO_ROW))
        {
            Some(&token_id) => Err(ModelError::LookupRowMissing { token_id }),
            None => Ok(()),
        }
    }

    /// The `hidden`-wide gradient row of `id` (checked by [`LookupGrads::check`]).
    pub(crate) fn row_mut(&mut self, id: u32) -> &mut [A] {
        let row = self.index[id as usize] as usize;
        &mut self.grads[row * self.hidden..(row + 1) * self.hidden]
    }
}

#[cfg(test)]
mod tests {
    use super::LookupGrads;

    #[test]
    fn rows_follow_the_presence_vector_and_add_back_in_place() {
        let mut l = LookupGrads::<f64>::from_presence(&[0.0, 2.0, 0.0, 1.0, 0.0], 2);
        assert_eq!(l.ids(), &[1, 3]);
        assert!(l.check(&[1, 3, 3], 2).is_ok());
        let missing = l.check(&[1, 2], 2).unwrap_err().to_string();
        assert!(missing.contains("token id 2"), "{missing}");
        assert!(l.check(&[9], 2).is_err());
        l.row_mut(3).copy_from_slice(&[5.0, 6.0]);
        l.row_mut(1)[0] = 1.5;
        let rows = l.take_grads();
        assert_eq!(rows, vec![1.5, 0.0, 5.0, 6.0]);
        assert!(l.add_into(&mut [0.0; 10]).is_err(), "rows taken out");
        assert!(l.set_grads(vec![0.0; 3]).is_err());
        l.set_grads(rows).unwrap();
        let mut word = vec![1.0; 10];
        l.add_into(&mut word).unwrap();
        assert_eq!(word, vec![1.0, 1.0, 2.5, 1.0, 1.0, 1.0, 6.0, 7.0, 1.0, 1.0]);
        assert!(l.add_into(&mut [0.0; 8]).is_err());
    }
}
