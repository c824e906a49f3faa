//! Text: documents tokenised into fixed-length sequences.
//!
//! The input is a JSONL file (one document per line, in a string field), a plain text file (one
//! document), or a directory of them, walked recursively in path order (hidden files and
//! directories skipped). Files ending in `.jsonl` or `.json` are JSONL; every other file must be
//! UTF-8 text and is one document.
//!
//! The default tokenizer is byte-level: token ids 0–255 are the UTF-8 bytes, 256 ends a
//! document ([`EOS`]) and 257 pads ([`PAD`]), a vocabulary of 258 ([`BYTE_VOCABULARY`]). With a
//! Hugging Face `tokenizer.json`, its ids are used instead; documents end with the first of its
//! tokens `<|endoftext|>`, `</s>`, `<eos>`, `[SEP]` that exists (none if it has none), and
//! padding uses the first of `<pad>`, `[PAD]`, `<|padding|>` (else the end token, else 0).
//! Documents are concatenated, each followed by its end token, and cut into sequences of
//! `sequence_length` tokens; the last sequence is padded, with an `attention_mask` column
//! marking real tokens (1) and padding (0).
//!
//! The tokens are spooled to an unnamed temporary file (4 bytes a token, in the system's
//! temporary directory), so a corpus of any size prepares in the memory of its largest
//! document: a plain text file is read whole, a JSONL file a line at a time.

use std::{
    io::{BufRead, BufReader, Write},
    path::{Path, PathBuf},
};

use safetensors::Dtype;

use super::{Column, PrepareError, Source};

/// Ends each document.
pub const EOS: i32 = 256;
/// Fills the last sequence.
pub const PAD: i32 = 257;
/// The byte-level tokenizer's vocabulary: 256 bytes, [`EOS`] and [`PAD`].
pub const BYTE_VOCABULARY: usize = 258;

/// Token sequences, spooled to a temporary file (4 bytes a token, little-endian).
#[derive(Debug)]
pub struct Text {
    columns: Vec<Column>,
    /// The real tokens; those after them, up to a whole sequence, are `pad`.
    tokens: std::fs::File,
    real: u64,
    pad: i32,
    sequence_length: usize,
}

impl Text {
    /// Reads the documents of `path` (see the module's doc; JSONL documents are the string in
    /// `field` of each line) and tokenises them byte-level or with the Hugging Face tokenizer
    /// at `tokenizer`.
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
        let spool_error = |e: std::io::Error| PrepareError::io(&std::env::temp_dir(), e);
        let tokens = tempfile::tempfile().map_err(spool_error)?;
        let mut spool = std::io::BufWriter::with_capacity(1 << 20, &tokens);
        let mut real = 0u64;
        let mut write = |ids: &mut dyn Iterator<Item = i32>| -> Result<(), PrepareError> {
            for id in ids {
                spool.write_all(&id.to_le_bytes()).map_err(spool_error)?;
                real += 1;
            }
            Ok(())
        };
        for_each_document(path, field, &mut |file, place, text| {
            match &tokenizer {
                None => write(&mut text.bytes().map(i32::from))?,
                Some(v) => write(
                    &mut v
                        .encode(text)
                        .map_err(|e| PrepareError::input(file, format!("{place}{e}")))?
                        .into_iter(),
                )?,
            }
            write(&mut eos.into_iter())
        })?;
        spool.flush().map_err(spool_error)?;
        drop(spool);
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
            pad,
            sequence_length,
        })
    }
}

impl Source for Text {
    fn columns(&self) -> &[Column] {
        &self.columns
    }

    fn samples(&self) -> u64 {
        self.real.div_ceil(self.sequence_length as u64)
    }

