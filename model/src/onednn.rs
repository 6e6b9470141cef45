//! oneDNN's matmul primitive (Intel's deep-learning primitives, what PyTorch uses on CPU;
//! Debian 12 ships 2.6.3 as `libdnnl2`) through the C shim `csrc/dnnl_matmul.c`, with the
//! primitives cached per shape, strides, data type, alpha, beta and whether a bias is added.
//!
//! Why oneDNN: it is the only library in Debian 12 with a fast bf16 GEMM (OpenBLAS 0.3.21
//! there is built without `sbgemm`); with AMX its bf16 matmul ran at 290-1,000 GFLOP/s on one
//! core at BERT shapes (measured on a Sapphire/Emerald Rapids Xeon, 2026-12-01). OpenBLAS stays the fp32 backend.
//!
//! Why a C shim rather than `extern "C"` declarations of the C API: oneDNN 2.x's memory
//! descriptor is a large by-value struct whose layout Rust would have to mirror exactly; the
//! shim keeps it on the C side and exports three functions over plain integers and pointers.
//!
//! Threads: Keel owns them. Each call runs oneDNN on the calling thread alone (the shim sets
//! that thread's OpenMP team to 1 before every call); large GEMMs are cut among Keel's threads
//! by `super::gemm` as for OpenBLAS. Creating a primitive takes 0.1-several ms (it JITs code),
//! running one only microseconds of overhead, hence the cache: a model has a few dozen shapes.

use std::collections::HashMap;
use std::ffi::{CStr, c_char, c_int, c_void};
use std::sync::{Arc, Mutex, OnceLock};

use ndarray::{ArrayView2, ArrayViewMut2};

/// The shim's primitive (opaque).
#[repr(C)]
struct RawMatmul {
    _private: [u8; 0],
}

unsafe extern "C" {
    fn keel_dnnl_matmul_create(
        bf16: c_int,
        ndims: c_int,
        a_dims: *const i64,
        a_strides: *const i64,
        b_dims: *const i64,
        b_strides: *const i64,
        c_dims: *const i64,
        c_strides: *const i64,
        alpha: f32,
        beta: f32,
        bias: c_int,
        out: *mut *mut RawMatmul,
        impl_name: *mut c_char,
        impl_len: usize,
    ) -> c_int;
    fn keel_dnnl_matmul_run(
        mm: *const RawMatmul,
        a: *const c_void,
        b: *const c_void,
        bias: *const f32,
        c: *mut f32,
    ) -> c_int;
    fn keel_dnnl_matmul_destroy(mm: *mut RawMatmul);
}

/// The input data type of a matmul (the output is always f32).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum InputType {
    /// f32 inputs: not used by the model (OpenBLAS is the fp32 backend); it lets the tests
    /// exercise this FFI layer on CPUs without bf16 (oneDNN's f32 matmul runs everywhere).
    #[cfg_attr(not(test), allow(dead_code))]
    F32,
    /// bf16 inputs (bit patterns in `u16`: the high half of the f32).
    Bf16,
}

/// Errors of oneDNN (its `dnnl_status_t`) or of a view it cannot take.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum DnnlError {
    /// oneDNN returned this status (2 = invalid arguments, 3 = unimplemented: e.g. no bf16
    /// matmul on this CPU; see `dnnl_status_t` in `dnnl_types.h`).
    #[error("oneDNN {what} failed with status {status} ({})", status_name(*status))]
    Status {
        /// `creating a bf16 [m, k] x [k, n] matmul`, ...
        what: String,
        /// The `dnnl_status_t`.
        status: i32,
    },
    /// A view with a negative stride (ndarray allows them; oneDNN does not).
    #[error("oneDNN matmul needs non-negative strides, got {0:?}")]
    NegativeStride([isize; 2]),
    /// A batched operand whose dimensions and strides reach past its slice, or whose shapes
    /// do not chain (`[.., m, k] x [.., k, n] -> [.., m, n]`).
    #[error("oneDNN batched matmul: {0}")]
    BadOperand(String),
}

