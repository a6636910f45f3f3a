//! CUDA twins of the convolutions and of nearest ×2 upsampling (`conv.cu`). A convolution takes one of
//! three paths, chosen by [`ConvAlgo`] (default `Auto`: [`auto_conv_algo`] per call, i.e. im2col for an
//! unpadded 1×1×1 kernel and cuDNN on channels-last data for everything else):
//!
//! **cuDNN on NCDHW** (`crate::cuda::cudnn`, [`ConvAlgo::Cudnn`]): `cudnnConvolutionForward` on our
//! NCDHW tensors, the algorithm measured once per shape, then `conv_bias_add` in place. cuDNN pads
//! symmetrically and reads one input buffer, so a causal conv (time padding kt − 1 in front, none
//! behind) and its cached frames are first joined into one buffer by one copy (`conv_join_frames`:
//! zero frames, cache, x) and run with no time padding; a conv with symmetric padding and no cache
//! reads x in place.
//!
//! **cuDNN on NDHWC** ([`ConvAlgo::CudnnNdhwc`]): cuDNN's legacy NCDHW algorithms are slow at some of
//! the VAE's shapes (20 TFLOP/s at 96 channels full size) where its channels-last ones are not, so the
//! input is rewritten channels-last once: `conv_to_ndhwc` writes the frame join above (zero frames,
//! cache, x) transposed to [B, F, H, W, C_in] in one pass; cuDNN convolves it with the filter
//! [C_out, kt, kh, kw, C_in] (made once per weight tensor and kept, see [`ndhwc_filter`]) into
//! [B, T_out, H_out, W_out, C_out]; `conv_from_ndhwc` transposes that back to NCDHW adding the bias in
//! the same pass. Our tensors stay NCDHW. The two transposes also absorb two of the VAE's neighbouring
//! ops, bit for bit: `conv_to_ndhwc_up2` reads a nearest ×2 upsampling in place ([`super::causal_conv3d_upsampled`])
//! and `conv_from_ndhwc` can add a residual after the bias ([`super::causal_conv3d_residual`]), so
//! neither the upsampled tensor nor the conv's pre-residual output is written to memory.
//!
//! **im2col + cuBLASLt** ([`ConvAlgo::Im2col`]), f32 accumulation: for batch item b and output pixels
//! [p0, p0 + np) (flattened t, h, w), col [K = C_in·kt·kh·kw, np] ← im2col; block [C_out, np] =
//! w [C_out, K] · col; then out[b, :, p0..p0 + np] = block + bias (`conv_bias_scatter`). Blocks are sized
//! so that col holds at most [`COL_BUDGET`] elements: memory stays bounded whatever the frame size (at
//! 480p the 96-wide 3×3×3 convs take ~26k pixels per block). A causal conv's cached frames are read in
//! place by im2col (no concatenated copy of the input). A 1×1×1 conv without padding, stride or cache
//! whose one block covers the item skips im2col: the input already is col.
//!
//! GEMM mapping onto column-major cuBLASLt (`crate::cuda::gemm`): row-major block [C_out × np] is
//! column-major [np × C_out] = col' [np × K] · w' [K × C_out], where col's row-major [K × np] buffer is
//! col' with ld np and w's row-major [C_out × K] buffer is w' with ld K: m = np, n = C_out, k = K, no
//! transposes.
//!
//! All paths: operands of different dtypes are promoted to f32 (exact for bf16) and the result cast
//! back to x's dtype, as `linear` does. In bf16 the convolution's sum is rounded to bf16 before the bias
//! is added (two roundings where the CPU has one): see the parity tolerances in
//! `kernels/tests/cuda_parity.rs`.
//!
//! [`conv3d_channels_last`] runs cuDNN on channels-last tensors: the measured answer to whether a
//! channels-last VAE would pay (`bench/src/bin/conv.rs`).

use std::collections::HashMap;
use std::sync::{LazyLock, Mutex, Weak};

use cudarc::driver::{DeviceRepr, LaunchConfig, PushKernelArg};

use super::Halo;
use super::cpu::ConvGeometry;
use crate::cuda::cudnn::{self, DnnConvKey, DnnLayout};
use crate::cuda::{
    ConvAlgo, CudaBackend, CudaStorage, KernelSource, auto_conv_algo, conv_algo, gemm::Epilogue,
    gemm::GemmKey, gemm::gemm, grid_1d, suffix,
};
use crate::tensor::Storage;
use crate::{DType, KernelError, Result, Tensor};

pub(crate) const SOURCE: KernelSource = KernelSource {
    name: "conv",
    text: include_str!("conv.cu"),
};

/// Most elements of one im2col block (128 Mi: 256 MiB in bf16, 512 MiB in f32).
const COL_BUDGET: usize = 1 << 27;

/// `ConvGeom` of conv.cu, field for field.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct ConvGeom {
    c_in: i64,
    cached: i64,
    input: [i64; 3],
    output: [i64; 3],
    kernel: [i64; 3],
    stride: [i64; 3],
    pad: [i64; 3],
}

// SAFETY: plain-old-data `#[repr(C)]` struct of i64s matching the kernel's `ConvGeom` by value.
unsafe impl DeviceRepr for ConvGeom {}

fn i64s(v: [usize; 3]) -> [i64; 3] {
    v.map(|x| x as i64)
}

/// The operands in one dtype: theirs when they agree, else f32.
fn common_dtype(x: &Tensor, w: &Tensor) -> DType {
    if x.dtype() == w.dtype() {
        x.dtype()
    } else {
        DType::F32
    }
}

/// The path one call takes: im2col, or cuDNN with its shape (whose layout says which of the two cuDNN
/// paths) and the zero frames to join in front of and behind the input (cached frames are joined too).
enum Path {
    Im2col,
    Cudnn { key: DnnConvKey, zeros: [usize; 2] },
}

