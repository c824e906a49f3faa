//! Empty: a build script makes cargo build this crate's build-dependencies, which unify the
//! features of build-time crates (`cc`, `syn`) as the dependencies unify the others.

fn main() {}
