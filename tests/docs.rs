//! The documentation and the release metadata, checked as files:
//!
//! * the README stays an overview (at most [`README_MAX_LINES`] lines) and
//!   links every page under `docs/`;
//! * every relative link of the README, the changelog and the docs pages
//!   names a file of the repository (and, for a `.md` target with an
//!   anchor, a heading of that page); none leaves the repository, so a
//!   clone stands alone (the behaviour contract is `docs/behaviour.md`);
//! * the contract keeps every rule number;
//! * no page says that a rule has no tests or is not implemented while test
//!   functions carry that rule's number;
//! * the guard examples quoted in `docs/guards.md` are the example files;
//! * one version number: the workspace's, stated alike by the Python and
//!   Node packages and by the crates' path dependencies;
//! * the client SDK, and the wire-types crate it depends on, force no exact
//!   `=` version pin on their users;
//! * the proto against the last release's (`scripts/check-proto-compat`,
//!   with its self-test).

use crate::harness::*;
use std::collections::BTreeSet;
use std::path::{Component, Path, PathBuf};

/// The README is an overview: what guardmesh is, the two commands, a map of
/// the code and links. Everything else goes to a page under `docs/`.
const README_MAX_LINES: usize = 400;

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()))
}

/// The Markdown files whose links are checked: the README, the changelog,
/// and every page under `docs/`.
fn markdown_files() -> Vec<PathBuf> {
    let root = repo_root();
    let mut files = vec![root.join("README.md"), root.join("CHANGELOG.md")];
    files.extend(docs_pages());
    files
}

/// Every `docs/*.md` page.
fn docs_pages() -> Vec<PathBuf> {
    let mut pages: Vec<PathBuf> = std::fs::read_dir(repo_root().join("docs"))
        .expect("docs/ exists")
        .map(|e| e.expect("a docs/ entry").path())
        .filter(|p| p.extension().is_some_and(|x| x == "md"))
        .collect();
    pages.sort();
    pages
}

/// The text of a Markdown file outside its fenced code blocks (a link in a
/// code block is code, not a link).
fn prose(text: &str) -> String {
    let mut out = String::new();
    let mut fenced = false;
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if !fenced {
            out.push_str(line);
            out.push('\n');
        }
    }
    out
}

/// The targets of the inline links `[text](target)` of a Markdown text,
/// outside code blocks and code spans.
fn link_targets(text: &str) -> Vec<String> {
    let mut targets = Vec::new();
    for line in prose(text).lines() {
        // Drop code spans: `[a](b)` inside backticks is not a link.
        let mut plain = String::new();
        let mut in_code = false;
        for c in line.chars() {
            if c == '`' {
                in_code = !in_code;
            } else if !in_code {
                plain.push(c);
            }
        }
        let mut rest = plain.as_str();
        while let Some(i) = rest.find("](") {
            let after = &rest[i + 2..];
            let Some(end) = after.find(')') else { break };
            targets.push(after[..end].trim().to_owned());
            rest = &after[end..];
        }
    }
    targets
}

/// GitHub's anchor for a heading: lower case, spaces to `-`, punctuation
/// other than `-` and `_` dropped.
fn slug(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}

fn anchors(page: &Path) -> BTreeSet<String> {
    prose(&read(page))
        .lines()
        .filter(|l| l.starts_with('#'))
        .map(|l| slug(l.trim_start_matches('#')))
        .collect()
}

/// `path` with `.` and `..` resolved, without touching the file system;
/// `None` when it climbs above its start.
fn normalize(path: &Path) -> Option<PathBuf> {
    let mut out = PathBuf::new();
    for c in path.components() {
        match c {
            Component::ParentDir => {
                if !out.pop() {
                    return None;
                }
            }
            Component::CurDir => {}
            Component::Normal(p) => out.push(p),
            Component::RootDir | Component::Prefix(_) => return None,
        }
    }
    Some(out)
}

/// What is wrong with each relative link of `file` (empty: nothing).
fn broken_links(file: &Path) -> Vec<String> {
    let rel = file
        .strip_prefix(repo_root())
        .expect("a file of the repository")
        .to_path_buf();
    broken_links_in(&rel, &read(file))
}

