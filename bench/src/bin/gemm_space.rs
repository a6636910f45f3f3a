//! cuBLASLt's whole bf16 algorithm space at the Wan2.1-14B DiT's linear shapes, timed at the power
//! limit (issue 23's bar: the 14B linears at ≥ 760 TFLOP/s).
//!
//! `kernels/src/cuda/gemm.rs` chooses among the heuristic's 8 algorithms. This driver asks whether
//! anything outside them is faster: it enumerates every configuration cuBLASLt accepts for a shape
//! (each algorithm id × its tiles × stages × cluster shapes × CTA swizzle × custom options, kept
//! when `cublasLtMatmulAlgoCheck` passes and the workspace fits our 32 MiB), then
//! 1. screens them in a time budget (`--screen-secs` per shape; one untimed and two timed calls
//!    each, the heuristic's first re-timed every 25 as a drift reference), and
//! 2. times the heuristic's list, the screen's `--finalists` fastest and any `--extra` ones
//!    *sustained*: `--rounds` interleaved rounds, each running every candidate `--warm` untimed
//!    then `--calls` timed calls back to back, median over rounds. A two-call screen runs at the
//!    clock the GPU had before; only sustained runs show the rate under the 700 W cap, where an
//!    H100 spends most of a 14B forward.
//!
//! Shapes, as the DiT calls them (`linear`: D [out × tokens] = W·xᵀ, cuBLASLt column-major, A
//! transposed): q/k/v (5120 → 5120, bias), the output projections (5120 → 5120, bias and the
//! residual as C, beta 1), the FFN's up (5120 → 13824, GELU(tanh) + bias) and down (13824 → 5120,
//! bias + residual), 75,600 tokens (720p, 81 frames); and 8192³. Operands: one 16 Mi block of
//! N(0, 1) bf16 repeated (as `ditstream_bench::random_input`).
//!
//! Output (tab-separated): `HEUR shape rank config`, `SPACE id … valid n`, `SCREEN shape ms
//! TFLOP/s config`, `FINAL shape name ms TFLOP/s ×heur0 rounds… config`. `scripts/gpu-gemm-space.sh`
//! runs it and prints the finals last.

use std::ffi::c_void;
use std::mem::size_of;
use std::time::Instant;

use anyhow::{Context, Result, anyhow, bail};
use clap::Parser;
use cudarc::cublaslt::result as lt;
use cudarc::cublaslt::sys::{
    self as sys, cublasLtMatmulAlgo_t as Algo, cublasLtMatmulAlgoCapAttributes_t as Cap,
    cublasLtMatmulAlgoConfigAttributes_t as Config, cublasLtMatmulDescAttributes_t as DescAttr,
};
use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaContext, CudaSlice, DevicePtr};
use half::bf16;

#[derive(Parser, Debug)]
#[command(about = "cuBLASLt's algorithm space at the 14B DiT linears, timed sustained")]
struct Args {
    /// Seconds of screening per shape (0: no enumeration; the finals take the heuristic's list and
    /// `--extra`).
    #[arg(long, default_value_t = 40.0)]
    screen_secs: f64,
    /// How many of the screen's fastest enter the finals.
    #[arg(long, default_value_t = 4)]
    finalists: usize,
    /// Interleaved rounds of the finals.
    #[arg(long, default_value_t = 15)]
    rounds: usize,
    /// Untimed calls before each candidate's timed ones, in every round.
    #[arg(long, default_value_t = 4)]
    warm: usize,
    /// Timed calls per candidate and round.
    #[arg(long, default_value_t = 12)]
    calls: usize,
    /// Further finalists, `id:tile:stages:option:cluster` (cuBLASLt's numeric ids).
    #[arg(long)]
    extra: Vec<String>,
    /// Only shapes whose label contains this.
    #[arg(long)]
    only: Option<String>,
}

/// cuBLASLt's workspace, as `kernels/src/cuda/gemm.rs` gives it.
const WORKSPACE: usize = 32 << 20;
/// Cluster shapes tried (`cublasLtClusterShape_t`: auto, then 1x1x1 … 2x8x1; none beyond 16 CTAs).
const CLUSTERS: [u16; 14] = [0, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14];
/// Custom options tried per algorithm (up to its maximum).
const MAX_OPTION: u32 = 7;

