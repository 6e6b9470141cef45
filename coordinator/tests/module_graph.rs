//! "Layout shows the architecture: one concept per file, no import cycles", checked for every
//! crate of the workspace at the level of FILES.
//!
//! # The graph
//! - Nodes: the `.rs` files of each crate's `src/`, found the way rustc finds them: from
//!   `lib.rs` and `main.rs` (two crates when a package has both) through `mod NAME;`
//!   declarations, honouring `#[path = "..."]`. A module `foo` lives in `foo.rs` or
//!   `foo/mod.rs`; `foo.rs` with a `foo/` folder is the module `foo`, its children in `foo/`.
//!   Non-test inline modules (`mod rpc { ... }`) belong to the file that holds them.
//! - Left out, because tests may use anything: files declared under `#[cfg(test)]` (or
//!   `#[cfg(all(test, ...))]`) and their children, files named `*_tests.rs`, and in every
//!   other file the items under such an attribute (`#[cfg(test)] mod tests { ... }`, a
//!   `#[cfg(test)] fn`, ...).
//! - Edges: file A -> file B when A's code (comments and string literals stripped) names B
//!   through `crate::...`, `super::...`, `self::...`, a child module's name (`child::f`), or a
//!   `use` of those (groups, `self`, globs and `as` included). A path is resolved to the
//!   deepest module it names, then to the file that DEFINES the item: a re-export
//!   (`pub use`, or any `use` a child reaches through its parent) is an alias, followed to
//!   the file it points to. So naming `crate::Error` is an edge to the file defining `Error`,
//!   not to `lib.rs`, and a `mod.rs` that re-exports its children gets no edge from doing
//!   so. A `pub use` is an edge from its file only when that file's own code names the item.
//!   Paths into other crates are not edges (Cargo forbids cycles between crates).
//!
//! A cycle is a strongly connected component of more than one file. The test fails naming
//! every cycle, its files and the paths that make each edge, except the groups listed in
//! [`KNOWN_CYCLES`] (each with its reason); a listed group that is no longer a cycle fails
//! too, so the list only shrinks.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The crates checked, relative to the workspace root.
const CRATES: [&str; 6] = ["proto", "net", "model", "worker", "coordinator", "cli"];

/// Cycles allowed for now, each a set of files (relative to the workspace root) and why. A
/// cycle found must be exactly one of these; any other cycle fails the test.
const KNOWN_CYCLES: &[(&[&str], &str)] = &[];

// ---------------------------------------------------------------------------------------
// Tokens
// ---------------------------------------------------------------------------------------

#[derive(Clone, Debug, PartialEq)]
enum Tok {
    Ident(String),
    /// `::`
    Path,
    Punct(char),
    /// A string literal's contents (for `#[path = "..."]`).
    Str(String),
    /// Numbers, chars, lifetimes: nothing this test looks at.
    Other,
}

