//! Key → partition: `xxh3_64(key) % 256`, computed once at schedule time and stored with the record.
//!
//! XXH3's output is frozen (xxHash ≥ 0.8.0), so a key keeps its partition across versions and machines.

use xxhash_rust::xxh3::xxh3_64;

/// Number of partitions. Fixed forever: changing it would move keys between partitions and break
/// per-key order for records already stored.
pub const PARTITIONS: u16 = 256;

/// A partition number, `0..256`.
pub type Partition = u8;

/// The partition of a key.
pub fn partition_of(key: &str) -> Partition {
    // PARTITIONS is 256, so the remainder is the low byte.
    (xxh3_64(key.as_bytes()) % u64::from(PARTITIONS)) as Partition
}

/// All partitions, `0..=255`.
pub fn all_partitions() -> impl Iterator<Item = Partition> {
    0..=u8::MAX
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_values_never_change() {
        // Pinned so a dependency upgrade or refactor that moved keys would fail here.
        assert_eq!(xxh3_64(b""), 0x2D06_8005_38D3_94C2);
        assert_eq!(partition_of("order-1"), (xxh3_64(b"order-1") & 0xff) as u8);
        let pinned: Vec<u8> = ["a", "order-1", "customer/42"].iter().map(|k| partition_of(k)).collect();
        assert_eq!(pinned, PINNED);
    }

    // Cross-checked against the reference xxHash implementation (Python `xxhash.xxh3_64_intdigest`).
    const PINNED: [u8; 3] = [31, 118, 232];

    #[test]
    fn keys_spread_over_all_partitions() {
        let mut counts = [0u32; 256];
        for i in 0..256_000 {
            counts[partition_of(&format!("key-{i}")) as usize] += 1;
        }
        let (min, max) = (counts.iter().min().copied(), counts.iter().max().copied());
        assert!(min > Some(850) && max < Some(1150), "uneven spread: {min:?}..{max:?}");
    }
}
