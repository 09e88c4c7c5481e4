//! `schedc compare` (placeholder).