/// (label, out features m, tokens n, in features k, epilogue, residual C).
type Shape = (&'static str, u64, u64, u64, sys::cublasLtEpilogue_t, bool);
const SHAPES: [Shape; 5] = {
    use sys::cublasLtEpilogue_t::{
        CUBLASLT_EPILOGUE_BIAS as BIAS, CUBLASLT_EPILOGUE_DEFAULT as NONE,
        CUBLASLT_EPILOGUE_GELU_BIAS as GELU,
    };
    [
        ("14B.qkv+bias", 5120, 75600, 5120, BIAS, false),
        ("14B.out+bias+res", 5120, 75600, 5120, BIAS, true),
        ("14B.up+gelu", 13824, 75600, 5120, GELU, false),
        ("14B.down+bias+res", 5120, 75600, 13824, BIAS, true),
        ("8192^3", 8192, 8192, 8192, NONE, false),
    ]
};

fn check(status: sys::cublasStatus_t, what: &str) -> Result<()> {
    if status == sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
        Ok(())
    } else {
        Err(anyhow!("{what}: {status:?}"))
    }
}

/// A cuBLASLt attribute getter: of an algorithm's configuration or of its capabilities.
type Getter<A> = unsafe fn(*const Algo, A, *mut c_void, usize, *mut usize) -> sys::cublasStatus_t;

/// One attribute of `algo` through `get`; the default when cuBLASLt has none (the values only
/// label output or bound the enumeration).
fn attribute<T: Default + Copy, A>(get: Getter<A>, algo: &Algo, attr: A) -> T {
    let (mut value, mut written) = (T::default(), 0usize);
    // SAFETY: `value` is the attribute's C type (i32, u32 or u16 per cuBLASLt's tables) and as
    // large as the size passed.
    unsafe {
        get(
            algo,
            attr,
            (&mut value as *mut T).cast(),
            size_of::<T>(),
            &mut written,
        )
    };
    value
}

fn config<T: Default + Copy>(algo: &Algo, attr: Config) -> T {
    attribute(sys::cublasLtMatmulAlgoConfigGetAttribute, algo, attr)
}

fn capability<T: Default + Copy>(algo: &Algo, attr: Cap) -> T {
    attribute(sys::cublasLtMatmulAlgoCapGetAttribute, algo, attr)
}

fn set_config<T>(algo: &mut Algo, attr: Config, value: T) -> Result<()> {
    // SAFETY: as in `attribute`; cuBLASLt copies the value.
    check(
        unsafe {
            sys::cublasLtMatmulAlgoConfigSetAttribute(
                algo,
                attr,
                (&value as *const T).cast(),
                size_of::<T>(),
            )
        },
        "cublasLtMatmulAlgoConfigSetAttribute",
    )
}

/// A list capability (u32 ids); empty when the algorithm has none.
fn capability_list(algo: &Algo, attr: Cap) -> Vec<u32> {
    let mut bytes = 0usize;
    // SAFETY: a null buffer of size 0 asks only for the size.
    unsafe {
        sys::cublasLtMatmulAlgoCapGetAttribute(algo, attr, std::ptr::null_mut(), 0, &mut bytes)
    };
    let mut ids = vec![0u32; bytes / size_of::<u32>()];
    if !ids.is_empty() {
        // SAFETY: `ids` holds `bytes` bytes.
        unsafe {
            sys::cublasLtMatmulAlgoCapGetAttribute(
                algo,
                attr,
                ids.as_mut_ptr().cast(),
                bytes,
                &mut bytes,
            )
        };
    }
    ids
}

/// An algorithm's configuration, e.g. `id66 tile470 stages35 opt7 cluster5 swz0 split1`.
fn describe(algo: &Algo) -> String {
    format!(
        "id{} tile{} stages{} opt{} cluster{} swz{} split{}",
        config::<i32>(algo, Config::CUBLASLT_ALGO_CONFIG_ID),
        config::<u32>(algo, Config::CUBLASLT_ALGO_CONFIG_TILE_ID),
        config::<u32>(algo, Config::CUBLASLT_ALGO_CONFIG_STAGES_ID),
        config::<u32>(algo, Config::CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION),
        config::<u16>(algo, Config::CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID),
        config::<u32>(algo, Config::CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING),
        config::<u32>(algo, Config::CUBLASLT_ALGO_CONFIG_SPLITK_NUM),
    )
}

