//! Every third-party dependency of the workspace with one feature set, whichever package
//! cargo builds: each crate depends on this one, which asks for the union of the features the
//! workspace uses (computed by `cargo hakari generate`). Without it, `cargo run -p hypha`
//! after `cargo build` would rebuild the crates whose features differ between the two
//! selections. It holds no code; `tests/unified.rs` checks that it is current.
