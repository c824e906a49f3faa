//! The DiLoCo settings a scheduler gives the executors of a job, typed once for everyone
//! who writes or reads them.
//!
//! - [`TrainerConfig`]: the `diloco` key of a trainer's job config (the job file's `[config]`
//!   with `data` and `diloco` added). The Rust trainer and the Python SDK read it; the
//!   bridge's `openapi.json` describes it (`components.schemas.TrainerConfig`), and the SDK's
//!   tests check their reading against that description.
//! - [`ServerConfig`]: the built-in parameter server's whole job config.
//!
//! Both carry the job's [`Compression`]: the codec's name under `compression` and its own
//! keys beside it (`topk_density`, `sparse_density`, …), flat, as the job file's `[diloco]`
//! table has them. What a codec's keys mean and which values are in range is
//! `hypha_diloco::codec`'s to say (`Codec::try_from(Compression)`); this module holds shapes.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// A trainer's DiLoCo settings: the `diloco` key of its job's config.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct TrainerConfig {
    /// Samples in an inner step's batch.
    pub batch_size: u64,
    /// The inner steps' AdamW.
    pub inner: InnerOptimizer,
    /// How pseudo-gradients are compressed, with the codec's own keys beside it.
    #[serde(flatten, deserialize_with = "compression_or_none")]
    pub compression: Compression,
    /// Train on into the next round while the pseudo-gradient travels, and move what was
    /// trained onto the new global model when it arrives (one round of delay).
    #[serde(default)]
    pub overlap: bool,
}

/// The parameter server's job config.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ServerConfig {
    /// The outer step.
    pub outer: OuterOptimizer,
    /// The job's codec: the global model's changes go back compressed with its broadcast
    /// form (`hypha_diloco::Codec::for_broadcast`).
    #[serde(flatten, deserialize_with = "compression_or_none")]
    pub compression: Compression,
    /// The most samples one update may claim (its weight in the mean).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_samples: Option<u64>,
    /// An update whose L2 norm is more than this many times the round's reference norm
    /// counts for that many times the reference (clipped, `hypha_diloco::robust`); unset:
    /// no check. `max_norm_ratio` is read too (what schedulers before this type wrote).
    #[serde(
        default,
        alias = "max_norm_ratio",
        skip_serializing_if = "Option::is_none"
    )]
    pub max_update_norm_ratio: Option<f64>,
    /// The samples a round is planned to hold: a round with fewer steps by the share it
    /// holds (a tail round at the end of the data); unset: every round steps whole.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub samples_per_round: Option<u64>,
    /// Checkpoint every this many rounds; unset: by traffic.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpoint_every: Option<u64>,
    /// Start from the scheduler's checkpoint of this round instead of a trainer's model.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restore: Option<Restore>,
    /// Follow the serving server until the scheduler says to take over.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub standby: bool,
}

/// The checkpoint a parameter server starts from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Restore {
    pub round: u64,
}

/// `sparse`'s share of a chunk's values kept unless the job says otherwise: 64 of 4,096
/// (Covenant's setting). With Elias-Fano offsets it takes 88 bytes a chunk, 0.0054 of f32;
/// on `hypha-bench outcome`'s text 1.66 % ended 1.2 % nearer f32 than 1 % (BENCHMARKS.md).
pub const SPARSE_DENSITY: f32 = 0.015625;
/// `sparse`'s bits a kept value unless the job says otherwise.
pub const SPARSE_BITS: u8 = 2;
/// `sparse`'s share of a trainer's residual carried on unless the job says otherwise. With
/// it the residual is the trainer's outer momentum, as in SparseLoCo, and the parameter
/// server steps without one (`hypha_diloco::codec::SPARSE_OUTER`). On `hypha-bench
/// outcome`'s real text (64 rounds; BENCHMARKS.md, "outcome"), with the outer step 1.25, the
/// changes sent back at 4× and each chunk's levels fitted to its values, 0.97 ended at 1.019
/// of f32's held-out loss on two seeds (1.021 and 1.022 with overlap) and 0.95, SparseLoCo's
/// value, at 1.023 (with the levels at the chunk's smallest and largest value, 0.97 lagged:
/// 1.031, and 0.95 was chosen).
pub const SPARSE_DECAY: f32 = 0.97;