fn status_name(status: i32) -> &'static str {
    match status {
        1 => "out of memory",
        2 => "invalid arguments",
        3 => "unimplemented",
        4 => "iterator ends",
        5 => "runtime error",
        6 => "not required",
        _ => "unknown",
    }
}

/// What identifies a primitive: everything it was created with. `dims` and `strides` are
/// A's, B's and C's, the first `ndims` entries of each used (outermost first).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct Key {
    input: InputType,
    ndims: usize,
    dims: [[i64; 4]; 3],
    strides: [[i64; 4]; 3],
    alpha: u32,
    beta: u32,
    /// A dense f32 bias `[n]` is added to every row.
    bias: bool,
}

impl Key {
    /// The key of a plain `[m, k] x [k, n]` product with these (row, column) strides of A,
    /// B and C, with or without a bias.
    fn plain(
        input: InputType,
        [m, k, n]: [usize; 3],
        s: [i64; 6],
        (alpha, beta): (f32, f32),
        bias: bool,
    ) -> Key {
        let (m, k, n) = (m as i64, k as i64, n as i64);
        Key {
            input,
            ndims: 2,
            dims: [[m, k, 0, 0], [k, n, 0, 0], [m, n, 0, 0]],
            strides: [[s[0], s[1], 0, 0], [s[2], s[3], 0, 0], [s[4], s[5], 0, 0]],
            alpha: alpha.to_bits(),
            beta: beta.to_bits(),
            bias,
        }
    }

    fn describe(&self) -> String {
        let d = |i: usize| format!("{:?}", &self.dims[i][..self.ndims]);
        let bias = if self.bias { " with a bias" } else { "" };
        format!("{:?} {} x {} matmul{bias}", self.input, d(0), d(1))
    }
}

/// A created primitive. oneDNN primitives are immutable once created and may be executed
/// from several threads at once (the shim gives each call its own scratchpad).
struct Matmul {
    raw: *mut RawMatmul,
    implementation: String,
}

// SAFETY: the primitive is immutable after creation; concurrent execution is allowed by
// oneDNN with a user scratchpad per call (see the shim), and it is destroyed exactly once.
unsafe impl Send for Matmul {}
// SAFETY: as above: `run` only reads it.
unsafe impl Sync for Matmul {}

impl Drop for Matmul {
    fn drop(&mut self) {
        // SAFETY: `raw` came from `keel_dnnl_matmul_create` and is dropped once.
        unsafe { keel_dnnl_matmul_destroy(self.raw) }
    }
}

/// Most primitives kept: a model has a few dozen GEMM shapes; a stream of new shapes (eval
/// batches of many sizes, say) empties the cache rather than growing it without bound.
const CACHE_LIMIT: usize = 1024;

fn cache() -> &'static Mutex<HashMap<Key, Arc<Matmul>>> {
    static CACHE: OnceLock<Mutex<HashMap<Key, Arc<Matmul>>>> = OnceLock::new();
    CACHE.get_or_init(|| Mutex::new(HashMap::new()))
}

fn strides_of<T>(v: &ArrayView2<'_, T>) -> Result<[i64; 2], DnnlError> {
    let s = v.strides();
    if s[0] < 0 || s[1] < 0 {
        return Err(DnnlError::NegativeStride([s[0], s[1]]));
    }
    Ok([s[0] as i64, s[1] as i64])
}

