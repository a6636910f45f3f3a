//! Raw UCX bindings, generated at build time by bindgen from the system's `ucp/api/ucp.h` (see
//! `common/build.rs`), plus the two things bindgen cannot see: `ucp_init` (a static inline over
//! [`ucp_init_version`]) and `UCS_PTR_IS_ERR` (a macro). Everything here is `unsafe` to call; the
//! safe wrappers live in the parent module.

#![allow(
    non_upper_case_globals,
    non_camel_case_types,
    non_snake_case,
    dead_code,
    unused_imports,
    missing_docs,
    unsafe_op_in_unsafe_fn,
    clippy::all,
    clippy::undocumented_unsafe_blocks
)]

include!(concat!(env!("OUT_DIR"), "/ucx_sys.rs"));

/// `UCS_PTR_IS_ERR`: UCX returns errors from pointer-returning calls as the (negative) status
/// cast to a pointer, so any address at or above `(uintptr_t)UCS_ERR_LAST` is an error.
pub fn ptr_is_err(ptr: ucs_status_ptr_t) -> bool {
    ptr as usize >= UCS_ERR_LAST as isize as usize
}

/// `UCS_PTR_STATUS`: the status an error pointer carries.
pub fn ptr_status(ptr: ucs_status_ptr_t) -> ucs_status_t {
    ptr as isize as ucs_status_t
}
