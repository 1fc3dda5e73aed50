//! The workspace's shape, checked on its sources: module imports point one way (no cycle in any
//! crate; no module of the kernels crate imports from its `lib.rs`, the public front), no source
//! file over 1,000 lines and no function over 150 lines outside `#[cube]` kernels.
//!
//! Imports are read from the text: `use` trees and `crate::` / `super::` / `self::` paths outside
//! comments and strings. A module declaring or re-exporting its own submodules is the module tree,
//! not an import, so only a module's references to modules outside itself are edges.

mod layering_scan;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use layering_scan::{function_lengths, import_paths, strip};

const MAX_FILE_LINES: usize = 1_000;
const MAX_FN_LINES: usize = 150;

/// A library crate's modules: module path (`["attention", "mma"]`) -> file.
fn modules(src: &Path) -> BTreeMap<Vec<String>, PathBuf> {
    let mut out = BTreeMap::new();
    let mut todo = vec![(Vec::<String>::new(), src.join("lib.rs"))];
    while let Some((path, file)) = todo.pop() {
        let text = strip(&std::fs::read_to_string(&file).expect("read a module"));
        // `mod name;` declares a submodule kept in its own file; `mod name { .. }` is inline.
        let dir = if path.is_empty() || file.ends_with("mod.rs") {
            file.parent().unwrap().to_path_buf()
        } else {
            file.with_extension("")
        };
        for name in declared_modules(&text) {
            let own = [
                dir.join(format!("{name}.rs")),
                dir.join(&name).join("mod.rs"),
            ];
            let Some(f) = own.into_iter().find(|f| f.exists()) else {
                continue;
            };
            let mut p = path.clone();
            p.push(name);
            todo.push((p, f));
        }
        out.insert(path, file);
    }
    out
}

/// Names in `mod name;` declarations.
fn declared_modules(text: &str) -> Vec<String> {
    let words: Vec<&str> = text
        .split(|c: char| c.is_whitespace() || c == '}' || c == '{')
        .filter(|w| !w.is_empty())
        .collect();
    words
        .windows(2)
        .filter(|w| w[0] == "mod" && w[1].ends_with(';'))
        .map(|w| w[1].trim_end_matches(';').to_string())
        .collect()
}

/// Edges `module -> module it imports from`, resolved to the longest known module prefix.
fn imports(mods: &BTreeMap<Vec<String>, PathBuf>) -> BTreeSet<(Vec<String>, Vec<String>)> {
    let mut edges = BTreeSet::new();
    for (module, file) in mods {
        let text = strip(&std::fs::read_to_string(file).unwrap());
        let mut paths = Vec::new();
        inline_modules(&text, module.to_vec(), &mut paths);
        for (inside, path) in paths {
            let Some(target) = resolve(&inside, &path, mods) else {
                continue;
            };
            // Itself or one of its own submodules: the module tree, not an import.
            if target.starts_with(module) {
                continue;
            }
            edges.insert((module.clone(), target));
        }
    }
    edges
}

/// The import paths of a file's text, each with the module it is written in: the file's own, or
/// an inline `mod name { .. }` inside it (whose `super::` is the file's module).
fn inline_modules(text: &str, module: Vec<String>, out: &mut Vec<(Vec<String>, Vec<String>)>) {
    let mut outside = String::new();
    let mut rest = text;
    while let Some((start, name, open)) = next_inline_module(rest) {
        let close = matching_brace(rest, open);
        outside.push_str(&rest[..start]);
        let mut inner = module.clone();
        inner.push(name);
        inline_modules(&rest[open + 1..close], inner, out);
        rest = &rest[close.saturating_add(1).min(rest.len())..];
    }
    outside.push_str(rest);
    out.extend(
        import_paths(&outside)
            .into_iter()
            .map(|p| (module.clone(), p)),
    );
}

