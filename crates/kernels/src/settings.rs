//! Process-wide switches of the kernels: the GEMMs' ordering with CubeCL's work, the FP8 GEMM's
//! path and tile shape, and FlashAttention's tile overrides (for benchmarks, tuning sweeps and
//! tests; the defaults are what training should use).
//!
//! Each setting starts from its environment variable ([`Settings::from_env`]), read once, at the
//! first kernel that needs a setting or at [`init_from_env`]; a program can instead set them with
//! [`set`] or change one with [`update`]. A bad environment value is an error naming the
//! variable: from [`init_from_env`] (which a program calls at start to report it cleanly), else a
//! panic at the first kernel.
//!
//! | setting | variable | values |
//! |---|---|---|
//! | [`Settings::gemm_order`] | `BURNMIX_GEMM_ORDER` | `same` (default), `stream`, `host` |
//! | [`Settings::fp8_gemm_order`] | `BURNMIX_GEMM_FP8_ORDER` | `same`, `stream`, `host` (default: `gemm_order`) |
//! | [`Settings::gemm_hold`] | `BURNMIX_GEMM_HOLD` | `none` turns it off (a diagnostic) |
//! | [`Settings::gemm_queue`] | `BURNMIX_GEMM_QUEUE` | `on` (default), `off` (a comparison) |
//! | [`Settings::gemm_spare_sm`] | `BURNMIX_GEMM_SPARE_SM` | `on` (default), `off` (a comparison) |
//! | [`Settings::gemm_algo`] | `BURNMIX_GEMM_ALGO` | `heuristic` (default), `timed` |
//! | [`Settings::fp8_gemm`] | `BURNMIX_FP8_GEMM` | `auto` (default), `cublaslt`, `mma`, `dequantize` |
//! | [`Settings::fp8_mma_shape`] | `BURNMIX_FP8_MMA_SHAPE` | `wm,wn,mt,nt` ([`MmaShape`]) |
//! | [`Settings::fp8_pair`] | `BURNMIX_FP8_PAIR` | `auto` (default), `native`, `fused`, `separate` |
//! | [`Settings::fp8_swiglu_producer`] | `BURNMIX_FP8_SWIGLU_PRODUCER` | `on` (default), `off` (a comparison) |
//! | [`Settings::flash_tiles`] | `BURNMIX_FLASH_TILES` | [`FlashTiles`] |
//! | [`Settings::flash_hopper`] | `BURNMIX_FLASH_HOPPER` | `on` (default), `off` (the CubeCL forward and backward on Hopper too) |
//! | [`Settings::flash_fp8`] | `BURNMIX_FLASH_FP8` | `off` (default), `on` (the Hopper forward in FP8: experimental) |
//! | [`Settings::embedding_atomic`] | `BURNMIX_EMBEDDING_GRAD` | `atomic` (default), `reference` |
//! | [`Settings::memory_trace`] | `BURNMIX_MEMORY_TRACE` | `0` / `off` (default), `1` / `on` |

use std::sync::RwLock;

use crate::fp8::mma::MmaShape;
use crate::fp8::path::{Fp8GemmPath, Fp8PairPath};

