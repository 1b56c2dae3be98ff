//! `include/cuarena.h`, the Rust C ABI and the Python glue must not drift apart:
//! - the header's `cuarena_stats` fields, in order, are `size` then the Rust `Stats` fields (read
//!   from `Stats`'s derived `Debug`, which lists every field in declaration order), and the
//!   Python `_FIELDS` list is the same;
//! - the header's macros (version, stats size, error code) are the library's values, and the
//!   Python package's version is Cargo's;
//! - the functions the header declares are the ones the library exports;
//! - the header compiles as strict C99 and as C++, on its own and after CUDA's headers (whose
//!   include guards are faked), and a C program built against it links with `libcuarena.so` and
//!   sees the same sizes, offsets and versions as Rust.

use std::path::{Path, PathBuf};
use std::process::Command;

use cuarena::Stats;
#[path = "../capi/src/lib.rs"]
#[allow(dead_code)]
mod cuarena_c;

use cuarena_c::{CUARENA_ERR_STATS_SIZE, CUARENA_STATS_SIZE_V1, cuarena_stats};

/// The repository root: the nearest ancestor of this crate's directory with `include/cuarena.h`.
fn root() -> PathBuf {
    let here = Path::new(env!("CARGO_MANIFEST_DIR"));
    here.ancestors()
        .find(|d| d.join("include/cuarena.h").is_file())
        .unwrap_or_else(|| panic!("no include/cuarena.h above {}", here.display()))
        .to_path_buf()
}

