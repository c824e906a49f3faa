//! The `sparse` codec's records: of every chunk of [`CHUNK`] values, the k of largest
//! magnitude, each as a 12-bit offset in its chunk and a code of 2 or 4 bits, with the chunk's
//! smallest and largest kept magnitude.
//!
//! # Records, wire format version 1
//!
//! A parameter of n values (row-major, whatever its shape) is ⌈n / 4096⌉ chunks; chunk j holds
//! the values 4096·j .. min(4096·(j + 1), n), L of them, and keeps k_L: k (metadata
//! [`KEPT`], 1 ..= 4096) in a whole chunk, ⌈k·L / 4096⌉ (at least 1) in a shorter last one.
//! The parameter's tensor `name#sparse` (U8) is the chunks' records one after the other, each:
//!
//! | bytes | what |
//! |---|---|
//! | 4 | `low`: f32 LE, the smallest magnitude kept |
//! | 4 | `high`: f32 LE, the largest |
//! | ⌈12·k_L / 8⌉ | k_L offsets in the chunk, 12 bits each, strictly increasing |
//! | ⌈b·k_L / 8⌉ | k_L codes of b bits (metadata [`BITS`]: 2 or 4), the i-th for the i-th offset |
//!
//! Offsets and codes are packed from the least significant bit of their first byte on; the
//! bits after the last are zero. A code's top bit is the sign (1: negative), its other b − 1
//! bits a level q of M = 2^(b−1): the value is ±(low + (high − low) · (q / (M − 1))), in f32.
//! Every other value of the chunk is 0. The record's size follows from L, k and b alone, so a
//! file is laid out before a value is compressed, and chunk j's record begins at j times a
//! whole chunk's: a range of values is read without reading what comes before it.
//!
//! A reader refuses a record whose `low` or `high` is not finite, negative, beyond
//! [`MAX_UPDATE_VALUE`], or `low` > `high`; whose offsets are not increasing or not inside the
//! chunk; whose padding bits are set.
//!
//! # Why these choices
//!
//! Chunks of 4,096 values, not 64 × 64 tiles: every tensor (biases, 1-D norms, a 3-D
//! convolution) splits the same way, and a chunk of a row-major matrix is a band of its rows,
//! which keeps the locality a tile has along one axis. 12-bit offsets in the chunk, where
//! `topk` sends 32-bit positions in the tensor; `low` and `high` rather than one scale, because
//! the kept magnitudes crowd just above the chunk's threshold and a grid from 0 would spend a
//! level on values that were never kept. At k = 41 (1 %) and b = 2 a chunk is 81 bytes against
//! 16,384 in f32: 0.0049 of it.

use crate::{MAX_UPDATE_VALUE, codec::kept_count};

/// Values per chunk.
pub const CHUNK: usize = 4096;
/// Bits of an offset in a chunk.
const OFFSET_BITS: u32 = 12;
/// Metadata key: the values kept of a whole chunk.
pub const KEPT: &str = "hypha.sparse.kept";
/// Metadata key: the bits of a kept value's code.
pub const BITS: &str = "hypha.sparse.bits";
/// The suffix of a parameter's records.
pub(crate) const RECORDS: &str = "#sparse";
/// Bytes of a record's `low` and `high`.
const BOUNDS: usize = 8;

/// How a file's records are laid out: the values kept of a whole chunk, and the bits of
/// each one's code.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Format {
    kept: usize,
    bits: u32,
}

impl Format {
    /// `kept` values of a whole chunk (1 ..= [`CHUNK`]), each in `bits` (2 or 4).
    pub fn new(kept: usize, bits: u32) -> Result<Self, String> {
        if !(1..=CHUNK).contains(&kept) {
            return Err(format!(
                "{kept} values kept of a chunk of {CHUNK}: from 1 to {CHUNK}"
            ));
        }
        if bits != 2 && bits != 4 {
            return Err(format!("codes of {bits} bits: 2 or 4"));
        }
        Ok(Self { kept, bits })
    }