/// `BURNMIX_GEMM_ORDER`: [`Settings::gemm_order`].
pub const GEMM_ORDER_ENV: &str = "BURNMIX_GEMM_ORDER";
/// `BURNMIX_GEMM_FP8_ORDER`: [`Settings::fp8_gemm_order`].
pub const FP8_GEMM_ORDER_ENV: &str = "BURNMIX_GEMM_FP8_ORDER";
/// `BURNMIX_GEMM_HOLD`: [`Settings::gemm_hold`].
pub const GEMM_HOLD_ENV: &str = "BURNMIX_GEMM_HOLD";
/// `BURNMIX_GEMM_QUEUE`: [`Settings::gemm_queue`].
pub const GEMM_QUEUE_ENV: &str = "BURNMIX_GEMM_QUEUE";
/// `BURNMIX_GEMM_SPARE_SM`: [`Settings::gemm_spare_sm`].
pub const GEMM_SPARE_SM_ENV: &str = "BURNMIX_GEMM_SPARE_SM";
/// `BURNMIX_GEMM_ALGO`: [`Settings::gemm_algo`].
pub const GEMM_ALGO_ENV: &str = "BURNMIX_GEMM_ALGO";
/// `BURNMIX_FP8_GEMM`: [`Settings::fp8_gemm`].
pub const FP8_GEMM_ENV: &str = "BURNMIX_FP8_GEMM";
/// `BURNMIX_FP8_MMA_SHAPE`: [`Settings::fp8_mma_shape`].
pub const FP8_MMA_SHAPE_ENV: &str = "BURNMIX_FP8_MMA_SHAPE";
/// `BURNMIX_FP8_PAIR`: [`Settings::fp8_pair`].
pub const FP8_PAIR_ENV: &str = "BURNMIX_FP8_PAIR";
/// `BURNMIX_FP8_SWIGLU_PRODUCER`: [`Settings::fp8_swiglu_producer`].
pub const FP8_SWIGLU_PRODUCER_ENV: &str = "BURNMIX_FP8_SWIGLU_PRODUCER";
/// `BURNMIX_FLASH_TILES`: [`Settings::flash_tiles`].
pub const FLASH_TILES_ENV: &str = "BURNMIX_FLASH_TILES";
/// `BURNMIX_FLASH_HOPPER`: [`Settings::flash_hopper`].
pub const FLASH_HOPPER_ENV: &str = "BURNMIX_FLASH_HOPPER";
/// `BURNMIX_FLASH_FP8`: [`Settings::flash_fp8`].
pub const FLASH_FP8_ENV: &str = "BURNMIX_FLASH_FP8";
/// `BURNMIX_EMBEDDING_GRAD`: [`Settings::embedding_atomic`].
pub const EMBEDDING_GRAD_ENV: &str = "BURNMIX_EMBEDDING_GRAD";
/// `BURNMIX_MEMORY_TRACE`: [`Settings::memory_trace`].
pub const MEMORY_TRACE_ENV: &str = "BURNMIX_MEMORY_TRACE";

/// How a cuBLASLt GEMM is ordered with CubeCL's work on the same device (see `gemm/cublaslt/order.rs`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GemmOrder {
    /// On CubeCL's own stream, behind CubeCL's earlier work and before its later work (the
    /// default). Where CubeCL's stream cannot be found, `Stream`, with a warning.
    Same,
    /// On the GPU, on a stream of its own: flags written and waited for by the streams, no host
    /// wait.
    Stream,
    /// The host waits for CubeCL's stream before the GEMM and for the GEMM's stream after it.
    Host,
}

impl std::str::FromStr for GemmOrder {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "same" => Ok(GemmOrder::Same),
            "stream" => Ok(GemmOrder::Stream),
            "host" => Ok(GemmOrder::Host),
            _ => Err(format!("`{s}` is not one of same, stream, host")),
        }
    }
}

/// How a cuBLASLt GEMM's algorithm is chosen, once per problem (types, shape, layouts,
/// alignments, epilogue).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GemmAlgo {
    /// cuBLASLt's heuristic's first choice (the default; what PyTorch's matmuls use).
    Heuristic,
    /// Each of the heuristic's first few results is timed on the problem's first call, on its
    /// own buffers and stream, and the fastest is kept for the process. Runs in two processes may
    /// then differ in rounding where their timings chose differently.
    Timed,
}

impl std::str::FromStr for GemmAlgo {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "heuristic" => Ok(GemmAlgo::Heuristic),
            "timed" => Ok(GemmAlgo::Timed),
            _ => Err(format!("`{s}` is not one of heuristic, timed")),
        }
    }
}

/// Which path [`crate::fp8_gemm`] takes (see [`crate::fp8::fp8_gemm_path`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fp8GemmChoice {
    /// cuBLASLt where the device has its block-scaled FP8 GEMM, else dequantize (the default).
    Auto,
    /// This path where it applies to the operands, else dequantize.
    Path(Fp8GemmPath),
}

