//! SafeTensors files read and written a piece at a time, so that a model of gigabytes is never
//! held twice in memory, nor its updates once.
//!
//! - [`Source`]: any range of a file's bytes, borrowed from memory or read from disk
//!   ([`FileSource`]) into a buffer that is reused.
//! - [`Layout`]: a file's header, checked as the `safetensors` crate checks it (offsets
//!   contiguous, each tensor's bytes its shape times its dtype, nothing after the last) against
//!   the file's length, with every tensor's place in the file.
//! - [`Writer`]: a file whose tensors' sizes are known before their bytes, written one tensor
//!   after the other; its metadata may still change until it is finished (a fingerprint that
//!   is known only once every tensor was written), within room reserved in the header.

use std::{
    collections::BTreeMap,
    fs::File,
    io::{Seek, SeekFrom, Write},
    path::{Path, PathBuf},
};

use safetensors::Dtype;

use crate::{Error, MAX_HEADER, Metadata};

/// The bytes read from a file at once: large enough to run at the disk's and the page cache's
/// speed, small enough to stay in a core's cache while they are decoded.
pub const CHUNK: usize = 1 << 20;

/// Buffers that reads from files go through, kept from chunk to chunk and tensor to tensor:
/// a fresh megabyte for every chunk made the kernel zero pages for most of a round's close
/// (62 % of its time, measured with perf).
#[derive(Debug, Default)]
pub struct Scratch {
    pub main: Vec<u8>,
    pub companion: Vec<u8>,
    /// The samples that sent each value of a range ([`Accumulator::sum_into`]).
    ///
    /// [`Accumulator::sum_into`]: crate::Accumulator
    pub(crate) senders: Vec<f32>,
}

/// Random access to the bytes of a SafeTensors file.
pub trait Source {
    /// The file's length in bytes.
    fn size(&self) -> u64;

    /// The `len` bytes at `offset`: borrowed where they are in memory, read into `buffer`
    /// (reused from call to call) where they are not.
    fn bytes_at<'b>(
        &'b self,
        offset: u64,
        len: usize,
        buffer: &'b mut Vec<u8>,
    ) -> Result<&'b [u8], Error>;
}

impl Source for [u8] {
    fn size(&self) -> u64 {
        self.len() as u64
    }

    fn bytes_at<'b>(
        &'b self,
        offset: u64,
        len: usize,
        _: &'b mut Vec<u8>,
    ) -> Result<&'b [u8], Error> {
        usize::try_from(offset)
            .ok()
            .and_then(|start| self.get(start..start.checked_add(len)?))
            .ok_or_else(|| Error::Format(format!("{len} bytes at {offset}: past the end")))
    }
}

/// Bytes held in memory by any owner (`Vec<u8>`, `Arc<[u8]>`): an [`Accumulator`] keeps
/// such an update until the round's sum.
///
/// [`Accumulator`]: crate::Accumulator
impl<T: std::ops::Deref<Target = [u8]>> Source for T {
    fn size(&self) -> u64 {
        (**self).size()
    }

    fn bytes_at<'b>(
        &'b self,
        offset: u64,
        len: usize,
        buffer: &'b mut Vec<u8>,
    ) -> Result<&'b [u8], Error> {
        (**self).bytes_at(offset, len, buffer)
    }
}

/// A SafeTensors file on disk, read with `pread` at whatever offsets are asked: never mapped,
/// so that its pages count against the page cache, not against the reader's memory.
#[derive(Debug)]
pub struct FileSource {
    file: File,
    len: u64,
    path: PathBuf,
}

impl FileSource {
    pub fn open(path: &Path) -> Result<Self, Error> {
        let read = |error| hypha_files::Error::Read {
            path: path.to_path_buf(),
            error,
        };
        let file = File::open(path).map_err(read)?;
        let len = file.metadata().map_err(read)?.len();
        Ok(Self {
            file,
            len,
            path: path.to_path_buf(),
        })
    }
}

impl Source for FileSource {
    fn size(&self) -> u64 {
        self.len
    }

