//! GPUs and their links: the datasheet figures the cost model starts from, and the
//! achieved fractions of them that it uses.
//!
//! Presets (`--hardware h100|h200|h800|b200`); sources in the book's cost-model chapter
//! (NVIDIA's H100/H200/B200 datasheets; H800 as DeepSeek-V3's report describes it, arXiv
//! 2412.19437 §3.1 and §3.2.2). Any other GPU: a TOML file with the same keys.
//!
//! ```toml
//! name = "h800"
//! bf16_flops = 989.4e12      # dense peak, FLOP/s
//! fp8_flops = 1978.9e12      # dense peak, FLOP/s
//! hbm_bytes = 80e9           # memory per GPU, bytes
//! hbm_bandwidth = 3.35e12    # bytes/s
//! nvlink_bandwidth = 200e9   # per GPU, one direction, bytes/s
//! network_bandwidth = 50e9   # per GPU, one direction, bytes/s (400 Gb/s)
//! gpus_per_node = 8
//! # gemm_efficiency = 0.6     # measured fraction of the bf16 peak (default: the fit)
//! # gemm_fp8_efficiency = 0.5
//! ```

use serde::{Deserialize, Serialize};

/// One GPU and its links.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Hardware {
    /// Name.
    pub name: String,
    /// Dense bf16 peak, FLOP/s.
    pub bf16_flops: f64,
    /// Dense fp8 peak, FLOP/s.
    pub fp8_flops: f64,
    /// Memory per GPU, bytes.
    pub hbm_bytes: f64,
    /// Memory bandwidth, bytes/s.
    pub hbm_bandwidth: f64,
    /// NVLink bandwidth per GPU in one direction, bytes/s (datasheet).
    pub nvlink_bandwidth: f64,
    /// Scale-out network bandwidth per GPU in one direction, bytes/s (one 400 Gb/s NIC per
    /// GPU: 50e9).
    pub network_bandwidth: f64,
    /// GPUs per node (one NVLink domain).
    pub gpus_per_node: u32,
    /// The fraction of the bf16 peak a large GEMM reaches on this GPU, when you have
    /// measured it: it replaces the fitted default ([`super::Efficiency::gemm`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gemm_efficiency: Option<f64>,
    /// The same for fp8 GEMMs ([`super::Efficiency::gemm_fp8`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gemm_fp8_efficiency: Option<f64>,
}

/// The preset names.
pub const PRESETS: &[&str] = &["a100", "h100", "h200", "h800", "b200"];

impl Hardware {
    /// A preset: `a100` (SXM 80GB, 200 Gb/s per GPU), `h100` (SXM), `h200` (SXM), `h800` (SXM), `b200` (HGX), each in nodes of 8
    /// with one 400 Gb/s NIC per GPU.
    pub fn preset(name: &str) -> Option<Hardware> {
        if name == "a100" {
            // A100 SXM 80GB: 312 TFLOP/s dense bf16 (no fp8: the fp8 figure is the bf16
            // one), 80 GB HBM2e at 2.039 TB/s, NVLink 3 at 600 GB/s both directions; 200
            // Gb/s per GPU of scale-out network (HDR InfiniBand).
            return Some(Hardware {
                name: name.to_string(),
                bf16_flops: 312e12,
                fp8_flops: 312e12,
                hbm_bytes: 80e9,
                hbm_bandwidth: 2.039e12,
                nvlink_bandwidth: 300e9,
                network_bandwidth: 25e9,
                gpus_per_node: 8,
                gemm_efficiency: None,
                gemm_fp8_efficiency: None,
            });
        }
        let (bf16, hbm, hbm_bw, nvlink) = match name {
            // H100 SXM5: 989.4 TFLOP/s dense bf16, 80 GB HBM3 at 3.35 TB/s, NVLink 4 at 900
            // GB/s both directions.
            "h100" => (989.4e12, 80e9, 3.35e12, 450e9),
            // H200 SXM: H100's compute, 141 GB HBM3e at 4.8 TB/s.
            "h200" => (989.4e12, 141e9, 4.8e12, 450e9),
            // H800 SXM: H100's compute and memory, NVLink cut to 400 GB/s both directions.
            "h800" => (989.4e12, 80e9, 3.35e12, 200e9),
            // B200 (HGX): 2.25 PFLOP/s dense bf16, 180 GB HBM3e at 7.7 TB/s, NVLink 5 at 1.8
            // TB/s both directions.
            "b200" => (2.25e15, 180e9, 7.7e12, 900e9),
            _ => return None,
        };
        Some(Hardware {
            name: name.to_string(),
            bf16_flops: bf16,
            fp8_flops: 2.0 * bf16,
            hbm_bytes: hbm,
            hbm_bandwidth: hbm_bw,
            nvlink_bandwidth: nvlink,
            network_bandwidth: 50e9,
            gpus_per_node: 8,
            gemm_efficiency: None,
            gemm_fp8_efficiency: None,
        })
    }

    /// Checks every figure is finite and positive. Errors name the key.
    pub fn validate(&self) -> Result<(), String> {
        for (k, v) in [
            ("bf16_flops", self.bf16_flops),
            ("fp8_flops", self.fp8_flops),
            ("hbm_bytes", self.hbm_bytes),
            ("hbm_bandwidth", self.hbm_bandwidth),
            ("nvlink_bandwidth", self.nvlink_bandwidth),
            ("network_bandwidth", self.network_bandwidth),
        ] {
            if !(v.is_finite() && v > 0.0) {
                return Err(format!("`{k}` must be a positive number, got {v}"));
            }
        }
        if self.gpus_per_node == 0 {
            return Err("`gpus_per_node` must be at least 1".into());
        }
        for (k, v) in [
            ("gemm_efficiency", self.gemm_efficiency),
            ("gemm_fp8_efficiency", self.gemm_fp8_efficiency),
        ] {
            if let Some(v) = v {
                if !(v > 0.0 && v <= 1.0) {
                    return Err(format!("`{k}` must be in (0, 1], got {v}"));
                }
            }
        }
        Ok(())
    }

    /// A preset name or a TOML file. Errors: an unknown name that is not a file (the presets
    /// listed), an unreadable file, TOML that does not parse or lacks a key (named), or a
    /// value [`Hardware::validate`] refuses.
    pub fn resolve(spec: &str) -> Result<Hardware, String> {
        if let Some(h) = Hardware::preset(spec) {
            return Ok(h);
        }
        let path = std::path::Path::new(spec);
        if !path.exists() {
            return Err(format!(
                "unknown hardware `{spec}`: give a TOML file or a preset ({})",
                PRESETS.join(", ")
            ));
        }
        let text =
            std::fs::read_to_string(path).map_err(|e| format!("cannot read `{spec}`: {e}"))?;
        let h: Hardware = toml::from_str(&text).map_err(|e| format!("{spec}: {e}"))?;
        h.validate().map_err(|e| format!("{spec}: {e}"))?;
        Ok(h)
    }
}