/// `(offset of "mod", name, offset of "{")` of the first inline module in `text`.
fn next_inline_module(text: &str) -> Option<(usize, String, usize)> {
    let mut from = 0;
    while let Some(p) = text[from..].find("mod ") {
        let at = from + p;
        from = at + 4;
        if at > 0 && text[..at].ends_with(|c: char| c.is_alphanumeric() || c == '_') {
            continue;
        }
        let after = text[at + 4..].trim_start();
        let name: String = after
            .chars()
            .take_while(|&c| c.is_alphanumeric() || c == '_')
            .collect();
        let tail = after[name.len()..].trim_start();
        if !name.is_empty() && tail.starts_with('{') {
            let open = text.len() - tail.len();
            return Some((at, name, open));
        }
    }
    None
}

/// Offset of the `}` closing the `{` at `open`.
fn matching_brace(text: &str, open: usize) -> usize {
    let mut depth = 0;
    for (k, ch) in text[open..].char_indices() {
        match ch {
            '{' => depth += 1,
            '}' => {
                depth -= 1;
                if depth == 0 {
                    return open + k;
                }
            }
            _ => {}
        }
    }
    text.len()
}

/// The module a path names, from inside `module` (kept in `file`).
fn resolve(
    module: &[String],
    path: &[String],
    mods: &BTreeMap<Vec<String>, PathBuf>,
) -> Option<Vec<String>> {
    let mut base: Vec<String> = module.to_vec();
    let mut rest = path;
    match rest.first().map(String::as_str) {
        Some("crate") => {
            base.clear();
            rest = &rest[1..];
        }
        Some("self") => rest = &rest[1..],
        Some("super") => {
            while rest.first().map(String::as_str) == Some("super") {
                base.pop()?;
                rest = &rest[1..];
            }
        }
        // A bare first segment is a submodule of this one, or another crate.
        Some(first) => {
            let mut child = base.clone();
            child.push(first.to_string());
            if !mods.contains_key(&child) {
                return None;
            }
        }
        None => return None,
    }
    let mut target = base;
    for seg in rest {
        let mut next = target.clone();
        next.push(seg.clone());
        if !mods.contains_key(&next) {
            break;
        }
        target = next;
    }
    Some(target)
}

/// Modules on a cycle of imports, each cycle as its sorted members (Tarjan's strongly connected
/// components of more than one module).
fn cycles(edges: &BTreeSet<(Vec<String>, Vec<String>)>) -> Vec<Vec<String>> {
    let mut next: BTreeMap<&Vec<String>, Vec<&Vec<String>>> = BTreeMap::new();
    for (a, b) in edges {
        next.entry(a).or_default().push(b);
        next.entry(b).or_default();
    }
    // Reachability closure is enough at this size: a and b share a cycle when each reaches the
    // other.
    let reach = |from: &Vec<String>| {
        let mut seen = BTreeSet::new();
        let mut todo = vec![from];
        while let Some(m) = todo.pop() {
            for n in &next[m] {
                if seen.insert(*n) {
                    todo.push(n);
                }
            }
        }
        seen
    };
    let all: Vec<&Vec<String>> = next.keys().copied().collect();
    let reaches: BTreeMap<&Vec<String>, BTreeSet<&Vec<String>>> =
        all.iter().map(|m| (*m, reach(m))).collect();
    let mut found = BTreeSet::new();
    for a in &all {
        let members: Vec<String> = all
            .iter()
            .filter(|b| reaches[a].contains(**b) && reaches[**b].contains(*a))
            .map(|b| name(b))
            .collect();
        if members.len() > 1 {
            found.insert(members);
        }
    }
    found.into_iter().collect()
}

fn name(m: &[String]) -> String {
    if m.is_empty() {
        "lib.rs".into()
    } else {
        m.join("::")
    }
}

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

const CRATES: [&str; 3] = ["crates/kernels", "crates/model", "crates/trainer"];

