//! `cargo xtask module-cycles`: fails when modules within a crate import each other in a cycle
//! (CONTRIBUTING.md: a type two modules both need lives in a leaf module named after it).
//!
//! The edges come from the source text: every `crate::` and `super::` path outside comments and
//! test modules (`#[cfg(test)] mod ...`), use trees (`crate::{a::X, b::Y}`) expanded. A path
//! from module `x::a::...` to `x::b::...` is an edge between the siblings `x::a` and `x::b`
//! (the level where the two paths part), as long as `b` is a module (a file or folder in the
//! crate's `src/`). A cycle is a strongly connected set of two or more modules.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

/// Checks every crate under `crates/` and `xtask` itself.
pub fn check(root: &Path) -> Result<()> {
    let mut srcs: Vec<(String, PathBuf)> = Vec::new();
    for entry in fs::read_dir(root.join("crates")).context("reading crates/")? {
        let dir = entry?.path();
        if dir.join("src").is_dir() {
            let name = dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
            srcs.push((name, dir.join("src")));
        }
    }
    srcs.push(("xtask".into(), root.join("xtask/src")));
    srcs.sort();
    let mut found = Vec::new();
    for (name, src) in &srcs {
        for cycle in crate_cycles(src)? {
            found.push(format!("{name}: {}", cycle.join(" <-> ")));
        }
    }
    if !found.is_empty() {
        bail!(
            "module cycles (move what both modules need into a leaf module named after it):\n  {}",
            found.join("\n  ")
        );
    }
    eprintln!("module-cycles: no cycle among the modules of {} crates", srcs.len());
    Ok(())
}

/// The cycles among the modules of the crate whose sources are in `src`.
fn crate_cycles(src: &Path) -> Result<Vec<Vec<String>>> {
    let mut files = Vec::new();
    rust_files(src, &mut files)?;
    let mut edges: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for file in &files {
        let rel = file.strip_prefix(src).expect("under src");
        if rel.starts_with("bin") {
            continue; // binaries are crates of their own
        }
        let me = module_path(rel);
        if me.is_empty() {
            continue; // the crate root declares modules; it is no module's sibling
        }
        let text = fs::read_to_string(file).with_context(|| format!("reading {}", file.display()))?;
        for target in referenced_paths(&code_of(&text), &me) {
            let common = me.iter().zip(&target).take_while(|(a, b)| a == b).count();
            if common < me.len() && common < target.len() {
                let (from, to) = (me[..=common].join("/"), target[..=common].join("/"));
                if is_module(src, &to) {
                    edges.entry(from).or_default().insert(to);
                }
            }
        }
    }
    Ok(strongly_connected(&edges).into_iter().filter(|c| c.len() > 1).collect())
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) -> Result<()> {
    for entry in fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
        let path = entry?.path();
        if path.is_dir() {
            rust_files(&path, out)?;
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
    Ok(())
}

/// `runtime/jobs.rs` -> `[runtime, jobs]`; `runtime/mod.rs` -> `[runtime]`; `lib.rs` -> `[]`.
fn module_path(rel: &Path) -> Vec<String> {
    let mut parts: Vec<String> = rel.iter().map(|p| p.to_string_lossy().into_owned()).collect();
    if let Some(last) = parts.last_mut() {
        *last = last.trim_end_matches(".rs").to_string();
    }
    if matches!(parts.last().map(String::as_str), Some("mod" | "lib" | "main")) {
        parts.pop();
    }
    parts
}

fn is_module(src: &Path, path: &str) -> bool {
    let p = src.join(path);
    p.is_dir() || p.with_extension("rs").is_file()
}

/// The text without line comments and without a trailing test module.
fn code_of(text: &str) -> String {
    let mut code: String = text
        .lines()
        .map(|l| match l.find("//") {
            Some(i) => &l[..i],
            None => l,
        })
        .collect::<Vec<_>>()
        .join("\n");
    let mut at = 0;
    while let Some(i) = code[at..].find("#[cfg(test)]") {
        let start = at + i;
        let rest = code[start + "#[cfg(test)]".len()..].trim_start();
        let rest = rest.strip_prefix("pub(crate)").or_else(|| rest.strip_prefix("pub")).unwrap_or(rest).trim_start();
        if rest.starts_with("mod ") {
            code.truncate(start);
            break;
        }
        at = start + 1;
    }
    code
}

/// Every module path named after `crate::` or `super::` in `code` (of module `me`), absolute.
fn referenced_paths(code: &str, me: &[String]) -> Vec<Vec<String>> {
    let bytes = code.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        let ident_before = i > 0 && (bytes[i - 1].is_ascii_alphanumeric() || bytes[i - 1] == b'_');
        let base: Option<(Vec<String>, usize)> = if ident_before {
            None
        } else if bytes[i..].starts_with(b"crate::") {
            Some((Vec::new(), i + "crate::".len()))
        } else if bytes[i..].starts_with(b"super::") {
            let mut base = me[..me.len() - 1].to_vec();
            let mut j = i + "super::".len();
            while bytes[j..].starts_with(b"super::") {
                base.pop();
                j += "super::".len();
            }
            Some((base, j))
        } else {
            None
        };
        match base {
            Some((base, j)) => {
                let (trees, end) = use_tree(code, j);
                for t in trees {
                    let mut p = base.clone();
                    p.extend(t);
                    out.push(p);
                }
                i = end.max(i + 1);
            }
            None => i += 1,
        }
    }
    out
}

