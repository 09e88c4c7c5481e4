//! Compiling the kernel sources with NVRTC at run time (cudarc, loaded dynamically): the
//! whole set as one program per element type for a run, or one program per kernel for
//! `schedc compile --backend cuda --ptx DIR`.

use crate::api::DType;
use crate::kernels::{KernelInfo, KERNELS, PRELUDE};

/// The default GPU architecture (H100/H200).
pub const DEFAULT_ARCH: &str = "sm_90";

/// The source of `kernels` for element type `dtype`: the prelude, `typedef ... T;`, the
/// kernels.
pub fn source(kernels: &[KernelInfo], dtype: DType) -> String {
    let mut s = String::with_capacity(64 * 1024);
    s += PRELUDE;
    s += &format!("\ntypedef {} T;\n", dtype.c_type());
    for k in kernels {
        s += &format!("\n// ---- {}.cu\n", k.name);
        s += k.source;
    }
    s
}

/// Runs `f`, turning a panic (cudarc panics when a library or a symbol is missing) into
/// an error naming `what`.
pub fn guard<T>(what: &str, f: impl FnOnce() -> Result<T, String>) -> Result<T, String> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(p) => Err(format!(
            "{what}: {}",
            schedc_program::interp::panic_message(&*p)
        )),
    }
}

/// Why NVRTC is unusable, if it is: its library cannot be loaded.
pub fn unavailable() -> Option<String> {
    // SAFETY: only tries to load the library.
    let present = guard("loading NVRTC", || {
        Ok(unsafe { cudarc::nvrtc::sys::is_culib_present() })
    });
    match present {
        Ok(true) => None,
        Ok(false) => Some(format!(
            "the NVRTC library cannot be loaded (cudarc looks for {}; put the directory of libnvrtc.so.13, from the CUDA toolkit or the nvidia-cuda-nvrtc wheel, on LD_LIBRARY_PATH)",
            crate::cuda::candidates("nvrtc")
        )),
        Err(e) => Some(e),
    }
}

/// Compiles `src` (named `name` in messages) to PTX for `arch`. Errors: NVRTC missing, or
/// the compiler's log.
pub fn compile(src: &str, name: &str, arch: &str) -> Result<String, String> {
    if let Some(why) = unavailable() {
        return Err(why);
    }
    guard(&format!("NVRTC compiling {name}"), || {
        let opts = cudarc::nvrtc::CompileOptions {
            options: vec![format!("--gpu-architecture={arch}"), "-std=c++17".into()],
            name: Some(format!("{name}.cu")),
            ..Default::default()
        };
        match cudarc::nvrtc::compile_ptx_with_opts(src, opts) {
            Ok(ptx) => Ok(ptx.to_src()),
            Err(cudarc::nvrtc::CompileError::CompileError { log, .. }) => Err(format!(
                "NVRTC could not compile {name} for {arch}:\n{}",
                log.to_string_lossy()
            )),
            Err(e) => Err(format!("NVRTC could not compile {name} for {arch}: {e:?}")),
        }
    })
}

/// One PTX file per kernel and element type: `(file name, PTX)`, e.g. `rmsnorm_fwd.f32.ptx`.
/// Errors: the first kernel that does not compile.
pub fn compile_each(arch: &str, dtypes: &[DType]) -> Result<Vec<(String, String)>, String> {
    let mut out = Vec::new();
    for dt in dtypes {
        for k in KERNELS {
            let src = source(std::slice::from_ref(k), *dt);
            let ptx = compile(&src, k.name, arch)?;
            out.push((format!("{}.{}.ptx", k.name, dt.name()), ptx));
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kernel_is_in_the_combined_source_once() {
        let s = source(KERNELS, DType::Bf16);
        assert!(s.starts_with(PRELUDE));
        assert!(s.contains("typedef bf16 T;"));
        for k in KERNELS {
            assert_eq!(
                s.matches(&format!("KERNEL {}(", k.name)).count(),
                1,
                "{}",
                k.name
            );
        }
        // Every kernel also compiles in the host shim (the build's table).
        let shim = crate::host::shim_kernel_names();
        let names: Vec<&str> = KERNELS.iter().map(|k| k.name).collect();
        assert_eq!(shim, names);
    }

    #[test]
    fn without_nvrtc_compiling_is_an_error_with_the_cause() {
        if unavailable().is_some() {
            let e = compile("KERNEL x() {}", "x", DEFAULT_ARCH).unwrap_err();
            assert!(e.contains("NVRTC library cannot be loaded"), "{e}");
            assert!(e.contains("LD_LIBRARY_PATH"), "{e}");
        } else {
            println!("skipped: NVRTC is present here; the NVRTC check runs in .ci/run");
        }
    }
}
