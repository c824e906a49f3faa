//! Arithmetic on [`Resources`].

pub use hypha_messages::market::Resources;

/// `a − b`, never below zero.
pub fn minus(a: Resources, b: Resources) -> Resources {
    Resources {
        cpu: (a.cpu - b.cpu).max(0.0),
        memory: (a.memory - b.memory).max(0.0),
        storage: (a.storage - b.storage).max(0.0),
        gpu: (a.gpu - b.gpu).max(0.0),
    }
}

/// `a + b`.
pub fn plus(a: Resources, b: Resources) -> Resources {
    Resources {
        cpu: a.cpu + b.cpu,
        memory: a.memory + b.memory,
        storage: a.storage + b.storage,
        gpu: a.gpu + b.gpu,
    }
}

/// Whether `asked` fits in `available`, kind by kind.
pub fn fits(asked: Resources, available: Resources) -> bool {
    const EPSILON: f64 = 1e-9;
    asked.cpu <= available.cpu + EPSILON
        && asked.memory <= available.memory + EPSILON
        && asked.storage <= available.storage + EPSILON
        && asked.gpu <= available.gpu + EPSILON
}

/// The largest fraction of any kind of `capacity` that `asked` takes (0.0 to 1.0 when it fits).
/// Kinds the worker does not have and the request does not ask for do not count.
pub fn share(asked: Resources, capacity: Resources) -> f64 {
    [
        (asked.cpu, capacity.cpu),
        (asked.memory, capacity.memory),
        (asked.storage, capacity.storage),
        (asked.gpu, capacity.gpu),
    ]
    .into_iter()
    .filter(|(a, _)| *a > 0.0)
    .map(|(a, c)| if c > 0.0 { a / c } else { f64::INFINITY })
    .fold(0.0, f64::max)
}
