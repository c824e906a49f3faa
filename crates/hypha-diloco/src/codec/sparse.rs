//! The `sparse` codec's records: of every chunk of [`CHUNK`] values, the k of largest
//! magnitude, each as its offset in the chunk (Elias-Fano coded: about 2 + log₂(L/k) bits) and
//! a code of 2 or 4 bits, on a grid of levels fitted to the chunk's kept magnitudes.
//!
//! # Records, wire format version 2
//!
//! A parameter of n values (row-major, whatever its shape) is ⌈n / 4096⌉ chunks; chunk j holds
//! the values 4096·j .. min(4096·(j + 1), n), L of them, and keeps k_L: k (metadata
//! [`KEPT`], 1 ..= 4096) in a whole chunk, every value (k_L = L) in a shorter one.
//! The parameter's tensor `name#sparse` (U8) is the chunks' records one after the other, each:
//!
//! | bytes | what |
//! |---|---|
//! | 4 | `low`: f32 LE, the magnitude of the lowest level |
//! | 4 | `high`: f32 LE, that of the highest |
//! | ⌈l·k_L / 8⌉ | the low l bits of each offset, l = ⌊log₂(L / k_L)⌋, in order |
//! | ⌈(k_L + ((L − 1) >> l) + 1) / 8⌉ | the high parts: for the i-th offset o_i (from 0), bit (o_i >> l) + i is set, every other bit is clear |
//! | ⌈b·k_L / 8⌉ | k_L codes of b bits (metadata [`BITS`]: 2 or 4), the i-th for the i-th offset |
//!
//! Where k_L = L the offsets are 0 .. L and both offset fields are empty. Offsets are strictly
//! increasing. A writer keeps every value whose magnitude is above the k_L-th largest, then the
//! earliest of those equal to it. It fits `low` and `high` to the kept magnitudes by Lloyd's
//! algorithm (see `fitted_levels`), within the smallest and the largest of them, and writes each
//! value's nearest level, halves away from zero (the Python SDK writes the same bytes; a test
//! holds them to it). A reader needs none of that: the grid is in the record. Every field is packed from the least significant bit of
//! its first byte on; the bits after its last are zero. A code's top bit is the sign (1:
//! negative), its other b − 1 bits a level q of M = 2^(b−1): the value is ±(low + (high −
//! low) · (q / (M − 1))), in f32. Every other value of the chunk is 0. The record's size
//! follows from L, k and b alone, so a file is laid out before a value is compressed, and
//! chunk j's record begins at j times a whole chunk's: a range of values is read without
//! reading what comes before it.
//!
//! A reader refuses a record whose `low` or `high` is not finite, negative, beyond
//! [`MAX_UPDATE_VALUE`], or `low` > `high`; whose high parts do not set exactly k_L bits;
//! whose offsets are not increasing or not inside the chunk; whose padding bits are set.
//!
//! Version 1 wrote each offset in 12 bits; its files are refused (every node of a network
//! runs one release).
//!
//! # Why these choices
//!
//! Chunks of 4,096 values, not 64 × 64 tiles: every tensor (biases, 1-D norms, a 3-D
//! convolution) splits the same way, and a chunk of a row-major matrix is a band of its rows,
//! which keeps the locality a tile has along one axis. Elias-Fano offsets, where `topk` sends
//! 32-bit positions in the tensor and version 1 sent 12 bits: k increasing offsets below L
//! take at most k·(2 + ⌈log₂(L/k)⌉) bits, within a bit or two a value of the least any code
//! can take (log₂ of the ways to choose k of L), and the size is fixed, which a gap code's is
//! not. At 64 of 4,096 (1.56 %, Covenant's setting) an offset costs 8 bits (6 low, 2 high)
//! instead of 12: the positions are most of a record, so 88 bytes carry 64 values where
//! version 1's 81 carried 41 (what a round moves of each chunk is what sparse training waits for;
//! BENCHMARKS.md, "outcome"). `low` and `high` rather than one scale, because the kept
//! magnitudes crowd just above the chunk's threshold and a grid from 0 would spend a level on
//! values that were never kept. The ends are fitted to the kept magnitudes, not their smallest
//! and largest: at 2 bits those two put every value at an extreme (the largest is often an
//! outlier), and the means of the two groups carry a chunk with about a quarter of the
//! squared error (at 4 bits 0.77 of it;
//! `sparse_keeps_the_largest_values_of_each_chunk_on_a_grid_fitted_to_them`); on
//! `hypha-bench outcome`'s text sparse went from 1.025 to 1.023 of f32, with overlap from 1.027
//! to 1.022, for the same bytes and readers. At k = 64 and b = 2 a chunk is 88 bytes against 16,384 in
//! f32: 0.0054 of it. A chunk shorter than 4,096 values (a parameter that small: a bias, a
//! norm's scale; or a larger one's last) goes whole, b bits a value: such values are few,
//! a norm's are among the model's most sensitive, and at 1.56 % a 128-value norm would move
//! 2 values a round (on `hypha-bench outcome`'s text, keeping them whole ended 0.5 % nearer
//! f32).

