//! Exports of a schedule to training frameworks' own settings: Megatron-LM's command-line
//! flags ([`megatron`]) and torchtitan's pipeline settings next to torch's schedule CSV
//! ([`torchtitan`]).

pub mod megatron;
pub mod torchtitan;

use crate::costmodel::layout::{balanced_layout, parse_layout, Chunk};

/// Why an export failed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ExportError {
    /// The framework cannot run this schedule (the reason, naming what differs): exit
    /// status 1, a rejection.
    Unsupported(String),
    /// The options do not fit the schedule (a layer count below the number of stages, a
    /// layout that does not parse): exit status 2, bad usage.
    Usage(String),
}

impl std::fmt::Display for ExportError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ExportError::Unsupported(s) | ExportError::Usage(s) => f.write_str(s),
        }
    }
}

/// The most transformer layers a model may have here (a layout's repetition count is capped
/// at this).
pub const MAX_LAYERS: u32 = 100_000;

/// Which model layers each of `chunks` model chunks (stages in model order) holds: `layout`
/// (a Megatron-LM layout string, [`parse_layout`]) where given, else the split
/// [`balanced_layout`] writes (an even split where `layers` divides; otherwise the extra
/// layers on the middle chunks first). The embedding goes with chunk 0, the head with the
/// last.
///
/// Errors ([`ExportError::Usage`]): a layout that does not parse or does not hold `layers`
/// layers in `chunks` stages; without one, fewer layers than chunks or more than
/// [`MAX_LAYERS`].
pub fn model_chunks(
    layers: u32,
    chunks: u32,
    layout: Option<&str>,
) -> Result<(Vec<Chunk>, String), ExportError> {
    let text = match layout {
        Some(l) => l.to_string(),
        None => {
            if layers > MAX_LAYERS {
                return Err(ExportError::Usage(format!(
                    "{layers} layers: at most {MAX_LAYERS} are supported"
                )));
            }
            if layers < chunks {
                return Err(ExportError::Usage(format!(
                    "{layers} layer(s) over {chunks} pipeline stages would leave a stage without a transformer layer: give more --layers, fewer stages, or a --layout that says where each layer goes"
                )));
            }
            balanced_layout(layers, chunks)
        }
    };
    let c = parse_layout(&text, layers, chunks).map_err(ExportError::Usage)?;
    Ok((c, text))
}
