//! The coordinator's modules import one another one way only: no import cycle (a review found
//! one of eight files). Reads `coordinator/src`, takes each file's `crate::NAME` references as
//! edges between top-level modules (a folder is one module), and fails naming a cycle.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// Top-level module -> the top-level modules it names.
fn graph() -> BTreeMap<String, BTreeSet<String>> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut stack = vec![src.clone()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
                continue;
            }
            if path.extension().is_none_or(|e| e != "rs") {
                continue;
            }
            let rel = path.strip_prefix(&src).unwrap();
            let first = rel
                .components()
                .next()
                .unwrap()
                .as_os_str()
                .to_string_lossy();
            let module = first.trim_end_matches(".rs").to_string();
            if module == "lib" || module == "main" {
                continue;
            }
            // Code only: a doc comment may name a module it does not import.
            let text: String = std::fs::read_to_string(&path)
                .unwrap()
                .lines()
                .filter(|l| !l.trim_start().starts_with("//"))
                .collect::<Vec<_>>()
                .join("\n");
            let edges = graph.entry(module.clone()).or_default();
            for (i, _) in text.match_indices("crate::") {
                let name: String = text[i + 7..]
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect();
                // `crate::CoordinatorError` and other items re-exported at the root.
                if !name.is_empty()
                    && name.starts_with(|c: char| c.is_ascii_lowercase())
                    && name != module
                {
                    edges.insert(name);
                }
            }
        }
    }
    graph
}

/// A cycle through `start`, if any (depth-first).
fn cycle_from(
    graph: &BTreeMap<String, BTreeSet<String>>,
    start: &str,
    path: &mut Vec<String>,
) -> Option<Vec<String>> {
    let node = path.last().cloned()?;
    for next in graph.get(&node).into_iter().flatten() {
        if next == start {
            let mut cycle = path.clone();
            cycle.push(next.clone());
            return Some(cycle);
        }
        if !path.contains(next) {
            path.push(next.clone());
            if let Some(c) = cycle_from(graph, start, path) {
                return Some(c);
            }
            path.pop();
        }
    }
    None
}

#[test]
fn coordinator_modules_have_no_import_cycle() {
    let graph = graph();
    assert!(
        graph.contains_key("machine") && graph.contains_key("driver"),
        "{graph:?}"
    );
    assert!(
        graph["driver"].contains("machine"),
        "the driver drives the machine: {graph:?}"
    );
    for start in graph.keys() {
        let mut path = vec![start.clone()];
        if let Some(cycle) = cycle_from(&graph, start, &mut path) {
            panic!("import cycle: {}\ngraph: {graph:#?}", cycle.join(" -> "));
        }
    }
}

#[test]
fn the_machine_touches_no_runtime_files_or_clock() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/machine");
    let mut checked = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_none_or(|e| e != "rs") {
            continue;
        }
        let text = std::fs::read_to_string(&path).unwrap();
        // Unit tests may take a clock reading to start their injected time from.
        let text = text.split("#[cfg(test)]").next().unwrap_or_default();
        for banned in [
            "tokio",
            "std::fs",
            "Instant::now",
            "SystemTime::now",
            "spawn",
        ] {
            assert!(!text.contains(banned), "{} uses {banned}", path.display());
        }
        checked += 1;
    }
    assert!(checked >= 8, "only {checked} files under src/machine");
}