use crate::{MAX_UPDATE_VALUE, codec::kept_count};

/// Values per chunk.
pub const CHUNK: usize = 4096;
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

    /// The values kept of a chunk of `len` values (1 ..= [`CHUNK`]): k of a whole chunk,
    /// every value of a shorter one.
    fn kept_in(&self, len: usize) -> usize {
        if len == CHUNK { self.kept } else { len }
    }

    /// The bytes of the record of a chunk of `len` values.
    fn record_bytes(&self, len: usize) -> usize {
        let k = self.kept_in(len);
        let offsets = Offsets::new(len, k);
        BOUNDS + offsets.low_bytes() + offsets.high_bytes() + (self.bits as usize * k).div_ceil(8)
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
        let magnitudes = kept.iter().map(|&o| chunk[o as usize].abs());
        let steps = self.levels() - 1;
        let (low, high) = fitted_levels(magnitudes, steps);
        out.extend(low.to_le_bytes());
        out.extend(high.to_le_bytes());
        Offsets::new(chunk.len(), k).encode(kept, out);
        let sign = 1 << (self.bits - 1);
        pack(
            out,
            self.bits,
            kept.iter().map(|&o| {
                let value = chunk[o as usize];
                level_of(value.abs(), low, high, steps) | if value < 0.0 { sign } else { 0 }
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
        // The last chunk may be short: its record instead of a whole one's.
        let bytes = match values % CHUNK {
            rest if rest > 0 && last == values.div_ceil(CHUNK) && last > first => {
                bytes - self.record_bytes(CHUNK) + self.record_bytes(rest)
            }
            _ => bytes,
        };
        (first, self.record_at(first), bytes)
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
        let positions = Offsets::new(len, k);
        let (offsets, codes) = record[BOUNDS..].split_at(positions.bytes());
        let mut offsets = positions.decoder(offsets);
        let mut codes = Unpacker::new(codes, self.bits);
        let steps = (self.levels() - 1) as f32;
        let span = high - low;
        let sign = 1 << (self.bits - 1);
        let mut previous = None;
        for _ in 0..k {
            let offset = offsets
                .next()
                .ok_or("a record's high parts set fewer bits than it keeps")?;
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

/// Rounds of fitting a chunk's levels. Lloyd's algorithm settles in a few on a chunk's kept
/// magnitudes (a tail, crowded just above the threshold).
const FITTING_ROUNDS: usize = 4;

/// The level (0 ..= `steps`) nearest to `magnitude` on the grid from `low` to `high`.
fn level_of(magnitude: f32, low: f32, high: f32, steps: usize) -> u32 {
    let span = high - low;
    if span > 0.0 {
        ((magnitude - low) / span * steps as f32)
            .round()
            .clamp(0.0, steps as f32) as u32
    } else {
        0
    }
}

/// The grid's ends (`low`, `high`) that carry `magnitudes` with the least squared error, as
/// Lloyd's algorithm finds them: each magnitude to its nearest level, then the line through
/// the levels fitted by least squares to what they hold, and again. With two levels (2-bit
/// codes) the ends are the means of the smaller and of the larger magnitudes. It starts from
/// the smallest and the largest magnitude, the grid the writers used before, which carries
/// every magnitude but the ends too far out.
///
/// The arithmetic is fixed so that the Python SDK computes the same bits: f64 sums in the
/// order of the offsets, of the magnitudes and of their products with whole levels (exact),
/// and the same expressions after them.
fn fitted_levels(magnitudes: impl Iterator<Item = f32> + Clone, steps: usize) -> (f32, f32) {
    let (smallest, largest) = magnitudes
        .clone()
        .fold((f32::INFINITY, 0.0f32), |(low, high), m| {
            (low.min(m), high.max(m))
        });
    let (mut low, mut high) = (smallest, largest);
    for _ in 0..FITTING_ROUNDS {
        // m = a + d·q over the kept magnitudes m at their levels q.
        let (mut n, mut q, mut qq, mut m, mut mq) = (0.0f64, 0.0, 0.0, 0.0, 0.0);
        for magnitude in magnitudes.clone() {
            let level = f64::from(level_of(magnitude, low, high, steps));
            let magnitude = f64::from(magnitude);
            n += 1.0;
            q += level;
            qq += level * level;
            m += magnitude;
            mq += magnitude * level;
        }
        let spread = n * qq - q * q;
        let (a, b) = if spread > 0.0 {
            let d = (n * mq - q * m) / spread;
            let a = (m - d * q) / n;
            (a, a + d * steps as f64)
        } else {
            (m / n, m / n)
        };
        // Inside the magnitudes, so that a reader's bounds hold.
        low = (a as f32).clamp(smallest, largest);
        high = (b as f32).clamp(low, largest);
    }
    (low, high)
}

/// The Elias-Fano code of k strictly increasing offsets below L: each offset's low l bits
/// packed, then its high part in unary (bit `(o >> l) + i` of a field of k + ((L − 1) >> l) + 1
/// bits set for the i-th offset). Where every value is kept (k = L) the offsets are 0 .. L and
/// the code is empty.
#[derive(Debug, Clone, Copy)]
struct Offsets {
    kept: usize,
    low_bits: u32,
    high_bits: usize,
}

impl Offsets {
    /// The code of `kept` offsets (1 ..= `len`) in a chunk of `len` values.
    fn new(len: usize, kept: usize) -> Self {
        let kept = kept.max(1);
        if kept >= len {
            return Self {
                kept,
                low_bits: 0,
                high_bits: 0,
            };
        }
        let low_bits = (len / kept).max(1).ilog2();
        Self {
            kept,
            low_bits,
            high_bits: kept + (len.saturating_sub(1) >> low_bits) + 1,
        }
    }

    /// Whether every value is kept: no code.
    fn every(&self) -> bool {
        self.high_bits == 0
    }

    fn low_bytes(&self) -> usize {
        (self.low_bits as usize * self.kept).div_ceil(8)
    }

    fn high_bytes(&self) -> usize {
        self.high_bits.div_ceil(8)
    }

    /// The bytes of the code.
    fn bytes(&self) -> usize {
        self.low_bytes() + self.high_bytes()
    }

    /// Appends the code of `offsets` (`kept` of them, strictly increasing, below the chunk's
    /// length) to `out`.
    fn encode(&self, offsets: &[u16], out: &mut Vec<u8>) {
        if self.every() {
            return;
        }
        let mask = (1u32 << self.low_bits) - 1;
        pack(
            out,
            self.low_bits,
            offsets.iter().map(|&o| u32::from(o) & mask),
        );
        let start = out.len();
        out.resize(start + self.high_bytes(), 0);
        for (i, &offset) in offsets.iter().enumerate() {
            let bit = (usize::from(offset) >> self.low_bits) + i;
            out[start + bit / 8] |= 1 << (bit % 8);
        }
    }

    /// Reads offsets back from `bytes` (the code's [`bytes`](Self::bytes) bytes).
    fn decoder<'a>(&self, bytes: &'a [u8]) -> OffsetDecoder<'a> {
        let (low, high) = bytes.split_at(self.low_bytes().min(bytes.len()));
        OffsetDecoder {
            every: self.every().then_some(self.kept),
            low: Unpacker::new(low, self.low_bits),
            low_bits: self.low_bits,
            high,
            high_bits: self.high_bits,
            bit: 0,
            read: 0,
        }
    }
}

/// The offsets of one record, in order.
struct OffsetDecoder<'a> {
    /// Every value is kept, of a chunk this long.
    every: Option<usize>,
    low: Unpacker<'a>,
    low_bits: u32,
    high: &'a [u8],
    high_bits: usize,
    /// The next bit of the high parts to look at.
    bit: usize,
    /// Offsets read so far.
    read: usize,
}

impl OffsetDecoder<'_> {
    /// The next offset; `None` when the high parts set no further bit.
    fn next(&mut self) -> Option<usize> {
        if let Some(len) = self.every {
            self.read += 1;
            return (self.read <= len).then_some(self.read - 1);
        }
        while self.bit < self.high_bits {
            let bit = self.bit;
            self.bit += 1;
            if self.high[bit / 8] & (1 << (bit % 8)) != 0 {
                let high = bit - self.read;
                self.read += 1;
                return Some((high << self.low_bits) | self.low.next() as usize);
            }
        }
        None
    }

    /// Whether the bits not read are all zero: the low bits' padding, and every high bit
    /// after the last offset's (its padding included).
    fn rest_is_zero(&self) -> bool {
        let high_rest =
            (self.bit..self.high.len() * 8).all(|bit| self.high[bit / 8] & (1 << (bit % 8)) == 0);
        self.low.rest_is_zero() && high_rest
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
        let format = Format::new(68, 2).unwrap_or_else(|e| panic!("{e}"));
        // l = ⌊log₂(4096 / 68)⌋ = 5: 68 · 5 low bits, 68 + 128 high bits, 68 · 2 code bits.
        assert_eq!(format.record_bytes(CHUNK), 8 + 43 + 25 + 17);
        // The last chunk of 100 values keeps every one: no offsets, 100 codes of 2 bits.
        assert_eq!(format.bytes(CHUNK + 100), 93 + 8 + 25);
        assert_eq!(format.span(CHUNK + 100, 0, CHUNK + 100), (0, 0, 126));
        assert_eq!(format.span(CHUNK + 100, CHUNK, CHUNK + 100), (1, 93, 33));
        assert_eq!(format.span(3 * CHUNK, CHUNK, 2 * CHUNK), (1, 93, 93));
    }

    #[test]
    fn offsets_come_back_from_their_elias_fano_code_at_every_density() {
        for (len, every) in [
            (CHUNK, 60),
            (CHUNK, 1),
            (CHUNK, 4096),
            (100, 7),
            (1, 1),
            (CHUNK, 3),
        ] {
            let kept: Vec<u16> = (0..len as u16).filter(|o| o % every == every / 2).collect();
            let kept = if kept.is_empty() { vec![0] } else { kept };
            let code = Offsets::new(len, kept.len());
            let mut out = Vec::new();
            code.encode(&kept, &mut out);
            assert_eq!(out.len(), code.bytes(), "{len} / {every}");
            let mut decoder = code.decoder(&out);
            let got: Vec<usize> = std::iter::from_fn(|| decoder.next()).collect();
            assert_eq!(
                got,
                kept.iter().map(|&o| usize::from(o)).collect::<Vec<_>>()
            );
            assert!(decoder.rest_is_zero());
        }
        // Every value of a chunk: no code.
        assert_eq!(Offsets::new(CHUNK, CHUNK).bytes(), 0);
        // One value: its 12 bits low, a field of 2 high bits.
        assert_eq!(Offsets::new(CHUNK, 1).bytes(), 2 + 1);
        // Every value of a chunk: no code at all.
        assert_eq!(Offsets::new(100, 100).bytes(), 0);
    }

    #[test]
    fn a_record_whose_high_parts_set_too_many_or_too_few_bits_is_refused() {
        let format = Format::new(68, 2).unwrap_or_else(|e| panic!("{e}"));
        let chunk: Vec<f32> = (0..CHUNK)
            .map(|i| ((i * 7919) % 4096) as f32 / 4096.0)
            .collect();
        let mut record = Vec::new();
        format.encode(&chunk, &mut record);
        assert!(format.decode(CHUNK, 0, &record, |_, _| {}).is_ok());
        let high = BOUNDS + Offsets::new(CHUNK, 68).low_bytes();
        // The first set bit of the high parts cleared: an offset fewer.
        let mut fewer = record.clone();
        let byte = (high..).find(|at| fewer[*at] != 0).unwrap_or(high);
        fewer[byte] &= fewer[byte] - 1;
        assert!(format.decode(CHUNK, 0, &fewer, |_, _| {}).is_err());
        // The last bit of the high parts set: one more.
        let mut more = record.clone();
        let last = high + Offsets::new(CHUNK, 68).high_bytes() - 1;
        more[last] |= 0x80;
        assert!(format.decode(CHUNK, 0, &more, |_, _| {}).is_err());
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
