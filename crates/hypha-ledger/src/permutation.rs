//! The order in which an epoch hands out its slices.
//!
//! A Fisher–Yates shuffle driven by SplitMix64, seeded from the iteration's seed and the epoch
//! number. Both are spelled out here rather than taken from a crate because the order is part
//! of the ledger's stored format: an iteration resumed by a newer build must see the order it
//! started with, whatever a random-number crate does in its next major version. The order
//! depends on nothing but `(seed, epoch, slice count)`, so the number of workers cannot change
//! it.

/// The slice indices `0..count` in the order epoch `epoch` of an iteration seeded with `seed`
/// hands them out.
pub fn permutation(seed: u64, epoch: u32, count: usize) -> Vec<u64> {
    let mut order: Vec<u64> = (0..count as u64).collect();
    // Each epoch gets its own stream; the odd multiplier keeps (seed, epoch) pairs apart.
    let mut rng = SplitMix64(seed ^ u64::from(epoch).wrapping_mul(0xD1B5_4A32_D192_ED03));
    for i in (1..count).rev() {
        let j = rng.below(i as u64 + 1) as usize;
        order.swap(i, j);
    }
    order
}

/// Steele, Lea and Flood's SplitMix64 (the seeding generator of `java.util.SplittableRandom`).
struct SplitMix64(u64);

impl SplitMix64 {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A uniform value in `0..bound` (Lemire's multiply-shift with rejection, so no modulo
    /// bias).
    fn below(&mut self, bound: u64) -> u64 {
        let threshold = bound.wrapping_neg() % bound;
        loop {
            let product = u128::from(self.next()) * u128::from(bound);
            if (product as u64) >= threshold {
                return (product >> 64) as u64;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_slice_appears_once() {
        let mut order = permutation(7, 0, 1000);
        order.sort_unstable();
        assert_eq!(order, (0..1000).collect::<Vec<_>>());
    }

    #[test]
    fn seeds_and_epochs_give_different_orders() {
        let a = permutation(7, 0, 100);
        assert_ne!(a, permutation(7, 1, 100));
        assert_ne!(a, permutation(8, 0, 100));
        assert_eq!(a, permutation(7, 0, 100));
    }

    #[test]
    fn the_order_is_the_stored_format() {
        // Pinned: an iteration resumed by a later build must see this exact order.
        assert_eq!(permutation(42, 0, 10), [8, 3, 6, 5, 4, 0, 9, 2, 1, 7]);
    }

    #[test]
    fn splitmix64_matches_its_reference_output() {
        // The first outputs for seed 0 of the reference implementation (Vigna's splitmix64.c).
        let mut rng = SplitMix64(0);
        assert_eq!(rng.next(), 0xE220_A839_7B1D_CDAF);
        assert_eq!(rng.next(), 0x6E78_9E6A_A1B9_65F4);
    }

    #[test]
    fn tiny_counts() {
        assert!(permutation(1, 0, 0).is_empty());
        assert_eq!(permutation(1, 0, 1), [0]);
    }
}