/// bf16 matmuls run by one of oneDNN's reference kernels (see [`reference_bf16_calls`]).
static REFERENCE_BF16_CALLS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
/// bf16 matmuls run by `gemm:jit` (see [`gemm_jit_bf16_calls`]).
static GEMM_JIT_BF16_CALLS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// How many bf16 matmuls in this process ran on oneDNN's `gemm:jit` rather than a `brg:`
/// (brgemm) kernel. oneDNN 2.6.3 picks `gemm:jit` when an operand is not dense (a row-strided
/// view, a column block of a wider matrix); on an AMX CPU that is not the AMX kernel, at
/// 0.45-0.6x its rate (measured on a 2-core AMX Xeon). The bench prints it.
pub(crate) fn gemm_jit_bf16_calls() -> u64 {
    GEMM_JIT_BF16_CALLS.load(std::sync::atomic::Ordering::Relaxed)
}

/// How many bf16 matmuls in this process ran on a oneDNN reference kernel (`ref:...`): scalar
/// loops, 100x slower or more than the `brg:` ones. The model's GEMMs should cause none; the
/// bench prints it and the GEMM-form tests require 0.
pub(crate) fn reference_bf16_calls() -> u64 {
    REFERENCE_BF16_CALLS.load(std::sync::atomic::Ordering::Relaxed)
}

/// The cached primitive for this call, created on a miss.
fn primitive(key: Key) -> Result<Arc<Matmul>, DnnlError> {
    if let Some(p) = cache().lock().ok().and_then(|c| c.get(&key).cloned()) {
        return Ok(p);
    }
    let mut raw = std::ptr::null_mut();
    let mut name = [0 as c_char; 128];
    // SAFETY: plain integers in (`ndims` <= 4 entries of each array are read); `raw` and
    // `name` are valid out-pointers of the given sizes.
    let status = unsafe {
        keel_dnnl_matmul_create(
            c_int::from(key.input == InputType::Bf16),
            key.ndims as c_int,
            key.dims[0].as_ptr(),
            key.strides[0].as_ptr(),
            key.dims[1].as_ptr(),
            key.strides[1].as_ptr(),
            key.dims[2].as_ptr(),
            key.strides[2].as_ptr(),
            f32::from_bits(key.alpha),
            f32::from_bits(key.beta),
            c_int::from(key.bias),
            &mut raw,
            name.as_mut_ptr(),
            name.len(),
        )
    };
    if status != 0 || raw.is_null() {
        return Err(DnnlError::Status {
            what: format!("creating a {}", key.describe()),
            status,
        });
    }
    // SAFETY: the shim NUL-terminates `name` within its length.
    let implementation = unsafe { CStr::from_ptr(name.as_ptr()) }
        .to_string_lossy()
        .into_owned();
    if implementation.starts_with("ref") {
        // The reference kernels are scalar loops, 100x slower or more: a layout the fast
        // kernels do not take reached oneDNN. Said once per shape (the primitive is cached).
        tracing::warn!(
            matmul = %key.describe(), strides = ?key.strides, %implementation,
            "oneDNN chose its reference matmul for this shape and layout: slow"
        );
    }
    let p = Arc::new(Matmul {
        raw,
        implementation,
    });
    if let Ok(mut c) = cache().lock() {
        if c.len() >= CACHE_LIMIT {
            c.clear();
        }
        c.insert(key, p.clone());
    }
    Ok(p)
}

impl InputType {
    /// Panics unless `T` has this input type's element size (f32: 4 bytes, bf16: 2).
    fn check_element<T>(self) {
        let expected = match self {
            InputType::F32 => std::mem::size_of::<f32>(),
            InputType::Bf16 => std::mem::size_of::<u16>(),
        };
        assert_eq!(
            std::mem::size_of::<T>(),
            expected,
            "element size of {self:?}"
        );
    }
}