#[test]
fn no_crate_has_an_import_cycle() {
    let mut problems = Vec::new();
    for krate in CRATES {
        let mods = modules(&root().join(krate).join("src"));
        for cycle in cycles(&imports(&mods)) {
            problems.push(format!("{krate}: {}", cycle.join(" <-> ")));
        }
    }
    assert!(
        problems.is_empty(),
        "modules that import each other:\n{}",
        problems.join("\n")
    );
}

#[test]
fn kernels_modules_do_not_import_the_public_front() {
    let mods = modules(&root().join("crates/kernels/src"));
    let up: Vec<String> = imports(&mods)
        .into_iter()
        .filter(|(_, to)| to.is_empty())
        .map(|(from, _)| format!("{} ({})", name(&from), mods[&from].display()))
        .collect();
    assert!(
        up.is_empty(),
        "modules of the kernels crate that import from lib.rs (move what they use into a \
         module below the ops):\n{}",
        up.join("\n")
    );
}

/// Every `.rs` file of the workspace outside `target/`.
fn sources() -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut todo = vec![
        root().join("crates"),
        root().join("src"),
        root().join("tests"),
    ];
    while let Some(dir) = todo.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for e in entries.flatten() {
            let p = e.path();
            if p.is_dir() && !p.ends_with("target") {
                todo.push(p);
            } else if p.extension().is_some_and(|x| x == "rs") {
                out.push(p);
            }
        }
    }
    out.sort();
    out
}

#[test]
fn no_source_file_is_over_a_thousand_lines() {
    let long: Vec<String> = sources()
        .into_iter()
        .filter_map(|f| {
            let n = std::fs::read_to_string(&f).unwrap().lines().count();
            (n > MAX_FILE_LINES).then(|| format!("{} ({n} lines)", f.display()))
        })
        .collect();
    assert!(
        long.is_empty(),
        "files over {MAX_FILE_LINES} lines (split them by subject):\n{}",
        long.join("\n")
    );
}

#[test]
fn no_function_is_over_150_lines_outside_cube_kernels() {
    let mut long = Vec::new();
    for f in sources() {
        let text = std::fs::read_to_string(&f).unwrap();
        for (name, line, n) in function_lengths(&text) {
            if n > MAX_FN_LINES {
                long.push(format!("{}:{line} fn {name} ({n} lines)", f.display()));
            }
        }
    }
    assert!(
        long.is_empty(),
        "functions over {MAX_FN_LINES} lines (outside #[cube] kernels):\n{}",
        long.join("\n")
    );
}

#[test]
fn the_scanner_sees_imports_cycles_and_long_functions() {
    // The checks above pass vacuously if the scanner reads nothing: check it on known text.
    let text = strip(
        "use crate::{a::B, c::{self, D}};\n// use crate::e;\nfn f() { super::g::h(); let s = \"crate::x\"; }\n",
    );
    let paths: BTreeSet<String> = import_paths(&text).iter().map(|p| p.join("::")).collect();
    assert_eq!(
        paths,
        ["crate::a::B", "crate::c", "crate::c::D", "super::g::h"]
            .map(String::from)
            .into()
    );
    let edges: BTreeSet<(Vec<String>, Vec<String>)> =
        [(vec!["a"], vec!["b"]), (vec!["b"], vec!["a"])]
            .into_iter()
            .map(|(x, y)| {
                (
                    x.into_iter().map(String::from).collect(),
                    y.into_iter().map(String::from).collect(),
                )
            })
            .collect();
    assert_eq!(cycles(&edges), vec![vec!["a".to_string(), "b".to_string()]]);
    let body = "\n".repeat(200);
    let src = format!("fn long() {{{body}}}\n#[cube]\nfn kernel() {{{body}}}\nfn short() {{}}\n");
    let lens = function_lengths(&src);
    assert_eq!(lens.len(), 2, "{lens:?}");
    assert_eq!((lens[0].0.as_str(), lens[0].2), ("long", 201));
    assert_eq!(lens[1].0, "short");
}
