//! Training data and which sequence each micro-batch of each rank reads: every backend feeds
//! the same tokens to the same (step, data shard, micro-batch), so runs on different
//! backends and the sequential reference see the same batches.

/// Training data: a token stream cut into sequences.
#[derive(Clone, Debug)]
pub struct Data {
    tokens: Vec<u32>,
}

impl Data {
    /// Byte-level tokens of `bytes` (vocabulary 256).
    pub fn from_bytes(bytes: &[u8]) -> Self {
        Data {
            tokens: bytes.iter().map(|b| *b as u32).collect(),
        }
    }

    /// Reads a file as bytes. Errors: the file cannot be read.
    pub fn from_file(path: &std::path::Path) -> Result<Self, String> {
        std::fs::read(path)
            .map(|b| Data::from_bytes(&b))
            .map_err(|e| format!("cannot read {}: {e}", path.display()))
    }

    /// A built-in text (a few sentences), for runs without `--data`.
    pub fn builtin() -> Self {
        Data::from_bytes(BUILTIN.as_bytes())
    }

    /// Number of tokens.
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    /// True if there are no tokens.
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// The largest token id plus one.
    pub fn vocab_needed(&self) -> usize {
        self.tokens.iter().max().map_or(0, |m| *m as usize + 1)
    }

    /// Sequence number `index` (a global counter over steps, shards and micro-batches):
    /// `(inputs, targets)` of `seq_len` tokens each, targets shifted by one. Consecutive
    /// indices take consecutive windows, wrapping around. Errors: fewer than `seq_len + 1`
    /// tokens.
    pub fn sequence(&self, index: usize, seq_len: usize) -> Result<(Vec<u32>, Vec<u32>), String> {
        if self.tokens.len() < seq_len + 1 {
            return Err(format!(
                "the data has {} tokens, fewer than one sequence of {} plus its target",
                self.tokens.len(),
                seq_len
            ));
        }
        let windows = self.tokens.len() - seq_len;
        let start = (index * seq_len) % windows;
        Ok((
            self.tokens[start..start + seq_len].to_vec(),
            self.tokens[start + 1..start + seq_len + 1].to_vec(),
        ))
    }
}

impl Data {
    /// The `b` sequences of micro-batch number `index` (the counter of
    /// [`Batching::index`]): sequences `index b..(index + 1) b` of [`Self::sequence`],
    /// concatenated, `(inputs, targets)` of `b seq_len` tokens each. With `b = 1` it is
    /// [`Self::sequence`]`(index)`. Errors: as [`Self::sequence`].
    pub fn micro_batch(
        &self,
        index: usize,
        seq_len: usize,
        b: usize,
    ) -> Result<(Vec<u32>, Vec<u32>), String> {
        let (mut tokens, mut targets) = (
            Vec::with_capacity(b * seq_len),
            Vec::with_capacity(b * seq_len),
        );
        for s in 0..b {
            let (x, y) = self.sequence(index * b + s, seq_len)?;
            tokens.extend(x);
            targets.extend(y);
        }
        Ok((tokens, targets))
    }
}

const BUILTIN: &str = "First Citizen: Before we proceed any further, hear me speak. \
All: Speak, speak. First Citizen: You are all resolved rather to die than to famish? \
All: Resolved. resolved. First Citizen: First, you know Caius Marcius is chief enemy to \
the people. All: We know't, we know't. First Citizen: Let us kill him, and we'll have corn \
at our own price. Is't a verdict? All: No more talking on't; let it be done: away, away!";

/// Where the data of one micro-batch comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Batching {
    /// Data shards (`dp * ep`).
    pub shards: usize,
    /// Micro-batches per step per shard over all directions.
    pub microbatches: usize,
    /// Sequence-parallel chunks per sequence (each routes as its own group).
    pub sp: usize,
}

impl Batching {
    /// The sequence index of `(step, shard, global micro-batch)`.
    pub fn index(&self, step: usize, shard: usize, mb: usize) -> usize {
        (step * self.shards + shard) * self.microbatches + mb
    }
    /// Tokens in one step's global batch, given the tokens of one micro-batch
    /// (`B T`: [`crate::ModelConfig::micro_batch_tokens`]).
    pub fn tokens(&self, mb_tokens: usize) -> usize {
        self.shards * self.microbatches * mb_tokens
    }
}
