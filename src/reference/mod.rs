//! Plain-loop CPU reference (f64 accumulation) for every op and the whole forward pass.