/// What is wrong with each relative link of `text`, the text of the file
/// `rel` (relative to the repository's root).
fn broken_links_in(rel: &Path, text: &str) -> Vec<String> {
    let root = repo_root();
    let rel_dir = rel.parent().unwrap_or(Path::new("")).to_path_buf();
    let shown = rel.display().to_string();
    let mut broken = Vec::new();
    for target in link_targets(text) {
        if target.contains("://") || target.starts_with("mailto:") {
            continue;
        }
        let (path, anchor) = match target.split_once('#') {
            Some((p, a)) => (p, Some(a)),
            None => (target.as_str(), None),
        };
        if path.is_empty() {
            let own: BTreeSet<String> = prose(text)
                .lines()
                .filter(|l| l.starts_with('#'))
                .map(|l| slug(l.trim_start_matches('#')))
                .collect();
            if let Some(anchor) = anchor
                && !own.contains(anchor)
            {
                broken.push(format!(
                    "{shown}: link {target:?}: no heading with that anchor"
                ));
            }
            continue;
        }
        let Some(resolved) = normalize(&rel_dir.join(path)) else {
            broken.push(format!(
                "{shown}: link {target:?} points outside the repository (a clone must stand \
                 alone; the behaviour contract is docs/behaviour.md)"
            ));
            continue;
        };
        let full = root.join(&resolved);
        if !full.exists() {
            broken.push(format!(
                "{shown}: link {target:?} points at {}, which does not exist",
                resolved.display()
            ));
            continue;
        }
        if let Some(anchor) = anchor
            && full.extension().is_some_and(|x| x == "md")
            && !anchors(&full).contains(anchor)
        {
            broken.push(format!(
                "{shown}: link {target:?}: {} has no heading with the anchor #{anchor}",
                resolved.display()
            ));
        }
    }
    broken
}

#[test]
fn readme_is_at_most_400_lines() {
    let lines = read(&repo_root().join("README.md")).lines().count();
    assert!(
        lines <= README_MAX_LINES,
        "README.md has {lines} lines, more than {README_MAX_LINES}: move the detail into a page \
         under docs/ and link it"
    );
}

#[test]
fn readme_links_every_docs_page() {
    let readme = read(&repo_root().join("README.md"));
    let linked: BTreeSet<String> = link_targets(&readme)
        .into_iter()
        .map(|t| t.split('#').next().unwrap_or_default().to_owned())
        .collect();
    let missing: Vec<String> = docs_pages()
        .iter()
        .map(|p| format!("docs/{}", p.file_name().unwrap().to_string_lossy()))
        .filter(|p| !linked.contains(p))
        .collect();
    assert!(
        missing.is_empty(),
        "README.md does not link these pages: {missing:?}"
    );
}

#[test]
fn relative_links_of_readme_changelog_and_docs_resolve() {
    let broken: Vec<String> = markdown_files()
        .iter()
        .flat_map(|f| broken_links(f))
        .collect();
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}

/// The checker itself fails on what it must find (a check that would
/// catch nothing proves nothing).
#[test]
fn the_link_checker_finds_broken_and_escaping_links() {
    let text = "# Scratch\n\n[gone](nowhere.md) [out](../../shared/SPEC.md) \
                [anchor](behaviour.md#no-such-heading) [ok](behaviour.md#decisions) \
                [self](#scratch) [own](#elsewhere) `[code](nowhere.md)`\n\n\
                ```\n[fenced](nowhere.md)\n```\n";
    let broken = broken_links_in(Path::new("docs/scratch.md"), text);
    assert_eq!(broken.len(), 4, "{broken:#?}");
    assert!(broken[0].contains("does not exist"), "{}", broken[0]);
    assert!(
        broken[1].contains("outside the repository"),
        "{}",
        broken[1]
    );
    assert!(broken[2].contains("no heading"), "{}", broken[2]);
    assert!(broken[3].contains("no heading"), "{}", broken[3]);
}