/// Rust source as tokens, without comments; string and char literals are single tokens.
fn tokenize(src: &str) -> Vec<Tok> {
    let c: Vec<char> = src.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    let ident_char = |ch: char| ch.is_alphanumeric() || ch == '_';
    while i < c.len() {
        let ch = c[i];
        let next = c.get(i + 1).copied().unwrap_or('\0');
        if ch.is_whitespace() {
            i += 1;
        } else if ch == '/' && next == '/' {
            while i < c.len() && c[i] != '\n' {
                i += 1;
            }
        } else if ch == '/' && next == '*' {
            let mut depth = 0;
            while i < c.len() {
                if c[i] == '/' && c.get(i + 1) == Some(&'*') {
                    depth += 1;
                    i += 2;
                } else if c[i] == '*' && c.get(i + 1) == Some(&'/') {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    i += 1;
                }
            }
        } else if (ch == 'r' || ch == 'b') && raw_string_start(&c, i).is_some() {
            // r"..", r#".."#, br"..", br#".."#
            let (hashes, body) = raw_string_start(&c, i).unwrap();
            let mut j = body;
            let mut s = String::new();
            loop {
                if j >= c.len() {
                    break;
                }
                if c[j] == '"' && (0..hashes).all(|k| c.get(j + 1 + k) == Some(&'#')) {
                    j += 1 + hashes;
                    break;
                }
                s.push(c[j]);
                j += 1;
            }
            out.push(Tok::Str(s));
            i = j;
        } else if ch == '"' || (ch == 'b' && next == '"') {
            let mut j = if ch == 'b' { i + 2 } else { i + 1 };
            let mut s = String::new();
            while j < c.len() && c[j] != '"' {
                if c[j] == '\\' {
                    j += 1;
                }
                if j < c.len() {
                    s.push(c[j]);
                }
                j += 1;
            }
            out.push(Tok::Str(s));
            i = j + 1;
        } else if ch == '\'' || (ch == 'b' && next == '\'') {
            let start = if ch == 'b' { i + 1 } else { i };
            // A char literal ('x', '\n', '\u{..}') or a lifetime ('a).
            if c.get(start + 1) == Some(&'\\') {
                let mut j = start + 2;
                while j < c.len() && c[j] != '\'' {
                    j += 1;
                }
                i = j + 1;
            } else if c.get(start + 2) == Some(&'\'') {
                i = start + 3;
            } else {
                let mut j = start + 1;
                while j < c.len() && ident_char(c[j]) {
                    j += 1;
                }
                i = j;
            }
            out.push(Tok::Other);
        } else if ch.is_ascii_digit() {
            while i < c.len() && (ident_char(c[i]) || c[i] == '.') {
                // `0..n`: stop at a range.
                if c[i] == '.' && c.get(i + 1) == Some(&'.') {
                    break;
                }
                i += 1;
            }
            out.push(Tok::Other);
        } else if ident_char(ch) {
            let mut j = i;
            if ch == 'r' && next == '#' {
                j += 2;
            }
            let start = j;
            while j < c.len() && ident_char(c[j]) {
                j += 1;
            }
            out.push(Tok::Ident(c[start..j].iter().collect()));
            i = j;
        } else if ch == ':' && next == ':' {
            out.push(Tok::Path);
            i += 2;
        } else {
            out.push(Tok::Punct(ch));
            i += 1;
        }
    }
    out
}

/// At `i`, a raw string literal's number of `#` and the index of its first character.
fn raw_string_start(c: &[char], i: usize) -> Option<(usize, usize)> {
    let mut j = i;
    if c[j] == 'b' {
        j += 1;
    }
    if c.get(j) != Some(&'r') {
        return None;
    }
    // Not the end of an identifier such as `bar` or `for`.
    if i > 0 && (c[i - 1].is_alphanumeric() || c[i - 1] == '_') {
        return None;
    }
    j += 1;
    let mut hashes = 0;
    while c.get(j) == Some(&'#') {
        hashes += 1;
        j += 1;
    }
    (c.get(j) == Some(&'"')).then_some((hashes, j + 1))
}

fn ident(t: Option<&Tok>) -> Option<&str> {
    match t {
        Some(Tok::Ident(s)) => Some(s),
        _ => None,
    }
}

/// The index just past the bracket group opening at `i` (`(`, `[` or `{`).
fn group_end(toks: &[Tok], i: usize) -> usize {
    let mut depth = 0i32;
    let mut j = i;
    while j < toks.len() {
        match toks[j] {
            Tok::Punct('(' | '[' | '{') => depth += 1,
            Tok::Punct(')' | ']' | '}') => {
                depth -= 1;
                if depth == 0 {
                    return j + 1;
                }
            }
            _ => {}
        }
        j += 1;
    }
    toks.len()
}

/// The index just past the item starting at `i`: its `;` or its first `{ ... }` group.
fn item_end(toks: &[Tok], i: usize) -> usize {
    let mut j = i;
    while j < toks.len() {
        match toks[j] {
            Tok::Punct(';') => return j + 1,
            Tok::Punct('{') => {
                let end = group_end(toks, j);
                // `use a::{b, c};`
                return if toks.get(end) == Some(&Tok::Punct(';')) {
                    end + 1
                } else {
                    end
                };
            }
            Tok::Punct('(' | '[') => j = group_end(toks, j),
            // The end of the enclosing block: the item was a statement or a field.
            Tok::Punct('}') => return j,
            _ => j += 1,
        }
    }
    toks.len()
}

/// Whether an attribute's tokens (inside `#[...]`) compile its item for tests only.
fn is_test_only(attr: &[Tok]) -> bool {
    let idents: Vec<&str> = attr.iter().filter_map(|t| ident(Some(t))).collect();
    matches!(idents.as_slice(), ["cfg", "test"])
        || (idents.first() == Some(&"cfg")
            && idents.get(1) == Some(&"all")
            && idents.contains(&"test"))
}

