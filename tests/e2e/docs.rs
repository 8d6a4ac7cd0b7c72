//! The user documentation stays true: README.md, SECURITY.md, CHANGELOG.md and docs/*.md.
//!
//! - Every relative link resolves: the file (or directory) is there, and a `#anchor` is a
//!   heading of the target, by GitHub's rule (lower case, spaces to `-`, punctuation dropped,
//!   `-1`, `-2`, ... for repeated headings).
//! - Every test the docs cite as `` `path.rs` `test_name` `` (the Knative compatibility table,
//!   the security guarantees) is a `fn test_name(` in that file; the Knative table cites at least
//!   one test in every row.
//! - Every example configuration is loaded into the real filter by `envoy --mode validate`
//!   (which loads fanout.wasm and runs its configuration check). Each ```json block of the
//!   docs is preceded by a marker: `<!-- fanout-config: accepted -->` (the filter must accept
//!   it), `<!-- fanout-config: refused: TEXT -->` (Envoy must refuse it and the filter's log
//!   must say `invalid plugin configuration: ...TEXT`), or
//!   `<!-- fanout-config: not a configuration (...) -->` (a report, a Knative object). A json
//!   block without a marker fails the test, so no example goes unchecked.
//! - Every Prometheus name of fanout's metrics that the docs and the shipped rules and
//!   dashboard (`deploy/`) use is one docs/metrics.md's table lists (a histogram's `_bucket`,
//!   `_count`, `_sum` included), and none has Envoy's `wasmcustom` prefix, which Envoy drops in
//!   `/stats/prometheus` (tests/e2e/metrics.rs reads the names off a real Envoy).

use std::collections::HashMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;

use crate::harness::{
    envoy_bin, filter_log_lines, manifest_dir as repo_root, EnvoyBuilder, TempDir,
};

/// The documents whose links and examples are checked, relative to the crate root.
fn documents() -> Vec<PathBuf> {
    let root = repo_root();
    let mut docs: Vec<PathBuf> = ["README.md", "SECURITY.md", "CHANGELOG.md"]
        .iter()
        .map(PathBuf::from)
        .collect();
    let mut pages: Vec<PathBuf> = fs::read_dir(root.join("docs"))
        .expect("read docs/")
        .map(|e| e.expect("a docs/ entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .map(|p| p.strip_prefix(&root).expect("under the root").to_path_buf())
        .collect();
    pages.sort();
    docs.extend(pages);
    for doc in &docs {
        assert!(root.join(doc).is_file(), "{} is missing", doc.display());
    }
    docs
}

fn read(path: &Path) -> String {
    fs::read_to_string(repo_root().join(path))
        .unwrap_or_else(|e| panic!("read {}: {e}", path.display()))
}

/// The lines of a markdown text outside fenced code blocks, with their 1-based numbers.
fn prose_lines(text: &str) -> Vec<(usize, &str)> {
    let mut fence: Option<&str> = None;
    let mut lines = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let trimmed = line.trim_start();
        match fence {
            Some(marker) => {
                if trimmed.starts_with(marker)
                    && trimmed.trim_start_matches(marker).trim().is_empty()
                {
                    fence = None;
                }
            }
            None => {
                if trimmed.starts_with("```") {
                    fence = Some("```");
                } else if trimmed.starts_with("~~~") {
                    fence = Some("~~~");
                } else {
                    lines.push((i + 1, line));
                }
            }
        }
    }
    lines
}

/// GitHub's anchor of a heading's text.
fn anchor(heading: &str) -> String {
    // A link in a heading counts by its text: `[text](url)` -> `text`.
    let mut text = String::new();
    let mut rest = heading;
    while let Some(open) = rest.find('[') {
        let Some(mid) = rest[open..].find("](").map(|m| open + m) else {
            break;
        };
        let Some(close) = rest[mid..].find(')').map(|c| mid + c) else {
            break;
        };
        text.push_str(&rest[..open]);
        text.push_str(&rest[open + 1..mid]);
        rest = &rest[close + 1..];
    }
    text.push_str(rest);
    text.trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            '-' | '_' => Some(c),
            c if c.is_alphanumeric() => Some(c),
            _ => None,
        })
        .collect()
}

