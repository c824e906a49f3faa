pub(crate) mod allocation;
pub(crate) mod ceilings;
pub(crate) mod dataserve;
pub(crate) mod transport;