impl std::str::FromStr for Fp8GemmChoice {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(Fp8GemmChoice::Auto),
            "cublaslt" => Ok(Fp8GemmChoice::Path(Fp8GemmPath::CublasLt)),
            "mma" => Ok(Fp8GemmChoice::Path(Fp8GemmPath::TensorCores)),
            "dequantize" => Ok(Fp8GemmChoice::Path(Fp8GemmPath::Dequantize)),
            _ => Err(format!(
                "`{s}` is not one of auto, cublaslt, mma, dequantize"
            )),
        }
    }
}

/// Overrides of the FlashAttention tensor-core kernels' tiles, applied over the per-head-dim
/// defaults: `fwd=MTxBLOCK[xWARPS],dq=MTxBLOCK[xWARPS],dkdv=MTxBLOCK[xWARPS]`, any subset (e.g.
/// `fwd=2x64,dkdv=1x32`); row tiles 1, 2 or 4, the block a multiple of 16 from 16 to 128, warps 4
/// or 8; `dq=fused` computes dQ inside the dK/dV kernel (f32 atomics), `dq=separate` in its own
/// (deterministic) kernel; `stages=2` or `stages=3` sets the forward's key/value buffers;
/// `stmatrix=off` makes the forward stage its output without `stmatrix` (as on devices before
/// sm_90); `bwd=split` runs the dK/dV kernel in FlashAttention-2's warp layouts (32 keys a warp;
/// dQ inside it with `dq=fused`, in its own kernel with `dq=separate`; the default at head_dim
/// 128), `bwd=rows` with whole key rows a warp (the default at 64). Any override also keeps the
/// backward on these kernels where the Hopper backward would run (the forward stays on the Hopper
/// kernel).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FlashTiles(String);

impl FlashTiles {
    /// The overrides as written.
    pub fn spec(&self) -> &str {
        &self.0
    }
}

impl std::str::FromStr for FlashTiles {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        crate::attention::check_tiles(s)?;
        Ok(FlashTiles(s.to_string()))
    }
}