/// The anchors of a markdown file's headings, repeated ones numbered as GitHub does.
fn anchors(text: &str) -> Vec<String> {
    let mut seen: HashMap<String, usize> = HashMap::new();
    let mut out = Vec::new();
    for (_, line) in prose_lines(text) {
        let hashes = line.chars().take_while(|&c| c == '#').count();
        if hashes == 0 || hashes > 6 || !line[hashes..].starts_with(' ') {
            continue;
        }
        let base = anchor(line[hashes..].trim().trim_end_matches('#').trim());
        let n = seen.entry(base.clone()).or_insert(0);
        out.push(if *n == 0 {
            base.clone()
        } else {
            format!("{base}-{n}")
        });
        *n += 1;
    }
    out
}

/// Inline code spans removed (a link inside one is not a link), line numbers kept.
fn without_code_spans(line: &str) -> String {
    let mut out = String::new();
    let mut in_code = false;
    for c in line.chars() {
        if c == '`' {
            in_code = !in_code;
        } else if !in_code {
            out.push(c);
        }
    }
    out
}

/// The targets of the inline links and images of one line: `[text](target)`.
fn link_targets(line: &str) -> Vec<String> {
    let line = without_code_spans(line);
    let mut targets = Vec::new();
    let mut rest = line.as_str();
    while let Some(at) = rest.find("](") {
        let after = &rest[at + 2..];
        match after.find(')') {
            Some(end) => {
                // `[text](target "title")`: the target alone.
                let target = after[..end].split_whitespace().next().unwrap_or("");
                targets.push(target.to_owned());
                rest = &after[end + 1..];
            }
            None => break,
        }
    }
    targets
}

#[test]
fn every_relative_link_in_the_docs_resolves_to_a_file_and_heading() {
    let root = repo_root();
    let mut headings: HashMap<PathBuf, Vec<String>> = HashMap::new();
    let mut problems = Vec::new();
    let mut checked = 0;
    for doc in documents() {
        let text = read(&doc);
        for (number, line) in prose_lines(&text) {
            for target in link_targets(line) {
                if target.is_empty() || target.contains("://") || target.starts_with("mailto:") {
                    continue;
                }
                checked += 1;
                let (path, fragment) = match target.split_once('#') {
                    Some((path, fragment)) => (path, Some(fragment)),
                    None => (target.as_str(), None),
                };
                let file = if path.is_empty() {
                    doc.clone()
                } else {
                    let dir = doc.parent().unwrap_or(Path::new(""));
                    normalize(&dir.join(path))
                };
                let where_ = format!("{}:{number}: ({target})", doc.display());
                if !root.join(&file).exists() {
                    problems.push(format!("{where_}: {} does not exist", file.display()));
                    continue;
                }
                let Some(fragment) = fragment else { continue };
                if file.extension().is_none_or(|e| e != "md") {
                    problems.push(format!(
                        "{where_}: an anchor into a file that is not markdown"
                    ));
                    continue;
                }
                let known = headings
                    .entry(file.clone())
                    .or_insert_with(|| anchors(&read(&file)));
                if !known.iter().any(|a| a == fragment) {
                    problems.push(format!(
                        "{where_}: {} has no heading #{fragment}; its anchors: {}",
                        file.display(),
                        known.join(", ")
                    ));
                }
            }
        }
    }
    assert!(
        checked > 50,
        "only {checked} relative links found: is the parser broken?"
    );
    assert!(problems.is_empty(), "dead links:\n{}", problems.join("\n"));
}

/// `docs/../README.md` -> `README.md` (the paths stay relative to the crate root).
fn normalize(path: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for part in path.components() {
        match part {
            std::path::Component::ParentDir => {
                out.pop();
            }
            std::path::Component::CurDir => {}
            other => out.push(other),
        }
    }
    out
}

