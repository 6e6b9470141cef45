//! Builds the small C shim over oneDNN's matmul (`csrc/dnnl_matmul.c`) and links oneDNN
//! (Debian 12: `libdnnl-dev`, runtime `libdnnl2`) and libgomp, whose `omp_set_num_threads`
//! the shim calls (oneDNN's Debian build runs on OpenMP). See `src/model/onednn.rs`.

fn main() {
    println!("cargo:rerun-if-changed=csrc/dnnl_matmul.c");
    cc::Build::new()
        .file("csrc/dnnl_matmul.c")
        .flag("-fopenmp")
        .warnings(true)
        .compile("keel_dnnl_shim");
    println!("cargo:rustc-link-lib=dylib=dnnl");
    println!("cargo:rustc-link-lib=dylib=gomp");
}