/// The kernels' switches (see the module docs).
#[derive(Debug, Clone, PartialEq)]
pub struct Settings {
    /// Ordering of the bf16, f16 and f32 cuBLASLt GEMMs. Fixed at the process's first cuBLASLt
    /// GEMM: later changes do not apply (GEMMs of the first order may still be in flight).
    pub gemm_order: GemmOrder,
    /// Ordering of the FP8 cuBLASLt GEMMs; `None`: `gemm_order`. Fixed at the first FP8 GEMM.
    pub fp8_gemm_order: Option<GemmOrder>,
    /// In the `stream` order, hold each GEMM's tensors until the GEMM has run (default). Off only to
    /// show the race that holding prevents (their memory can be handed out while the GEMM runs).
    pub gemm_hold: bool,
    /// In a GPU order (`same`, `stream`), queue a bf16/f16/f32 GEMM whose problem has run on cuBLASLt before on
    /// CubeCL's device thread without waiting for it (default). Off (`BURNMIX_GEMM_QUEUE=off`):
    /// each GEMM waits until that thread has issued it, a comparison.
    pub gemm_queue: bool,
    /// In the `stream` order, tell cuBLASLt to plan each GEMM for one SM fewer than the GPU has
    /// (`CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET`), since CubeCL's waiting kernel occupies part of
    /// one SM while the GEMM runs (default). Off (`BURNMIX_GEMM_SPARE_SM=off`): every SM, for
    /// comparison.
    pub gemm_spare_sm: bool,
    /// How each problem's cuBLASLt algorithm is chosen. Fixed for a problem at its first call.
    pub gemm_algo: GemmAlgo,
    /// Test hook: a queued GEMM acts as if cuBLASLt refused it, so that its fallback (Burn's
    /// matmul on CubeCL's device thread) runs.
    #[doc(hidden)]
    pub gemm_refuse_queued: bool,
    /// The FP8 GEMM's path.
    pub fp8_gemm: Fp8GemmChoice,
    /// The tensor-core FP8 GEMM's cube shape; `None`: [`MmaShape::DEFAULT`].
    pub fp8_mma_shape: Option<MmaShape>,
    /// How the FP8 quantizer takes both orientations of an operand
    /// ([`crate::fp8::fp8_quantize_pair`]); `None`: native where it applies
    /// ([`crate::fp8::fp8_pair_path`]).
    pub fp8_pair: Option<Fp8PairPath>,
    /// SwiGLU's output and gradient quantized inside the CUDA C++ pair kernel that computes them
    /// (`fp8/producer.rs`) in the FP8 MLP (default); off: SwiGLU's CubeCL kernel writes the
    /// values and the pair quantizer reads them, for comparison.
    pub fp8_swiglu_producer: bool,
    /// FlashAttention tile overrides; `None`: the defaults.
    pub flash_tiles: Option<FlashTiles>,
    /// FlashAttention's forward and backward on Hopper GPUs run the CUDA C++ kernels on TMA and
    /// warpgroup MMA where they apply (default; see `attention::hopper`); off: the CubeCL
    /// tensor-core kernels, for comparison.
    pub flash_hopper: bool,
    /// Experimental: FlashAttention's forward on Hopper GPUs in FP8 (e4m3 q, k, v with block
    /// scales, FlashAttention-3's recipe; see `attention::hopper::fp8`) where the Hopper forward
    /// applies; the backward stays in 16 bits. Off by default.
    pub flash_fp8: bool,
    /// The embedding backward's scatter with f32 atomic adds on CUDA (default); off: Burn's
    /// select-assign, the reference, for comparison.
    pub embedding_atomic: bool,
    /// Print the memory pools' bytes in use and reserved at the points of a step that call
    /// [`crate::memory::trace`] (off by default).
    pub memory_trace: bool,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            gemm_order: GemmOrder::Same,
            fp8_gemm_order: None,
            gemm_hold: true,
            gemm_queue: true,
            gemm_spare_sm: true,
            gemm_algo: GemmAlgo::Heuristic,
            gemm_refuse_queued: false,
            fp8_gemm: Fp8GemmChoice::Auto,
            fp8_mma_shape: None,
            fp8_pair: None,
            fp8_swiglu_producer: true,
            flash_tiles: None,
            flash_hopper: true,
            flash_fp8: false,
            embedding_atomic: true,
            memory_trace: false,
        }
    }
}

impl Settings {
    /// The defaults with every variable of the module docs that is set (and not empty) applied;
    /// an error names the first bad one.
    pub fn from_env() -> Result<Settings, String> {
        Self::from_lookup(|name| std::env::var(name).ok())
    }