// ---------------------------------------------------------------------------------------
// One file: its `mod` declarations, its items, its `use`s and its paths
// ---------------------------------------------------------------------------------------

#[derive(Debug, Default)]
struct ModDecl {
    name: String,
    /// `#[path = "..."]`
    path: Option<String>,
    test_only: bool,
    /// `mod name { ... }`: part of this file.
    inline: bool,
}

#[derive(Debug, Clone)]
struct UseEntry {
    /// The path as written (`crate`, `super`, `self` or a first name).
    path: Vec<String>,
    /// The name it binds; `None` for a glob.
    name: Option<String>,
    /// `pub use`, `pub(crate) use`, ...: a re-export.
    public: bool,
}

#[derive(Debug, Default)]
struct FileInfo {
    mods: Vec<ModDecl>,
    /// Names of the items defined here (`fn`, `struct`, ..., `macro_rules!`).
    defs: BTreeSet<String>,
    uses: Vec<UseEntry>,
    /// Paths in code outside `use` statements that start with `crate`, `super`, `self` or
    /// any other name (resolved later against the module's children).
    paths: Vec<Vec<String>>,
    /// Every identifier in code outside `use` statements.
    idents: BTreeSet<String>,
}

fn parse_file(src: &str) -> FileInfo {
    let toks = tokenize(src);
    let mut info = FileInfo::default();
    // Pass 1: drop the items under a test-only attribute; record `mod` declarations.
    let mut kept: Vec<Tok> = Vec::with_capacity(toks.len());
    let mut attrs: Vec<Vec<Tok>> = Vec::new();
    let mut attr_start = None;
    let mut i = 0;
    while i < toks.len() {
        if toks[i] == Tok::Punct('#') {
            let mut j = i + 1;
            if toks.get(j) == Some(&Tok::Punct('!')) {
                j += 1;
            }
            if toks.get(j) == Some(&Tok::Punct('[')) {
                let end = group_end(&toks, j);
                attr_start.get_or_insert(kept.len());
                attrs.push(toks[j + 1..end - 1].to_vec());
                kept.extend_from_slice(&toks[i..end]);
                i = end;
                continue;
            }
        }
        let test_only = attrs.iter().any(|a| is_test_only(a));
        // Skip visibility to find the item's keyword.
        let mut k = i;
        if ident(toks.get(k)) == Some("pub") {
            k += 1;
            if toks.get(k) == Some(&Tok::Punct('(')) {
                k = group_end(&toks, k);
            }
        }
        if ident(toks.get(k)) == Some("mod")
            && let Some(name) = ident(toks.get(k + 1))
        {
            let path = attrs.iter().find_map(|a| match a.as_slice() {
                [Tok::Ident(p), Tok::Punct('='), Tok::Str(s)] if p == "path" => Some(s.clone()),
                _ => None,
            });
            info.mods.push(ModDecl {
                name: name.to_string(),
                path,
                test_only,
                inline: toks.get(k + 2) == Some(&Tok::Punct('{')),
            });
        }
        if test_only {
            kept.truncate(attr_start.unwrap());
            i = item_end(&toks, i);
        } else {
            kept.push(toks[i].clone());
            i += 1;
        }
        attrs.clear();
        attr_start = None;
    }
    let toks = kept;

    // Pass 2: items, `use` trees and paths.
    let mut i = 0;
    while i < toks.len() {
        let prev = if i > 0 { toks.get(i - 1) } else { None };
        match ident(toks.get(i)) {
            Some("use") if !matches!(prev, Some(Tok::Path)) => {
                let public = is_public_before(&toks, i);
                let end = item_end(&toks, i);
                let mut p = i + 1;
                parse_use_tree(&toks, &mut p, &mut Vec::new(), public, &mut info.uses);
                i = end;
                continue;
            }
            Some(
                "fn" | "struct" | "enum" | "trait" | "type" | "const" | "static" | "union" | "mod",
            ) => {
                if let Some(name) = ident(toks.get(i + 1)) {
                    info.defs.insert(name.to_string());
                }
            }
            Some("macro_rules") if toks.get(i + 1) == Some(&Tok::Punct('!')) => {
                if let Some(name) = ident(toks.get(i + 2)) {
                    info.defs.insert(name.to_string());
                }
            }
            _ => {}
        }
        if let Some(first) = ident(toks.get(i)) {
            info.idents.insert(first.to_string());
            // The start of a path: not after `::` or `.` (a field or a later segment).
            let starts = !matches!(prev, Some(Tok::Path | Tok::Punct('.')));
            if starts && toks.get(i + 1) == Some(&Tok::Path) {
                let mut path = vec![first.to_string()];
                let mut j = i + 1;
                while toks.get(j) == Some(&Tok::Path) {
                    match ident(toks.get(j + 1)) {
                        Some(s) => path.push(s.to_string()),
                        None => break,
                    }
                    j += 2;
                }
                info.paths.push(path);
            }
        }
        i += 1;
    }
    info
}

