//! Compiling the kernel sources with NVRTC at run time (cudarc, loaded dynamically): the
//! whole set as one program per element type for a run, or one program per kernel for
//! `schedc compile --backend cuda --ptx DIR`.

use crate::api::DType;
use crate::kernels::{KernelInfo, KERNELS, PRELUDE};

/// The default GPU architecture (H100/H200).
pub const DEFAULT_ARCH: &str = "sm_90";

/// Checks the form of a GPU architecture for `--arch` before NVRTC is loaded, so that a
/// misspelt one is reported as such even where NVRTC is missing: `sm_NN` or `compute_NN`
/// with a compute capability NN from 50 to 199 written as digits (`sm_90`, `sm_100`),
/// optionally followed by `a` or `f` (`sm_90a`, `sm_100f`). Whether this NVRTC supports it
/// is NVRTC's to say. Errors: the message (bad usage).
pub fn validate_arch(arch: &str) -> Result<(), String> {
    let bad = || {
        format!(
            "--arch {arch}: expected a GPU architecture such as sm_80 (A100), sm_90 (H100, H200) or sm_100 (B200): `sm_` or `compute_` and a compute capability from 50 to 199, optionally followed by `a` or `f`"
        )
    };
    let digits = arch
        .strip_prefix("sm_")
        .or_else(|| arch.strip_prefix("compute_"))
        .ok_or_else(bad)?;
    let digits = digits
        .strip_suffix('a')
        .or_else(|| digits.strip_suffix('f'))
        .unwrap_or(digits);
    if !(2..=3).contains(&digits.len()) || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return Err(bad());
    }
    let cc: u32 = digits.parse().map_err(|_| bad())?;
    if !(50..=199).contains(&cc) {
        return Err(bad());
    }
    Ok(())
}

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
    fn finding16_arch_is_validated_without_nvrtc() {
        for ok in [
            "sm_75",
            "sm_90",
            "sm_90a",
            "sm_100",
            "sm_100f",
            "compute_90",
            "sm_120",
        ] {
            assert_eq!(validate_arch(ok), Ok(()), "{ok}");
        }
        for bad in [
            "sm_9000", "sm_9", "sm90", "90", "sm_", "sm_abc", "sm_40", "sm_90x", "",
        ] {
            let e = validate_arch(bad).unwrap_err();
            assert!(
                e.starts_with(&format!("--arch {bad}: expected a GPU architecture")),
                "{e}"
            );
        }
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