    fn from_lookup(var: impl Fn(&str) -> Option<String>) -> Result<Settings, String> {
        fn parse<T: std::str::FromStr<Err = String>>(
            var: &impl Fn(&str) -> Option<String>,
            name: &str,
        ) -> Result<Option<T>, String> {
            match var(name).filter(|v| !v.trim().is_empty()) {
                None => Ok(None),
                Some(v) => v
                    .trim()
                    .parse()
                    .map(Some)
                    .map_err(|e| format!("{name}: {e}")),
            }
        }
        // An `on` / `off` variable: `default` (the setting's default) where unset or empty.
        fn on_off(
            var: &impl Fn(&str) -> Option<String>,
            name: &str,
            default: bool,
        ) -> Result<bool, String> {
            match var(name).as_deref().map(str::trim) {
                None | Some("") => Ok(default),
                Some("on") => Ok(true),
                Some("off") => Ok(false),
                Some(v) => Err(format!("{name}: `{v}` is not `on` or `off`")),
            }
        }
        let mut s = Settings::default();
        if let Some(o) = parse(&var, GEMM_ORDER_ENV)? {
            s.gemm_order = o;
        }
        s.fp8_gemm_order = parse(&var, FP8_GEMM_ORDER_ENV)?;
        match var(GEMM_HOLD_ENV).as_deref().map(str::trim) {
            None | Some("") => {}
            Some("none") => s.gemm_hold = false,
            Some(v) => return Err(format!("{GEMM_HOLD_ENV}: `{v}` is not `none`")),
        }
        s.gemm_queue = on_off(&var, GEMM_QUEUE_ENV, s.gemm_queue)?;
        s.gemm_spare_sm = on_off(&var, GEMM_SPARE_SM_ENV, s.gemm_spare_sm)?;
        if let Some(a) = parse(&var, GEMM_ALGO_ENV)? {
            s.gemm_algo = a;
        }
        if let Some(c) = parse(&var, FP8_GEMM_ENV)? {
            s.fp8_gemm = c;
        }
        s.fp8_mma_shape = match var(FP8_MMA_SHAPE_ENV).filter(|v| !v.trim().is_empty()) {
            None => None,
            Some(v) => Some(MmaShape::parse(&v).map_err(|e| format!("{FP8_MMA_SHAPE_ENV}: {e}"))?),
        };
        s.fp8_pair = match var(FP8_PAIR_ENV).as_deref().map(str::trim) {
            None | Some("") | Some("auto") => None,
            Some("native") => Some(Fp8PairPath::Native),
            Some("fused") => Some(Fp8PairPath::Fused),
            Some("separate") => Some(Fp8PairPath::Separate),
            Some(v) => {
                return Err(format!(
                    "{FP8_PAIR_ENV}: `{v}` is not one of auto, native, fused, separate"
                ))
            }
        };
        s.fp8_swiglu_producer = on_off(&var, FP8_SWIGLU_PRODUCER_ENV, s.fp8_swiglu_producer)?;
        s.flash_tiles = parse(&var, FLASH_TILES_ENV)?;
        s.flash_hopper = on_off(&var, FLASH_HOPPER_ENV, s.flash_hopper)?;
        s.flash_fp8 = on_off(&var, FLASH_FP8_ENV, s.flash_fp8)?;
        match var(EMBEDDING_GRAD_ENV).as_deref().map(str::trim) {
            None | Some("") | Some("atomic") => {}
            Some("reference") => s.embedding_atomic = false,
            Some(v) => {
                return Err(format!(
                    "{EMBEDDING_GRAD_ENV}: `{v}` is not one of atomic, reference"
                ))
            }
        }
        match var(MEMORY_TRACE_ENV).as_deref().map(str::trim) {
            None | Some("") | Some("0") | Some("off") => {}
            Some("1") | Some("on") => s.memory_trace = true,
            Some(v) => {
                return Err(format!(
                    "{MEMORY_TRACE_ENV}: `{v}` is not one of 1, on, 0, off"
                ))
            }
        }
        Ok(s)
    }

    /// The FP8 GEMMs' ordering (`gemm_order` when not set apart).
    pub fn fp8_order(&self) -> GemmOrder {
        self.fp8_gemm_order.unwrap_or(self.gemm_order)
    }
}

static SETTINGS: RwLock<Option<Settings>> = RwLock::new(None);

/// Reads the environment into the settings, unless they were set already; a bad value is an
/// error naming its variable.
pub fn init_from_env() -> Result<(), String> {
    let mut slot = SETTINGS.write().unwrap_or_else(|e| e.into_inner());
    if slot.is_none() {
        *slot = Some(Settings::from_env()?);
    }
    Ok(())
}

/// Replaces the settings.
pub fn set(settings: Settings) {
    *SETTINGS.write().unwrap_or_else(|e| e.into_inner()) = Some(settings);
}

/// Changes the settings (starting from the environment if nothing was set yet). `f` runs on a
/// copy, so it may itself read the settings.
pub fn update(f: impl FnOnce(&mut Settings)) {
    let mut s = get();
    f(&mut s);
    set(s);
}