/// Whether the `use` at `i` is preceded by `pub` or `pub(...)`.
fn is_public_before(toks: &[Tok], i: usize) -> bool {
    if i >= 1 && ident(toks.get(i - 1)) == Some("pub") {
        return true;
    }
    if i >= 1 && toks[i - 1] == Tok::Punct(')') {
        // Walk back over `( ... )` to find `pub`.
        let mut j = i - 1;
        while j > 0 && toks[j] != Tok::Punct('(') {
            j -= 1;
        }
        return j >= 1 && ident(toks.get(j - 1)) == Some("pub");
    }
    false
}

/// Parses one use tree at `*p` (after `use` or inside `{ }`), with `prefix` before it.
fn parse_use_tree(
    toks: &[Tok],
    p: &mut usize,
    prefix: &mut Vec<String>,
    public: bool,
    out: &mut Vec<UseEntry>,
) {
    let depth = prefix.len();
    if toks.get(*p) == Some(&Tok::Path) {
        // `use ::std::...`
        *p += 1;
    }
    loop {
        match toks.get(*p) {
            Some(Tok::Ident(s)) => {
                prefix.push(s.clone());
                *p += 1;
                if toks.get(*p) == Some(&Tok::Path) {
                    *p += 1;
                    continue;
                }
                // The end of a simple path, maybe with `as`.
                let mut path = prefix.clone();
                let mut name = path.last().cloned();
                if path.last().map(String::as_str) == Some("self") {
                    path.pop();
                    name = path.last().cloned();
                }
                if ident(toks.get(*p)) == Some("as") {
                    name = ident(toks.get(*p + 1)).map(str::to_string);
                    if toks.get(*p + 1) == Some(&Tok::Punct('_')) {
                        name = Some("_".to_string());
                    }
                    *p += 2;
                }
                out.push(UseEntry { path, name, public });
                break;
            }
            Some(Tok::Punct('*')) => {
                *p += 1;
                out.push(UseEntry {
                    path: prefix.clone(),
                    name: None,
                    public,
                });
                break;
            }
            Some(Tok::Punct('{')) => {
                *p += 1;
                loop {
                    match toks.get(*p) {
                        Some(Tok::Punct('}')) => {
                            *p += 1;
                            break;
                        }
                        Some(Tok::Punct(',')) => *p += 1,
                        None => break,
                        _ => {
                            let mut inner = prefix.clone();
                            let before = *p;
                            parse_use_tree(toks, p, &mut inner, public, out);
                            if *p == before {
                                *p += 1;
                            }
                        }
                    }
                }
                break;
            }
            _ => break,
        }
    }
    prefix.truncate(depth);
}

// ---------------------------------------------------------------------------------------
// A crate: its module tree, then the edges between its files
// ---------------------------------------------------------------------------------------

/// One crate (a `lib.rs` or a `main.rs` and the files below it).
#[derive(Debug, Default)]
struct Crate {
    /// Module path -> file (a non-test inline module maps to its file).
    modules: BTreeMap<Vec<String>, PathBuf>,
    /// File -> its module path and what it holds (files with code that counts only).
    files: BTreeMap<PathBuf, (Vec<String>, FileInfo)>,
    /// Files that hold test code only.
    test_files: BTreeSet<PathBuf>,
}