#[test]
fn the_behaviour_contract_keeps_every_rule_number() {
    let text = read(&repo_root().join("docs/behaviour.md"));
    let mut rules: Vec<String> = (1..=35).map(|n| format!("R{n}")).collect();
    rules.insert(31, "R31b".to_owned());
    for rule in rules {
        assert!(
            text.contains(&format!("- **{rule} ")),
            "docs/behaviour.md has no rule {rule}"
        );
    }
}

/// Words that say a rule is not held: no test is named after it, or it is
/// not implemented yet (lower case).
const NOT_HELD: [&str; 13] = [
    "no test",
    "not tested",
    "untested",
    "without tests",
    "without a test",
    "not implemented",
    "unimplemented",
    "ahead of its implementation",
    "ahead of their implementation",
    "not hold it",
    "not hold them",
    "not yet hold",
    "not held",
];

/// The rules whose numbers test functions carry: `fn r32_...` holds R32,
/// `fn r31b_...` R31b, `fn r10_r27_...` both R10 and R27. Read from every
/// `.rs` file under `tests/` and the crates' `src/` folders (unit tests live
/// beside the code).
fn rules_with_tests() -> BTreeSet<String> {
    fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
        let Ok(entries) = std::fs::read_dir(dir) else {
            return;
        };
        for entry in entries {
            let path = entry.expect("a directory entry").path();
            if path.is_dir() {
                rust_files(&path, out);
            } else if path.extension().is_some_and(|x| x == "rs") {
                out.push(path);
            }
        }
    }
    let root = repo_root();
    let mut files = Vec::new();
    for dir in [
        "tests",
        "server/src",
        "gateway/src",
        "client/src",
        "cli/src",
        "bench/src",
        "conformance/src",
    ] {
        rust_files(&root.join(dir), &mut files);
    }
    let mut rules = BTreeSet::new();
    for file in files {
        rules.extend(rules_in_test_names(&read(&file)));
    }
    rules
}

/// The rules named by the functions `fn rNN_...` / `fn rNNb_...` of `code`
/// (not in comments).
fn rules_in_test_names(code: &str) -> BTreeSet<String> {
    let mut rules = BTreeSet::new();
    for line in code.lines() {
        if line.trim_start().starts_with("//") {
            continue;
        }
        for (at, _) in line.match_indices("fn r") {
            if line[..at].ends_with(|c: char| c.is_alphanumeric() || c == '_') {
                continue;
            }
            let mut rest = &line[at + "fn ".len()..];
            // `r10_r27_...`: every leading `rNN_` of the name.
            while let Some(tail) = rest.strip_prefix('r') {
                let digits = tail.chars().take_while(char::is_ascii_digit).count();
                if digits == 0 {
                    break;
                }
                let mut len = digits;
                if tail[len..].starts_with('b') {
                    len += 1;
                }
                let Some(after) = tail[len..].strip_prefix('_') else {
                    break;
                };
                rules.insert(format!("R{}", &tail[..len]));
                rest = after;
            }
        }
    }
    rules
}

/// The rule numbers a clause names, with ranges (`R32 to R35`, `R32..R35`,
/// `R32-R35`, `R32 through R35`) spelled out.
fn rules_named(clause: &str) -> Vec<String> {
    let bytes = clause.as_bytes();
    // (start, end, number, suffix) of each `R<digits>[b]` standing alone.
    let mut found: Vec<(usize, usize, u32, bool)> = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        let alone = i == 0 || !(bytes[i - 1].is_ascii_alphanumeric() || bytes[i - 1] == b'_');
        if bytes[i] == b'R' && alone {
            let digits = bytes[i + 1..]
                .iter()
                .take_while(|b| b.is_ascii_digit())
                .count();
            if digits > 0 {
                let mut end = i + 1 + digits;
                let suffix = bytes.get(end) == Some(&b'b');
                if suffix {
                    end += 1;
                }
                if !bytes
                    .get(end)
                    .is_some_and(|b| b.is_ascii_alphanumeric() || *b == b'_')
                {
                    let number = clause[i + 1..i + 1 + digits].parse().unwrap_or(0);
                    found.push((i, end, number, suffix));
                    i = end;
                    continue;
                }
            }
        }
        i += 1;
    }
    let name = |n: u32, b: bool| format!("R{n}{}", if b { "b" } else { "" });
    let mut rules = Vec::new();
    let mut k = 0;
    while k < found.len() {
        let (_, end, from, from_b) = found[k];
        if let Some(&(start, _, to, to_b)) = found.get(k + 1) {
            let between = clause[end..start].trim();
            if ["to", "..", "-", "–", "through"].contains(&between) && to > from {
                rules.push(name(from, from_b));
                rules.extend((from + 1..=to).map(|n| name(n, false)));
                if to_b {
                    rules.push(name(to, true));
                }
                k += 2;
                continue;
            }
        }
        rules.push(name(from, from_b));
        k += 1;
    }
    rules
}