/// Parses a path or use tree at `at`: `a::b`, `a::{b, c::d}`, `{a, b}`. Returns the paths (their
/// lower-case segments: modules, not types) and where the tree ends.
fn use_tree(code: &str, at: usize) -> (Vec<Vec<String>>, usize) {
    let bytes = code.as_bytes();
    let skip_ws = |mut k: usize| {
        while k < bytes.len() && bytes[k].is_ascii_whitespace() {
            k += 1;
        }
        k
    };
    let mut k = skip_ws(at);
    if k < bytes.len() && bytes[k] == b'{' {
        let mut out = Vec::new();
        k += 1;
        loop {
            k = skip_ws(k);
            if k >= bytes.len() {
                return (out, k);
            }
            match bytes[k] {
                b'}' => return (out, k + 1),
                b',' => k += 1,
                _ => {
                    let (trees, end) = use_tree(code, k);
                    out.extend(trees);
                    // Skip what the tree did not take (`as` renames, `*`, `self`).
                    k = end.max(k + 1);
                    while k < bytes.len() && !matches!(bytes[k], b',' | b'}' | b'{') {
                        k += 1;
                    }
                }
            }
        }
    }
    let start = k;
    while k < bytes.len() && (bytes[k].is_ascii_alphanumeric() || bytes[k] == b'_') {
        k += 1;
    }
    // ASCII only: a boundary on both sides.
    let ident = std::str::from_utf8(&bytes[start..k]).unwrap_or_default();
    if ident.is_empty() || ident == "self" || !ident.starts_with(|c: char| c.is_ascii_lowercase() || c == '_') {
        return (vec![Vec::new()], k);
    }
    if bytes[k..].starts_with(b"::") {
        let (trees, end) = use_tree(code, k + 2);
        let out = trees
            .into_iter()
            .map(|t| {
                let mut p = vec![ident.to_string()];
                p.extend(t);
                p
            })
            .collect();
        return (out, end);
    }
    (vec![vec![ident.to_string()]], k)
}

/// Tarjan's strongly connected components.
fn strongly_connected(edges: &BTreeMap<String, BTreeSet<String>>) -> Vec<Vec<String>> {
    struct State<'a> {
        edges: &'a BTreeMap<String, BTreeSet<String>>,
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        on_stack: BTreeSet<&'a str>,
        out: Vec<Vec<String>>,
    }
    fn visit<'a>(s: &mut State<'a>, v: &'a str) {
        let n = s.index.len();
        s.index.insert(v, n);
        s.low.insert(v, n);
        s.stack.push(v);
        s.on_stack.insert(v);
        if let Some(ws) = s.edges.get(v) {
            for w in ws {
                if !s.index.contains_key(w.as_str()) {
                    visit(s, w);
                    let lw = s.low[w.as_str()];
                    let lv = s.low.get_mut(v).expect("visited");
                    *lv = (*lv).min(lw);
                } else if s.on_stack.contains(w.as_str()) {
                    let iw = s.index[w.as_str()];
                    let lv = s.low.get_mut(v).expect("visited");
                    *lv = (*lv).min(iw);
                }
            }
        }
        if s.low[v] == s.index[v] {
            let mut comp = Vec::new();
            while let Some(w) = s.stack.pop() {
                s.on_stack.remove(w);
                comp.push(w.to_string());
                if w == v {
                    break;
                }
            }
            comp.sort();
            s.out.push(comp);
        }
    }
    let mut s = State {
        edges,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        out: Vec::new(),
    };
    for v in edges.keys() {
        if !s.index.contains_key(v.as_str()) {
            visit(&mut s, v);
        }
    }
    s.out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn paths(code: &str, me: &[&str]) -> Vec<String> {
        let me: Vec<String> = me.iter().map(|s| s.to_string()).collect();
        referenced_paths(&code_of(code), &me).into_iter().map(|p| p.join("/")).collect()
    }

    #[test]
    fn use_trees_paths_and_super_are_resolved() {
        let code = "use crate::{backend::{Backend, Memory}, job::Job as J};\nuse super::slots::SlotKey;\n\
                    fn f() { crate::stats::count(); let _ = super::super::top::X; }\n";
        assert_eq!(
            paths(code, &["runtime", "jobs"]),
            ["backend", "backend", "job", "runtime/slots", "stats/count", "top"]
        );
    }

    #[test]
    fn comments_and_test_modules_are_not_edges() {
        let code = "// crate::a::b\nuse crate::c;\n#[cfg(test)]\nmod tests {\n    use crate::d;\n}\n";
        assert_eq!(paths(code, &["x"]), ["c"]);
    }

    #[test]
    fn a_cycle_is_found_and_a_chain_is_not() {
        let mut edges: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        edges.entry("a".into()).or_default().insert("b".into());
        edges.entry("b".into()).or_default().insert("c".into());
        assert!(strongly_connected(&edges).iter().all(|c| c.len() == 1));
        edges.entry("c".into()).or_default().insert("a".into());
        let cycles: Vec<_> = strongly_connected(&edges).into_iter().filter(|c| c.len() > 1).collect();
        assert_eq!(cycles, [vec!["a".to_string(), "b".into(), "c".into()]]);
    }
}
