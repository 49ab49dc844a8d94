//! Typed kernel choices: which layout each kernel takes is chosen from the adapter
//! (`kernels::linear::{matvec_layout, packed_matvec_layout, matmul_layout, xbcast_fits,
//! tiled_fits, xu_fits, packed_f16}`, `kernels::x_texture::fits`); a library caller
//! ([`DeviceOptions::kernels`](super::DeviceOptions), [`GpuContext::with_kernels`](super::GpuContext::with_kernels))
//! or the CLI (`--matvec`, `--matmul`, `--no-xbcast`, ...) overrides them, for comparisons
//! and tests. Nothing reads the environment to pick a kernel.

use std::str::FromStr;

/// A forced decode matvec layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MatvecLayout {
    /// One invocation per output row (float weights; packed weights take `Rows4`).
    Thread,
    /// Four adjacent rows per invocation, workgroups of 8 (CPU adapters' layout).
    Rows4,
    /// A workgroup of 8 per row.
    Wg8,
    /// A workgroup of 64 per row (GPUs' float-weight layout).
    Wg64,
    /// Packed weights: two rows per 64-wide workgroup in 16-element units (GPUs' packed
    /// layout); float weights take `Wg64`.
    MultiRow,
}

/// A forced prefill matmul.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MatmulLayout {
    /// Workgroup-memory tiles (GPUs).
    Tiled,
    /// Register blocks of 8 tokens x 8 rows, no workgroup memory (CPU adapters).
    Blocked,
}

/// What a name does not name.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown {what} `{given}` (expected one of: {expected})")]
pub struct UnknownLayout {
    pub what: &'static str,
    pub given: String,
    pub expected: &'static str,
}

impl FromStr for MatvecLayout {
    type Err = UnknownLayout;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "thread" => Ok(MatvecLayout::Thread),
            "rows4" => Ok(MatvecLayout::Rows4),
            "wg8" => Ok(MatvecLayout::Wg8),
            "wg64" => Ok(MatvecLayout::Wg64),
            "multirow" => Ok(MatvecLayout::MultiRow),
            _ => Err(UnknownLayout { what: "matvec layout", given: s.into(), expected: "thread, rows4, wg8, wg64, multirow" }),
        }
    }
}

impl FromStr for MatmulLayout {
    type Err = UnknownLayout;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "tiled" => Ok(MatmulLayout::Tiled),
            "blocked" => Ok(MatmulLayout::Blocked),
            _ => Err(UnknownLayout { what: "matmul layout", given: s.into(), expected: "tiled, blocked" }),
        }
    }
}

/// The kernel choices of a context. The default takes what the adapter suits; each field
/// narrows it. A switched-on path still runs only where the adapter can run it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct KernelOptions {
    /// The decode matvec's layout (`None`: the adapter's).
    pub matvec: Option<MatvecLayout>,
    /// The prefill matmul (`None`: the adapter's).
    pub matmul: Option<MatmulLayout>,
    /// x shared by `subgroupBroadcast` where the workgroup of 8 is one subgroup (`XBCAST`).
    pub xbcast: bool,
    /// Packed weights held as tiled textures on CPU adapters with 8-lane subgroups (`TEX`);
    /// off, they stay in storage buffers (and x textures are off too). Per model:
    /// `ModelOptions::weight_textures`.
    pub weight_textures: bool,
    /// The tiled matvec reads x and the norm weight through 64 KiB uniform windows (`XU`).
    pub uniform_x: bool,
    /// The CPU adapters' blocked matmul reads x from a texture copy of the step (`XTEX`).
    pub x_textures: bool,
    /// GPUs with shader-f16 dequantize packed weights in half precision.
    pub f16_dequant: bool,
}

impl Default for KernelOptions {
    fn default() -> Self {
        KernelOptions {
            matvec: None,
            matmul: None,
            xbcast: true,
            weight_textures: true,
            uniform_x: true,
            x_textures: true,
            f16_dequant: true,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts_parse_by_name_and_refuse_others_by_name() {
        assert_eq!("multirow".parse::<MatvecLayout>(), Ok(MatvecLayout::MultiRow));
        assert_eq!("blocked".parse::<MatmulLayout>(), Ok(MatmulLayout::Blocked));
        let e = "rows8".parse::<MatvecLayout>().unwrap_err();
        assert!(e.to_string().contains("rows8") && e.to_string().contains("rows4"), "{e}");
    }
}