/// Where `text` (a Markdown page, `shown` in messages) says that a rule in
/// `tested` has no tests or is not implemented. A claim is a clause (a
/// sentence cut at `;`, `:` and parentheses) holding one of [`NOT_HELD`];
/// its rules are those it names or, when it names none ("this release does
/// not hold them"), those of the sentence's clause before it.
fn stale_claims(shown: &str, text: &str, tested: &BTreeSet<String>) -> Vec<String> {
    let mut stale = Vec::new();
    for paragraph in prose(text).split("\n\n") {
        let paragraph = paragraph.split_whitespace().collect::<Vec<_>>().join(" ");
        for sentence in paragraph.split(". ") {
            let mut before: Vec<String> = Vec::new();
            for clause in sentence.split([';', ':', '(', ')']) {
                let mut rules = rules_named(clause);
                let lower = clause.to_lowercase();
                if NOT_HELD.iter().any(|w| lower.contains(w)) {
                    if rules.is_empty() {
                        rules = before.clone();
                    }
                    let held: Vec<&String> = rules.iter().filter(|r| tested.contains(*r)).collect();
                    if !held.is_empty() {
                        stale.push(format!(
                            "{shown}: {:?} says {held:?} are not held, yet tests are named \
                             after them",
                            clause.trim()
                        ));
                    }
                }
                if !rules.is_empty() {
                    before = rules;
                }
            }
        }
    }
    stale
}

/// The contract and the other pages say a rule is untested or not
/// implemented only while no test function carries its number (tests are
/// named after the rule they hold).
#[test]
fn no_page_calls_a_tested_rule_untested_or_unimplemented() {
    let tested = rules_with_tests();
    assert!(
        tested.contains("R1") && tested.contains("R31b"),
        "the scan of test names found too little: {tested:?}"
    );
    let root = repo_root();
    let stale: Vec<String> = markdown_files()
        .iter()
        .filter(|f| !f.ends_with("CHANGELOG.md"))
        .flat_map(|f| {
            let shown = f.strip_prefix(&root).unwrap_or(f).display().to_string();
            stale_claims(&shown, &read(f), &tested)
        })
        .collect();
    assert!(
        stale.is_empty(),
        "pages say rules are not held that tests hold:\n{}",
        stale.join("\n")
    );
}

/// The claim checker finds what it must find, and only that.
#[test]
fn the_claim_checker_finds_untested_claims_of_tested_rules() {
    // `FN`, not the keyword: this file's own text is scanned for test names.
    let names = rules_in_test_names(
        &"FN r32_a() {}\nasync FN r10_r27_b() {}\nFN r31b_c() {}\nFN rr1_d() {}\nFN r7x() {}\n\
          // FN r33_in_a_comment() {}\n"
            .replace("FN", "fn"),
    );
    let want: BTreeSet<String> = ["R10", "R27", "R31b", "R32"]
        .into_iter()
        .map(str::to_owned)
        .collect();
    assert_eq!(names, want);
    assert_eq!(
        rules_named("R1..R3, R31b and R32 to R34; R40-R41 (R9 through R10)"),
        [
            "R1", "R2", "R3", "R31b", "R32", "R33", "R34", "R40", "R41", "R9", "R10"
        ]
    );

    let tested: BTreeSet<String> = ["R1", "R32", "R33"]
        .into_iter()
        .map(str::to_owned)
        .collect();
    let text = "R32 to R35 are specified ahead of their implementation: this release does \
                not hold them yet.\n\nRules R1..R35 (R33 has no tests); tests are named \
                after the rule they hold.\n\nR35 is not implemented: no test is named after \
                it. A case that does not hold fails (R1).\n\n```\nR1 is untested\n```\n";
    let stale = stale_claims("scratch.md", text, &tested);
    assert_eq!(stale.len(), 3, "{stale:#?}");
    assert!(stale[0].contains("R32"), "{}", stale[0]);
    assert!(stale[1].contains("R32"), "{}", stale[1]);
    assert!(stale[2].contains("R33"), "{}", stale[2]);
}