fn load_crate(root: &Path) -> Crate {
    let mut krate = Crate::default();
    let mut stack = vec![(root.to_path_buf(), Vec::<String>::new(), false)];
    while let Some((file, module, test_only)) = stack.pop() {
        let src =
            std::fs::read_to_string(&file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
        let info = parse_file(&src);
        let test_only = test_only
            || file
                .file_stem()
                .is_some_and(|s| s.to_string_lossy().ends_with("_tests"));
        let dir = file.parent().unwrap().to_path_buf();
        let stem = file.file_stem().unwrap().to_string_lossy().to_string();
        let mod_rs = root == file || stem == "mod";
        // Where the children of this module live.
        let child_dir = if mod_rs { dir.clone() } else { dir.join(&stem) };
        for m in &info.mods {
            let mut child = module.clone();
            child.push(m.name.clone());
            if m.inline {
                if !(test_only || m.test_only) {
                    krate.modules.insert(child, file.clone());
                }
                continue;
            }
            let path = match &m.path {
                Some(p) => dir.join(p),
                None => {
                    let flat = child_dir.join(format!("{}.rs", m.name));
                    if flat.exists() {
                        flat
                    } else {
                        child_dir.join(&m.name).join("mod.rs")
                    }
                }
            };
            stack.push((path, child, test_only || m.test_only));
        }
        if test_only {
            krate.test_files.insert(file);
        } else {
            krate.modules.insert(module.clone(), file.clone());
            krate.files.insert(file, (module, info));
        }
    }
    krate
}

impl Crate {
    /// The file defining what `path` (as written in module `from`) names, if it is in this
    /// crate. `use_path` marks a `use`'s path, where a first name may be a local item too.
    fn resolve(
        &self,
        from: &[String],
        path: &[String],
        seen: &mut Vec<Vec<String>>,
    ) -> Option<PathBuf> {
        let mut abs: Vec<String> = Vec::new();
        let mut rest = path;
        match path.first().map(String::as_str) {
            Some("crate") => rest = &path[1..],
            Some("self") => {
                abs = from.to_vec();
                rest = &path[1..];
            }
            Some("super") => {
                abs = from.to_vec();
                while rest.first().map(String::as_str) == Some("super") {
                    abs.pop()?;
                    rest = &rest[1..];
                }
                if rest.first().map(String::as_str) == Some("self") {
                    rest = &rest[1..];
                }
            }
            Some(first) => {
                // A child module of `from` (2018 paths), or an item of `from`'s own file.
                let mut child = from.to_vec();
                child.push(first.to_string());
                let here = &self.files.get(self.modules.get(from)?)?.1;
                if self.modules.contains_key(&child) || here.defs.contains(first) {
                    abs = from.to_vec();
                } else {
                    return None;
                }
            }
            None => return None,
        }
        abs.extend(rest.iter().cloned());
        self.resolve_abs(&abs, seen)
    }

    /// The file defining the item at the absolute path `abs`.
    fn resolve_abs(&self, abs: &[String], seen: &mut Vec<Vec<String>>) -> Option<PathBuf> {
        if seen.iter().any(|s| s == abs) || seen.len() > 16 {
            return None;
        }
        seen.push(abs.to_vec());
        let mut module: Vec<String> = Vec::new();
        let mut i = 0;
        while i < abs.len() {
            let mut next = module.clone();
            next.push(abs[i].clone());
            if !self.modules.contains_key(&next) {
                break;
            }
            module = next;
            i += 1;
        }
        let file = self.modules.get(&module)?.clone();
        if i == abs.len() {
            return Some(file);
        }
        let name = &abs[i];
        let Some((_, info)) = self.files.get(&file) else {
            return Some(file);
        };
        if info.defs.contains(name) {
            return Some(file);
        }
        // An alias: a `use` in that module binding `name`, followed.
        for u in &info.uses {
            if u.name.as_deref() == Some(name.as_str()) {
                let mut target = u.path.clone();
                target.extend(abs[i + 1..].iter().cloned());
                return self.resolve(&module, &target, seen).or(Some(file));
            }
        }
        // A glob: the first one under which the name resolves to another file.
        for u in info.uses.iter().filter(|u| u.name.is_none()) {
            let mut target = u.path.clone();
            target.extend(abs[i..].iter().cloned());
            if let Some(f) = self.resolve(&module, &target, seen)
                && f != *self
                    .modules
                    .get(&self.absolute(&module, &u.path))
                    .unwrap_or(&file)
            {
                return Some(f);
            }
        }
        Some(file)
    }

    /// A module path as written in `from`, made absolute (for globs).
    fn absolute(&self, from: &[String], path: &[String]) -> Vec<String> {
        let mut abs = from.to_vec();
        let mut rest = path;
        match path.first().map(String::as_str) {
            Some("crate") => {
                abs.clear();
                rest = &path[1..];
            }
            Some("self") => rest = &path[1..],
            _ => {
                while rest.first().map(String::as_str) == Some("super") {
                    abs.pop();
                    rest = &rest[1..];
                }
            }
        }
        abs.extend(rest.iter().cloned());
        abs
    }

    /// File -> (file it names -> the paths that name it).
    fn edges(&self) -> BTreeMap<PathBuf, BTreeMap<PathBuf, BTreeSet<String>>> {
        let mut edges: BTreeMap<PathBuf, BTreeMap<PathBuf, BTreeSet<String>>> = BTreeMap::new();
        for (file, (module, info)) in &self.files {
            let out = edges.entry(file.clone()).or_default();
            let mut add = |path: &[String]| {
                if let Some(target) = self.resolve(module, path, &mut Vec::new())
                    && target != *file
                    && self.files.contains_key(&target)
                {
                    out.entry(target).or_default().insert(path.join("::"));
                }
            };
            for u in &info.uses {
                let named_here = match &u.name {
                    Some(n) => n == "_" || info.idents.contains(n),
                    None => true,
                };
                // A re-export is an edge only when this file's own code uses it too.
                if !u.public || (u.name.is_some() && named_here) {
                    add(&u.path);
                }
            }
            for p in &info.paths {
                add(p);
            }
        }
        edges
    }
}

/// The workspace-relative name of a file, for messages.
fn display(root: &Path, file: &Path) -> String {
    file.strip_prefix(root)
        .unwrap_or(file)
        .to_string_lossy()
        .replace('\\', "/")
}

/// Strongly connected components of more than one node (Tarjan).
fn cycles<N: Ord + Clone>(edges: &BTreeMap<N, BTreeSet<N>>) -> Vec<BTreeSet<N>> {
    struct State<N> {
        index: BTreeMap<N, usize>,
        low: BTreeMap<N, usize>,
        stack: Vec<N>,
        on_stack: BTreeSet<N>,
        out: Vec<BTreeSet<N>>,
    }
    fn visit<N: Ord + Clone>(n: &N, edges: &BTreeMap<N, BTreeSet<N>>, s: &mut State<N>) {
        let i = s.index.len();
        s.index.insert(n.clone(), i);
        s.low.insert(n.clone(), i);
        s.stack.push(n.clone());
        s.on_stack.insert(n.clone());
        for m in edges.get(n).into_iter().flatten() {
            if !s.index.contains_key(m) {
                visit(m, edges, s);
                let low = s.low[n].min(s.low[m]);
                s.low.insert(n.clone(), low);
            } else if s.on_stack.contains(m) {
                let low = s.low[n].min(s.index[m]);
                s.low.insert(n.clone(), low);
            }
        }
        if s.low[n] == s.index[n] {
            let mut scc = BTreeSet::new();
            loop {
                let m = s.stack.pop().unwrap();
                s.on_stack.remove(&m);
                scc.insert(m.clone());
                if m == *n {
                    break;
                }
            }
            if scc.len() > 1 {
                s.out.push(scc);
            }
        }
    }
    let mut s = State {
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        out: Vec::new(),
    };
    for n in edges.keys() {
        if !s.index.contains_key(n) {
            visit(n, edges, &mut s);
        }
    }
    s.out.sort();
    s.out
}

/// Every import cycle among the files of the crates under `root`: (files, edges inside it
/// with the paths that make them), named relative to `root`.
#[allow(clippy::type_complexity)]
fn find_cycles(root: &Path, crates: &[&str]) -> (usize, Vec<(BTreeSet<String>, Vec<String>)>) {
    let mut found = Vec::new();
    let mut files = 0;
    for name in crates {
        let src = root.join(name).join("src");
        let mut reached = BTreeSet::new();
        for entry in ["lib.rs", "main.rs"] {
            let top = src.join(entry);
            if !top.exists() {
                continue;
            }
            let krate = load_crate(&top);
            reached.extend(krate.files.keys().cloned());
            reached.extend(krate.test_files.iter().cloned());
            files += krate.files.len();
            let edges = krate.edges();
            let plain: BTreeMap<PathBuf, BTreeSet<PathBuf>> = edges
                .iter()
                .map(|(a, bs)| (a.clone(), bs.keys().cloned().collect()))
                .collect();
            for scc in cycles(&plain) {
                let mut why = Vec::new();
                for a in &scc {
                    for (b, paths) in &edges[a] {
                        if scc.contains(b) {
                            let paths: Vec<_> = paths.iter().cloned().collect();
                            why.push(format!(
                                "{} -> {}  ({})",
                                display(root, a),
                                display(root, b),
                                paths.join(", ")
                            ));
                        }
                    }
                }
                found.push((scc.iter().map(|f| display(root, f)).collect(), why));
            }
        }
        // Every file under src/ is part of a crate: a stray file would go unchecked.
        let mut stack = vec![src.clone()];
        while let Some(dir) = stack.pop() {
            for entry in std::fs::read_dir(&dir).unwrap() {
                let path = entry.unwrap().path();
                if path.is_dir() {
                    stack.push(path);
                } else if path.extension().is_some_and(|e| e == "rs") {
                    assert!(
                        reached.contains(&path),
                        "{} is not reached from lib.rs or main.rs by `mod` declarations",
                        display(root, &path)
                    );
                }
            }
        }
    }
    (files, found)
}

#[test]
fn no_file_imports_itself_through_a_cycle() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let (files, found) = find_cycles(root, &CRATES);
    assert!(files > 150, "only {files} files checked");
    let mut report = String::new();
    let mut known_seen = vec![false; KNOWN_CYCLES.len()];
    for (scc, why) in &found {
        let known = KNOWN_CYCLES.iter().position(|(group, _)| {
            group.len() == scc.len() && group.iter().all(|f| scc.contains(*f))
        });
        match known {
            Some(k) => known_seen[k] = true,
            None => {
                report.push_str(&format!(
                    "\ncycle of {} files: {}\n",
                    scc.len(),
                    scc.iter().cloned().collect::<Vec<_>>().join(", ")
                ));
                for line in why {
                    report.push_str(&format!("    {line}\n"));
                }
            }
        }
    }
    for (k, seen) in known_seen.iter().enumerate() {
        if !seen {
            report.push_str(&format!(
                "\nKNOWN_CYCLES lists {:?}, which is no longer a cycle: remove it\n",
                KNOWN_CYCLES[k].0
            ));
        }
    }
    assert!(report.is_empty(), "import cycles between files:\n{report}");
}