    /// The format a writer with `density` and `bits` uses; `bits` must be 2 or 4.
    pub(crate) fn of(density: f32, bits: u8) -> Result<Self, String> {
        Self::new(kept_count(density, CHUNK), u32::from(bits))
    }

    /// The same format keeping `times` as many values (at most every one).
    pub fn denser(self, times: usize) -> Self {
        Self {
            kept: (self.kept * times).min(CHUNK),
            ..self
        }
    }

    /// The values kept of a whole chunk.
    pub fn kept(&self) -> usize {
        self.kept
    }

    /// The bits of a code.
    pub fn bits(&self) -> u32 {
        self.bits
    }

    /// The values kept of a chunk of `len` values (1 ..= [`CHUNK`]).
    fn kept_in(&self, len: usize) -> usize {
        if len == CHUNK {
            self.kept
        } else {
            (self.kept * len).div_ceil(CHUNK).clamp(1, len.max(1))
        }
    }

    /// The bytes of the record of a chunk of `len` values.
    fn record_bytes(&self, len: usize) -> usize {
        let k = self.kept_in(len);
        BOUNDS + (OFFSET_BITS as usize * k).div_ceil(8) + (self.bits as usize * k).div_ceil(8)
    }

    /// The bytes of the records of a parameter of `values` values (saturating: a claimed
    /// shape of more values than any file holds gives a size no file has).
    pub fn bytes(&self, values: usize) -> u64 {
        let whole = ((values / CHUNK) as u64).saturating_mul(self.record_bytes(CHUNK) as u64);
        match values % CHUNK {
            0 => whole,
            rest => whole.saturating_add(self.record_bytes(rest) as u64),
        }
    }

    /// The levels of a code's magnitude: M = 2^(b−1).
    fn levels(&self) -> usize {
        1 << (self.bits - 1)
    }

    /// The records of `values` (a whole number of chunks but for the last), appended to
    /// `out`. The values must be finite.
    pub(crate) fn encode(&self, values: &[f32], out: &mut Vec<u8>) {
        let mut order = Vec::with_capacity(CHUNK);
        let mut kept = Vec::with_capacity(self.kept);
        for chunk in values.chunks(CHUNK) {
            self.encode_chunk(chunk, &mut order, &mut kept, out);
        }
    }

    fn encode_chunk(
        &self,
        chunk: &[f32],
        order: &mut Vec<u32>,
        kept: &mut Vec<u16>,
        out: &mut Vec<u8>,
    ) {
        let k = self.kept_in(chunk.len());
        // A finite f32's magnitude orders as the integer of its bits.
        let magnitude = |v: f32| v.to_bits() & 0x7fff_ffff;
        order.clear();
        order.extend(chunk.iter().map(|v| magnitude(*v)));
        let threshold = if k < chunk.len() {
            *order.select_nth_unstable(chunk.len() - k).1
        } else {
            0
        };
        // Those above the threshold, then those at it in the order they come, k in all.
        let mut ties = k - chunk.iter().filter(|v| magnitude(**v) > threshold).count();
        kept.clear();
        for (offset, value) in chunk.iter().enumerate() {
            let m = magnitude(*value);
            if m > threshold || (m == threshold && ties > 0) {
                if m == threshold {
                    ties -= 1;
                }
                kept.push(offset as u16);
            }
        }
        let (low, high) = kept
            .iter()
            .fold((f32::INFINITY, 0.0f32), |(low, high), &o| {
                let m = chunk[o as usize].abs();
                (low.min(m), high.max(m))
            });
        out.extend(low.to_le_bytes());
        out.extend(high.to_le_bytes());
        pack(out, OFFSET_BITS, kept.iter().map(|&o| u32::from(o)));
        let steps = (self.levels() - 1) as f32;
        let span = high - low;
        let sign = 1 << (self.bits - 1);
        pack(
            out,
            self.bits,
            kept.iter().map(|&o| {
                let value = chunk[o as usize];
                let level = if span > 0.0 {
                    ((value.abs() - low) / span * steps)
                        .round()
                        .clamp(0.0, steps) as u32
                } else {
                    0
                };
                level | if value < 0.0 { sign } else { 0 }
            }),
        );
    }