/// A job's codec with its parameters, as `compression = "…"` and the codec's own keys.
/// Unset parameters take the codec's defaults (`hypha_diloco::codec`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(tag = "compression", rename_all = "lowercase")]
pub enum Compression {
    /// Full f32.
    #[default]
    None,
    /// bfloat16: half the bytes.
    Bf16,
    /// Blockwise int8 with a scale per 256 values: about a quarter of the bytes.
    Int8,
    /// The share `topk_density` of each tensor's values of largest magnitude, with their
    /// positions.
    Topk {
        /// The share of each tensor's values kept, in (0, 1].
        #[schemars(extend("exclusiveMinimum" = 0, "maximum" = 1))]
        topk_density: f32,
    },
    /// The largest values of every chunk of 4,096, 2 or 4 bits each, with error feedback
    /// that decays.
    Sparse {
        /// The share of each chunk's values kept, in (0, 1].
        #[serde(default, skip_serializing_if = "Option::is_none")]
        #[schemars(extend("default" = decimal(SPARSE_DENSITY), "exclusiveMinimum" = 0, "maximum" = 1))]
        sparse_density: Option<f32>,
        /// Bits a kept value, 2 or 4.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        #[schemars(extend("default" = SPARSE_BITS, "enum" = [2, 4, null]))]
        sparse_bits: Option<u8>,
        /// The share of a trainer's residual carried into its next update, in (0, 1].
        #[serde(default, skip_serializing_if = "Option::is_none")]
        #[schemars(extend("default" = decimal(SPARSE_DECAY), "exclusiveMinimum" = 0, "maximum" = 1))]
        sparse_decay: Option<f32>,
    },
}

/// The [`Compression`] among a config's other keys; a config without `compression` (written
/// by hand: schedulers always write it) sends f32, as it did before the key existed.
fn compression_or_none<'de, D: serde::Deserializer<'de>>(
    deserializer: D,
) -> Result<Compression, D::Error> {
    let keys = serde_json::Map::deserialize(deserializer)?;
    if !keys.contains_key("compression") {
        return Ok(Compression::None);
    }
    Compression::deserialize(serde_json::Value::Object(keys)).map_err(serde::de::Error::custom)
}

/// `value` as the decimal it was written as (0.8, not the f32's 0.800000011920929), for the
/// schema's defaults.
fn decimal(value: f32) -> f64 {
    value.to_string().parse().unwrap_or(value.into())
}

/// The trainers' AdamW.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct InnerOptimizer {
    pub learning_rate: f64,
    pub weight_decay: f64,
    pub beta1: f64,
    pub beta2: f64,
}

impl Default for InnerOptimizer {
    fn default() -> Self {
        // DiLoCo's paper trains its inner loop with AdamW at these betas.
        Self {
            learning_rate: 1e-3,
            weight_decay: 0.01,
            beta1: 0.9,
            beta2: 0.999,
        }
    }
}

/// The parameter server's outer step: SGD with Nesterov momentum (plain SGD at momentum 0).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct OuterOptimizer {
    pub learning_rate: f64,
    pub momentum: f64,
}

impl Default for OuterOptimizer {
    fn default() -> Self {
        // The DiLoCo paper's outer settings.
        Self {
            learning_rate: 0.7,
            momentum: 0.9,
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn a_codec_and_its_keys_travel_flat_beside_the_other_settings() {
        let config = TrainerConfig {
            batch_size: 32,
            inner: InnerOptimizer::default(),
            compression: Compression::Sparse {
                sparse_density: Some(0.02),
                sparse_bits: None,
                sparse_decay: None,
            },
            overlap: true,
        };
        let json = serde_json::to_value(config).unwrap();
        assert_eq!(json["compression"], "sparse");
        assert_eq!(json["sparse_density"], 0.02f32);
        assert!(json.get("sparse_bits").is_none(), "unset keys are left out");
        assert_eq!(
            serde_json::from_value::<TrainerConfig>(json).unwrap(),
            config
        );
        let topk: TrainerConfig = serde_json::from_str(
            r#"{"batch_size": 8, "inner": {"learning_rate": 0.1, "weight_decay": 0, "beta1": 0.9, "beta2": 0.99}, "compression": "topk", "topk_density": 0.5}"#,
        )
        .unwrap();
        assert_eq!(topk.compression, Compression::Topk { topk_density: 0.5 });
        assert!(!topk.overlap);
        let error = serde_json::from_str::<TrainerConfig>(
            r#"{"batch_size": 8, "inner": {"learning_rate": 0.1, "weight_decay": 0, "beta1": 0.9, "beta2": 0.99}, "compression": "zip"}"#,
        )
        .unwrap_err()
        .to_string();
        assert!(error.contains("zip"), "{error}");
        let unset: ServerConfig =
            serde_json::from_str(r#"{"outer": {"learning_rate": 1.0, "momentum": 0.0}}"#).unwrap();
        assert_eq!(unset.compression, Compression::None, "without the key: f32");
    }

    #[test]
    fn a_server_reads_the_norm_ratio_under_its_old_name_too() {
        let old: ServerConfig = serde_json::from_str(
            r#"{"outer": {"learning_rate": 0.7, "momentum": 0.9}, "compression": "int8", "max_norm_ratio": 10.0, "restore": {"round": 3}}"#,
        )
        .unwrap();
        assert_eq!(old.max_update_norm_ratio, Some(10.0));
        assert_eq!(old.restore, Some(Restore { round: 3 }));
        assert_eq!(old.compression, Compression::Int8);
        let json = serde_json::to_value(old).unwrap();
        assert_eq!(json["max_update_norm_ratio"], 10.0);
        assert!(json.get("max_norm_ratio").is_none() && json.get("standby").is_none());
    }
}