/// The cuDNN form of `g` in `layout`: time padding made symmetric by joining the excess as zero frames
/// (`zeros` [front, back]); `None` where H or W padding is asymmetric (never from the public ops) or a
/// size exceeds cuDNN's 32-bit descriptors.
fn cudnn_form(
    g: &ConvGeometry,
    dtype: DType,
    layout: DnnLayout,
) -> Option<(DnnConvKey, [usize; 2])> {
    if g.pad_front[1..] != g.pad_back[1..] {
        return None;
    }
    let t_pad = g.pad_front[0].min(g.pad_back[0]);
    let zeros = [g.pad_front[0] - t_pad, g.pad_back[0] - t_pad];
    let key = DnnConvKey {
        dtype,
        layout,
        batch: g.batch,
        c_in: g.in_channels,
        c_out: g.out_channels,
        input: [zeros[0] + g.input[0] + zeros[1], g.input[1], g.input[2]],
        kernel: g.kernel,
        stride: g.stride,
        pad: [t_pad, g.pad_front[1], g.pad_front[2]],
    };
    key.fits().then_some((key, zeros))
}

/// The cuDNN layout of a cuDNN path.
fn dnn_layout(algo: ConvAlgo) -> Option<DnnLayout> {
    match algo {
        ConvAlgo::Cudnn => Some(DnnLayout::Ncdhw),
        ConvAlgo::CudnnNdhwc => Some(DnnLayout::Ndhwc),
        ConvAlgo::Auto | ConvAlgo::Im2col => None,
    }
}

/// The path for this call under the thread's [`ConvAlgo`].
fn choose(backend: &CudaBackend, op: &'static str, g: &ConvGeometry, dtype: DType) -> Result<Path> {
    let cudnn = |(key, zeros)| Path::Cudnn { key, zeros };
    match conv_algo() {
        ConvAlgo::Im2col => Ok(Path::Im2col),
        ConvAlgo::Auto => {
            let padded = g.pad_front.iter().chain(&g.pad_back).any(|&p| p > 0);
            let form = dnn_layout(auto_conv_algo(g.kernel, padded))
                .and_then(|layout| cudnn_form(g, dtype, layout));
            Ok(match form {
                Some(form) if cudnn::available(backend) => cudnn(form),
                _ => Path::Im2col,
            })
        }
        forced => {
            let layout = dnn_layout(forced).ok_or_else(|| {
                KernelError::arg(op, "ConvAlgo", format!("{forced:?}"), "not a cuDNN path")
            })?;
            let form = cudnn_form(g, dtype, layout).ok_or_else(|| {
                KernelError::arg(
                    op,
                    "ConvAlgo",
                    format!("{forced:?}"),
                    "cuDNN needs symmetric H/W padding and fewer than 2³¹ elements per tensor",
                )
            })?;
            cudnn::ensure(backend)?;
            Ok(cudnn(form))
        }
    }
}

/// Conv3d on the GPU: `cache` [B, C_in, T_c, H, W] (optional) followed by x [B, C_in, T, H, W] along T
/// is the input `g` describes (g.input[0] = T_c + T); w [C_out, C_in, kt, kh, kw], bias [C_out] →
/// [B, C_out, T_out, H_out, W_out] in x's dtype.
///
/// With `upsampled`, the input `g` describes is the nearest ×2 upsampling (in H and W) of cache ++ x,
/// whose frames are [H/2, W/2]: on the channels-last cuDNN path `conv_to_ndhwc_up2` reads it in place
/// (the upsampled tensor is never written); the other paths upsample x and the cache first.
///
/// With `residual` (the output's shape, checked by the caller) the result is `add(conv, residual)`:
/// on the channels-last path, when the conv computes in x's dtype and the residual has it too, the add
/// runs in `conv_from_ndhwc`'s epilogue with the same two roundings; elsewhere it is the `add` op.
#[allow(clippy::too_many_arguments)]
pub(super) fn conv3d(
    op: &'static str,
    (cache, x, halo): (Option<&Tensor>, &Tensor, Option<&Halo>),
    w: &Tensor,
    bias: Option<&Tensor>,
    g: &ConvGeometry,
    upsampled: bool,
    residual: Option<&Tensor>,
) -> Result<Tensor> {
    let dtype = common_dtype(x, w);
    let out_shape = g.output_shape();
    let [t_out, h_out, w_out] = g.output();
    let pixels = t_out * h_out * w_out;
    let [kt, kh, kw] = g.kernel;
    let taps = g.in_channels * kt * kh * kw;
    if g.batch * g.out_channels * pixels == 0 || taps == 0 {
        // Nothing to compute (an empty output), or an empty sum: the bias (or zeros) everywhere.
        let zeros = Tensor::zeros(&out_shape, x.dtype(), x.device())?;
        let out = match bias {
            Some(b) => crate::add(&zeros, &b.reshape(&[g.out_channels, 1, 1, 1])?)?,
            None => zeros,
        };
        return residual.map_or(Ok(out.clone()), |r| crate::add(&out, r));
    }
    let mut xc = x.to_dtype(dtype)?;
    let mut cache = cache.map(|c| c.to_dtype(dtype)).transpose()?;
    let backend = CudaBackend::get(xc.cuda_storage(op)?.ordinal)?;
    let path = choose(&backend, op, g, dtype)?;
    let in_place = matches!(&path, Path::Cudnn { key, .. } if key.layout == DnnLayout::Ndhwc);
    let cached = cache.as_ref().map_or(0, |c| c.shape()[2]);
    let edges = match halo.filter(|_| in_place) {
        Some(h) => Some(Edges {
            axis: h.axis,
            extent: h.extent,
            before: h.before.map(|t| t.to_dtype(dtype)).transpose()?,
            after: h.after.map(|t| t.to_dtype(dtype)).transpose()?,
        }),
        None => None,
    };
    match halo.filter(|_| !in_place) {
        // Only the channels-last transpose reads the halo (a missing edge as zeros) and the
        // upsampling in place: join, upsample and cut them as the definition does for the others.
        Some(h) => {
            let frames = xc.shape()[2];
            let joined = match &cache {
                Some(c) => Tensor::concat(&[c, &xc], 2)?,
                None => xc.clone(),
            };
            let joined = h.joined(&joined, &xc, cached, upsampled)?;
            cache = cache.map(|_| joined.narrow(2, 0, cached)).transpose()?;
            xc = joined.narrow(2, cached, frames)?;
        }
        None if upsampled && !in_place => {
            xc = crate::upsample_nearest2x(&xc)?;
            cache = cache.map(|c| crate::upsample_nearest2x(&c)).transpose()?;
        }
        None => {}
    }
    let up = upsampled && in_place;
    // The epilogue's add equals the `add` op only where nothing is rounded after it: the conv's dtype
    // is x's (no cast back) and the residual is stored in it.
    let fused_residual = residual.filter(|r| in_place && dtype == x.dtype() && r.dtype() == dtype);
    let out = match path {
        Path::Im2col => {
            let wc = w.to_dtype(dtype)?;
            im2col_conv3d(&backend, op, cache.as_ref(), &xc, &wc, bias, g, dtype)?
        }
        Path::Cudnn { key, zeros } if key.layout == DnnLayout::Ndhwc => ndhwc_conv3d(
            &backend,
            op,
            cache.as_ref(),
            &xc,
            w,
            bias,
            g,
            (&key, zeros),
            (up, fused_residual),
            edges.as_ref(),
        )?,
        Path::Cudnn { key, zeros } => {
            let wc = w.to_dtype(dtype)?;
            cudnn_conv3d(
                &backend,
                op,
                cache.as_ref(),
                &xc,
                &wc,
                bias,
                g,
                (&key, zeros),
            )?
        }
    };
    let out = Tensor::from_cuda(out, &out_shape).to_dtype(x.dtype())?;
    match residual {
        Some(r) if fused_residual.is_none() => crate::add(&out, r),
        _ => Ok(out),
    }
}