    /// Where chunk `chunk`'s record begins, from the first record.
    fn record_at(&self, chunk: usize) -> u64 {
        chunk as u64 * self.record_bytes(CHUNK) as u64
    }

    /// The span of records of the chunks that hold values `start..end` of a parameter of
    /// `values` values: the first chunk, the offset of its record and the bytes to its last's
    /// end.
    pub(crate) fn span(&self, values: usize, start: usize, end: usize) -> (usize, u64, usize) {
        let first = start / CHUNK;
        let last = end.div_ceil(CHUNK).min(values.div_ceil(CHUNK));
        let bytes = (self.record_at(last) - self.record_at(first)) as usize;
        // The last chunk may be short: the bytes of a whole one less the difference.
        let short = match values % CHUNK {
            rest if rest > 0 && last == values.div_ceil(CHUNK) && last > first => {
                self.record_bytes(CHUNK) - self.record_bytes(rest)
            }
            _ => 0,
        };
        (first, self.record_at(first), bytes - short)
    }

    /// Calls `each` with the position and value of every kept value of the records `bytes`
    /// (those of the chunks from `first` of a parameter of `values` values), checking them:
    /// the reason a record is refused.
    pub(crate) fn decode(
        &self,
        values: usize,
        first: usize,
        mut bytes: &[u8],
        mut each: impl FnMut(usize, f32),
    ) -> Result<(), &'static str> {
        let mut chunk = first;
        while !bytes.is_empty() {
            let start = chunk * CHUNK;
            let len = values.saturating_sub(start).min(CHUNK);
            if len == 0 {
                return Err("records past the parameter's values");
            }
            let size = self.record_bytes(len);
            let (record, rest) = bytes.split_at_checked(size).ok_or("a record cut short")?;
            self.decode_record(record, len, |offset, value| each(start + offset, value))?;
            bytes = rest;
            chunk += 1;
        }
        Ok(())
    }

    /// One chunk's `record`, the chunk `len` values long.
    fn decode_record(
        &self,
        record: &[u8],
        len: usize,
        mut each: impl FnMut(usize, f32),
    ) -> Result<(), &'static str> {
        let k = self.kept_in(len);
        let f32_at = |at: usize| {
            f32::from_le_bytes([record[at], record[at + 1], record[at + 2], record[at + 3]])
        };
        let (low, high) = (f32_at(0), f32_at(4));
        // Written so that a NaN fails it.
        if !(0.0 <= low && low <= high && high <= MAX_UPDATE_VALUE) {
            return Err(
                "a chunk's magnitudes are not finite, negative, beyond ±1e9 or out of order",
            );
        }
        let offsets_len = (OFFSET_BITS as usize * k).div_ceil(8);
        let (offsets, codes) = record[BOUNDS..].split_at(offsets_len);
        let mut offsets = Unpacker::new(offsets, OFFSET_BITS);
        let mut codes = Unpacker::new(codes, self.bits);
        let steps = (self.levels() - 1) as f32;
        let span = high - low;
        let sign = 1 << (self.bits - 1);
        let mut previous = None;
        for _ in 0..k {
            let offset = offsets.next() as usize;
            if offset >= len || previous.is_some_and(|p| offset <= p) {
                return Err("offsets outside the chunk or not increasing");
            }
            previous = Some(offset);
            let code = codes.next();
            let magnitude = low + span * ((code & (sign - 1)) as f32 / steps);
            each(
                offset,
                if code & sign != 0 {
                    -magnitude
                } else {
                    magnitude
                },
            );
        }
        if !(offsets.rest_is_zero() && codes.rest_is_zero()) {
            return Err("bits set after a record's last offset or code");
        }
        Ok(())
    }
}

