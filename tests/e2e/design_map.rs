//! docs/design.md's module map held against `src/` as it is at test time: every source file
//! has its row, every row its file, and each row's imports are what the file's code names.
//! No Envoy: it reads the tree and the document. A failure says which row to add, remove or
//! correct, and what to write in it.

use std::collections::BTreeSet;
use std::fs;
use std::path::{Path, PathBuf};

/// One row of the map: the file (relative to `src/`) and its imports cell.
struct Row {
    file: String,
    imports: BTreeSet<String>,
}

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The rows of the table under "## The module map".
fn map_rows() -> Vec<Row> {
    let design = fs::read_to_string(root().join("docs/design.md")).unwrap();
    let section = design
        .split("\n## ")
        .find(|s| s.starts_with("The module map"))
        .expect("docs/design.md has no \"## The module map\" section");
    let mut rows = Vec::new();
    for line in section.lines().filter(|l| l.starts_with('|')) {
        let cells: Vec<&str> = line.split('|').map(str::trim).collect();
        // ["", layer, file, job, imports, ""]
        assert_eq!(
            cells.len(),
            6,
            "docs/design.md's module map: a row must have four cells (layer | file | its one \
             job | imports): {line}"
        );
        let file = cells[2];
        if file == "file" || file.starts_with("---") {
            continue;
        }
        assert!(
            file.starts_with('`') && file.ends_with('`') && file.matches('`').count() == 2,
            "docs/design.md's module map: one file a row, in backticks: {line}"
        );
        rows.push(Row {
            file: file.trim_matches('`').to_string(),
            imports: parse_imports(cells[4]),
        });
    }
    rows
}

fn parse_imports(cell: &str) -> BTreeSet<String> {
    cell.split(',')
        .map(str::trim)
        .filter(|m| !m.is_empty() && *m != "–" && *m != "-")
        .map(str::to_string)
        .collect()
}

/// Every `.rs` file under `src/`, relative to it, `/`-separated.
fn source_files() -> Vec<String> {
    fn walk(dir: &Path, base: &Path, out: &mut Vec<String>) {
        for entry in fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                walk(&path, base, out);
            } else if path.extension().is_some_and(|e| e == "rs") {
                let rel = path.strip_prefix(base).unwrap();
                let parts: Vec<String> = rel
                    .components()
                    .map(|c| c.as_os_str().to_string_lossy().into_owned())
                    .collect();
                out.push(parts.join("/"));
            }
        }
    }
    let src = root().join("src");
    let mut files = Vec::new();
    walk(&src, &src, &mut files);
    files.sort();
    files
}

/// The crate's top-level modules `file` (relative to `src/`) names, but its own.
fn code_imports(file: &str) -> BTreeSet<String> {
    let text = fs::read_to_string(root().join("src").join(file)).unwrap();
    let own = match file.split_once('/') {
        Some((folder, _)) => Some(folder),
        None => file.strip_suffix(".rs").filter(|m| *m != "lib"),
    };
    let mut modules = imports_of(&text);
    if let Some(own) = own {
        modules.remove(own);
    }
    modules
}

/// The modules `text` names as `crate::<module>` outside comments and its unit tests (the
/// `#[cfg(test)] mod tests` at its end).
fn imports_of(text: &str) -> BTreeSet<String> {
    let code = match unit_tests_start(text) {
        Some(at) => &text[..at],
        None => text,
    };
    let mut modules = BTreeSet::new();
    for line in code.lines() {
        let line = line.trim_start();
        if line.starts_with("//") {
            continue;
        }
        let mut rest = line;
        while let Some(at) = rest.find("crate::") {
            rest = &rest[at + "crate::".len()..];
            if let Some(group) = rest.strip_prefix('{') {
                // `crate::{a::X, b}`: the first segment of each item.
                let group = &group[..group.find('}').unwrap_or(group.len())];
                modules.extend(
                    group
                        .split(',')
                        .filter_map(|item| first_segment(item.trim())),
                );
            } else {
                modules.extend(first_segment(rest));
            }
        }
    }
    modules
}

fn first_segment(path: &str) -> Option<String> {
    let end = path
        .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .unwrap_or(path.len());
    let segment = &path[..end];
    (!segment.is_empty() && segment.starts_with(|c: char| c.is_ascii_lowercase()))
        .then(|| segment.to_string())
}

/// Where a file's unit tests begin: a `#[cfg(test)]` line followed by `mod tests`.
fn unit_tests_start(text: &str) -> Option<usize> {
    let mut offset = 0;
    let mut lines = text.split_inclusive('\n').peekable();
    while let Some(line) = lines.next() {
        if line.trim() == "#[cfg(test)]"
            && lines
                .peek()
                .is_some_and(|next| next.trim_start().starts_with("mod tests"))
        {
            return Some(offset);
        }
        offset += line.len();
    }
    None
}

fn cell(imports: &BTreeSet<String>) -> String {
    if imports.is_empty() {
        "–".to_string()
    } else {
        imports.iter().cloned().collect::<Vec<_>>().join(", ")
    }
}

#[test]
fn the_module_map_has_a_row_for_every_source_file_and_no_other() {
    let rows = map_rows();
    let files = source_files();
    let mut problems = Vec::new();
    let mut seen = BTreeSet::new();
    for row in &rows {
        if !seen.insert(row.file.as_str()) {
            problems.push(format!("src/{} has two rows: remove one", row.file));
        }
        if !files.contains(&row.file) {
            problems.push(format!(
                "docs/design.md lists src/{}, which is gone: remove its row",
                row.file
            ));
        }
    }
    for file in &files {
        if !seen.contains(file.as_str()) {
            problems.push(format!(
                "src/{file} is not in docs/design.md's module map: add the row \
                 `| | `{file}` | <its one job> | {} |` in its layer",
                cell(&code_imports(file))
            ));
        }
    }
    assert!(problems.is_empty(), "\n{}\n", problems.join("\n"));
}

#[test]
fn the_module_maps_imports_are_what_the_code_names() {
    let files = source_files();
    let mut problems = Vec::new();
    for row in map_rows().iter().filter(|r| files.contains(&r.file)) {
        let code = code_imports(&row.file);
        if code != row.imports {
            problems.push(format!(
                "docs/design.md's row of src/{} says imports `{}`; the code names `{}`: write \
                 that",
                row.file,
                cell(&row.imports),
                cell(&code)
            ));
        }
    }
    assert!(problems.is_empty(), "\n{}\n", problems.join("\n"));
}

/// The checks themselves: the reading of imports, on the kinds of line the source has.
#[test]
fn imports_are_read_from_code_not_comments_nor_unit_tests() {
    let text = "//! [`crate::json::kind`]\nuse crate::answer::Answer;\nuse crate::{call::Leg, \
                headers};\nfn f() { crate::metrics::x(); }\n#[cfg(test)]\nmod tests {\n    \
                use crate::testing::FakeHost;\n}\n";
    let modules = imports_of(text);
    assert_eq!(
        cell(&modules),
        "answer, call, headers, metrics",
        "comments and unit tests are not imports"
    );
    assert_eq!(parse_imports("–"), BTreeSet::new());
    assert_eq!(
        parse_imports("a, b"),
        BTreeSet::from(["a".to_string(), "b".to_string()])
    );
}