// ---------------------------------------------------------------------------------------
// The algorithm on tiny trees
// ---------------------------------------------------------------------------------------

/// The cycles in a tree of `files` (path, text) written under a fresh folder.
fn cycle_files(files: &[(&str, &str)]) -> Vec<BTreeSet<String>> {
    let dir = tempfile::tempdir().unwrap();
    for (path, text) in files {
        let path = dir.path().join(path);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, text).unwrap();
    }
    find_cycles(dir.path(), &["k"])
        .1
        .into_iter()
        .map(|(scc, _)| scc)
        .collect()
}

fn set(files: &[&str]) -> BTreeSet<String> {
    files.iter().map(|f| f.to_string()).collect()
}

#[test]
fn a_cycle_between_two_files_is_found() {
    let found = cycle_files(&[
        ("k/src/lib.rs", "pub mod a;\npub mod b;\nmod c;\n"),
        ("k/src/a.rs", "use crate::b::B;\npub struct A(B);\n"),
        (
            "k/src/b.rs",
            "pub struct B;\npub fn f() -> super::a::A { todo!() }\n",
        ),
        ("k/src/c.rs", "use crate::a::A;\n"),
    ]);
    assert_eq!(found, vec![set(&["k/src/a.rs", "k/src/b.rs"])]);
}