/// The minimal guards of `docs/guards.md` are the example files the tests
/// run (`readme_minimal_python_and_node_guards_work_as_documented`, and the
/// Rust example the suite builds).
#[test]
fn the_guard_examples_in_the_docs_are_the_example_files() {
    let root = repo_root();
    let page = read(&root.join("docs/guards.md"));
    let mut blocks = Vec::new();
    let mut current: Option<String> = None;
    for line in page.lines() {
        match (&mut current, line.trim_start().starts_with("```")) {
            (None, true) => current = Some(String::new()),
            (Some(block), true) => {
                blocks.push(std::mem::take(block));
                current = None;
            }
            (Some(block), false) => {
                block.push_str(line);
                block.push('\n');
            }
            (None, false) => {}
        }
    }
    for (file, whole) in [
        ("client/examples/no_delete_guard.rs", false),
        ("guards/python/examples/no_delete.py", true),
        ("guards/node/examples/no_delete.js", true),
    ] {
        let text = read(&root.join(file));
        let found = blocks.iter().any(|b| {
            if whole {
                *b == text
            } else {
                b.lines().count() > 10 && text.contains(b.as_str())
            }
        });
        assert!(
            found,
            "docs/guards.md does not quote {file} as it is (the page says it is run as written)"
        );
    }
}

fn toml_file(path: &str) -> toml::Table {
    read(&repo_root().join(path))
        .parse()
        .unwrap_or_else(|e| panic!("{path} is not TOML: {e}"))
}

fn workspace_version() -> String {
    toml_file("Cargo.toml")["workspace"]["package"]["version"]
        .as_str()
        .expect("[workspace.package] version")
        .to_owned()
}

