pub(crate) mod transport;