    fn bytes_at<'b>(
        &'b self,
        offset: u64,
        len: usize,
        buffer: &'b mut Vec<u8>,
    ) -> Result<&'b [u8], Error> {
        use std::os::unix::fs::FileExt;
        buffer.resize(len, 0);
        self.file
            .read_exact_at(buffer, offset)
            .map_err(|error| hypha_files::Error::Read {
                path: self.path.clone(),
                error,
            })?;
        Ok(buffer)
    }
}

/// Where one tensor's bytes lie in its file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    /// From the start of the file.
    pub offset: u64,
    pub len: u64,
}

impl Entry {
    /// The number of values, as its shape says.
    pub fn values(&self) -> usize {
        self.shape.iter().product()
    }

    /// Calls `each` with the tensor's bytes in order, at most [`CHUNK`] at a time and always
    /// a whole number of `unit` bytes (a value, or a block of values, never split), with the
    /// offset of the first within the tensor. Bytes read from a file go through `buffer`.
    pub fn chunks(
        &self,
        source: &(impl Source + ?Sized),
        unit: usize,
        buffer: &mut Vec<u8>,
        mut each: impl FnMut(u64, &[u8]) -> Result<(), Error>,
    ) -> Result<(), Error> {
        let step = (CHUNK / unit).max(1) * unit;
        let mut done = 0u64;
        while done < self.len {
            let len = step.min((self.len - done) as usize);
            each(done, source.bytes_at(self.offset + done, len, buffer)?)?;
            done += len as u64;
        }
        Ok(())
    }
}

/// A SafeTensors file's header: its metadata and where each tensor is.
#[derive(Debug, Clone, Default)]
pub struct Layout {
    pub metadata: Metadata,
    pub entries: BTreeMap<String, Entry>,
}

impl Layout {
    /// Reads and checks the header of the file `source` holds.
    pub fn read(source: &(impl Source + ?Sized)) -> Result<Self, Error> {
        let mut buffer = Vec::new();
        let length = source.bytes_at(0, 8, &mut buffer).map_err(|_| {
            Error::Format("shorter than a SafeTensors header's length (8 bytes)".into())
        })?;
        let length = u64::from_le_bytes(length.try_into().unwrap_or_default());
        if length > MAX_HEADER || 8 + length > source.size() {
            return Err(Error::Format(format!(
                "a header of {length} bytes in a file of {} (at most {MAX_HEADER})",
                source.size()
            )));
        }
        let header = source.bytes_at(8, length as usize, &mut buffer)?;
        // The crate's own type checks what it checks when it reads a whole file.
        let header: safetensors::tensor::Metadata =
            serde_json::from_slice(header).map_err(Error::HeaderJson)?;
        let start = 8 + length;
        // Each tensor's size is checked by the crate, their sum is a peer's to choose.
        if start.checked_add(header.data_len() as u64) != Some(source.size()) {
            return Err(Error::Format(format!(
                "the header describes {} bytes of tensors; the file holds {}",
                header.data_len(),
                source.size() - start
            )));
        }
        let entries = header
            .tensors()
            .into_iter()
            .map(|(name, info)| {
                let (from, to) = info.data_offsets;
                let entry = Entry {
                    dtype: info.dtype,
                    shape: info.shape.clone(),
                    offset: start + from as u64,
                    len: (to - from) as u64,
                };
                (name, entry)
            })
            .collect();
        let metadata = header
            .metadata()
            .iter()
            .flatten()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        Ok(Self { metadata, entries })
    }
}

/// The bytes a value of `dtype` takes.
pub fn dtype_bytes(dtype: Dtype) -> usize {
    dtype.bitsize().div_ceil(8)
}

/// Writes a SafeTensors file whose tensors (names, dtypes, shapes) are known before their
/// bytes: the header first, then each tensor's bytes in the order the tensors were given,
/// in as many pieces as suit the writer.
#[derive(Debug)]
pub struct Writer<W: Write + Seek> {
    out: W,
    tensors: Vec<(String, Dtype, Vec<usize>, u64)>,
    metadata: Metadata,
    /// The header's length, padding included: a rewritten header must fit in it.
    header_len: usize,
    /// The tensor being written, and its bytes written so far.
    current: usize,
    written: u64,
}

