//! schedc-cuda
pub mod api;
pub mod driver;
pub mod host;
pub mod kernels;
pub mod layout;
pub mod model;
pub mod pool;
pub mod record;
pub mod transport;