/// Every `` `file.rs` `name` `` pair of a text: (file, test name).
fn cited_tests(text: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(start) = rest.find('`') {
        let after = &rest[start + 1..];
        let Some(end) = after.find('`') else { break };
        let span = &after[..end];
        rest = &after[end + 1..];
        let is_file = (span.starts_with("src/") || span.starts_with("tests/"))
            && span.ends_with(".rs")
            && !span.contains(' ');
        if !is_file {
            continue;
        }
        if let Some(name) = rest
            .strip_prefix(" `")
            .and_then(|r| r.split_once('`'))
            .map(|(name, _)| name)
            .filter(|name| {
                !name.is_empty() && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
            })
        {
            out.push((span.to_owned(), name.to_owned()));
        }
    }
    out
}

/// Where `fn name(` is under src/ and tests/, to say where a cited test went.
fn find_test(name: &str) -> Vec<String> {
    fn walk(dir: &Path, needle: &str, root: &Path, found: &mut Vec<String>) {
        let Ok(entries) = fs::read_dir(dir) else {
            return;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            if path.is_dir() {
                walk(&path, needle, root, found);
            } else if path.extension().is_some_and(|e| e == "rs")
                && fs::read_to_string(&path).is_ok_and(|t| t.contains(needle))
            {
                found.push(
                    path.strip_prefix(root)
                        .unwrap_or(&path)
                        .display()
                        .to_string(),
                );
            }
        }
    }
    let root = repo_root();
    let mut found = Vec::new();
    let needle = format!("fn {name}(");
    for dir in ["src", "tests"] {
        walk(&root.join(dir), &needle, &root, &mut found);
    }
    found
}

#[test]
fn every_test_the_docs_cite_exists_in_the_file_they_name() {
    let root = repo_root();
    let mut problems = Vec::new();
    let mut cited = 0;
    for doc in documents() {
        let text = read(&doc);
        for (file, name) in cited_tests(&text) {
            cited += 1;
            let source = fs::read_to_string(root.join(&file)).unwrap_or_default();
            if !source.contains(&format!("fn {name}(")) {
                let elsewhere = find_test(&name);
                problems.push(format!(
                    "{}: `{file}` `{name}`: no `fn {name}(` in {file}{}",
                    doc.display(),
                    if elsewhere.is_empty() {
                        " (nor anywhere under src/ or tests/)".to_owned()
                    } else {
                        format!(" (it is in {})", elsewhere.join(", "))
                    }
                ));
            }
        }
    }
    assert!(
        problems.is_empty(),
        "cited tests not found:\n{}",
        problems.join("\n")
    );

    // The Knative table proves each row with tests: every row cites one.
    let knative = read(Path::new("docs/knative.md"));
    let section = knative
        .split("\n## ")
        .find(|s| s.starts_with("Compatibility with Knative's specs"))
        .expect("docs/knative.md has the section \"Compatibility with Knative's specs\"");
    let rows: Vec<&str> = section
        .lines()
        .filter(|l| l.starts_with('|') && !l.starts_with("|---") && !l.starts_with("| the spec"))
        .collect();
    assert!(
        rows.len() >= 19,
        "the Knative table has {} rows",
        rows.len()
    );
    for row in &rows {
        let last = row.trim_end_matches('|').rsplit('|').next().unwrap_or("");
        assert!(
            !cited_tests(last).is_empty(),
            "a row of the Knative table cites no test as `file.rs` `name`: {row}"
        );
    }
    assert!(
        cited >= 40,
        "only {cited} tests cited: is the parser broken?"
    );
}

#[derive(Debug)]
enum Expect {
    Accepted,
    /// The text the filter's log must say after `invalid plugin configuration: `.
    Refused(String),
}

#[derive(Debug)]
struct Example {
    place: String,
    config: String,
    expect: Expect,
}

const MARKER: &str = "<!-- fanout-config:";