#[test]
fn an_acyclic_graph_passes() {
    let found = cycle_files(&[
        ("k/src/lib.rs", "pub mod a;\npub mod b;\npub use a::A;\n"),
        ("k/src/a.rs", "use crate::b::B;\npub struct A(B);\n"),
        // Naming `crate::A` is naming a.rs (followed through lib.rs's re-export).
        ("k/src/b.rs", "pub struct B;\n"),
        ("k/src/main.rs", "mod m;\nmod n;\n"),
        ("k/src/m.rs", "use crate::n::N;\n"),
        ("k/src/n.rs", "pub struct N;\n"),
    ]);
    assert!(found.is_empty(), "{found:?}");
}

#[test]
fn folders_reexports_groups_and_three_file_cycles() {
    let found = cycle_files(&[
        ("k/src/lib.rs", "pub mod m;\npub use m::Y;\n"),
        // `m.rs` with an `m/` folder is the module `m`; it re-exports, which is no edge.
        (
            "k/src/m.rs",
            "mod x;\nmod y;\nmod z;\npub use y::Y;\npub use self::x::X;\n",
        ),
        (
            "k/src/m/x.rs",
            "use super::{y::{self}, z::Z};\npub struct X;\n",
        ),
        // `crate::Y` is m/y.rs itself (a self edge, not a cycle); `super::X` is m/x.rs.
        (
            "k/src/m/y.rs",
            "pub struct Y;\nfn f() { let _ = crate::Y; let _ = super::X; }\n",
        ),
        ("k/src/m/z.rs", "pub struct Z;\n"),
    ]);
    assert_eq!(found, vec![set(&["k/src/m/x.rs", "k/src/m/y.rs"])]);

    // Three files in a ring, one through a `mod.rs` folder and a glob.
    let found = cycle_files(&[
        ("k/src/lib.rs", "mod a;\nmod b;\nmod c;\n"),
        ("k/src/a.rs", "fn f() { crate::b::g(); }\n"),
        ("k/src/b/mod.rs", "pub fn g() { use crate::c::*; h(); }\n"),
        ("k/src/c.rs", "pub fn h() { crate::a::f(); }\n"),
    ]);
    assert_eq!(
        found,
        vec![set(&["k/src/a.rs", "k/src/b/mod.rs", "k/src/c.rs"])]
    );
}