    fn read(&self, column: usize, start: u64, count: u64) -> Result<Vec<u8>, PrepareError> {
        use std::os::unix::fs::FileExt;
        let length = self.sequence_length as u64;
        let (from, to) = (start * length, (start + count) * length);
        Ok(match column {
            0 => {
                let stored = to.min(self.real).saturating_sub(from);
                let mut bytes = vec![0u8; usize::try_from((to - from) * 4).unwrap_or(0)];
                let (kept, padding) = bytes.split_at_mut(stored as usize * 4);
                self.tokens
                    .read_exact_at(kept, from * 4)
                    .map_err(|e| PrepareError::io(&std::env::temp_dir(), e))?;
                for slot in padding.chunks_exact_mut(4) {
                    slot.copy_from_slice(&self.pad.to_le_bytes());
                }
                bytes
            }
            _ => (from..to).map(|i| u8::from(i < self.real)).collect(),
        })
    }
}

/// Calls `each(file, place, text)` for every document under `path` in order; `place` is
/// `"line N: "` for a JSONL document and empty for a whole file, for errors to point at.
fn for_each_document(
    path: &Path,
    field: &str,
    each: &mut dyn FnMut(&Path, &str, &str) -> Result<(), PrepareError>,
) -> Result<(), PrepareError> {
    let metadata = std::fs::metadata(path).map_err(|e| PrepareError::io(path, e))?;
    if !metadata.is_dir() {
        return read_file(path, field, each);
    }
    let mut files = Vec::new();
    collect_files(path, &mut files)?;
    if files.is_empty() {
        return Err(PrepareError::input(
            path,
            "the directory holds no files (hidden ones are skipped)",
        ));
    }
    for file in &files {
        read_file(file, field, each)?;
    }
    Ok(())
}

/// The regular files under `directory`, recursively, sorted by path; hidden entries skipped.
fn collect_files(directory: &Path, files: &mut Vec<PathBuf>) -> Result<(), PrepareError> {
    let mut entries = std::fs::read_dir(directory)
        .map_err(|e| PrepareError::io(directory, e))?
        .map(|entry| entry.map(|e| e.path()))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| PrepareError::io(directory, e))?;
    entries.sort();
    for entry in entries {
        let hidden = entry
            .file_name()
            .is_some_and(|name| name.to_string_lossy().starts_with('.'));
        if hidden {
            continue;
        }
        let metadata = std::fs::metadata(&entry).map_err(|e| PrepareError::io(&entry, e))?;
        if metadata.is_dir() {
            collect_files(&entry, files)?;
        } else if metadata.is_file() {
            files.push(entry);
        }
    }
    Ok(())
}

/// Whether `path` is read as JSONL (by its extension) rather than as one plain document.
pub fn is_jsonl(path: &Path) -> bool {
    path.extension()
        .and_then(|e| e.to_str())
        .is_some_and(|e| e.eq_ignore_ascii_case("jsonl") || e.eq_ignore_ascii_case("json"))
}

fn read_file(
    path: &Path,
    field: &str,
    each: &mut dyn FnMut(&Path, &str, &str) -> Result<(), PrepareError>,
) -> Result<(), PrepareError> {
    if !is_jsonl(path) {
        let bytes = std::fs::read(path).map_err(|e| PrepareError::io(path, e))?;
        let text = String::from_utf8(bytes).map_err(|e| {
            PrepareError::input(
                path,
                format!(
                    "not UTF-8 text (byte {} is not); text inputs are .jsonl files or UTF-8 text files: \
                     move other files out of the input",
                    e.utf8_error().valid_up_to()
                ),
            )
        })?;
        return each(path, "", &text);
    }
    let file = std::fs::File::open(path).map_err(|e| PrepareError::io(path, e))?;
    for (number, line) in BufReader::new(file).lines().enumerate() {
        let line = line.map_err(|e| PrepareError::io(path, e))?;
        if line.trim().is_empty() {
            continue;
        }
        let place = format!("line {}: ", number + 1);
        let value: serde_json::Value = serde_json::from_str(&line)
            .map_err(|e| PrepareError::input(path, format!("{place}not JSON ({e})")))?;
        let text = value.get(field).and_then(|v| v.as_str()).ok_or_else(|| {
            PrepareError::input(
                path,
                format!("{place}no string field {field:?}; choose the field with --text-field"),
            )
        })?;
        each(path, &place, text)?;
    }
    Ok(())
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
