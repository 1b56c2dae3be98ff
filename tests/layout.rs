//! The allocator crate's modules import one way, along the data path (README, "Layout"): no
//! module imports one that imports it back, directly or through others. Read from the sources:
//! every `crate::NAME` outside comments is an edge to the top-level module `NAME`.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            sources(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// The top-level module a source file belongs to (`src/device/cuda.rs` → `device`).
fn module_of(src: &Path, file: &Path) -> String {
    let rel = file.strip_prefix(src).unwrap();
    let first = rel.components().next().unwrap().as_os_str().to_string_lossy().into_owned();
    first.trim_end_matches(".rs").to_string()
}

fn graph() -> BTreeMap<String, BTreeSet<String>> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    sources(&src, &mut files);
    let mut g: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for f in files {
        let m = module_of(&src, &f);
        if m == "lib" || m == "main" {
            continue; // the crate root declares and re-exports every module
        }
        let text = std::fs::read_to_string(&f).unwrap();
        let deps = g.entry(m.clone()).or_default();
        for line in text.lines().filter(|l| !l.trim_start().starts_with("//")) {
            for (i, _) in line.match_indices("crate::") {
                let name: String =
                    line[i + 7..].chars().take_while(|c| c.is_ascii_lowercase() || *c == '_').collect();
                if !name.is_empty() && name != m {
                    deps.insert(name);
                }
            }
        }
    }
    g
}

/// A cycle through `start`, if any: depth-first search over the import graph.
fn cycle(g: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit(
        g: &BTreeMap<String, BTreeSet<String>>,
        n: &str,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(i) = path.iter().position(|p| p == n) {
            let mut c = path[i..].to_vec();
            c.push(n.to_string());
            return Some(c);
        }
        if done.contains(n) {
            return None;
        }
        path.push(n.to_string());
        for d in g.get(n).into_iter().flatten() {
            if let Some(c) = visit(g, d, path, done) {
                return Some(c);
            }
        }
        path.pop();
        done.insert(n.to_string());
        None
    }
    let mut done = BTreeSet::new();
    g.keys().find_map(|n| visit(g, n, &mut Vec::new(), &mut done))
}

#[test]
fn no_module_imports_one_that_imports_it_back() {
    let g = graph();
    assert!(g.len() > 10, "found the sources: {:?}", g.keys());
    assert!(g["allocator"].contains("arena"), "the reader sees edges: {:?}", g["allocator"]);
    if let Some(c) = cycle(&g) {
        panic!("import cycle: {}", c.join(" -> "));
    }
}

#[test]
fn the_cycle_finder_finds_a_cycle() {
    let mut g: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    g.entry("arena".into()).or_default().insert("pool".into());
    g.entry("pool".into()).or_default().insert("shell".into());
    assert!(cycle(&g).is_none());
    g.entry("shell".into()).or_default().insert("arena".into());
    assert_eq!(cycle(&g).unwrap(), ["arena", "pool", "shell", "arena"]);
}

/// The data path, top to bottom: each listed module may import only those after it.
#[test]
fn the_data_path_reads_downwards() {
    let g = graph();
    let path =
        ["allocator", "arena", "outbox", "env", "global_pool", "superblock", "shell", "fence", "device"];
    for (i, m) in path.iter().enumerate() {
        for above in &path[..i] {
            assert!(!g.get(*m).is_some_and(|d| d.contains(*above)), "{m} imports {above}, which is above it");
        }
    }
}