impl<W: Write + Seek> Writer<W> {
    /// Writes the header of a file of `tensors` and `metadata` to `out`. A value to be
    /// [set](Self::set_metadata) later is given a placeholder of its length now: the header
    /// is not moved once tensors follow it.
    pub fn new(
        mut out: W,
        tensors: impl IntoIterator<Item = (String, Dtype, Vec<usize>)>,
        metadata: Metadata,
    ) -> Result<Self, Error> {
        let tensors: Vec<_> = tensors
            .into_iter()
            .map(|(name, dtype, shape)| {
                let len = (shape.iter().product::<usize>() * dtype.bitsize()).div_ceil(8) as u64;
                (name, dtype, shape, len)
            })
            .collect();
        let header = header(&tensors, &metadata)?;
        let header_len = header.len().next_multiple_of(8);
        let mut writer = Self {
            out: {
                out.seek(SeekFrom::Start(0)).map_err(Error::Write)?;
                out
            },
            tensors,
            metadata,
            header_len,
            current: 0,
            written: 0,
        };
        writer.write_header(&header)?;
        writer.skip_empty();
        Ok(writer)
    }

    fn write_header(&mut self, header: &[u8]) -> Result<(), Error> {
        let mut padded = Vec::with_capacity(8 + self.header_len);
        padded.extend_from_slice(&(self.header_len as u64).to_le_bytes());
        padded.extend_from_slice(header);
        // Spaces are JSON's whitespace: every reader takes them after the header's object.
        padded.resize(8 + self.header_len, b' ');
        self.out.write_all(&padded).map_err(Error::Write)
    }

    /// The next `bytes` of the tensors, in order (they may run on from one tensor into the
    /// next).
    pub fn write(&mut self, mut bytes: &[u8]) -> Result<(), Error> {
        while !bytes.is_empty() {
            let Some((_, _, _, len)) = self.tensors.get(self.current) else {
                return Err(Error::Format(format!(
                    "{} bytes past the last tensor",
                    bytes.len()
                )));
            };
            let take = bytes.len().min((len - self.written) as usize);
            self.out.write_all(&bytes[..take]).map_err(Error::Write)?;
            self.written += take as u64;
            bytes = &bytes[take..];
            if self.written == *len {
                self.current += 1;
                self.written = 0;
                self.skip_empty();
            }
        }
        Ok(())
    }

    /// Tensors without values are written as soon as they are reached.
    fn skip_empty(&mut self) {
        while self
            .tensors
            .get(self.current)
            .is_some_and(|(_, _, _, len)| *len == 0)
        {
            self.current += 1;
        }
    }

    /// Sets a metadata entry; written when the file is [finished](Self::finish).
    pub fn set_metadata(&mut self, key: &str, value: String) {
        self.metadata.insert(key.to_string(), value);
    }

    /// Checks that every tensor was written whole, rewrites the header if its metadata
    /// changed, and gives the writer back.
    pub fn finish(mut self) -> Result<W, Error> {
        if let Some((name, _, _, len)) = self.tensors.get(self.current) {
            return Err(Error::Mismatch {
                name: name.clone(),
                problem: format!("{} bytes written of {len}", self.written),
            });
        }
        let header = header(&self.tensors, &self.metadata)?;
        if header.len() > self.header_len {
            return Err(Error::Format(format!(
                "metadata set after the start takes {} bytes more than the header's (set a placeholder of its length first)",
                header.len() - self.header_len
            )));
        }
        self.out.seek(SeekFrom::Start(0)).map_err(Error::Write)?;
        self.write_header(&header)?;
        self.out.seek(SeekFrom::End(0)).map_err(Error::Write)?;
        Ok(self.out)
    }
}