#[test]
fn comments_strings_and_test_code_are_not_edges() {
    let found = cycle_files(&[
        ("k/src/lib.rs", "mod a;\nmod b;\n"),
        ("k/src/a.rs", "use crate::b::B;\nfn f(_: B) {}\n"),
        (
            "k/src/b.rs",
            r##"//! Uses [`crate::a::f`] in a comment.
/* crate::a::f */
pub struct B;
fn s() -> &'static str { "crate::a::f" }
fn r() -> &'static str { r#"super::a::f"# }
#[cfg(test)]
mod tests {
    use crate::a::f;
}
#[cfg(test)]
use super::a::f;
#[cfg(test)]
#[path = "b_tests.rs"]
mod more;
"##,
        ),
        ("k/src/b_tests.rs", "use crate::a::f;\n"),
    ]);
    assert!(found.is_empty(), "{found:?}");
}

#[test]
fn path_attributes_place_a_module_in_a_named_file() {
    let found = cycle_files(&[
        ("k/src/lib.rs", "mod a;\n"),
        (
            "k/src/a.rs",
            "#[path = \"a_inner.rs\"]\nmod inner;\npub struct A;\n",
        ),
        // The module `a::inner` is k/src/a_inner.rs; `super` is `a`.
        ("k/src/a_inner.rs", "use super::A;\npub struct I;\n"),
    ]);
    assert!(found.is_empty(), "{found:?}");
    let found = cycle_files(&[
        ("k/src/lib.rs", "mod a;\n"),
        (
            "k/src/a.rs",
            "#[path = \"a_inner.rs\"]\nmod inner;\npub struct A(inner::I);\n",
        ),
        ("k/src/a_inner.rs", "use super::A;\npub struct I;\n"),
    ]);
    assert_eq!(found, vec![set(&["k/src/a.rs", "k/src/a_inner.rs"])]);
}

// ---------------------------------------------------------------------------------------
// The coordinator's own rules
// ---------------------------------------------------------------------------------------

/// The coordinator's top-level modules (a folder is one module) import one another one way
/// only too: the file graph above, with each file taken as its top-level module.
#[test]
fn coordinator_modules_have_no_import_cycle() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let krate = load_crate(&src.join("lib.rs"));
    let top = |file: &Path| -> Option<String> {
        let (module, _) = &krate.files[file];
        module.first().cloned()
    };
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (a, bs) in krate.edges() {
        let Some(ta) = top(&a) else { continue };
        let out = graph.entry(ta.clone()).or_default();
        for b in bs.keys() {
            if let Some(tb) = top(b)
                && tb != ta
            {
                out.insert(tb);
            }
        }
    }
    assert!(
        graph.contains_key("machine") && graph.contains_key("driver"),
        "{graph:?}"
    );
    assert!(
        graph["driver"].contains("machine"),
        "the driver drives the machine: {graph:?}"
    );
    let found = cycles(&graph);
    assert!(
        found.is_empty(),
        "import cycles: {found:?}\ngraph: {graph:#?}"
    );
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
