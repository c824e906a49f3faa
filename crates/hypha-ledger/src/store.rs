//! The ledger's durable form in `redb`: the iteration's spec, the workers it has seen, and the
//! audit log.
//!
//! The audit log is the state: every transition of every slice is one row, and opening a ledger
//! replays them. One write per transition keeps the log and the state from ever disagreeing,
//! and makes the log complete by construction. Rows are fixed-size little-endian records (see
//! [`Record::encode`]); their layout is part of the format, like the permutation.

use std::path::Path;

use redb::{
    Database, Durability, ReadOnlyDatabase, ReadableDatabase, ReadableTable, TableDefinition,
};

use crate::{Error, Event, IterationSpec, ReturnReason, SliceKey};

const META: TableDefinition<&str, &[u8]> = TableDefinition::new("meta");
const WORKERS: TableDefinition<u32, &str> = TableDefinition::new("workers");
const AUDIT: TableDefinition<u64, &[u8]> = TableDefinition::new("audit");

/// The format this build writes and reads.
const FORMAT: &[u8] = b"hypha-ledger/1";

/// One stored transition, with workers as interned numbers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Record {
    pub time_ms: u64,
    pub key: SliceKey,
    pub kind: Kind,
    pub worker: u32,
    /// The lease deadline (assigned) or the round (consumed, used); the reason (returned).
    pub value: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    Assigned = 1,
    Consumed = 2,
    Used = 3,
    Returned = 4,
}

const RECORD_LEN: usize = 8 + 4 + 8 + 1 + 4 + 8;

impl Record {
    fn encode(&self) -> [u8; RECORD_LEN] {
        let mut out = [0u8; RECORD_LEN];
        out[0..8].copy_from_slice(&self.time_ms.to_le_bytes());
        out[8..12].copy_from_slice(&self.key.epoch.to_le_bytes());
        out[12..20].copy_from_slice(&self.key.slice.to_le_bytes());
        out[20] = self.kind as u8;
        out[21..25].copy_from_slice(&self.worker.to_le_bytes());
        out[25..33].copy_from_slice(&self.value.to_le_bytes());
        out
    }

    fn decode(seq: u64, bytes: &[u8]) -> Result<Self, Error> {
        let corrupt = || Error::Corrupt(format!("audit row {seq} is malformed"));
        let bytes: &[u8; RECORD_LEN] = bytes.try_into().map_err(|_| corrupt())?;
        let u64_at = |at: usize| {
            let mut b = [0u8; 8];
            b.copy_from_slice(&bytes[at..at + 8]);
            u64::from_le_bytes(b)
        };
        let u32_at = |at: usize| {
            let mut b = [0u8; 4];
            b.copy_from_slice(&bytes[at..at + 4]);
            u32::from_le_bytes(b)
        };
        let kind = match bytes[20] {
            1 => Kind::Assigned,
            2 => Kind::Consumed,
            3 => Kind::Used,
            4 => Kind::Returned,
            _ => return Err(corrupt()),
        };
        Ok(Self {
            time_ms: u64_at(0),
            key: SliceKey {
                epoch: u32_at(8),
                slice: u64_at(12),
            },
            kind,
            worker: u32_at(21),
            value: u64_at(25),
        })
    }

    /// The record as the public event it stands for.
    pub(crate) fn event(&self, workers: &[String]) -> Event {
        let worker = workers
            .get(self.worker as usize)
            .cloned()
            .unwrap_or_default();
        match self.kind {
            Kind::Assigned => Event::Assigned {
                worker,
                deadline_ms: self.value,
            },
            Kind::Consumed => Event::Consumed {
                worker,
                round: self.value,
            },
            Kind::Used => Event::Used {
                worker,
                round: self.value,
            },
            Kind::Returned => Event::Returned {
                worker,
                reason: ReturnReason::from_code(self.value),
            },
        }
    }
}

/// Everything a ledger holds on disk, read back.
pub(crate) struct Loaded {
    pub spec: IterationSpec,
    pub id: String,
    pub workers: Vec<String>,
    pub records: Vec<Record>,
}

pub(crate) struct Store {
    db: Database,
    next_seq: u64,
}

/// Transitions and newly seen workers waiting to be committed together.
#[derive(Debug, Default)]
pub(crate) struct Writes {
    pub workers: Vec<(u32, String)>,
    pub records: Vec<Record>,
}

impl Writes {
    pub fn is_empty(&self) -> bool {
        self.workers.is_empty() && self.records.is_empty()
    }
}

impl Store {
    /// Creates a ledger file for a new iteration; refuses to touch an existing one.
    pub fn create(path: &Path, spec: &IterationSpec, id: &str) -> Result<Self, Error> {
        if path.exists() {
            return Err(Error::Exists(path.to_path_buf()));
        }
        let db = Database::create(path).map_err(redb::Error::from)?;
        let mut txn = db.begin_write().map_err(redb::Error::from)?;
        txn.set_durability(Durability::Immediate)
            .map_err(redb::Error::from)?;
        {
            let mut meta = txn.open_table(META).map_err(redb::Error::from)?;
            let spec_json = serde_json::to_vec(spec).map_err(|e| Error::Corrupt(e.to_string()))?;
            meta.insert("format", FORMAT).map_err(redb::Error::from)?;
            meta.insert("spec", spec_json.as_slice())
                .map_err(redb::Error::from)?;
            meta.insert("id", id.as_bytes())
                .map_err(redb::Error::from)?;
            txn.open_table(WORKERS).map_err(redb::Error::from)?;
            txn.open_table(AUDIT).map_err(redb::Error::from)?;
        }
        txn.commit().map_err(redb::Error::from)?;
        Ok(Self { db, next_seq: 0 })
    }