/// The header's JSON: the metadata (in key order), then each tensor's entry in file order.
fn header(
    tensors: &[(String, Dtype, Vec<usize>, u64)],
    metadata: &Metadata,
) -> Result<Vec<u8>, Error> {
    let json = Error::HeaderEncode;
    let mut header = b"{".to_vec();
    if !metadata.is_empty() {
        header.extend_from_slice(b"\"__metadata__\":");
        header.extend(serde_json::to_vec(metadata).map_err(json)?);
    }
    let mut offset = 0u64;
    for (name, dtype, shape, len) in tensors {
        if header.len() > 1 {
            header.push(b',');
        }
        let entry = serde_json::json!({
            "dtype": dtype,
            "shape": shape,
            "data_offsets": [offset, offset + len],
        });
        header.extend(serde_json::to_vec(name).map_err(json)?);
        header.push(b':');
        header.extend(serde_json::to_vec(&entry).map_err(json)?);
        offset += len;
    }
    header.push(b'}');
    Ok(header)
}

/// Writes the file at `path` atomically: `fill` writes the tensors' bytes into `writer`;
/// the file appears at `path` only once they are all written (fsynced when `durable`).
pub fn write_file(
    path: &Path,
    durable: bool,
    tensors: impl IntoIterator<Item = (String, Dtype, Vec<usize>)>,
    metadata: Metadata,
    fill: impl FnOnce(&mut Writer<std::io::BufWriter<&mut File>>) -> Result<(), Error>,
) -> Result<u64, Error> {
    let mut file = hypha_files::AtomicFile::create(path, hypha_files::Mode::Private)?;
    let size = {
        let out = std::io::BufWriter::with_capacity(CHUNK, file.file());
        let mut writer = Writer::new(out, tensors, metadata)?;
        fill(&mut writer)?;
        let mut out = writer.finish()?;
        out.flush().map_err(Error::Write)?;
        out.stream_position().map_err(Error::Write)?
    };
    file.commit(true, durable)?;
    Ok(size)
}

