//! What a node holds of an artifact: the chunks, their hashes and where they came from,
//! shared between the swarm's actor and the chunk server. The swarm's rules keep their own
//! record and tell the actor what changes ([`Action::Hold`](super::state::Action),
//! `Release`): this is the chunk server's view of it.

use std::sync::{
    Arc, Mutex,
    atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering},
};

use hypha_network::shares::PeerShares;
use tokio::sync::Semaphore;

use crate::assembly::Assembly;

/// A chunk this node holds: its hash, and whether the bytes came from the origin itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Held {
    pub(crate) hash: [u8; 32],
    pub(crate) from_origin: bool,
}

/// What a node holds of an artifact, shared with the chunk server.
#[derive(Debug)]
pub(crate) struct Holding {
    pub(crate) assembly: Arc<Assembly>,
    chunks: Vec<Mutex<Option<Held>>>,
    /// Chunks found changed on disk while being served: no longer served from here (the
    /// cache's stamps have them fetched again by the next fetch of the artifact).
    pub(super) damaged: Vec<AtomicBool>,
    pub(super) held: AtomicU32,
    pub(crate) uploads: Arc<Semaphore>,
    upload_slots: usize,
    /// At most half the upload slots go to one peer.
    pub(super) upload_shares: PeerShares,
    pub(crate) uploaded_chunks: AtomicU64,
    pub(crate) uploaded_bytes: AtomicU64,
}

impl Holding {
    pub(crate) fn new(assembly: Arc<Assembly>, upload_slots: usize) -> Holding {
        let count = assembly.manifest().chunk_count() as usize;
        Holding {
            assembly,
            chunks: (0..count).map(|_| Mutex::new(None)).collect(),
            damaged: (0..count).map(|_| AtomicBool::new(false)).collect(),
            held: AtomicU32::new(0),
            uploads: Arc::new(Semaphore::new(upload_slots.max(1))),
            upload_slots: upload_slots.max(1),
            upload_shares: PeerShares::new(upload_slots.div_ceil(2)),
            uploaded_chunks: AtomicU64::new(0),
            uploaded_bytes: AtomicU64::new(0),
        }
    }

    pub(super) fn slot(&self, chunk: u32) -> Option<std::sync::MutexGuard<'_, Option<Held>>> {
        self.chunks
            .get(chunk as usize)
            .map(|slot| slot.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// The chunk's hash if it is held (written and verified).
    pub(crate) fn held(&self, chunk: u32) -> Option<[u8; 32]> {
        self.held_as(chunk).map(|held| held.hash)
    }

    pub(crate) fn held_as(&self, chunk: u32) -> Option<Held> {
        self.slot(chunk).and_then(|slot| *slot)
    }

    /// Records a chunk as held, unless it already is.
    pub(crate) fn hold(&self, chunk: u32, held: Held) {
        if let Some(mut slot) = self.slot(chunk)
            && slot.is_none()
        {
            *slot = Some(held);
            self.held.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Forgets a held chunk (its bytes stay until they are written again); whether it was held.
    pub(super) fn release(&self, chunk: u32) -> bool {
        let released = self.slot(chunk).and_then(|mut slot| slot.take()).is_some();
        if released {
            self.held.fetch_sub(1, Ordering::Relaxed);
        }
        released
    }

    /// Takes note that `chunk`'s bytes on disk no longer match its hash.
    pub(super) fn damaged(&self, chunk: u32) {
        if let Some(flag) = self.damaged.get(chunk as usize)
            && !flag.swap(true, Ordering::AcqRel)
        {
            tracing::warn!(
                artifact = %self.assembly.manifest().id,
                chunk,
                "a chunk on disk no longer matches the hash it was verified with; no longer serving it"
            );
        }
    }

    pub(super) fn is_damaged(&self, chunk: u32) -> bool {
        self.damaged
            .get(chunk as usize)
            .is_some_and(|flag| flag.load(Ordering::Acquire))
    }

    pub(crate) fn held_count(&self) -> u32 {
        self.held.load(Ordering::Relaxed)
    }

    pub(super) fn uploads_now(&self) -> u32 {
        (self.upload_slots - self.uploads.available_permits()) as u32
    }
}