fn read(rel: &str) -> String {
    let p = root().join(rel);
    std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// Strips `/* ... */` and `// ...` comments.
fn strip_c_comments(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(i) = rest.find("/*") {
        out.push_str(&rest[..i]);
        let end = rest[i..].find("*/").expect("unterminated comment") + i + 2;
        out.push(' ');
        rest = &rest[end..];
    }
    out.push_str(rest);
    out.lines().map(|l| l.split("//").next().unwrap()).collect::<Vec<_>>().join("\n")
}

/// The header's `cuarena_stats` fields, in order, each checked to be a `uint64_t`.
fn header_stats_fields() -> Vec<String> {
    let h = strip_c_comments(&read("include/cuarena.h"));
    let start =
        h.find("typedef struct cuarena_stats {").expect("no `typedef struct cuarena_stats {` in the header");
    let body = &h[start + "typedef struct cuarena_stats {".len()..];
    let end = body.find("} cuarena_stats;").expect("no `} cuarena_stats;` in the header");
    body[..end]
        .split(';')
        .map(str::trim)
        .filter(|d| !d.is_empty())
        .map(|d| {
            let mut words = d.split_whitespace();
            let (ty, name) = (words.next().unwrap(), words.next().unwrap_or(""));
            assert_eq!(ty, "uint64_t", "header field `{d}`: every field is a uint64_t");
            assert!(words.next().is_none(), "header field `{d}`: one name per declaration");
            name.to_string()
        })
        .collect()
}

/// The Rust `Stats` fields in declaration order, from the derived `Debug`.
fn rust_stats_fields() -> Vec<String> {
    let d = format!("{:?}", Stats::default());
    let inner =
        d.strip_prefix("Stats { ").and_then(|s| s.strip_suffix(" }")).unwrap_or_else(|| panic!("{d}"));
    let names: Vec<String> = inner.split(", ").map(|f| f.split(':').next().unwrap().to_string()).collect();
    assert_eq!(names.len() * 8, size_of::<Stats>(), "every Stats field is a u64 shown by Debug");
    names
}

/// The Python `_FIELDS` list in `python/cuarena/__init__.py`.
fn python_fields() -> Vec<String> {
    let py = read("python/cuarena/__init__.py");
    let start =
        py.find("_FIELDS = [").expect("no `_FIELDS = [` in python/cuarena/__init__.py") + "_FIELDS = [".len();
    let end = py[start..].find(']').unwrap() + start;
    py[start..end]
        .split(',')
        .map(|w| w.trim())
        .filter(|w| !w.is_empty())
        .map(|w| w.trim_matches('"').to_string())
        .collect()
}

/// The PyTorch shim's own copy of the struct (`cuarena_stats_v2` in
/// `python/cuarena/torch_shim.cpp`: `uint64_t size, a, b, ...;`), in order.
fn shim_stats_fields() -> Vec<String> {
    let cpp = strip_c_comments(&read("python/cuarena/torch_shim.cpp"));
    let start = cpp.find("struct cuarena_stats_v2 {").expect("no `struct cuarena_stats_v2 {` in the shim")
        + "struct cuarena_stats_v2 {".len();
    let end = cpp[start..].find("};").unwrap() + start;
    let decl = cpp[start..end].trim();
    let list =
        decl.strip_prefix("uint64_t").and_then(|d| d.strip_suffix(';')).unwrap_or_else(|| panic!("{decl}"));
    list.split(',').map(|w| w.trim().to_string()).collect()
}

/// The integer value of `#define NAME value` in the header (parentheses allowed).
fn header_define(name: &str) -> i64 {
    let h = read("include/cuarena.h");
    let line = h
        .lines()
        .find(|l| l.split_whitespace().take(2).eq(["#define", name]))
        .unwrap_or_else(|| panic!("no #define {name} in the header"));
    let v = line.split_whitespace().nth(2).unwrap().trim_matches(['(', ')']);
    v.parse().unwrap_or_else(|_| panic!("#define {name}: {v} is not a number"))
}

#[test]
fn header_rust_and_python_stats_fields_match_in_order() {
    let header = header_stats_fields();
    let rust = rust_stats_fields();
    let python = python_fields();
    assert_eq!(header.first().map(String::as_str), Some("size"), "the header's first field is `size`");
    assert_eq!(header[1..], rust[..], "include/cuarena.h's cuarena_stats against the Rust Stats");
    assert_eq!(python, rust, "python/cuarena's _FIELDS against the Rust Stats");
    // The shim reads the fields it uses by name from its copy: a field out of place there
    // would answer PyTorch with another counter.
    assert_eq!(shim_stats_fields(), header, "torch_shim.cpp's cuarena_stats_v2 against the header");
    assert_eq!(header.len() * 8, size_of::<cuarena_stats>());
}

#[test]
fn header_macros_are_the_librarys_values() {
    let part = |v: &str| v.parse::<i64>().unwrap();
    assert_eq!(header_define("CUARENA_VERSION_MAJOR"), part(env!("CARGO_PKG_VERSION_MAJOR")));
    assert_eq!(header_define("CUARENA_VERSION_MINOR"), part(env!("CARGO_PKG_VERSION_MINOR")));
    assert_eq!(header_define("CUARENA_VERSION_PATCH"), part(env!("CARGO_PKG_VERSION_PATCH")));
    assert_eq!(header_define("CUARENA_STATS_SIZE_V1"), CUARENA_STATS_SIZE_V1 as i64);
    assert_eq!(header_define("CUARENA_ERR_STATS_SIZE"), CUARENA_ERR_STATS_SIZE as i64);
    assert_eq!(
        header_define("CUARENA_SIZE_HISTOGRAM_BUCKETS"),
        cuarena::stats::SIZE_HISTOGRAM_BUCKETS as i64
    );
    assert_eq!(header_define("CUARENA_MAX_OOM_RETRIES"), cuarena::MAX_OOM_RETRIES as i64);
}

#[test]
fn the_python_package_has_cargos_version() {
    let pyproject = read("python/pyproject.toml");
    let line =
        pyproject.lines().find(|l| l.starts_with("version = ")).expect("no `version = ` in pyproject.toml");
    assert_eq!(line, format!("version = \"{}\"", env!("CARGO_PKG_VERSION")), "python/pyproject.toml");
    let init = read("python/cuarena/__init__.py");
    let want = format!("__version__ = \"{}\"", env!("CARGO_PKG_VERSION"));
    assert!(init.lines().any(|l| l == want), "python/cuarena/__init__.py lacks `{want}`");
}

/// Every `cuarena_*` function the header declares (one declaration a line).
fn header_functions() -> Vec<String> {
    let h = strip_c_comments(&read("include/cuarena.h"));
    let mut names: Vec<String> = h
        .lines()
        .filter(|l| !l.trim_start().starts_with('#'))
        .filter_map(|l| {
            let head = &l[..l.find('(')?];
            let name = head.rsplit(|c: char| !(c.is_alphanumeric() || c == '_')).next()?;
            name.starts_with("cuarena_").then(|| name.to_string())
        })
        .collect();
    names.sort();
    names
}

/// Every function the Rust C ABI exports: `extern "C" fn cuarena_*` in the C library crate's
/// source (`capi/src/lib.rs`).
fn exported_functions() -> Vec<String> {
    let files = [root().join("capi/src/lib.rs")];
    let mut names: Vec<String> = files
        .iter()
        .flat_map(|f| {
            let text = std::fs::read_to_string(f).unwrap();
            text.lines()
                .filter_map(|l| {
                    let rest = l.split("extern \"C\" fn ").nth(1)?;
                    let name = rest.split('(').next()?.trim();
                    name.starts_with("cuarena_").then(|| name.to_string())
                })
                .collect::<Vec<_>>()
        })
        .collect();
    assert!(
        !names.is_empty(),
        "no `extern \"C\" fn cuarena_*` found in {}/capi/src/lib.rs",
        root().display()
    );
    names.sort();
    names.dedup();
    names
}

#[test]
fn the_header_declares_exactly_the_exported_functions() {
    assert_eq!(header_functions(), exported_functions());
}

fn cc() -> String {
    std::env::var("CC").unwrap_or_else(|_| "cc".into())
}

/// Compiles `source` with `cc` and `args`; panics with the compiler's output if it fails.
fn compile(what: &str, source: &str, lang: &str, args: &[&str], out: &Path) {
    let dir = out.parent().unwrap();
    let src = dir.join(format!(
        "{}.{}",
        out.file_name().unwrap().to_string_lossy(),
        if lang == "c++" { "cc" } else { "c" }
    ));
    std::fs::write(&src, source).unwrap();
    let inc = root().join("include");
    let o = Command::new(cc())
        .args(["-x", lang, "-Wall", "-Wextra", "-Werror", "-pedantic-errors", "-I"])
        .arg(&inc)
        .arg(&src)
        .args(args)
        .arg("-o")
        .arg(out)
        .output()
        .unwrap_or_else(|e| panic!("{what}: cannot run {} ({e}); set CC to a C compiler", cc()));
    assert!(
        o.status.success(),
        "{what}: {} failed:\n{}{}",
        cc(),
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
}

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("cuarena-header-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[test]
fn the_header_compiles_alone_and_after_cudas_headers_as_c99_and_cxx() {
    let dir = scratch("syntax");
    let alone = "#include \"cuarena.h\"\nint main(void) { cudaStream_t s = 0; return s != 0; }\n";
    // CUDA's headers, faked by their real include guards: cudaStream_t is already declared, and
    // a second typedef would be an error in C99 (-pedantic-errors).
    let after = |guard: &str| {
        format!(
            "#define {guard}\ntypedef struct CUstream_st *cudaStream_t;\n#include \"cuarena.h\"\n\
             int main(void) {{ cudaStream_t s = 0; return s != 0; }}\n"
        )
    };
    for std in ["-std=c99", "-std=c11"] {
        compile("header alone (C)", alone, "c", &[std, "-fsyntax-only"], &dir.join("alone"));
        for guard in ["__CUDA_RUNTIME_API_H__", "__DRIVER_TYPES_H__"] {
            compile(
                &format!("header after {guard} (C, {std})"),
                &after(guard),
                "c",
                &[std, "-fsyntax-only"],
                &dir.join("after"),
            );
        }
    }
    compile("header alone (C++)", alone, "c++", &["-std=c++11", "-fsyntax-only"], &dir.join("alone-cxx"));
    compile(
        "header after CUDA (C++)",
        &after("__CUDA_RUNTIME_API_H__"),
        "c++",
        &["-std=c++11", "-fsyntax-only"],
        &dir.join("after-cxx"),
    );
    let _ = std::fs::remove_dir_all(dir);
}

/// A C program built against the header and linked with this build's `libcuarena.so`.
const C_PROGRAM: &str = r#"
#include <stddef.h>
#include <stdio.h>
#include <string.h>
#include "cuarena.h"

int main(void) {
    /* Every function the header declares links (the list is filled in from the header). */
    typedef void (*fn)(void);
    fn fns[] = {FUNCTIONS};
    for (size_t i = 0; i < sizeof fns / sizeof fns[0]; i++)
        if (!fns[i]) return 10;
    printf("sizeof %zu\n", sizeof(cuarena_stats));
    printf("offset_live_bytes %zu\n", offsetof(cuarena_stats, live_bytes));
    printf("offset_pool_allocations %zu\n", offsetof(cuarena_stats, pool_allocations));
    printf("version %d %d\n", cuarena_version(), CUARENA_VERSION);
    printf("version_string %s\n", cuarena_version_string());
    cuarena_stats s;
    memset(&s, 0x5a, sizeof s);
    s.size = 16;
    int r = cuarena_get_stats(0, &s);
    printf("too_small %d %d %d\n", r, CUARENA_ERR_STATS_SIZE, s.size == 16 && s.live_bytes == 0x5a5a5a5a5a5a5a5aULL);
    const char *e = cuarena_last_error();
    printf("error %s\n", e ? e : "(none)");
    return 0;
}
"#;

#[test]
fn a_c_program_sees_the_same_layout_and_version_and_links() {
    let exe = std::env::current_exe().unwrap();
    let mut deps = exe.parent().unwrap().to_path_buf();
    if !deps.join("libcuarena.so").is_file() {
        // `cargo test` on a fresh clone builds the C library's tests, not its cdylib: build it
        // here, in a target directory of its own (the outer cargo holds the default one).
        let target = root().join("target/header-test-clib");
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let o = Command::new(cargo)
            .args(["build", "-p", "cuarena-c", "--target-dir"])
            .arg(&target)
            .current_dir(root())
            .output()
            .unwrap();
        assert!(o.status.success(), "building libcuarena.so: {}", String::from_utf8_lossy(&o.stderr));
        deps = target.join("debug");
    }
    let lib = deps.join("libcuarena.so");
    assert!(lib.is_file(), "{} not built", lib.display());
    let deps = deps.as_path();
    let dir = scratch("link");
    let prog = dir.join("abi");
    let libdir = format!("-L{}", deps.display());
    let rpath = format!("-Wl,-rpath,{}", deps.display());
    let fns: Vec<String> = header_functions().iter().map(|f| format!("(fn){f}")).collect();
    let source = C_PROGRAM.replace("FUNCTIONS", &fns.join(", "));
    compile("the C program", &source, "c", &["-std=c99", &libdir, "-l:libcuarena.so", &rpath], &prog);
    let o = Command::new(&prog).output().unwrap();
    let text = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(
        o.status.success(),
        "{}: {:?}\n{text}{}",
        prog.display(),
        o.status,
        String::from_utf8_lossy(&o.stderr)
    );
    let get = |key: &str| -> Vec<String> {
        let line = text
            .lines()
            .find(|l| l.split(' ').next() == Some(key))
            .unwrap_or_else(|| panic!("{key}?\n{text}"));
        line.split(' ').skip(1).map(String::from).collect()
    };
    assert_eq!(get("sizeof"), [size_of::<cuarena_stats>().to_string()]);
    assert_eq!(get("offset_live_bytes"), [std::mem::offset_of!(cuarena_stats, stats).to_string()]);
    let last = std::mem::offset_of!(cuarena_stats, stats) + std::mem::offset_of!(Stats, pool_allocations);
    assert_eq!(get("offset_pool_allocations"), [last.to_string()]);
    let v = cuarena_c::cuarena_version().to_string();
    assert_eq!(get("version"), [v.clone(), v], "the library's and the header's CUARENA_VERSION");
    assert_eq!(get("version_string"), [env!("CARGO_PKG_VERSION")]);
    let r = CUARENA_ERR_STATS_SIZE.to_string();
    assert_eq!(get("too_small"), [r.clone(), r, "1".into()], "a too-small size: its code, nothing written");
    assert!(text.contains("error cuarena_get_stats: out->size is 16"), "{text}");
    let _ = std::fs::remove_dir_all(dir);
}