/// Runs `p` on this thread and counts a bf16 call that ran on a reference kernel; returns the
/// implementation's name, or oneDNN's status.
///
/// # Safety
/// `a`, `b` and `c` must be valid for every offset the dims and strides `p` was created with
/// reach, of `p`'s input type (`c` f32, not aliased); `bias` valid for `n` floats when `p`
/// was created with a bias (else it may be null).
unsafe fn execute(
    p: &Matmul,
    input: InputType,
    a: *const c_void,
    b: *const c_void,
    bias: *const f32,
    c: *mut f32,
) -> Result<String, i32> {
    // SAFETY: per the function's contract.
    let status = unsafe { keel_dnnl_matmul_run(p.raw, a, b, bias, c) };
    if input == InputType::Bf16 && p.implementation.starts_with("ref") {
        REFERENCE_BF16_CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
    if input == InputType::Bf16 && p.implementation.starts_with("gemm:") {
        GEMM_JIT_BF16_CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
    if status != 0 {
        return Err(status);
    }
    Ok(p.implementation.clone())
}

/// `c = alpha * a b (+ bias) + beta * c` by oneDNN on this thread: `a` `[m, k]`, `b` `[k, n]`
/// of `T` (`f32` with [`InputType::F32`], bf16 bit patterns `u16` with [`InputType::Bf16`]),
/// `c` `[m, n]` f32; any non-negative strides (transposed and row-strided views included);
/// `bias` `[n]` f32, added to every row of `a b` before `beta * c` (oneDNN's matmul bias;
/// only with `alpha = 1`, since oneDNN scales the bias with the product).
/// Returns the name of the implementation oneDNN chose (e.g. `brg:avx512_core_amx_bf16`).
///
/// Errors: [`DnnlError::Status`] when oneDNN cannot create or run the primitive (bf16 on a
/// CPU it has no bf16 kernel for: "unimplemented"), [`DnnlError::NegativeStride`].
/// Panics if the shapes do not chain, or `bias` is not `n` long or comes with `alpha != 1` (a
/// caller's bug).
pub(crate) fn matmul<T: Copy>(
    input: InputType,
    (alpha, a, b): (f32, &ArrayView2<'_, T>, &ArrayView2<'_, T>),
    bias: Option<&[f32]>,
    beta: f32,
    c: &mut ArrayViewMut2<'_, f32>,
) -> Result<String, DnnlError> {
    input.check_element::<T>();
    let (m, k) = a.dim();
    let n = b.ncols();
    assert_eq!(b.nrows(), k, "inner dimensions");
    assert_eq!(c.dim(), (m, n), "output shape");
    if let Some(bias) = bias {
        assert_eq!(bias.len(), n, "bias length");
        assert!(
            alpha == 1.0,
            "a bias with alpha {alpha}: oneDNN would scale the bias too"
        );
    }
    let [a_rs, a_cs] = strides_of(a)?;
    let [b_rs, b_cs] = strides_of(b)?;
    let [c_rs, c_cs] = strides_of(&c.view())?;
    let p = primitive(Key::plain(
        input,
        [m, k, n],
        [a_rs, a_cs, b_rs, b_cs, c_rs, c_cs],
        (alpha, beta),
        bias.is_some(),
    ))?;
    // SAFETY: the primitive was created for exactly these shapes and strides (and a bias
    // exactly when `bias` is given, `n` long: checked); the pointers are the views' first
    // elements, valid for those strides; `c` is borrowed mutably.
    unsafe {
        execute(
            &p,
            input,
            a.as_ptr().cast(),
            b.as_ptr().cast(),
            bias.map_or(std::ptr::null(), <[f32]>::as_ptr),
            c.as_mut_ptr(),
        )
    }
    .map_err(|status| DnnlError::Status {
        what: format!("running a {input:?} [{m}, {k}] x [{k}, {n}] matmul"),
        status,
    })
}

/// A batch of matrices `[batch, heads, rows, cols]` over a slice, with element strides
/// (outermost first): attention's per-(sequence, head) blocks of a `[tokens, hidden]` buffer,
/// or a dense `[batch, heads, t, t]` one, without copying them out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Strided4 {
    /// `[batch, heads, rows, cols]`.
    pub dims: [usize; 4],
    /// Element strides of the four dimensions.
    pub strides: [usize; 4],
}

impl Strided4 {
    /// A dense row-major `[batch, heads, rows, cols]`.
    pub fn dense(dims: [usize; 4]) -> Strided4 {
        let [_, h, r, c] = dims;
        Strided4 {
            dims,
            strides: [h * r * c, r * c, c, 1],
        }
    }

    /// The same matrices transposed (rows and columns swapped; no data moves).
    pub fn t(self) -> Strided4 {
        let [b, h, r, c] = self.dims;
        let [sb, sh, sr, sc] = self.strides;
        Strided4 {
            dims: [b, h, c, r],
            strides: [sb, sh, sc, sr],
        }
    }

    /// One past the largest element offset it reaches (0 when it has no elements).
    pub fn extent(&self) -> usize {
        if self.dims.contains(&0) {
            return 0;
        }
        1 + self
            .dims
            .iter()
            .zip(&self.strides)
            .map(|(d, s)| (d - 1) * s)
            .sum::<usize>()
    }

    /// Element offset of matrix `(i, j)`'s first element.
    pub fn offset(&self, i: usize, j: usize) -> usize {
        i * self.strides[0] + j * self.strides[1]
    }
}

/// `c = alpha * a b + beta * c` for every matrix of a batch, by one oneDNN call on this
/// thread: `a` `[b, h, m, k]`, `b` `[b, h, k, n]` of `T` (f32 or bf16 bit patterns, as in
/// [`matmul`]), `c` `[b, h, m, n]` f32, each a [`Strided4`] over its slice. One call instead
/// of `b * h` saves oneDNN's per-call overhead, which at attention's `[128, 64]` blocks is
/// larger than the arithmetic. Returns the implementation's name.
///
/// Errors: [`DnnlError::BadOperand`] when the shapes do not chain or an operand reaches past
/// its slice; [`DnnlError::Status`] as for [`matmul`].
pub(crate) fn batched_matmul<T: Copy>(
    input: InputType,
    alpha: f32,
    (a, sa): (&[T], Strided4),
    (b, sb): (&[T], Strided4),
    beta: f32,
    (c, sc): (&mut [f32], Strided4),
) -> Result<String, DnnlError> {
    input.check_element::<T>();
    let [bb, h, m, k] = sa.dims;
    let n = sb.dims[3];
    if sb.dims != [bb, h, k, n] || sc.dims != [bb, h, m, n] {
        return Err(DnnlError::BadOperand(format!(
            "shapes {:?} x {:?} -> {:?} do not chain",
            sa.dims, sb.dims, sc.dims
        )));
    }
    for (what, extent, len) in [
        ("a", sa.extent(), a.len()),
        ("b", sb.extent(), b.len()),
        ("c", sc.extent(), c.len()),
    ] {
        if extent > len {
            return Err(DnnlError::BadOperand(format!(
                "{what} reaches element {extent} of a slice of {len}"
            )));
        }
    }
    if sc.extent() == 0 {
        return Ok(String::new());
    }
    let i64s = |x: [usize; 4]| x.map(|v| v as i64);
    let p = primitive(Key {
        input,
        ndims: 4,
        dims: [i64s(sa.dims), i64s(sb.dims), i64s(sc.dims)],
        strides: [i64s(sa.strides), i64s(sb.strides), i64s(sc.strides)],
        alpha: alpha.to_bits(),
        beta: beta.to_bits(),
        bias: false,
    })?;
    // SAFETY: the primitive was created for exactly these dims and strides, without a bias,
    // and every offset they reach lies inside the slices (checked above); `c` is borrowed
    // mutably.
    unsafe {
        execute(
            &p,
            input,
            a.as_ptr().cast(),
            b.as_ptr().cast(),
            std::ptr::null(),
            c.as_mut_ptr(),
        )
    }
    .map_err(|status| DnnlError::Status {
        what: format!(
            "running a batched {input:?} {:?} x {:?} matmul",
            sa.dims, sb.dims
        ),
        status,
    })
}

#[cfg(test)]
#[path = "onednn_tests.rs"]
mod tests;
