//! DeepSeek DualPipe reference traces (placeholder, being written).