/// The cuDNN path of [`conv3d`] on operands already in `key.dtype` (non-empty output and sum): joins
/// `zeros[0]` zero frames, the cache, x and `zeros[1]` zero frames when there is anything to join, runs
/// the convolution `key` and adds the bias; the [B, C_out, T_out, H_out, W_out] result in `key.dtype`.
#[allow(clippy::too_many_arguments)]
fn cudnn_conv3d(
    backend: &CudaBackend,
    op: &'static str,
    cache: Option<&Tensor>,
    xc: &Tensor,
    wc: &Tensor,
    bias: Option<&Tensor>,
    g: &ConvGeometry,
    (key, zeros): (&DnnConvKey, [usize; 2]),
) -> Result<CudaStorage> {
    let cached = cache.map_or(0, |c| c.shape()[2]);
    let x_ptr = xc.cuda_storage(op)?.ptr();
    // The joined input (freed, stream-ordered, after the convolution is queued), or x itself.
    let joined = if cached + zeros[0] + zeros[1] > 0 {
        let cache_ptr = match cache {
            Some(c) => c.cuda_storage(op)?.ptr(),
            None => 0,
        };
        let frames = [zeros[0], cached, g.input[0] - cached, zeros[1]];
        let (rows, plane) = (g.batch * g.in_channels, g.input[1] * g.input[2]);
        let joined = join_frames(
            backend, op, key.dtype, x_ptr, cache_ptr, rows, frames, plane,
        )?;
        Some(joined)
    } else {
        None
    };
    let input_ptr = joined.as_ref().map_or(x_ptr, |j| j.ptr());
    let pixels: usize = g.output().iter().product();
    let n = g.batch * g.out_channels * pixels;
    let out = backend.alloc(key.dtype, n)?;
    let w_ptr = wc.cuda_storage(op)?.ptr();
    cudnn::conv_forward(backend, op, key, input_ptr, w_ptr, out.ptr())?;
    if let Some(bias) = bias {
        bias_add(backend, op, &out, bias, (n, g.out_channels, pixels))?;
    }
    Ok(out)
}

/// The channels-last cuDNN path of [`conv3d`] on x and cache already in `key.dtype` (non-empty output
/// and sum; `key.layout` is NDHWC): `conv_to_ndhwc` writes `zeros[0]` zero frames, the cache, x and
/// `zeros[1]` zero frames as one [B, F, H, W, C_in] buffer, cuDNN convolves it with w's channels-last
/// filter, and `conv_from_ndhwc` writes the [B, C_out, T_out, H_out, W_out] result in `key.dtype` with
/// the bias added. `w` is the caller's weight (any dtype): its filter is made once and kept. With
/// `upsampled`, x and the cache hold frames of [H/2, W/2] whose nearest ×2 upsampling is the input
/// `g` describes, read in place by `conv_to_ndhwc_up2`. With `residual` ([B, C_out, T_out, H_out, W_out]
/// in `key.dtype`), it is added in `conv_from_ndhwc`'s epilogue after the bias's rounding.
#[allow(clippy::too_many_arguments)]
fn ndhwc_conv3d(
    backend: &CudaBackend,
    op: &'static str,
    cache: Option<&Tensor>,
    xc: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
    g: &ConvGeometry,
    (key, zeros): (&DnnConvKey, [usize; 2]),
    (upsampled, residual): (bool, Option<&Tensor>),
    halo: Option<&Edges>,
) -> Result<CudaStorage> {
    let cached = cache.map_or(0, |c| c.shape()[2]);
    let cache_ptr = match cache {
        Some(c) => c.cuda_storage(op)?.ptr(),
        None => 0,
    };
    let frames = [zeros[0], cached, g.input[0] - cached, zeros[1]];
    let edge_ptr = |edge: &Option<Tensor>| -> Result<u64> {
        Ok(match edge {
            Some(t) => t.cuda_storage(op)?.ptr(),
            None => 0, // zeros: the kernel reads none
        })
    };
    let source = match halo {
        Some(h) => Source::Haloed {
            before: edge_ptr(&h.before)?,
            after: edge_ptr(&h.after)?,
            extent: h.extent,
            axis: h.axis,
            upsampled,
        },
        None if upsampled => Source::Upsampled,
        None => Source::Plain,
    };
    let input = to_ndhwc(
        backend,
        op,
        key.dtype,
        (xc.cuda_storage(op)?.ptr(), cache_ptr),
        (g.batch, g.in_channels),
        frames,
        ([g.input[1], g.input[2]], source),
    )?;
    let filter = ndhwc_filter(op, w, key.dtype)?;
    let pixels: usize = key.output().iter().product();
    let y = backend.alloc(key.dtype, g.batch * pixels * g.out_channels)?;
    cudnn::conv_forward(
        backend,
        op,
        key,
        input.ptr(),
        filter.cuda_storage(op)?.ptr(),
        y.ptr(),
    )?;
    // input and y are freed stream-ordered once the kernels that read them are queued.
    from_ndhwc(
        backend,
        op,
        &y,
        (bias, residual),
        (g.batch, g.out_channels, pixels),
    )
}