/// Every json block of the docs with its marker; a block without one is a problem.
fn examples(problems: &mut Vec<String>) -> Vec<Example> {
    let mut out = Vec::new();
    for doc in documents() {
        let text = read(&doc);
        let lines: Vec<&str> = text.lines().collect();
        let mut i = 0;
        while i < lines.len() {
            let line = lines[i].trim();
            if !line.starts_with("```") {
                i += 1;
                continue;
            }
            let info = line.trim_start_matches('`').trim();
            let start = i;
            let end = (i + 1..lines.len())
                .find(|&j| lines[j].trim() == "```")
                .unwrap_or(lines.len());
            i = end + 1;
            if info != "json" {
                continue;
            }
            let place = format!("{}:{}", doc.display(), start + 1);
            let marker = (0..start)
                .rev()
                .map(|j| lines[j].trim())
                .find(|l| !l.is_empty())
                .filter(|l| l.starts_with(MARKER) && l.ends_with("-->"));
            let Some(marker) = marker else {
                problems.push(format!(
                    "{place}: a json block without a `{MARKER} ... -->` marker before it"
                ));
                continue;
            };
            let what = marker[MARKER.len()..marker.len() - 3].trim();
            let config = lines[start + 1..end].join("\n");
            let expect = if what == "accepted" {
                Expect::Accepted
            } else if let Some(text) = what.strip_prefix("refused:") {
                Expect::Refused(text.trim().to_owned())
            } else if what.starts_with("not a configuration") {
                continue;
            } else {
                problems.push(format!("{place}: unknown marker {marker:?}"));
                continue;
            };
            out.push(Example {
                place,
                config,
                expect,
            });
        }
    }
    out
}

/// `envoy --mode validate` on a bootstrap with the filter configured by `config`: whether
/// Envoy accepted it, and its output.
fn validate(config: &str) -> (bool, String) {
    let bootstrap = EnvoyBuilder::default().fanout_raw(config).bootstrap();
    let dir = TempDir::new("fanout-docs", "a docs example Envoy validated");
    let file = dir.path().join("envoy.json");
    fs::write(&file, bootstrap.to_string()).expect("write the bootstrap");
    let output = Command::new(envoy_bin())
        .args([
            "--mode",
            "validate",
            "--disable-hot-restart",
            "--log-level",
            "info",
            "-c",
        ])
        .arg(&file)
        .output()
        .expect("run envoy --mode validate");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    (output.status.success() && text.contains("' OK"), text)
}