/// Copies the SafeTensors file `source` holds to a file at `path` (atomically, not fsynced)
/// with its metadata replaced by `metadata`, a chunk at a time; the new file's size.
pub fn rewrite(
    source: &(impl Source + ?Sized),
    path: &Path,
    metadata: &Metadata,
) -> Result<u64, Error> {
    let layout = Layout::read(source)?;
    let listing = layout
        .entries
        .iter()
        .map(|(name, entry)| (name.clone(), entry.dtype, entry.shape.clone()));
    let mut buffer = Vec::new();
    write_file(path, false, listing, metadata.clone(), |writer| {
        for entry in layout.entries.values() {
            entry.chunks(source, 1, &mut buffer, |_, bytes| writer.write(bytes))?;
        }
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f32_bytes(values: &[f32]) -> Vec<u8> {
        values.iter().flat_map(|v| v.to_le_bytes()).collect()
    }

    #[test]
    fn a_written_file_is_read_back_by_the_safetensors_crate_and_by_layout() {
        let mut writer = Writer::new(
            std::io::Cursor::new(Vec::new()),
            [
                ("b".to_string(), Dtype::F32, vec![3]),
                ("a".to_string(), Dtype::I8, vec![2, 2]),
                ("empty".to_string(), Dtype::F32, vec![0]),
            ],
            Metadata::from([
                ("kind".to_string(), "test".to_string()),
                ("hash".to_string(), "0".repeat(64)),
            ]),
        )
        .unwrap();
        writer.write(&f32_bytes(&[1.0, 2.0])).unwrap();
        // The last of "b" and the first of "a" in one piece.
        let mut across = f32_bytes(&[3.0]);
        across.extend([1, 2]);
        writer.write(&across).unwrap();
        writer.write(&[3, 4]).unwrap();
        writer.set_metadata("hash", "x".repeat(64));
        let mut longer = Writer::new(
            std::io::Cursor::new(Vec::new()),
            [("w".to_string(), Dtype::U8, vec![1])],
            Metadata::new(),
        )
        .unwrap();
        longer.write(&[1]).unwrap();
        longer.set_metadata("hash", "x".repeat(64));
        assert!(longer.finish().is_err(), "the header has no room for it");
        // Nothing fits after the last tensor.
        let mut full = Writer::new(
            std::io::Cursor::new(Vec::new()),
            [("w".to_string(), Dtype::U8, vec![1])],
            Metadata::new(),
        )
        .unwrap();
        assert!(full.write(&[1, 2]).is_err());
        let bytes = writer.finish().unwrap().into_inner();

        let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        assert_eq!(
            file.tensor("b").unwrap().data(),
            &f32_bytes(&[1.0, 2.0, 3.0])[..]
        );
        assert_eq!(file.tensor("a").unwrap().data(), &[1, 2, 3, 4]);
        let layout = Layout::read(&bytes[..]).unwrap();
        assert_eq!(layout.metadata["hash"], "x".repeat(64));
        assert_eq!(layout.metadata["kind"], "test");
        let a = &layout.entries["a"];
        assert_eq!(
            (a.dtype, a.shape.clone(), a.len),
            (Dtype::I8, vec![2, 2], 4)
        );
        assert_eq!(&bytes[a.offset as usize..][..4], &[1, 2, 3, 4]);
    }

    #[test]
    fn a_writer_that_was_not_given_every_byte_does_not_finish() {
        let mut writer = Writer::new(
            std::io::Cursor::new(Vec::new()),
            [("w".to_string(), Dtype::F32, vec![2])],
            Metadata::new(),
        )
        .unwrap();
        writer.write(&[0; 4]).unwrap();
        let error = writer.finish().unwrap_err();
        assert!(
            error.to_string().contains("4 bytes written of 8"),
            "{error}"
        );
    }

    #[test]
    fn a_header_that_does_not_match_the_file_is_refused() {
        let mut bytes = safetensors::serialize(
            [(
                "w",
                safetensors::tensor::TensorView::new(Dtype::F32, vec![2], &[0u8; 8]).unwrap(),
            )],
            None,
        )
        .unwrap();
        assert!(Layout::read(&bytes[..]).is_ok());
        bytes.push(0);
        assert!(Layout::read(&bytes[..]).is_err());
        bytes.truncate(bytes.len() - 3);
        assert!(Layout::read(&bytes[..]).is_err());
        assert!(Layout::read(&bytes[..5]).is_err());
        let mut huge = bytes.clone();
        huge[..8].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(Layout::read(&huge[..]).is_err());
    }

    /// The crate checks each tensor's size; the sum of them is the sender's to choose.
    #[test]
    fn a_header_whose_tensors_add_up_past_u64_is_refused() {
        // 2⁶⁰ bytes each: the most whose bits the crate can count.
        let big: u64 = 1 << 60;
        let mut entries = Vec::new();
        let mut offset = 0u64;
        for i in 0..16u64 {
            let len = if i == 15 { big - 16 } else { big };
            entries.push(format!(
                "\"t{i}\":{{\"dtype\":\"U8\",\"shape\":[{len}],\"data_offsets\":[{offset},{}]}}",
                offset + len
            ));
            offset += len;
        }
        let header = format!("{{{}}}", entries.join(","));
        let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
        bytes.extend(header.as_bytes());
        let error = Layout::read(&bytes[..]).unwrap_err();
        assert!(error.to_string().contains("describes"), "{error}");
    }

    #[test]
    fn chunks_never_split_a_unit() {
        let data: Vec<u8> = (0..(3 * CHUNK + 10)).map(|i| i as u8).collect();
        let entry = Entry {
            dtype: Dtype::U8,
            shape: vec![data.len() - 2],
            offset: 2,
            len: (data.len() - 2) as u64,
        };
        let mut seen = Vec::new();
        entry
            .chunks(&data[..], 3, &mut Vec::new(), |at, bytes| {
                assert_eq!(at as usize, seen.len());
                assert!(bytes.len() % 3 == 0 || at + bytes.len() as u64 == entry.len);
                seen.extend_from_slice(bytes);
                Ok(())
            })
            .unwrap();
        assert_eq!(seen, data[2..]);
    }
}