/// The channels-last filter of weight `w` [C_out, C_in, kt, kh, kw]: [C_out, kt, kh, kw, C_in] in
/// `dtype`, made on the first call for this tensor (one permute, and a cast if the dtypes differ) and
/// kept for later calls while `w` lives (the VAE calls each conv once per chunk with the same weight).
///
/// The cache is keyed by the identity of w's storage (plus shape and dtype: a reshape shares storage):
/// each entry holds a `Weak` of that storage, which keeps its address from being reused while the entry
/// exists, so an entry whose `Weak` still upgrades is the same, immutable buffer. Entries of dropped
/// weights are swept whenever a filter is made, so their copies do not outlive them by more than that.
fn ndhwc_filter(op: &'static str, w: &Tensor, dtype: DType) -> Result<Tensor> {
    #[derive(PartialEq, Eq, Hash)]
    struct Key {
        storage: usize,
        shape: Vec<usize>,
        dtype: DType,
    }
    struct Entry {
        weight: Weak<Storage>,
        filter: Tensor,
    }
    static FILTERS: LazyLock<Mutex<HashMap<Key, Entry>>> = LazyLock::new(Default::default);

    let weight = w.storage_weak();
    let key = Key {
        storage: weight.as_ptr() as usize,
        shape: w.shape().to_vec(),
        dtype,
    };
    // A poisoned lock only means another thread panicked while inserting; the map is still valid.
    let mut filters = FILTERS.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(entry) = filters.get(&key)
        && entry.weight.strong_count() > 0
    {
        return Ok(entry.filter.clone());
    }
    // A CUDA tensor (checked by the caller's cuda_storage); the permute runs on its device.
    w.cuda_storage(op)?;
    let filter = w.to_dtype(dtype)?.permute(&[0, 2, 3, 4, 1])?;
    filters.retain(|_, e| e.weight.strong_count() > 0);
    filters.insert(
        key,
        Entry {
            weight,
            filter: filter.clone(),
        },
    );
    Ok(filter)
}

/// The word of the transposes' global accesses for elements of `elem_bytes` (conv.cu's PACK, named by
/// its kernel suffix): a whole 16-byte chunk ("pw") when both contiguous extents are multiples of its
/// elements, two elements ("p2") when both are even, else one ("p1"). Every word then starts at a
/// multiple of its elements, so it is aligned (buffers start 256-byte aligned).
fn transpose_pack(contiguous_in: usize, contiguous_out: usize, elem_bytes: usize) -> &'static str {
    let both = |n: usize| contiguous_in.is_multiple_of(n) && contiguous_out.is_multiple_of(n);
    if both(16 / elem_bytes) {
        "pw"
    } else if both(2) {
        "p2"
    } else {
        "p1"
    }
}

