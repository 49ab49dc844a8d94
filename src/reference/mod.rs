//! Plain-loop CPU reference (f64 accumulation) for every op and the whole forward pass: the
//! oracle GPU kernels and the GPU forward pass are tested against.
//!
//! [`ops`] holds the single ops over plain `&[f32]` slices; [`forward`] runs a whole model.

pub mod forward;
pub mod ops;

pub use forward::ReferenceModel;