    /// Opens an existing ledger file and reads it whole.
    pub fn open(path: &Path) -> Result<(Self, Loaded), Error> {
        if !path.exists() {
            return Err(Error::Missing(path.to_path_buf()));
        }
        let db = open_file(path)?;
        let loaded = read(&db)?;
        let next_seq = loaded.records.len() as u64;
        Ok((Self { db, next_seq }, loaded))
    }

    /// Writes one batch of new workers and transitions in one durable transaction.
    pub fn commit(&mut self, writes: &Writes) -> Result<(), Error> {
        if writes.is_empty() {
            return Ok(());
        }
        let Writes {
            workers: new_workers,
            records,
        } = writes;
        let mut txn = self.db.begin_write().map_err(redb::Error::from)?;
        txn.set_durability(Durability::Immediate)
            .map_err(redb::Error::from)?;
        {
            let mut workers = txn.open_table(WORKERS).map_err(redb::Error::from)?;
            for (id, name) in new_workers {
                workers
                    .insert(*id, name.as_str())
                    .map_err(redb::Error::from)?;
            }
            let mut audit = txn.open_table(AUDIT).map_err(redb::Error::from)?;
            for (offset, record) in records.iter().enumerate() {
                audit
                    .insert(self.next_seq + offset as u64, record.encode().as_slice())
                    .map_err(redb::Error::from)?;
            }
        }
        txn.commit().map_err(redb::Error::from)?;
        self.next_seq += records.len() as u64;
        Ok(())
    }
}

/// Reads a ledger file without changing it (for audits while no one writes it). A file left
/// by a process that died mid-write needs redb's repair: that is done on a copy in a temporary
/// directory, so that an audit never writes what it audits.
pub(crate) fn read_file(path: &Path) -> Result<Loaded, Error> {
    if !path.exists() {
        return Err(Error::Missing(path.to_path_buf()));
    }
    match ReadOnlyDatabase::open(path) {
        Ok(db) => read(&db),
        Err(redb::DatabaseError::DatabaseAlreadyOpen) => Err(Error::InUse(path.to_path_buf())),
        Err(redb::DatabaseError::RepairAborted) => {
            let dir = tempfile::tempdir()?;
            let copy = dir.path().join("ledger");
            std::fs::copy(path, &copy)?;
            read(&open_file(&copy)?)
        }
        Err(e) => Err(Error::Store(e.into())),
    }
}

/// Opens an existing ledger file, repairing it after a crash.
fn open_file(path: &Path) -> Result<Database, Error> {
    Database::create(path).map_err(|e| match e {
        redb::DatabaseError::DatabaseAlreadyOpen => Error::InUse(path.to_path_buf()),
        e => Error::Store(e.into()),
    })
}

fn read(db: &impl ReadableDatabase) -> Result<Loaded, Error> {
    let txn = db.begin_read().map_err(redb::Error::from)?;
    let meta = txn.open_table(META).map_err(redb::Error::from)?;
    let field = |name: &str| -> Result<Vec<u8>, Error> {
        Ok(meta
            .get(name)
            .map_err(redb::Error::from)?
            .ok_or_else(|| Error::Corrupt(format!("the ledger has no {name:?}")))?
            .value()
            .to_vec())
    };
    let format = field("format")?;
    if format != FORMAT {
        return Err(Error::Corrupt(format!(
            "the ledger's format is {:?}; this build reads {:?}",
            String::from_utf8_lossy(&format),
            String::from_utf8_lossy(FORMAT)
        )));
    }
    let spec: IterationSpec = serde_json::from_slice(&field("spec")?)
        .map_err(|e| Error::Corrupt(format!("the ledger's spec: {e}")))?;
    let id = String::from_utf8(field("id")?)
        .map_err(|_| Error::Corrupt("the ledger's id is not UTF-8".into()))?;

    let mut workers = Vec::new();
    for row in txn
        .open_table(WORKERS)
        .map_err(redb::Error::from)?
        .iter()
        .map_err(redb::Error::from)?
    {
        let (number, name) = row.map_err(redb::Error::from)?;
        if number.value() as usize != workers.len() {
            return Err(Error::Corrupt("worker numbers have a gap".into()));
        }
        workers.push(name.value().to_string());
    }

    let mut records = Vec::new();
    for row in txn
        .open_table(AUDIT)
        .map_err(redb::Error::from)?
        .iter()
        .map_err(redb::Error::from)?
    {
        let (seq, bytes) = row.map_err(redb::Error::from)?;
        if seq.value() != records.len() as u64 {
            return Err(Error::Corrupt("audit rows have a gap".into()));
        }
        let record = Record::decode(seq.value(), bytes.value())?;
        if record.worker as usize >= workers.len() {
            return Err(Error::Corrupt(format!(
                "audit row {} names an unknown worker",
                seq.value()
            )));
        }
        records.push(record);
    }
    Ok(Loaded {
        spec,
        id,
        workers,
        records,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_round_trip() {
        let record = Record {
            time_ms: 1_700_000_000_123,
            key: SliceKey {
                epoch: 3,
                slice: 1 << 40,
            },
            kind: Kind::Consumed,
            worker: 17,
            value: 99,
        };
        assert_eq!(Record::decode(0, &record.encode()).ok(), Some(record));
        assert!(Record::decode(0, &[0u8; 5]).is_err());
    }
}