/// Settings changed by `f` for as long as the returned guard lives, then restored (to what was
/// set before, or to "not set yet", which reads the environment again). A `scoped` on another
/// thread waits until this thread's guards are dropped, so that tests running side by side in one
/// process do not see each other's settings; on the same thread guards nest (drop them in the
/// reverse order of their making, as scopes do).
///
/// ```
/// let _tiles = kernels::settings::scoped(|s| s.flash_tiles = Some("bwd=split".parse().unwrap()));
/// // ... the kernels launched here use the override ...
/// ```
pub fn scoped(f: impl FnOnce(&mut Settings)) -> Scoped {
    static ONE_THREAD_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let lock = if SCOPES_HELD.with(|n| n.get()) == 0 {
        Some(
            ONE_THREAD_AT_A_TIME
                .lock()
                .unwrap_or_else(|e| e.into_inner()),
        )
    } else {
        None
    };
    SCOPES_HELD.with(|n| n.set(n.get() + 1));
    let previous = SETTINGS.read().unwrap_or_else(|e| e.into_inner()).clone();
    update(f);
    Scoped {
        previous,
        _one_thread_at_a_time: lock,
    }
}

thread_local! {
    /// How many [`Scoped`] guards this thread holds: only the outermost takes the lock.
    static SCOPES_HELD: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// The guard of [`scoped`]: restores the settings when dropped. It stays on the thread that made
/// it (it holds a lock guard, which is not `Send`).
pub struct Scoped {
    previous: Option<Settings>,
    _one_thread_at_a_time: Option<std::sync::MutexGuard<'static, ()>>,
}

impl Drop for Scoped {
    fn drop(&mut self) {
        *SETTINGS.write().unwrap_or_else(|e| e.into_inner()) = self.previous.take();
        SCOPES_HELD.with(|n| n.set(n.get() - 1));
    }
}

/// The current settings (from the environment at the first call when none were set).
pub fn get() -> Settings {
    read(Settings::clone)
}

/// Reads one thing from the current settings without copying them (`f` runs under the lock: it
/// must not call this module's functions).
pub(crate) fn read<R>(f: impl FnOnce(&Settings) -> R) -> R {
    {
        let slot = SETTINGS.read().unwrap_or_else(|e| e.into_inner());
        if let Some(s) = slot.as_ref() {
            return f(s);
        }
    }
    let mut slot = SETTINGS.write().unwrap_or_else(|e| e.into_inner());
    f(slot.get_or_insert_with(from_env_or_panic))
}

fn from_env_or_panic() -> Settings {
    Settings::from_env().unwrap_or_else(|e| panic!("kernel settings: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lookup<'a>(vars: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |name| {
            vars.iter()
                .find(|(n, _)| *n == name)
                .map(|(_, v)| v.to_string())
        }
    }

    #[test]
    fn unset_and_empty_variables_give_the_defaults() {
        assert_eq!(Settings::from_lookup(lookup(&[])), Ok(Settings::default()));
        let empty = [
            (GEMM_ORDER_ENV, ""),
            (FP8_GEMM_ENV, " "),
            (GEMM_HOLD_ENV, ""),
        ];
        assert_eq!(
            Settings::from_lookup(lookup(&empty)),
            Ok(Settings::default())
        );
    }

    #[test]
    fn scoped_guards_nest_on_one_thread_and_restore_in_turn() {
        let outer = scoped(|s| s.gemm_queue = false);
        {
            // Would wait for ever if the guards did not nest.
            let _inner = scoped(|s| s.embedding_atomic = false);
            assert!(!get().gemm_queue && !get().embedding_atomic);
        }
        assert!(!get().gemm_queue);
        assert_eq!(get().embedding_atomic, Settings::default().embedding_atomic);
        drop(outer);
        // Another thread takes the settings once this thread holds no guard.
        std::thread::spawn(|| drop(scoped(|s| s.gemm_hold = false)))
            .join()
            .unwrap();
    }

    #[test]
    fn every_variable_is_read() {
        let s = Settings::from_lookup(lookup(&[
            (GEMM_ORDER_ENV, "host"),
            (FP8_GEMM_ORDER_ENV, "stream"),
            (GEMM_HOLD_ENV, "none"),
            (GEMM_QUEUE_ENV, "off"),
            (GEMM_SPARE_SM_ENV, "off"),
            (GEMM_ALGO_ENV, "timed"),
            (FP8_GEMM_ENV, "cublaslt"),
            (FP8_MMA_SHAPE_ENV, "4,2,2,8"),
            (FP8_PAIR_ENV, "fused"),
            (FP8_SWIGLU_PRODUCER_ENV, "off"),
            (FLASH_TILES_ENV, "fwd=2x64,dq=separate"),
            (FLASH_HOPPER_ENV, "off"),
            (EMBEDDING_GRAD_ENV, "reference"),
            (FLASH_FP8_ENV, "on"),
            (MEMORY_TRACE_ENV, "1"),
        ]))
        .unwrap();
        assert_eq!(s.gemm_order, GemmOrder::Host);
        assert_eq!(s.fp8_order(), GemmOrder::Stream);
        assert!(!s.gemm_hold);
        assert!(!s.gemm_queue);
        assert!(!s.gemm_spare_sm);
        assert_eq!(s.gemm_algo, GemmAlgo::Timed);
        assert_eq!(s.fp8_gemm, Fp8GemmChoice::Path(Fp8GemmPath::CublasLt));
        assert_eq!(s.fp8_mma_shape, Some(MmaShape::parse("4,2,2,8").unwrap()));
        assert_eq!(s.fp8_pair, Some(Fp8PairPath::Fused));
        assert!(!s.fp8_swiglu_producer);
        assert_eq!(s.flash_tiles.unwrap().spec(), "fwd=2x64,dq=separate");
        assert!(!s.flash_hopper);
        assert!(s.flash_fp8);
        assert!(!s.embedding_atomic);
        assert!(s.memory_trace);
        // The FP8 order follows the other GEMMs' unless set.
        let s = Settings::from_lookup(lookup(&[(GEMM_ORDER_ENV, "host")])).unwrap();
        assert_eq!(s.fp8_order(), GemmOrder::Host);
    }

    #[test]
    fn a_bad_value_names_its_variable_and_the_valid_ones() {
        for (name, value, expected) in [
            (GEMM_ORDER_ENV, "gpu", "same, stream, host"),
            (FP8_GEMM_ORDER_ENV, "x", "same, stream, host"),
            (GEMM_HOLD_ENV, "off", "`none`"),
            (GEMM_QUEUE_ENV, "no", "`on` or `off`"),
            (GEMM_SPARE_SM_ENV, "1", "`on` or `off`"),
            (GEMM_ALGO_ENV, "fastest", "heuristic, timed"),
            (FP8_GEMM_ENV, "fast", "auto, cublaslt, mma, dequantize"),
            (FP8_MMA_SHAPE_ENV, "2,2", "wm,wn,mt,nt"),
            (FP8_PAIR_ENV, "one", "auto, native, fused, separate"),
            (FP8_SWIGLU_PRODUCER_ENV, "yes", "`on` or `off`"),
            (FLASH_TILES_ENV, "fwd=3x64", "row tiles must be 1, 2 or 4"),
            (FLASH_HOPPER_ENV, "yes", "`on` or `off`"),
            (FLASH_TILES_ENV, "attn=2x64", "expected fwd, dq, dkdv"),
            (FLASH_TILES_ENV, "bwd=2x64", "`split` or `rows`"),
            (EMBEDDING_GRAD_ENV, "fast", "atomic, reference"),
            (MEMORY_TRACE_ENV, "yes", "1, on, 0, off"),
        ] {
            let e = Settings::from_lookup(lookup(&[(name, value)])).unwrap_err();
            assert!(
                e.starts_with(name) && e.contains(expected),
                "{name}={value}: {e}"
            );
        }
    }
}