#[test]
fn versions_come_from_the_workspace() {
    let version = workspace_version();
    let root = repo_root();
    let mut wrong = Vec::new();

    let python = toml_file("guards/python/pyproject.toml");
    let py_version = python["project"]["version"].as_str().unwrap_or_default();
    if py_version != version {
        wrong.push(format!("guards/python/pyproject.toml: {py_version}"));
    }
    let init = read(&root.join("guards/python/src/guardmesh/__init__.py"));
    if !init.contains(&format!("__version__ = \"{version}\"")) {
        wrong.push("guards/python/src/guardmesh/__init__.py: __version__".to_owned());
    }
    let node: serde_json::Value =
        serde_json::from_str(&read(&root.join("guards/node/package.json"))).unwrap();
    if node["version"] != version.as_str() {
        wrong.push(format!("guards/node/package.json: {}", node["version"]));
    }
    let lock: serde_json::Value =
        serde_json::from_str(&read(&root.join("guards/node/package-lock.json"))).unwrap();
    for v in [&lock["version"], &lock["packages"][""]["version"]] {
        if *v != version.as_str() {
            wrong.push(format!("guards/node/package-lock.json: {v}"));
        }
    }
    // The package files the docs name (`guardmesh-X.Y.Z-py3-none-any.whl`,
    // `guardmesh-guard-X.Y.Z.tgz`) are those of this version.
    // (Not the changelog: it names the files of earlier releases too.)
    let mut docs: Vec<PathBuf> = markdown_files()
        .into_iter()
        .filter(|f| !f.ends_with("CHANGELOG.md"))
        .collect();
    docs.extend(
        [
            "guards/README.md",
            "guards/python/README.md",
            "guards/node/README.md",
        ]
        .iter()
        .map(|p| root.join(p)),
    );
    for file in docs {
        let text = read(&file);
        for (at, _) in text.match_indices("guardmesh-") {
            let rest = &text[at + "guardmesh-".len()..];
            let rest = rest.strip_prefix("guard-").unwrap_or(rest);
            if !rest.starts_with(|c: char| c.is_ascii_digit()) {
                continue;
            }
            let named: String = rest
                .chars()
                .take_while(|c| c.is_ascii_digit() || *c == '.')
                .collect();
            let named = named.trim_end_matches('.');
            if named != version {
                wrong.push(format!(
                    "{}: names a package file of version {named}",
                    file.strip_prefix(&root).unwrap_or(&file).display()
                ));
            }
        }
    }
    // Path dependencies between the crates carry a version for publishing:
    // the workspace's.
    for manifest in [
        "Cargo.toml",
        "server/Cargo.toml",
        "client/Cargo.toml",
        "cli/Cargo.toml",
        "gateway/Cargo.toml",
    ] {
        let text = read(&root.join(manifest));
        for line in text.lines() {
            if line.contains("path = ") && line.contains("version = ") {
                let want = format!("version = \"{version}\"");
                if !line.contains(&want) {
                    wrong.push(format!("{manifest}: {}", line.trim()));
                }
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "the workspace's version is {version} (Cargo.toml [workspace.package]); these differ:\n{}",
        wrong.join("\n")
    );
}

/// The version requirement of a dependency entry, following
/// `workspace = true` to the workspace's entry.
fn requirement(entry: &toml::Value, workspace: &toml::Table, name: &str) -> Option<String> {
    match entry {
        toml::Value::String(v) => Some(v.clone()),
        toml::Value::Table(t) if t.get("workspace").and_then(|w| w.as_bool()) == Some(true) => {
            requirement(workspace.get(name)?, workspace, name)
        }
        toml::Value::Table(t) => t.get("version").and_then(|v| v.as_str()).map(str::to_owned),
        _ => None,
    }
}

#[test]
fn the_client_sdk_pins_no_exact_versions() {
    let root = toml_file("Cargo.toml");
    let workspace = root["workspace"]["dependencies"]
        .as_table()
        .expect("[workspace.dependencies]")
        .clone();
    let mut pinned = Vec::new();
    for (manifest, table) in [
        ("Cargo.toml", root.clone()),
        ("client/Cargo.toml", toml_file("client/Cargo.toml")),
    ] {
        for section in ["dependencies", "build-dependencies"] {
            let Some(deps) = table.get(section).and_then(|d| d.as_table()) else {
                continue;
            };
            for (name, entry) in deps {
                if let Some(req) = requirement(entry, &workspace, name)
                    && req.trim_start().starts_with('=')
                {
                    pinned.push(format!("{manifest} [{section}] {name} = {req:?}"));
                }
            }
        }
    }
    assert!(
        pinned.is_empty(),
        "exact pins would be forced on every user of guardmesh-client (use a ^ range; \
         Cargo.lock pins what the tests run with):\n{}",
        pinned.join("\n")
    );
}

/// `scripts/check-proto-compat --self-test`: each kind of break applied to
/// a copy of the released proto is caught, and proto/ breaks nothing of
/// proto/released/.
#[test]
fn the_proto_breaks_nothing_of_the_last_release() {
    let root = repo_root();
    let python = root.join("build/venv/bin/python");
    assert!(
        python.exists(),
        "{} is missing: run scripts/setup-polyglot",
        python.display()
    );
    let out = std::process::Command::new(&python)
        .arg(root.join("scripts/check-proto-compat"))
        .arg("--self-test")
        .current_dir(&root)
        .output()
        .expect("scripts/check-proto-compat runs");
    assert!(
        out.status.success(),
        "scripts/check-proto-compat failed ({}):\n{}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The Python wheel carries the licence: setuptools packs the `LICENSE`
/// beside `pyproject.toml` (it cannot reach the repository's), so that copy
/// must be the repository's. (The npm tarball copies it when packed.)
#[test]
fn the_python_package_carries_the_licence() {
    let root = repo_root();
    assert_eq!(
        read(&root.join("guards/python/LICENSE")),
        read(&root.join("LICENSE")),
        "guards/python/LICENSE differs from LICENSE: copy it over"
    );
}
