//! Generates the raw UCX bindings (`src/link/ucx/sys.rs` includes them) when the `ucx` feature is
//! on: bindgen over the system's `ucp/api/ucp.h`, found and linked through pkg-config (Debian:
//! `libucx-dev`). Without the feature this script does nothing, so builds need no UCX.

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    #[cfg(feature = "ucx")]
    ucx::generate();
}

#[cfg(feature = "ucx")]
mod ucx {
    use std::path::PathBuf;

    /// What the link uses: the UCP API (context, worker, listener, endpoint, active messages) and
    /// the UCS status codes and memory types it speaks in.
    const HEADER: &str = "#include <ucp/api/ucp.h>\n";

    pub fn generate() {
        // pkg-config emits the -l/-L lines (ucp, uct, ucs, ucm) and finds the include path.
        let lib = pkg_config::Config::new()
            .atleast_version("1.10")
            .probe("ucx")
            .unwrap_or_else(|e| {
                panic!(
                    "the `ucx` feature needs UCX ≥ 1.10 (Debian: apt-get install libucx-dev): {e}"
                )
            });
        let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
        let bindings = bindgen::Builder::default()
            .header_contents("ucx_wrapper.h", HEADER)
            .clang_args(
                lib.include_paths
                    .iter()
                    .map(|p| format!("-I{}", p.display())),
            )
            .allowlist_function("ucp_.*")
            .allowlist_function("ucs_status_string")
            .allowlist_type("ucp_.*")
            .allowlist_type("ucs_status_t")
            .allowlist_type("ucs_memory_type")
            .allowlist_var("UCP_API_.*")
            // Field masks and flags are C enums of bits: plain constants OR together.
            .default_enum_style(bindgen::EnumVariation::Consts)
            .prepend_enum_name(false)
            .derive_default(true)
            .layout_tests(false)
            .generate_comments(false)
            .generate()
            .expect("bindgen could not parse ucp/api/ucp.h");
        bindings
            .write_to_file(out.join("ucx_sys.rs"))
            .expect("writing the UCX bindings to OUT_DIR");
    }
}