fn median(v: &[f64]) -> f64 {
    ditstream_bench::median(v).unwrap_or(f64::NAN)
}

/// The device buffers every shape uses (sized for the largest), as raw addresses.
struct Buffers {
    a: u64,
    b: u64,
    c: u64,
    bias: u64,
    d: u64,
    workspace: u64,
}

/// One shape's descriptors and a way to run and time an algorithm on them.
struct Gemm<'a> {
    handle: sys::cublasLtHandle_t,
    stream: &'a std::sync::Arc<cudarc::driver::CudaStream>,
    desc: sys::cublasLtMatmulDesc_t,
    layouts: [sys::cublasLtMatrixLayout_t; 3],
    buffers: &'a Buffers,
    residual: bool,
}

impl Gemm<'_> {
    fn accepts(&self, algo: &Algo) -> bool {
        let [a, b, d] = self.layouts;
        // SAFETY: a zeroed result is a valid bit pattern (integers and arrays).
        let mut result: sys::cublasLtMatmulHeuristicResult_t = unsafe { std::mem::zeroed() };
        // SAFETY: every handle is live; cuBLASLt only reads the algorithm and writes `result`.
        let status = unsafe {
            sys::cublasLtMatmulAlgoCheck(self.handle, self.desc, a, b, d, d, algo, &mut result)
        };
        status == sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS && result.workspaceSize <= WORKSPACE
    }

    fn run(&self, algo: &Algo) -> Result<()> {
        let [a, b, d] = self.layouts;
        let bufs = self.buffers;
        let (alpha, beta) = (1.0f32, if self.residual { 1.0f32 } else { 0.0 });
        let c = if self.residual { bufs.c } else { bufs.d };
        // SAFETY: the layouts describe the buffers (sized for the largest shape), C is D's layout,
        // the workspace is WORKSPACE long, and `algo` passed `accepts` (or came from the
        // heuristic) for these descriptors; with beta 0, C is not read.
        unsafe {
            lt::matmul(
                self.handle,
                self.desc,
                (&alpha as *const f32).cast(),
                (&beta as *const f32).cast(),
                bufs.a as *const c_void,
                a,
                bufs.b as *const c_void,
                b,
                c as *const c_void,
                d,
                bufs.d as *mut c_void,
                d,
                algo,
                bufs.workspace as *mut c_void,
                WORKSPACE,
                self.stream.cu_stream() as _,
            )
        }
        .map_err(|e| anyhow!("cublasLtMatmul: {e:?}"))
    }

    /// ms per call over `calls` back-to-back calls after `warm` untimed ones.
    fn time(&self, algo: &Algo, warm: usize, calls: usize) -> Result<f64> {
        for _ in 0..warm {
            self.run(algo)?;
        }
        let flags = Some(CUevent_flags::CU_EVENT_DEFAULT);
        let start = self.stream.record_event(flags)?;
        for _ in 0..calls {
            self.run(algo)?;
        }
        let end = self.stream.record_event(flags)?;
        Ok(f64::from(start.elapsed_ms(&end)?) / calls as f64)
    }
}