/// `values` of `bits` bits each (each below 2^bits) appended to `out`, from the least
/// significant bit of the first byte on; the last byte's unused bits zero.
fn pack(out: &mut Vec<u8>, bits: u32, values: impl Iterator<Item = u32>) {
    let (mut held, mut count) = (0u32, 0u32);
    for value in values {
        held |= value << count;
        count += bits;
        while count >= 8 {
            out.push(held as u8);
            held >>= 8;
            count -= 8;
        }
    }
    if count > 0 {
        out.push(held as u8);
    }
}

/// Values of `bits` bits read from packed bytes, as [`pack`] wrote them.
struct Unpacker<'a> {
    bytes: &'a [u8],
    bits: u32,
    held: u32,
    count: u32,
}

impl<'a> Unpacker<'a> {
    fn new(bytes: &'a [u8], bits: u32) -> Self {
        Self {
            bytes,
            bits,
            held: 0,
            count: 0,
        }
    }

    /// The next value; 0 past the end (the sizes were checked before).
    fn next(&mut self) -> u32 {
        while self.count < self.bits {
            let (byte, rest) = self
                .bytes
                .split_first()
                .map_or((0, &[][..]), |(b, r)| (*b, r));
            self.bytes = rest;
            self.held |= u32::from(byte) << self.count;
            self.count += 8;
        }
        let value = self.held & ((1 << self.bits) - 1);
        self.held >>= self.bits;
        self.count -= self.bits;
        value
    }

    /// Whether the bits not read are all zero.
    fn rest_is_zero(&self) -> bool {
        self.held == 0 && self.bytes.iter().all(|b| *b == 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_is_its_bounds_offsets_and_codes() {
        let format = Format::new(41, 2).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(format.record_bytes(CHUNK), 8 + 62 + 11);
        // The last chunk of 100 values keeps ⌈41 · 100 / 4096⌉ = 2.
        assert_eq!(format.bytes(CHUNK + 100), 81 + 8 + 3 + 1);
        assert_eq!(format.span(CHUNK + 100, 0, CHUNK + 100), (0, 0, 93));
        assert_eq!(format.span(CHUNK + 100, CHUNK, CHUNK + 100), (1, 81, 12));
        assert_eq!(format.span(3 * CHUNK, CHUNK, 2 * CHUNK), (1, 81, 81));
    }

    #[test]
    fn packed_values_come_back_and_padding_is_zero() {
        let values = [0xabc, 0x001, 0xfff];
        let mut out = Vec::new();
        pack(&mut out, 12, values.iter().copied());
        assert_eq!(out.len(), 5);
        let mut unpacker = Unpacker::new(&out, 12);
        assert_eq!([unpacker.next(), unpacker.next(), unpacker.next()], values);
        assert!(unpacker.rest_is_zero());
    }

    #[test]
    fn a_chunk_keeps_its_largest_values_at_their_levels() {
        let format = Format::new(4, 4).unwrap_or_else(|e| panic!("{e}"));
        let mut chunk = vec![0.01f32; CHUNK];
        for (at, value) in [(7, -1.0), (100, 0.5), (2000, 0.3), (4095, -0.8)] {
            chunk[at] = value;
        }
        let mut out = Vec::new();
        format.encode(&chunk, &mut out);
        let mut got = Vec::new();
        format
            .decode(CHUNK, 0, &out, |at, value| got.push((at, value)))
            .unwrap_or_else(|e| panic!("{e}"));
        // Eight levels from 0.3 to 1.0, a tenth apart: every kept value is on one.
        let expected = [(7, -1.0), (100, 0.5), (2000, 0.3), (4095, -0.8)];
        assert_eq!(got.len(), 4);
        for ((at, value), (want_at, want)) in got.iter().zip(expected) {
            assert_eq!(*at, want_at);
            assert!((value - want).abs() < 1e-6, "{at}: {value} for {want}");
        }
    }
}