#[test]
fn every_example_configuration_in_the_docs_is_accepted_or_refused_as_documented() {
    let mut problems = Vec::new();
    let examples = examples(&mut problems);
    let accepted = examples
        .iter()
        .filter(|e| matches!(e.expect, Expect::Accepted))
        .count();
    assert!(
        accepted >= 5 && examples.len() > accepted,
        "{accepted} accepted and {} refused examples found: are the markers gone?",
        examples.len() - accepted
    );
    // Each validate compiles the module in V8 (about a second): a few at a time.
    let workers = std::thread::available_parallelism().map_or(2, |n| n.get().min(4));
    let next = Mutex::new(examples.iter());
    let found = Mutex::new(Vec::new());
    std::thread::scope(|scope| {
        for _ in 0..workers {
            scope.spawn(|| loop {
                let Some(example) = next.lock().unwrap().next() else {
                    break;
                };
                let (ok, log) = validate(&example.config);
                let filter_lines = filter_log_lines(&log);
                let problem = match &example.expect {
                    Expect::Accepted if !ok => Some(format!(
                        "{}: fanout refused this example:\n  {}",
                        example.place,
                        filter_lines.join("\n  ")
                    )),
                    Expect::Accepted
                        if !filter_lines
                            .iter()
                            .any(|l| l.contains("fanout: configured ")) =>
                    {
                        Some(format!(
                            "{}: the filter did not say it was configured:\n{log}",
                            example.place
                        ))
                    }
                    Expect::Accepted => None,
                    Expect::Refused(_) if ok => Some(format!(
                        "{}: fanout accepted an example the docs say it refuses",
                        example.place
                    )),
                    Expect::Refused(text) => {
                        let needle = format!("invalid plugin configuration: {text}");
                        (!filter_lines.iter().any(|l| l.contains(&needle))).then(|| {
                            format!(
                                "{}: refused, but no log line of the filter says {needle:?}:\n  {}",
                                example.place,
                                filter_lines.join("\n  ")
                            )
                        })
                    }
                };
                if let Some(problem) = problem {
                    found.lock().unwrap().push(problem);
                }
            });
        }
    });
    problems.extend(found.into_inner().unwrap());
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn the_link_checker_reads_anchors_and_links_as_github_does() {
    assert_eq!(
        anchor("Circuit breakers (`overflow`)"),
        "circuit-breakers-overflow"
    );
    assert_eq!(
        anchor("Compatibility with Knative's specs"),
        "compatibility-with-knatives-specs"
    );
    assert_eq!(
        anchor("Docker compose: `examples/docker-compose/`"),
        "docker-compose-examplesdocker-compose"
    );
    assert_eq!(
        anchor("Live reconfiguration (ConfigMap)"),
        "live-reconfiguration-configmap"
    );
    assert_eq!(
        anchor("Redelivery without duplicates (`dedupe`)"),
        "redelivery-without-duplicates-dedupe"
    );
    assert_eq!(anchor("[0.1.0] - 2026-11-30"), "010---2026-11-30");
    assert_eq!(
        anchors("# A\n```\n# not a heading\n```\n## A\n## B #\n"),
        ["a", "a-1", "b"]
    );
    assert_eq!(
        link_targets("see [x](a.md#b), `[not](a link)` and ![img](c.svg \"title\")"),
        ["a.md#b", "c.svg"]
    );
    assert_eq!(
        cited_tests("| row | `tests/e2e/flow.rs` `a_b`, `src/retry.rs` `c` and `src/x.rs` alone |"),
        [
            ("tests/e2e/flow.rs".to_owned(), "a_b".to_owned()),
            ("src/retry.rs".to_owned(), "c".to_owned())
        ]
    );
}

/// The words of a text made of `[a-z0-9_]` that start with `prefix`; a recording rule's name
/// (`level:metric:operations`, checked by promtool and tests/e2e/alerts.rs) is not one.
fn words_starting_with<'a>(text: &'a str, prefix: &str) -> Vec<&'a str> {
    text.split(|c: char| !(c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_' || c == ':'))
        .filter(|w| !w.contains(':'))
        .filter(|w| w.starts_with(prefix))
        .collect()
}

/// The Prometheus metric names of fanout (not its labels, test or fuzz target names).
fn is_metric_name(word: &str) -> bool {
    [
        "fanout_requests_",
        "fanout_subscriber_",
        "fanout_in_flight",
        "fanout_duration_ms",
        "fanout_call_duration_ms",
        "fanout_dedupe_",
    ]
    .iter()
    .any(|p| word.starts_with(p))
}

#[test]
fn every_prometheus_name_the_docs_and_deploy_use_is_in_the_metrics_table() {
    let metrics = read(Path::new("docs/metrics.md"));
    // The table's second column: the Prometheus names.
    let listed: Vec<String> = metrics
        .lines()
        .filter(|l| l.starts_with("| `fanout."))
        .filter_map(|l| l.split('|').nth(2))
        .flat_map(|cell| {
            words_starting_with(cell, "fanout_")
                .into_iter()
                .map(str::to_owned)
        })
        .filter(|w| is_metric_name(w))
        .collect();
    assert!(
        listed.len() >= 20,
        "the table of docs/metrics.md: {listed:?}"
    );
    let known = |w: &str| {
        listed.iter().any(|l| {
            w == l
                || w == l.trim_end_matches("_bucket")
                || ["_bucket", "_count", "_sum"]
                    .iter()
                    .any(|suffix| w == format!("{}{suffix}", l.trim_end_matches("_bucket")))
        })
    };
    let mut files = documents();
    files.extend(
        [
            "deploy/prometheus/fanout-rules.yaml",
            "deploy/prometheus/fanout-rules.test.yaml",
            "deploy/grafana/fanout-dashboard.json",
        ]
        .map(PathBuf::from),
    );
    let mut problems = Vec::new();
    for file in &files {
        let text = read(file);
        for word in words_starting_with(&text, "wasmcustom_") {
            problems.push(format!(
                "{}: {word}: Envoy's /stats/prometheus drops the wasmcustom prefix",
                file.display()
            ));
        }
        for word in words_starting_with(&text, "fanout_")
            .into_iter()
            .filter(|w| is_metric_name(w))
        {
            if !known(word) {
                problems.push(format!(
                    "{}: {word} is not a name in docs/metrics.md's table",
                    file.display()
                ));
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
    // It sees what it checks.
    assert!(known("fanout_duration_ms_bucket") && known("fanout_in_flight"));
    assert!(!known("fanout_inflight"));
}
