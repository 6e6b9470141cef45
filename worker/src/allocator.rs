//! Allocator settings for the worker process.

/// Lets glibc keep freed memory for reuse instead of returning it to the kernel.
///
/// The ring all-reduce allocates a few buffers of up to 1 MiB per frame (encode, decode, sums),
/// thousands per training step. With glibc's defaults, large blocks are `mmap`ed and trimmed
/// back, and every fresh page then costs a page fault and a clear per 4 KiB (measured: ~6% of
/// the all-reduce's CPU). Blocks up to 32 MiB now come from the heap, and the heap is trimmed
/// only above 1 GiB of free memory at its top.
///
/// Call it first thing in `main`, before other threads start. Does nothing off glibc.
pub fn keep_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes allocator thresholds and takes the arena lock itself, so
    // threads started earlier (OpenBLAS starts its pool in a library constructor) are fine.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 1 << 30);
    }
}