fn main() -> Result<()> {
    let args = Args::parse();
    // The GPU script's CUDA settings (kernel cache, CUDA headers, algorithm searches).
    ditstream_kernels::testing::configure_cuda()?;
    if args.rounds == 0 || args.calls == 0 {
        bail!("--rounds and --calls must be ≥ 1");
    }
    let ctx = CudaContext::new(0).context("no CUDA device 0")?;
    let stream = ctx.default_stream();
    let handle = lt::create_handle().map_err(|e| anyhow!("cublasLtCreate: {e:?}"))?;
    // SAFETY: takes no arguments, reads a constant.
    println!("cuBLASLt version {}", unsafe { sys::cublasLtGetVersion() });

    let block = ditstream_kernels::Tensor::randn(
        &[1 << 24],
        ditstream_kernels::DType::BF16,
        7,
        ditstream_kernels::Device::Cpu,
    )?
    .to_vec_bf16()?;
    let filled = |len: usize| -> Result<CudaSlice<bf16>> {
        // SAFETY: every element is written below before any GEMM reads it.
        let mut buf = unsafe { stream.alloc::<bf16>(len) }?;
        for start in (0..len).step_by(block.len()) {
            let end = (start + block.len()).min(len);
            stream.memcpy_htod(&block[..end - start], &mut buf.slice_mut(start..end))?;
        }
        Ok(buf)
    };
    let (max_w, max_x) = (13824 * 5120, 75600 * 13824);
    let (a, b, c, bias) = (
        filled(max_w)?,
        filled(max_x)?,
        filled(75600 * 5120)?,
        filled(13824)?,
    );
    // SAFETY: D is only written (by the GEMMs), the workspace only used by cuBLASLt.
    let (d, ws) = unsafe { (stream.alloc::<bf16>(max_x)?, stream.alloc::<u8>(WORKSPACE)?) };
    let addr = |p: (u64, _)| p.0;
    let buffers = Buffers {
        a: addr(a.device_ptr(&stream)),
        b: addr(b.device_ptr(&stream)),
        c: addr(c.device_ptr(&stream)),
        bias: addr(bias.device_ptr(&stream)),
        d: addr(d.device_ptr(&stream)),
        workspace: addr(ws.device_ptr(&stream)),
    };
    stream.synchronize()?;

    let (bf, f32_) = (
        sys::cudaDataType_t::CUDA_R_16BF,
        sys::cudaDataType_t::CUDA_R_32F,
    );
    let compute = sys::cublasComputeType_t::CUBLAS_COMPUTE_32F;
    let mut ids = vec![0i32; 256];
    let mut count = 0;
    // SAFETY: `ids` holds 256 entries.
    let status = unsafe {
        sys::cublasLtMatmulAlgoGetIds(
            handle,
            compute,
            f32_,
            bf,
            bf,
            bf,
            bf,
            256,
            ids.as_mut_ptr(),
            &mut count,
        )
    };
    check(status, "cublasLtMatmulAlgoGetIds")?;
    ids.truncate(count.max(0) as usize);
    println!("algorithm ids: {ids:?}");
    let init = |id: i32| -> Result<Algo> {
        // SAFETY: a zeroed algorithm is a valid bit pattern; cuBLASLt fills it.
        let mut algo: Algo = unsafe { std::mem::zeroed() };
        // SAFETY: the handle is live; `algo` is written.
        let status = unsafe {
            sys::cublasLtMatmulAlgoInit(handle, compute, f32_, bf, bf, bf, bf, id, &mut algo)
        };
        check(status, "cublasLtMatmulAlgoInit")?;
        Ok(algo)
    };

    for (label, m, n, k, epilogue, residual) in SHAPES {
        if args.only.as_deref().is_some_and(|o| !label.contains(o)) {
            continue;
        }
        let flops = 2.0 * m as f64 * n as f64 * k as f64;
        let tflops = |ms: f64| flops / ms / 1e9;
        let map = |e: lt::CublasError| anyhow!("{e:?}");
        let layouts = [
            lt::create_matrix_layout(bf, k, m, k as i64).map_err(map)?, // W stored [k × m], transposed
            lt::create_matrix_layout(bf, k, n, k as i64).map_err(map)?,
            lt::create_matrix_layout(bf, m, n, m as i64).map_err(map)?,
        ];
        let desc = lt::create_matmul_desc(compute, f32_).map_err(map)?;
        let set = |attr: DescAttr, value: *const c_void, size: usize| {
            // SAFETY: `desc` is live and each value below is its attribute's C type and size.
            unsafe { lt::set_matmul_desc_attribute(desc, attr, value, size) }.map_err(map)
        };
        set(
            DescAttr::CUBLASLT_MATMUL_DESC_TRANSA,
            (&1i32 as *const i32).cast(),
            4,
        )?;
        set(
            DescAttr::CUBLASLT_MATMUL_DESC_EPILOGUE,
            (&epilogue as *const sys::cublasLtEpilogue_t).cast(),
            size_of::<sys::cublasLtEpilogue_t>(),
        )?;
        if epilogue != sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_DEFAULT {
            set(
                DescAttr::CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                (&buffers.bias as *const u64).cast(),
                8,
            )?;
        }
        let gemm = Gemm {
            handle,
            stream: &stream,
            desc,
            layouts,
            buffers: &buffers,
            residual,
        };

        // The heuristic's list, as gemm.rs asks for it (workspace limit only; it asks for 8).
        let pref = lt::create_matmul_pref().map_err(map)?;
        // SAFETY: `pref` is live; the value is a usize (size_t).
        unsafe {
            lt::set_matmul_pref_attribute(
                pref,
                sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                (&WORKSPACE as *const usize).cast(),
                size_of::<usize>(),
            )
        }
        .map_err(map)?;
        // SAFETY: a zeroed result is a valid bit pattern (integers and arrays).
        let zeroed: sys::cublasLtMatmulHeuristicResult_t = unsafe { std::mem::zeroed() };
        let mut results = vec![zeroed; 8];
        let [la, lb, ld] = layouts;
        // SAFETY: every handle is live; `results` holds 8 entries.
        let status = unsafe {
            sys::cublasLtMatmulAlgoGetHeuristic(
                handle,
                desc,
                la,
                lb,
                ld,
                ld,
                pref,
                8,
                results.as_mut_ptr(),
                &mut count,
            )
        };
        check(status, "cublasLtMatmulAlgoGetHeuristic")?;
        let heuristic: Vec<Algo> = results[..count.max(0) as usize]
            .iter()
            .filter(|r| r.state == sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS)
            .map(|r| r.algo)
            .collect();
        let Some(first) = heuristic.first() else {
            bail!("{label}: the heuristic has no algorithm");
        };
        println!("\n=== {label}: m {m}, n {n}, k {k}");
        for (rank, algo) in heuristic.iter().enumerate() {
            println!("HEUR\t{label}\t{rank}\t{}", describe(algo));
        }

        // The space, the heuristic's algorithm id first and within it the heuristic's tiles (the
        // screen may not reach the rest: 40 s cover ~1,000 configurations of a 5120² shape,
        // ~240 of the FFN's, of ~11,000).
        let mut space = Vec::new();
        if args.screen_secs > 0.0 {
            let first_id: i32 = config(first, Config::CUBLASLT_ALGO_CONFIG_ID);
            let mut order = ids.clone();
            order.sort_by_key(|&id| id != first_id);
            for id in order {
                let Ok(base) = init(id) else { continue };
                let list = |cap| match capability_list(&base, cap) {
                    l if l.is_empty() => vec![0],
                    l => l,
                };
                let (tiles, stages) = (
                    list(Cap::CUBLASLT_ALGO_CAP_TILE_IDS),
                    list(Cap::CUBLASLT_ALGO_CAP_STAGES_IDS),
                );
                let swizzle: u32 = capability(&base, Cap::CUBLASLT_ALGO_CAP_CTA_SWIZZLING_SUPPORT);
                let options = capability::<i32>(&base, Cap::CUBLASLT_ALGO_CAP_CUSTOM_OPTION_MAX)
                    .clamp(0, MAX_OPTION as i32) as u32;
                let before = space.len();
                for &tile in &tiles {
                    for &stage in &stages {
                        for cluster in CLUSTERS {
                            for swz in 0..=swizzle.min(1) {
                                for option in 0..=options {
                                    let mut algo = base;
                                    let configured = set_config(
                                        &mut algo,
                                        Config::CUBLASLT_ALGO_CONFIG_TILE_ID,
                                        tile,
                                    )
                                    .and(set_config(
                                        &mut algo,
                                        Config::CUBLASLT_ALGO_CONFIG_STAGES_ID,
                                        stage,
                                    ))
                                    .and(set_config(
                                        &mut algo,
                                        Config::CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID,
                                        cluster,
                                    ))
                                    .and(set_config(
                                        &mut algo,
                                        Config::CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING,
                                        swz,
                                    ))
                                    .and(set_config(
                                        &mut algo,
                                        Config::CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION,
                                        option,
                                    ));
                                    if configured.is_ok() && gemm.accepts(&algo) {
                                        space.push(algo);
                                    }
                                }
                            }
                        }
                    }
                }
                println!(
                    "SPACE\tid{id}\t{} tiles, {} stages, swizzle {swizzle}, options 0–{options}\tvalid {}",
                    tiles.len(),
                    stages.len(),
                    space.len() - before
                );
            }
            let tile = |a: &Algo| config::<u32>(a, Config::CUBLASLT_ALGO_CONFIG_TILE_ID);
            let tiles: Vec<u32> = heuristic.iter().map(tile).collect();
            space.sort_by_key(|a| !tiles.contains(&tile(a)));
            let near = space.iter().filter(|a| tiles.contains(&tile(a))).count();
            println!(
                "space: {} valid configurations, {near} with the heuristic's tiles",
                space.len()
            );
        }

        // Screen.
        let mut screened: Vec<(f64, usize)> = Vec::new();
        let mut drift = Vec::new();
        let clock = Instant::now();
        for (i, algo) in space.iter().enumerate() {
            if clock.elapsed().as_secs_f64() > args.screen_secs {
                println!("screen: budget spent after {i} of {}", space.len());
                break;
            }
            if i % 25 == 0 {
                drift.push(gemm.time(first, 1, 2)?);
            }
            match gemm.time(algo, 1, 2) {
                Ok(ms) => screened.push((ms, i)),
                Err(e) => println!("screen: {} fails to run ({e})", describe(algo)),
            }
        }
        stream.synchronize()?;
        if !drift.is_empty() {
            let lo = drift.iter().copied().fold(f64::INFINITY, f64::min);
            let hi = drift.iter().copied().fold(0.0, f64::max);
            println!(
                "screen: the heuristic's first at median {:.3} ms ({:.1} TFLOP/s), {lo:.3}–{hi:.3}",
                median(&drift),
                tflops(median(&drift))
            );
        }
        screened.sort_by(|x, y| x.0.total_cmp(&y.0));
        for &(ms, i) in screened.iter().take(10) {
            println!(
                "SCREEN\t{label}\t{ms:.3}\t{:.1}\t{}",
                tflops(ms),
                describe(&space[i])
            );
        }

        // Finals.
        let mut finalists: Vec<(String, Algo)> = heuristic
            .iter()
            .enumerate()
            .map(|(r, a)| (format!("heur{r}"), *a))
            .collect();
        for &(_, i) in screened.iter().take(args.finalists) {
            finalists.push((format!("space{i}"), space[i]));
        }
        for spec in &args.extra {
            let f: Vec<u32> = spec
                .split(':')
                .map(str::parse)
                .collect::<Result<_, _>>()
                .with_context(|| format!("--extra {spec}"))?;
            let [id, tile, stage, option, cluster] = f[..] else {
                bail!("--extra {spec}: want id:tile:stages:option:cluster");
            };
            let mut algo = init(id as i32)?;
            set_config(&mut algo, Config::CUBLASLT_ALGO_CONFIG_TILE_ID, tile)?;
            set_config(&mut algo, Config::CUBLASLT_ALGO_CONFIG_STAGES_ID, stage)?;
            set_config(
                &mut algo,
                Config::CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION,
                option,
            )?;
            set_config(
                &mut algo,
                Config::CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID,
                cluster as u16,
            )?;
            if gemm.accepts(&algo) {
                finalists.push((format!("x{spec}"), algo));
            } else {
                println!("--extra {spec}: not accepted for {label}");
            }
        }
        let mut rounds = vec![Vec::new(); finalists.len()];
        for _ in 0..args.rounds {
            for (times, (_, algo)) in rounds.iter_mut().zip(&finalists) {
                times.push(gemm.time(algo, args.warm, args.calls)?);
            }
        }
        let reference = median(&rounds[0]);
        let mut order: Vec<usize> = (0..finalists.len()).collect();
        order.sort_by(|&x, &y| median(&rounds[x]).total_cmp(&median(&rounds[y])));
        for j in order {
            let ms = median(&rounds[j]);
            let each: Vec<String> = rounds[j].iter().map(|t| format!("{t:.3}")).collect();
            println!(
                "FINAL\t{label}\t{}\t{ms:.3}\t{:.1}\t{:.3}\t{}\t{}",
                finalists[j].0,
                tflops(ms),
                reference / ms,
                each.join(","),
                describe(&finalists[j].1)
            );
        }
        // SAFETY: created above for this shape and not used after.
        unsafe {
            let _ = lt::destroy_matmul_pref(pref);
            let _ = lt::destroy_matmul_desc(desc);
            for l in layouts {
                let _ = lt::destroy_matrix_layout(l);
            }
        }
    }
    Ok(())
}
