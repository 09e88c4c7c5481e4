//! schedc-cuda
pub mod api;
pub mod host;
pub mod kernels;
pub mod layout;
pub mod model;
