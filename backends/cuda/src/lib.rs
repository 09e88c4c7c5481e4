//! schedc-cuda
pub mod api;
pub mod cuda;
pub mod driver;
pub mod host;
pub mod kernels;
pub mod layout;
pub mod memops;
pub mod model;
pub mod nvrtc;
pub mod pool;
pub mod record;
pub mod rendezvous;
pub mod run;
pub mod transport;
