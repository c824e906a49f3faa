pub(crate) mod allocation;
pub(crate) mod ceilings;
pub(crate) mod dataserve;
pub(crate) mod diloco;
pub(crate) mod distribute;
pub(crate) mod ledger;
pub(crate) mod prefetch;
pub(crate) mod transport;
