//! Text: JSONL documents tokenised into fixed-length sequences.
//!
//! The default tokenizer is byte-level: token ids 0–255 are the UTF-8 bytes, 256 ends a
//! document ([`EOS`]) and 257 pads ([`PAD`]). With a Hugging Face `tokenizer.json`, its ids are
//! used instead; documents end with the first of its tokens `<|endoftext|>`, `</s>`, `<eos>`,
//! `[SEP]` that exists (none if it has none), and padding uses the first of `<pad>`, `[PAD]`,
//! `<|padding|>` (else the end token, else 0). Documents are concatenated, each followed by its
//! end token, and cut into sequences of `sequence_length` tokens; the last sequence is padded,
//! with an `attention_mask` column marking real tokens (1) and padding (0).

use std::{
    io::{BufRead, BufReader},
    path::Path,
};

use safetensors::Dtype;

use super::{Column, PrepareError, Source};

/// Ends each document.
pub const EOS: i32 = 256;
/// Fills the last sequence.
pub const PAD: i32 = 257;

/// Token sequences held in memory (4 bytes a token).
#[derive(Debug)]
pub struct Text {
    columns: Vec<Column>,
    tokens: Vec<i32>,
    real: usize,
    sequence_length: usize,
}

impl Text {
    /// Reads `path` (one JSON object per line) and tokenises the string in `field` of each,
    /// byte-level or with the Hugging Face tokenizer at `tokenizer`.
    pub fn open(
        path: &Path,
        field: &str,
        sequence_length: usize,
        tokenizer: Option<&Path>,
    ) -> Result<Self, PrepareError> {
        if sequence_length == 0 {
            return Err(PrepareError::input(
                path,
                "the sequence length must be at least 1",
            ));
        }
        let tokenizer = tokenizer.map(Vocabulary::load).transpose()?;
        let (eos, pad) = match &tokenizer {
            None => (Some(EOS), PAD),
            Some(v) => (v.eos, v.pad),
        };
        let file = std::fs::File::open(path).map_err(|e| PrepareError::io(path, e))?;
        let mut tokens = Vec::new();
        for (number, line) in BufReader::new(file).lines().enumerate() {
            let line = line.map_err(|e| PrepareError::io(path, e))?;
            if line.trim().is_empty() {
                continue;
            }
            let value: serde_json::Value = serde_json::from_str(&line).map_err(|e| {
                PrepareError::input(path, format!("line {}: not JSON ({e})", number + 1))
            })?;
            let text = value.get(field).and_then(|v| v.as_str()).ok_or_else(|| {
                PrepareError::input(
                    path,
                    format!(
                        "line {}: no string field {field:?}; choose the field with --text-field",
                        number + 1
                    ),
                )
            })?;
            match &tokenizer {
                None => tokens.extend(text.bytes().map(i32::from)),
                Some(v) => {
                    tokens.extend(v.encode(text).map_err(|e| {
                        PrepareError::input(path, format!("line {}: {e}", number + 1))
                    })?)
                }
            }
            tokens.extend(eos);
        }
        let real = tokens.len();
        let padded = real.div_ceil(sequence_length) * sequence_length;
        tokens.resize(padded, pad);
        let columns = vec![
            Column {
                name: "input_ids".into(),
                dtype: Dtype::I32,
                sample_shape: vec![sequence_length],
            },
            Column {
                name: "attention_mask".into(),
                dtype: Dtype::U8,
                sample_shape: vec![sequence_length],
            },
        ];
        Ok(Text {
            columns,
            tokens,
            real,
            sequence_length,
        })
    }
}

impl Source for Text {
    fn columns(&self) -> &[Column] {
        &self.columns
    }

    fn samples(&self) -> u64 {
        (self.tokens.len() / self.sequence_length) as u64
    }

    fn read(&self, column: usize, start: u64, count: u64) -> Result<Vec<u8>, PrepareError> {
        let from = start as usize * self.sequence_length;
        let to = from + count as usize * self.sequence_length;
        Ok(match column {
            0 => self.tokens[from..to]
                .iter()
                .flat_map(|t| t.to_le_bytes())
                .collect(),
            _ => (from..to).map(|i| u8::from(i < self.real)).collect(),
        })
    }
}

/// A Hugging Face tokenizer and its special tokens.
struct Vocabulary {
    tokenizer: tokenizers::Tokenizer,
    eos: Option<i32>,
    pad: i32,
}

impl Vocabulary {
    fn load(path: &Path) -> Result<Self, PrepareError> {
        let tokenizer = tokenizers::Tokenizer::from_file(path)
            .map_err(|e| PrepareError::input(path, format!("not a usable tokenizer.json: {e}")))?;
        let id = |candidates: &[&str]| {
            candidates
                .iter()
                .find_map(|t| tokenizer.token_to_id(t))
                .and_then(|id| i32::try_from(id).ok())
        };
        let eos = id(&["<|endoftext|>", "</s>", "<eos>", "[SEP]"]);
        let pad = id(&["<pad>", "[PAD]", "<|padding|>"]).or(eos).unwrap_or(0);
        Ok(Vocabulary {
            tokenizer,
            eos,
            pad,
        })
    }

    fn encode(&self, text: &str) -> Result<Vec<i32>, String> {
        let encoding = self
            .tokenizer
            .encode(text, false)
            .map_err(|e| e.to_string())?;
        encoding
            .get_ids()
            .iter()
            .map(|&id| i32::try_from(id).map_err(|_| format!("token id {id} does not fit an I32")))
            .collect()
    }
}

impl std::fmt::Debug for Vocabulary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Vocabulary")
            .field("eos", &self.eos)
            .field("pad", &self.pad)
            .finish_non_exhaustive()
    }
}