/// The launch of a `conv.cu` transpose: x over the `channel_tiles`, y over the `pixel_tiles`, z over
/// the slabs, tiles of [`transpose_tile`] elements per side (at most 65,535 blocks in y and z: the
/// kernels loop over the rest).
fn transpose_grid(channel_tiles: usize, pixel_tiles: usize, slabs: usize) -> LaunchConfig {
    const THREADS: u32 = 256; // TR_THREADS of conv.cu
    let limit = |n: usize| n.clamp(1, 65_535) as u32;
    LaunchConfig {
        // Channel tiles: ≤ C / 32 (f32), far below x's 2³¹ − 1.
        grid_dim: (
            channel_tiles.max(1) as u32,
            limit(pixel_tiles),
            limit(slabs),
        ),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Elements per side of a transpose tile: 128 bytes of them (conv.cu's TE).
fn transpose_tile(elem_bytes: usize) -> usize {
    128 / elem_bytes
}

/// A [`Halo`] in the conv's dtype, for the channels-last transpose to read in place (a missing edge
/// reads as zeros).
struct Edges {
    axis: usize,
    extent: usize,
    before: Option<Tensor>,
    after: Option<Tensor>,
}

/// What `to_ndhwc` reads besides the cache and x frames of the plane it writes.
#[derive(Debug, Clone, Copy)]
enum Source {
    /// Frames of the plane itself.
    Plain,
    /// Frames of a quarter of the plane, nearest ×2 upsampled on the fly (`conv_to_ndhwc_up2`).
    Upsampled,
    /// Frames of the plane less `extent` rows (axis 3) or columns (axis 4) on each side, which come
    /// from `before` and `after` ([`Halo`]'s edges, cache frames first; 0: zeros;
    /// `conv_to_ndhwc_halo`); `upsampled`: the band and the edges hold frames of half the
    /// resolution, nearest ×2 upsampled on the fly (`conv_to_ndhwc_halo_up2`).
    Haloed {
        before: u64,
        after: u64,
        extent: usize,
        axis: usize,
        upsampled: bool,
    },
}

/// The last arguments of a `conv_to_ndhwc` kernel: the halo kernel's (height, width, halo, axis) as
/// i32, or the others' (plane, source width) as i64.
enum Tail {
    Halo([i32; 4]),
    Plane([i64; 2]),
}

/// The `conv_to_ndhwc` kernel reading `source` for `dtype` (a bit copy: named by element size) and
/// `pack` ([`transpose_pack`]).
fn to_ndhwc_kernel(dtype: DType, pack: &str, source: Source) -> String {
    let kind = match source {
        Source::Plain => "",
        Source::Upsampled => "_up2",
        Source::Haloed {
            upsampled: false, ..
        } => "_halo",
        Source::Haloed {
            upsampled: true, ..
        } => "_halo_up2",
    };
    format!("conv_to_ndhwc{kind}_e{}_{pack}", dtype.size_in_bytes())
}

/// `conv_from_ndhwc`'s instance for data `dtype`, bias `bias_dtype` and `pack` ([`transpose_pack`]).
fn from_ndhwc_kernel(dtype: DType, bias_dtype: DType, pack: &str) -> String {
    format!(
        "conv_from_ndhwc_{}_{}_{pack}",
        suffix(dtype),
        suffix(bias_dtype)
    )
}

/// [B, F, H·W, C] in `dtype` holding, along F, `frames[0]` zero frames, the `frames[1]` frames of the
/// cache [B, C, frames[1], ·] at `cache_ptr`, the `frames[2]` frames of x [B, C, frames[2], ·] at `x_ptr`
/// and `frames[3]` zero frames, each frame [H, W] = `dims` as `source` makes it from the cache's and
/// x's (plain: the same [H, W]; upsampled: [H/2, W/2], nearest ×2 on the fly; haloed: the band between
/// the halo's edges): the frame join and the NCDHW → NDHWC transpose in one kernel.
fn to_ndhwc(
    backend: &CudaBackend,
    op: &'static str,
    dtype: DType,
    (x_ptr, cache_ptr): (u64, u64),
    (batch, channels): (usize, usize),
    frames: [usize; 4],
    (dims, source): ([usize; 2], Source),
) -> Result<CudaStorage> {
    let plane = dims[0] * dims[1];
    let total: usize = frames.iter().sum();
    let out = backend.alloc(dtype, batch * total * plane * channels)?;
    if batch * total * plane * channels == 0 {
        return Ok(out);
    }
    let pack = transpose_pack(plane, channels, dtype.size_in_bytes());
    let f = backend.function(&SOURCE, &to_ndhwc_kernel(dtype, pack, source))?;
    let tile = transpose_tile(dtype.size_in_bytes());
    let cfg = transpose_grid(channels.div_ceil(tile), plane.div_ceil(tile), batch * total);
    let out_ptr = out.ptr();
    let [zf, cached, x_frames, zb] = frames.map(|v| v as i64);
    let (b, c, p) = (batch as i64, channels as i64, plane as i64);
    // The kernels' arguments: (x, cache, [before, after,] out, B, C, the four frame counts, then the
    // halo kernel's height, width, halo and axis, or the others' plane and source width).
    let (edges, ints) = match source {
        Source::Haloed {
            before,
            after,
            extent,
            axis,
            ..
        } => {
            // The kernel indexes a frame's pixels in 32 bits.
            let int = |name, v: usize| {
                i32::try_from(v).map_err(|_| {
                    KernelError::arg(op, name, v, "the halo transpose takes it as an i32")
                })
            };
            int("plane", plane)?;
            let dims = [int("height", dims[0])?, int("width", dims[1])?];
            (
                Some([before, after]),
                Tail::Halo([dims[0], dims[1], int("halo", extent)?, axis as i32]),
            )
        }
        Source::Upsampled => (None, Tail::Plane([p, dims[1] as i64 / 2])),
        Source::Plain => (None, Tail::Plane([p, 0])),
    };
    let mut launch = backend.stream.launch_builder(&f);
    launch.arg(&x_ptr).arg(&cache_ptr);
    if let Some([before, after]) = &edges {
        launch.arg(before).arg(after);
    }
    launch.arg(&out_ptr);
    for v in [&b, &c, &zf, &cached, &x_frames, &zb] {
        launch.arg(v);
    }
    match &ints {
        Tail::Halo(v) => v.iter().for_each(|v| {
            launch.arg(v);
        }),
        Tail::Plane(v) => v.iter().for_each(|v| {
            launch.arg(v);
        }),
    }
    // SAFETY: x holds B·C·x_frames·(its frame) elements and cache B·C·cached·(its frame) (read only when
    // cached > 0), their frames [H, W] (plain), [H/2, W/2] (upsampled: the caller's geometry is the
    // upsampled one) or the band [H − 2e, W] / [H, W − 2e] (haloed), and a halo's edges (those not
    // null) B·C·(cached + x_frames)·e·W or ·H·e each (checked by `conv3d_cached`); out B·F·plane·C; all of
    // `dtype` (whose size the kernel's element type has), and the arguments in the kernel's order;
    // plane and C are multiples of the pack's elements, so every word access is aligned (buffers start
    // 256-byte aligned; the halo kernel and the upsampling load element by element).
    unsafe { launch.launch(cfg) }.map_err(|e| backend.err(op, "cuLaunchKernel", e))?;
    Ok(out)
}

/// out [B, C, P] = y [B, P, C] transposed, plus bias [C] when given (added in f32, rounded once),
/// then plus `residual` [B, C, P] when given (y's dtype; added in f32 and rounded again, as a separate
/// `add` would): the NDHWC → NCDHW transpose of a convolution's result with its epilogue, in one
/// kernel; y's dtype.
fn from_ndhwc(
    backend: &CudaBackend,
    op: &'static str,
    y: &CudaStorage,
    (bias, residual): (Option<&Tensor>, Option<&Tensor>),
    (batch, channels, pixels): (usize, usize, usize),
) -> Result<CudaStorage> {
    let dtype = y.dtype();
    let out = backend.alloc(dtype, batch * channels * pixels)?;
    if batch * channels * pixels == 0 {
        return Ok(out);
    }
    let pack = transpose_pack(channels, pixels, dtype.size_in_bytes());
    let bias_dtype = bias.map_or(dtype, |b| b.dtype());
    let f = backend.function(&SOURCE, &from_ndhwc_kernel(dtype, bias_dtype, pack))?;
    let tile = transpose_tile(dtype.size_in_bytes());
    let cfg = transpose_grid(channels.div_ceil(tile), pixels.div_ceil(tile), batch);
    let (y_ptr, out_ptr) = (y.ptr(), out.ptr());
    let bias_ptr = match bias {
        Some(b) => b.cuda_storage(op)?.ptr(),
        None => 0,
    };
    let residual_ptr = match residual {
        Some(r) => r.cuda_storage(op)?.ptr(),
        None => 0,
    };
    let (b, c, p, has_bias, has_residual) = (
        batch as i64,
        channels as i64,
        pixels as i64,
        i32::from(bias.is_some()),
        i32::from(residual.is_some()),
    );
    let mut launch = backend.stream.launch_builder(&f);
    launch
        .arg(&y_ptr)
        .arg(&bias_ptr)
        .arg(&residual_ptr)
        .arg(&out_ptr)
        .arg(&b)
        .arg(&c)
        .arg(&p)
        .arg(&has_bias)
        .arg(&has_residual);
    // SAFETY: y and out hold B·P·C elements of `dtype`, bias C elements (read only when has_bias), the
    // residual B·C·P elements of `dtype` (read only when has_residual; the caller checked its shape and
    // dtype); C and P are multiples of the pack's elements, so every word access is aligned (buffers
    // start 256-byte aligned).
    unsafe { launch.launch(cfg) }.map_err(|e| backend.err(op, "cuLaunchKernel", e))?;
    Ok(out)
}

/// Channels-last Conv3d through cuDNN: x [B, T, H, W, C_in], w [C_out, kt, kh, kw, C_in], bias [C_out]
/// → [B, T_out, H_out, W_out, C_out] in x's dtype; `g` is the geometry in NCDHW terms, with symmetric
/// padding. Always cuDNN (an error where it cannot be used): there is no im2col twin of this layout.
pub(super) fn conv3d_channels_last(
    op: &'static str,
    x: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
    g: &ConvGeometry,
) -> Result<Tensor> {
    let dtype = common_dtype(x, w);
    let [t_out, h_out, w_out] = g.output();
    let out_shape = [g.batch, t_out, h_out, w_out, g.out_channels];
    let numel: usize = out_shape.iter().product();
    if numel == 0 || g.in_channels * g.kernel.iter().product::<usize>() == 0 {
        let zeros = Tensor::zeros(&out_shape, x.dtype(), x.device())?;
        return match bias {
            Some(b) => crate::add(&zeros, b),
            None => Ok(zeros),
        };
    }
    let key = DnnConvKey {
        dtype,
        layout: DnnLayout::Ndhwc,
        batch: g.batch,
        c_in: g.in_channels,
        c_out: g.out_channels,
        input: g.input,
        kernel: g.kernel,
        stride: g.stride,
        pad: g.pad_front,
    };
    if !key.fits() {
        return Err(KernelError::arg(
            op,
            "size",
            format!("{:?}", x.shape()),
            "cuDNN needs fewer than 2³¹ elements per tensor",
        ));
    }
    let (xc, wc) = (x.to_dtype(dtype)?, w.to_dtype(dtype)?);
    let backend = CudaBackend::get(xc.cuda_storage(op)?.ordinal)?;
    let out = backend.alloc(dtype, numel)?;
    cudnn::conv_forward(
        &backend,
        op,
        &key,
        xc.cuda_storage(op)?.ptr(),
        wc.cuda_storage(op)?.ptr(),
        out.ptr(),
    )?;
    if let Some(bias) = bias {
        bias_add(&backend, op, &out, bias, (numel, g.out_channels, 1))?;
    }
    Tensor::from_cuda(out, &out_shape).to_dtype(x.dtype())
}

/// One buffer [rows, F, plane] holding, along F, `frames[0]` zero frames, the `frames[1]` frames of
/// `cache` [rows, frames[1], plane], the `frames[2]` frames of `x` [rows, frames[2], plane] and
/// `frames[3]` zero frames (rows = B·C), in `dtype`. One kernel: the copy cuDNN's one-buffer input needs.
#[allow(clippy::too_many_arguments)]
fn join_frames(
    backend: &CudaBackend,
    op: &'static str,
    dtype: DType,
    x_ptr: u64,
    cache_ptr: u64,
    rows: usize,
    frames: [usize; 4],
    plane: usize,
) -> Result<CudaStorage> {
    let total: usize = frames.iter().sum();
    let out = backend.alloc(dtype, rows * total * plane)?;
    let plane_bytes = plane * dtype.size_in_bytes();
    // Frames start at multiples of plane_bytes from 256-byte-aligned buffer starts, so a word size that
    // divides plane_bytes keeps every word access aligned.
    let (name, word) = match plane_bytes {
        b if b % 16 == 0 => ("conv_join_frames_w16", 16),
        b if b % 4 == 0 => ("conv_join_frames_w4", 4),
        _ => ("conv_join_frames_w2", 2),
    };
    let plane_words = (plane_bytes / word) as i64;
    let n = rows * total * plane_bytes / word;
    if n == 0 {
        return Ok(out);
    }
    let f = backend.function(&SOURCE, name)?;
    let out_ptr = out.ptr();
    let [zf, cached, x_frames, zb] = frames.map(|v| v as i64);
    let rows_i = rows as i64;
    let mut launch = backend.stream.launch_builder(&f);
    launch
        .arg(&x_ptr)
        .arg(&cache_ptr)
        .arg(&out_ptr)
        .arg(&rows_i)
        .arg(&zf)
        .arg(&cached)
        .arg(&x_frames)
        .arg(&zb)
        .arg(&plane_words);
    // SAFETY: x holds rows·x_frames·plane elements and cache rows·cached·plane (read only when cached > 0),
    // out rows·total·plane; the word size divides plane's bytes and every buffer start is aligned.
    unsafe { launch.launch(grid_1d(n)) }.map_err(|e| backend.err(op, "cuLaunchKernel", e))?;
    Ok(out)
}

/// out[i] += bias[(i / inner) % channels] for i < n, in place (`out` a fresh, aligned buffer of ≥ n
/// elements).
fn bias_add(
    backend: &CudaBackend,
    op: &'static str,
    out: &CudaStorage,
    bias: &Tensor,
    (n, channels, inner): (usize, usize, usize),
) -> Result<()> {
    let dtype = out.dtype();
    if n == 0 {
        return Ok(());
    }
    let name = format!("conv_bias_add_{}_{}", suffix(dtype), suffix(bias.dtype()));
    let f = backend.function(&SOURCE, &name)?;
    // 16-byte words of V elements when every word's elements share a channel or are V consecutive ones.
    let per_word = 16 / dtype.size_in_bytes();
    let vec = n.is_multiple_of(per_word)
        && (inner.is_multiple_of(per_word) || (inner == 1 && channels.is_multiple_of(per_word)));
    let (out_ptr, bias_ptr) = (out.ptr(), bias.cuda_storage(op)?.ptr());
    let (c, inner_i, n_i, vec_i) = (channels as i64, inner as i64, n as i64, i32::from(vec));
    let mut launch = backend.stream.launch_builder(&f);
    launch
        .arg(&out_ptr)
        .arg(&bias_ptr)
        .arg(&c)
        .arg(&inner_i)
        .arg(&n_i)
        .arg(&vec_i);
    let threads = if vec { n / per_word } else { n };
    // SAFETY: out holds n elements of dtype starting 256-byte aligned; bias holds `channels` elements.
    unsafe { launch.launch(grid_1d(threads)) }.map_err(|e| backend.err(op, "cuLaunchKernel", e))?;
    Ok(())
}

/// The im2col path of [`conv3d`] on operands already in `dtype` (non-empty output and sum): the
/// [B, C_out, T_out, H_out, W_out] result in `dtype`.
#[allow(clippy::too_many_arguments)]
fn im2col_conv3d(
    backend: &CudaBackend,
    op: &'static str,
    cache: Option<&Tensor>,
    xc: &Tensor,
    wc: &Tensor,
    bias: Option<&Tensor>,
    g: &ConvGeometry,
    dtype: DType,
) -> Result<CudaStorage> {
    let [t_out, h_out, w_out] = g.output();
    let pixels = t_out * h_out * w_out;
    let [kt, kh, kw] = g.kernel;
    let taps = g.in_channels * kt * kh * kw;
    let out = backend.alloc(dtype, g.batch * g.out_channels * pixels)?;

    let cached = cache.map_or(0, |c| c.shape()[2]);
    let geom = ConvGeom {
        c_in: g.in_channels as i64,
        cached: cached as i64,
        input: i64s(g.input),
        output: i64s(g.output()),
        kernel: i64s(g.kernel),
        stride: i64s(g.stride),
        pad: i64s(g.pad_front),
    };
    let size = dtype.size_in_bytes() as u64;
    let [x_frames, h_in, w_in] = [g.input[0] - cached, g.input[1], g.input[2]];
    let x_item = (g.in_channels * x_frames * h_in * w_in) as u64 * size;
    let block = (COL_BUDGET / taps).clamp(1, pixels);
    // A pointwise conv reads x as col directly when one block covers the item, and every item starts
    // 256-byte aligned (cuBLASLt's heuristic assumes aligned operands; buffers start aligned).
    let pointwise = g.kernel == [1, 1, 1]
        && g.stride == [1, 1, 1]
        && g.pad_front == [0, 0, 0]
        && g.pad_back == [0, 0, 0]
        && cached == 0
        && block == pixels
        && (g.batch == 1 || x_item.is_multiple_of(256));
    let col = if pointwise {
        None
    } else {
        Some(backend.alloc(dtype, taps * block)?)
    };
    let partial = backend.alloc(dtype, g.out_channels * block)?;

    let im2col = backend.function(&SOURCE, &format!("im2col_{}", suffix(dtype)))?;
    let bias_dtype = bias.map_or(dtype, |b| b.dtype());
    let scatter = backend.function(
        &SOURCE,
        &format!("conv_bias_scatter_{}_{}", suffix(dtype), suffix(bias_dtype)),
    )?;
    let cache_item = (g.in_channels * cached * h_in * w_in) as u64 * size;
    let out_item = (g.out_channels * pixels) as u64 * size;
    let (x_ptr, w_ptr, out_ptr, partial_ptr) = (
        xc.cuda_storage(op)?.ptr(),
        wc.cuda_storage(op)?.ptr(),
        out.ptr(),
        partial.ptr(),
    );
    let cache_ptr = match cache {
        Some(c) => c.cuda_storage(op)?.ptr(),
        None => 0,
    };
    let bias_ptr = match bias {
        Some(b) => b.cuda_storage(op)?.ptr(),
        None => 0,
    };
    let has_bias = i32::from(bias.is_some());
    let (c_out, p_total) = (g.out_channels as i64, pixels as i64);
    for b in 0..g.batch as u64 {
        let x_b = x_ptr + b * x_item;
        for p0 in (0..pixels).step_by(block) {
            let np = block.min(pixels - p0);
            let (p0_i, np_i) = (p0 as i64, np as i64);
            let col_ptr = match &col {
                None => x_b,
                Some(col) => {
                    let col_ptr = col.ptr();
                    let cache_b = cache_ptr + b * cache_item;
                    let mut launch = backend.stream.launch_builder(&im2col);
                    launch
                        .arg(&x_b)
                        .arg(&cache_b)
                        .arg(&col_ptr)
                        .arg(&p0_i)
                        .arg(&np_i)
                        .arg(&geom);
                    // SAFETY: x_b/cache_b address item b's C_in·(T or T_c)·H·W elements; col holds
                    // taps·block ≥ taps·np elements; the kernel reads only in-range input indices.
                    unsafe { launch.launch(grid_1d(taps * np)) }
                        .map_err(|e| backend.err(op, "cuLaunchKernel", e))?;
                    col_ptr
                }
            };
            let key = GemmKey {
                dtype,
                e4m3: false,
                m: np as u64,
                n: g.out_channels as u64,
                k: taps as u64,
                transa: false,
                batch: 1,
                stride_a: 0,
                stride_b: 0,
                stride_d: 0,
                epilogue: Epilogue::None,
            };
            gemm(backend, op, key, col_ptr, w_ptr, partial_ptr, None, None)?;
            let out_b = out_ptr + b * out_item;
            let mut launch = backend.stream.launch_builder(&scatter);
            launch
                .arg(&partial_ptr)
                .arg(&bias_ptr)
                .arg(&out_b)
                .arg(&c_out)
                .arg(&np_i)
                .arg(&p0_i)
                .arg(&p_total)
                .arg(&has_bias);
            // SAFETY: partial holds C_out·np elements, bias C_out (or is unused), item b of out
            // C_out·p_total with p0 + np ≤ p_total.
            unsafe { launch.launch(grid_1d(g.out_channels * np)) }
                .map_err(|e| backend.err(op, "cuLaunchKernel", e))?;
        }
    }
    Ok(out)
}

/// x [.., H, W] → [.., 2H, 2W] (`n` images of h × w), x's dtype.
pub(super) fn upsample_nearest2x(
    op: &'static str,
    x: &Tensor,
    (n, h, w): (usize, usize, usize),
    out_shape: &[usize],
) -> Result<Tensor> {
    let src = x.cuda_storage(op)?;
    let backend = CudaBackend::get(src.ordinal)?;
    let out = backend.alloc(x.dtype(), 4 * n * h * w)?;
    if n * h * w > 0 {
        let es = x.dtype().size_in_bytes();
        // Rows of whole 8-byte words: a thread per word (the buffers start 256-byte aligned, so
        // every row, and every word of it, is aligned); otherwise a thread per output element.
        let words = (w * es).is_multiple_of(8);
        let (name, threads) = if words {
            (
                format!("upsample_nearest2x_words_e{es}"),
                2 * n * h * (w * es / 8),
            )
        } else {
            (
                format!("upsample_nearest2x_{}", suffix(x.dtype())),
                4 * n * h * w,
            )
        };
        let f = backend.function(&SOURCE, &name)?;
        let (xp, op_ptr) = (src.ptr(), out.ptr());
        let (n_i, h_i, w_i) = (n as i64, h as i64, w as i64);
        let mut launch = backend.stream.launch_builder(&f);
        launch.arg(&xp).arg(&op_ptr).arg(&n_i).arg(&h_i).arg(&w_i);
        // SAFETY: x holds n·h·w elements and out 4·n·h·w of x's dtype (whose size the kernel's
        // element type has), as both kernels index; the word kernel runs only on rows of whole
        // 8-byte words.
        unsafe { launch.launch(grid_1d(threads)) }
            .map_err(|e| backend.err(op, "cuLaunchKernel", e))?;
    }
    Ok(Tensor::from_cuda(out, out_shape))
}

/// The GPU side of [`crate::halo_edges`] (arguments checked there; `cache` has frames): both edges
/// of cache ++ x along `axis` from one `halo_edges` kernel of copy.cu.
pub(super) fn halo_edges(
    op: &'static str,
    cache: Option<&Tensor>,
    x: &Tensor,
    axis: usize,
    extent: usize,
) -> Result<(Tensor, Tensor)> {
    let src = x.cuda_storage(op)?;
    let backend = CudaBackend::get(src.ordinal)?;
    let &[b, c, frames, h, w] = x.shape() else {
        return Err(KernelError::shape(
            op,
            "x must be [B, C, T, H, W]",
            &[x.shape()],
        ));
    };
    let cached = cache.map_or(0, |t| t.shape()[2]);
    let cache_ptr = match cache {
        Some(t) => t.cuda_storage(op)?.ptr(),
        None => 0,
    };
    let mut edge_shape = vec![b, c, cached + frames, h, w];
    edge_shape[axis] = extent;
    let numel: usize = edge_shape.iter().product();
    let outs = [
        backend.alloc(x.dtype(), numel)?,
        backend.alloc(x.dtype(), numel)?,
    ];
    // Rows: each frame's edge is `extent` whole rows, one run; columns: `extent` elements per row.
    let (runs, run, stride, last) = match axis {
        3 => (1, extent * w, 0, (h - extent) * w),
        _ => (h, extent, w, w - extent),
    };
    let geometry = crate::cuda::EdgeRuns {
        slabs: b * c,
        cached,
        frames,
        plane: h * w,
        runs,
        run,
        stride,
        start: [0, last],
    };
    crate::cuda::halo_edges(
        op,
        &backend,
        (src.ptr(), cache_ptr),
        [outs[0].ptr(), outs[1].ptr()],
        geometry,
        x.dtype().size_in_bytes(),
    )?;
    let [first, last] = outs;
    Ok((
        Tensor::from_cuda(first, &edge_shape),
        Tensor::from_cuda(last, &edge_shape),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transposes_pack_words_only_when_aligned() {
        assert_eq!(transpose_pack(480 * 832, 96, 2), "pw"); // 8 bf16
        assert_eq!(transpose_pack(480 * 832, 96, 4), "pw"); // 4 f32
        assert_eq!(transpose_pack(480 * 832, 4 * 3, 2), "p2");
        assert_eq!(transpose_pack(5 * 7, 96, 2), "p1"); // odd plane
        assert_eq!(transpose_pack(4 * 480 * 832, 3, 4), "p1"); // conv_out's 3 channels
        assert_eq!((transpose_tile(2), transpose_tile(4)), (64, 32));
        let grid = transpose_grid(2, 70_000, 70_000);
        assert_eq!(grid.grid_dim, (2, 65_535, 65_535));
        assert_eq!(grid.block_dim, (256, 1, 1));
    }

    /// Every transpose instance the host can ask for exists in conv.cu's CUBIN (NVRTC only, no GPU;
    /// skips where libnvrtc is absent, as the compile test of every source does).
    #[test]
    fn every_transpose_instance_is_compiled() -> Result<()> {
        // SAFETY: only dlopens the candidate names.
        if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
            eprintln!("skipped: libnvrtc not found");
            return Ok(());
        }
        // The GPU script's CUDA headers (DITSTREAM_CUDA_INCLUDE), as every GPU test's gate.
        crate::testing::configure_cuda()?;
        let cubin = crate::cuda::nvrtc::cubin(&SOURCE, "sm_90a")?;
        let has = |name: &str| cubin.windows(name.len()).any(|w| w == name.as_bytes());
        for dtype in [DType::F32, DType::BF16] {
            for pack in ["p1", "p2", "pw"] {
                let haloed = |upsampled| Source::Haloed {
                    before: 0,
                    after: 0,
                    extent: 1,
                    axis: 3,
                    upsampled,
                };
                for source in [
                    Source::Plain,
                    Source::Upsampled,
                    haloed(false),
                    haloed(true),
                ] {
                    assert!(
                        has(&to_ndhwc_kernel(dtype, pack, source)),
                        "{dtype:?} {pack} {source:?}"
                    );
                }
                for bias in [DType::F32, DType::BF16] {
                    assert!(
                        has(&from_ndhwc_kernel(dtype, bias, pack)),
                        "{dtype:?} {bias:?} {pack}"
                    );
                }
            }
        }
        Ok(())
    }
}
