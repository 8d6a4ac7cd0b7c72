//! Links the library with BIND_NOW: every Envoy callback it imports is resolved when Envoy
//! loads it, so an Envoy that lacks one (older than 1.40.0: `log_v2`) refuses the module
//! cleanly (`undefined symbol: ...`) instead of failing at the first call.
fn main() {
    println!("cargo:rustc-cdylib-link-arg=-Wl,-z,now");
}
