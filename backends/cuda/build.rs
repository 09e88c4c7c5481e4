//! Generates the kernel table (`$OUT_DIR/kernels.rs`: every `kernels/*.cu`, its source and
//! its parameter kinds, parsed from the `KERNEL name(...)` line) and builds the host shim
//! (`shim/`), in which every kernel source compiles as C++ for the numerics tests.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

struct Kernel {
    name: String,
    path: PathBuf,
    params: Vec<&'static str>,
    sync: bool,
}

fn param_kind(decl: &str, file: &Path) -> &'static str {
    let decl = decl.trim();
    let ty = decl
        .rsplit_once(|c: char| c.is_whitespace() || c == '*')
        .map(|(t, _)| t)
        .unwrap_or("");
    if decl.contains('*') {
        "Ptr"
    } else {
        match ty.trim().trim_start_matches("const ").trim() {
            "int" => "I32",
            "unsigned" => "U32",
            "long" => "I64",
            "float" => "F32",
            "double" => "F64",
            other => panic!(
                "{}: kernel parameter `{decl}` has type `{other}`; kernels take pointers, int, unsigned, long, float or double",
                file.display()
            ),
        }
    }
}

fn parse(path: &Path) -> Kernel {
    let src = std::fs::read_to_string(path).expect("a kernel source is readable");
    let name = path.file_stem().unwrap().to_string_lossy().to_string();
    let head = format!("KERNEL {name}(");
    let at = src.find(&head).unwrap_or_else(|| {
        panic!(
            "{}: no `KERNEL {name}(...)` (one kernel per file, named like the file)",
            path.display()
        )
    });
    if src[at + head.len()..].contains("KERNEL ") {
        panic!("{}: more than one KERNEL", path.display());
    }
    let rest = &src[at + head.len()..];
    let close = rest.find(')').expect("the parameter list closes");
    let params = rest[..close]
        .split(',')
        .filter(|p| !p.trim().is_empty())
        .map(|p| param_kind(p, path))
        .collect();
    let sync =
        src.contains("__syncthreads") || src.contains("block_sum") || src.contains("block_max");
    Kernel {
        name,
        path: path.to_path_buf(),
        params,
        sync,
    }
}

fn main() {
    let root = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").unwrap());
    let out = PathBuf::from(std::env::var("OUT_DIR").unwrap());
    let kdir = root.join("kernels");
    println!("cargo:rerun-if-changed={}", kdir.display());
    println!("cargo:rerun-if-changed={}", root.join("shim").display());
    let mut files: Vec<PathBuf> = std::fs::read_dir(&kdir)
        .expect("backends/cuda/kernels exists")
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "cu"))
        .collect();
    files.sort();
    let kernels: Vec<Kernel> = files.iter().map(|p| parse(p)).collect();

    let mut rs = String::new();
    writeln!(rs, "/// The shared prelude of every kernel source.").unwrap();
    writeln!(
        rs,
        "pub static PRELUDE: &str = include_str!({:?});",
        kdir.join("prelude.cuh").display().to_string()
    )
    .unwrap();
    writeln!(rs, "/// Every kernel, by name.").unwrap();
    writeln!(rs, "pub static KERNELS: &[KernelInfo] = &[").unwrap();
    for k in &kernels {
        writeln!(
            rs,
            "    KernelInfo {{ name: {:?}, source: include_str!({:?}), params: &[{}], sync: {} }},",
            k.name,
            k.path.display().to_string(),
            k.params
                .iter()
                .map(|p| format!("Param::{p}"))
                .collect::<Vec<_>>()
                .join(", "),
            k.sync
        )
        .unwrap();
    }
    writeln!(rs, "];").unwrap();
    writeln!(
        rs,
        "/// The index in [`KERNELS`] (and in the shim's table, built in the same order) of the\n/// kernel named `name`: a `match` the compiler turns into a length switch and a compare,\n/// with no hashing or allocation, so that a launch resolves its kernel in nanoseconds."
    )
    .unwrap();
    writeln!(rs, "pub fn kernel_index(name: &str) -> Option<usize> {{").unwrap();
    writeln!(rs, "    match name {{").unwrap();
    for (ix, k) in kernels.iter().enumerate() {
        writeln!(rs, "        {:?} => Some({ix}),", k.name).unwrap();
    }
    writeln!(rs, "        _ => None,\n    }}\n}}").unwrap();
    std::fs::write(out.join("kernels.rs"), rs).unwrap();

    let mut cpp = String::new();
    writeln!(
        cpp,
        "#include \"shim.h\"\n#include \"prelude.cuh\"\n#include <utility>\n#include <type_traits>"
    )
    .unwrap();
    for (ns, ty) in [("schedc_f32", "float"), ("schedc_bf16", "bf16")] {
        writeln!(cpp, "namespace {ns} {{\ntypedef {ty} T;").unwrap();
        for k in &kernels {
            writeln!(cpp, "#include \"{}.cu\"", k.name).unwrap();
        }
        writeln!(cpp, "}}").unwrap();
    }
    cpp += r#"
template <typename... A, std::size_t... I>
static void call_with(void (*f)(A...), void** args, std::index_sequence<I...>) {
    f(*static_cast<typename std::remove_reference<A>::type*>(args[I])...);
}
template <typename... A>
static void call(void (*f)(A...), void** args) {
    call_with(f, args, std::index_sequence_for<A...>{});
}
struct ShimEntry {
    const char* name;
    bool sync;
    void (*f32)(void**);
    void (*bf16)(void**);
};
extern const ShimEntry SHIM_TABLE[] = {
"#;
    for k in &kernels {
        writeln!(
            cpp,
            "    {{\"{n}\", {s}, [](void** a) {{ call(&schedc_f32::{n}, a); }}, [](void** a) {{ call(&schedc_bf16::{n}, a); }}}},",
            n = k.name,
            s = k.sync
        )
        .unwrap();
    }
    writeln!(
        cpp,
        "}};\nextern const int SHIM_TABLE_LEN = {};",
        kernels.len()
    )
    .unwrap();
    std::fs::write(out.join("shim_kernels.cpp"), cpp).unwrap();

    cc::Build::new()
        .cpp(true)
        .file(root.join("shim/shim.cpp"))
        .file(out.join("shim_kernels.cpp"))
        .include(&kdir)
        .include(root.join("shim"))
        .flag("-std=c++17")
        .flag("-ffp-contract=off")
        .flag_if_supported("-Wno-unused-parameter")
        .opt_level(2)
        .compile("schedc_shim");
}
