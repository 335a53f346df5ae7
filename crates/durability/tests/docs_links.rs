//! Every link of the README and the guide (`docs/*.md`) resolves, and every
//! guide file the crates' own docs mention exists.
//!
//! A relative link must name a file or directory of the repository; a
//! `#anchor` must match a heading of its target by GitHub's slug rules (what
//! a forge renders). Links to other sites are not followed: the suite runs
//! offline.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Component, Path, PathBuf};

/// The repository root, two levels above this crate.
fn repository() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// README.md and every docs/*.md, keyed by their path from the root.
fn guide_files() -> BTreeMap<PathBuf, String> {
    let root = repository();
    let mut files = BTreeMap::new();
    let read = |relative: &Path| {
        std::fs::read_to_string(root.join(relative))
            .unwrap_or_else(|e| panic!("cannot read {}: {e}", relative.display()))
    };
    files.insert(PathBuf::from("README.md"), read(Path::new("README.md")));
    let docs = std::fs::read_dir(root.join("docs")).unwrap_or_else(|e| panic!("docs/: {e}"));
    for entry in docs {
        let name = entry.unwrap_or_else(|e| panic!("docs/: {e}")).file_name();
        let relative = Path::new("docs").join(&name);
        if relative.extension().is_some_and(|x| x == "md") {
            let text = read(&relative);
            files.insert(relative, text);
        }
    }
    files
}

/// A link found in a Markdown file: its target as written and its line.
#[derive(Debug)]
struct Link {
    line: usize,
    target: String,
}

/// The inline links `[text](target)` and reference definitions
/// `[label]: target` of a Markdown text, outside fenced code blocks and
/// inline code spans.
fn links(markdown: &str) -> Vec<Link> {
    let mut found = Vec::new();
    let mut in_fence = false;
    for (n, line) in markdown.lines().enumerate() {
        if line.trim_start().starts_with("```") {
            in_fence = !in_fence;
            continue;
        }
        if in_fence {
            continue;
        }
        let prose = without_code_spans(line);
        let trimmed = prose.trim_start();
        if trimmed.starts_with('[')
            && let Some(end) = trimmed.find("]: ")
        {
            let target = trimmed[end + 3..].split_whitespace().next().unwrap_or("");
            found.push(Link {
                line: n + 1,
                target: target.to_owned(),
            });
            continue;
        }
        let mut rest = prose.as_str();
        while let Some(at) = rest.find("](") {
            let after = &rest[at + 2..];
            let Some(end) = after.find(')') else { break };
            // `[text](<target> "title")`: the target is the first word.
            let target = after[..end].split_whitespace().next().unwrap_or("");
            found.push(Link {
                line: n + 1,
                target: target.trim_matches(['<', '>']).to_owned(),
            });
            rest = &after[end..];
        }
    }
    found
}

/// The line with every `code span` blanked, so that `[a](b)` inside one is
/// not taken for a link.
fn without_code_spans(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut in_code = false;
    for c in line.chars() {
        if c == '`' {
            in_code = !in_code;
            out.push(' ');
        } else if in_code {
            out.push(' ');
        } else {
            out.push(c);
        }
    }
    out
}

/// GitHub's anchors for the headings of a Markdown text: the heading's
/// text (inline markup removed) in lower case, spaces turned into `-`,
/// every other character that is not a letter, digit, `-` or `_` dropped;
/// the second heading with the same slug gets `-1`, the third `-2`.
fn heading_slugs(markdown: &str) -> BTreeSet<String> {
    let mut slugs = BTreeSet::new();
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    let mut in_fence = false;
    for line in markdown.lines() {
        if line.trim_start().starts_with("```") {
            in_fence = !in_fence;
            continue;
        }
        let Some(title) = heading_text(line).filter(|_| !in_fence) else {
            continue;
        };
        let base = slug(&title);
        let count = seen.entry(base.clone()).or_insert(0);
        let unique = if *count == 0 {
            base
        } else {
            format!("{base}-{count}")
        };
        *count += 1;
        slugs.insert(unique);
    }
    slugs
}

/// The text of an ATX heading (`# Title`, up to six `#`), if the line is one.
fn heading_text(line: &str) -> Option<String> {
    let hashes = line.chars().take_while(|&c| c == '#').count();
    if hashes == 0 || hashes > 6 {
        return None;
    }
    let rest = &line[hashes..];
    if !rest.is_empty() && !rest.starts_with(' ') {
        return None;
    }
    Some(rest.trim().trim_end_matches('#').trim().to_owned())
}

/// GitHub's slug of one heading's text.
fn slug(title: &str) -> String {
    // A link in a heading contributes its text only: drop `(target)`.
    let mut text = String::new();
    let mut rest = title;
    while let Some(at) = rest.find("](") {
        text.push_str(&rest[..at]);
        match rest[at..].find(')') {
            Some(end) => rest = &rest[at + end + 1..],
            None => rest = "",
        }
    }
    text.push_str(rest);
    text.chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            '-' | '_' => Some(c),
            c if c.is_alphanumeric() => Some(c),
            _ => None,
        })
        .flat_map(char::to_lowercase)
        .collect()
}

/// `a/b/../c` as `a/c`, without touching the file system.
fn normalize(path: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for part in path.components() {
        match part {
            Component::ParentDir => {
                if !out.pop() {
                    out.push("..");
                }
            }
            Component::CurDir => {}
            other => out.push(other),
        }
    }
    out
}

/// Every broken link of `files` (path from the root → Markdown text), as a
/// line a reader can act on. `exists` says whether a path from the root
/// names a file or directory; the Markdown targets' anchors are checked
/// against `files` when they are among them, else read through `read`.
fn broken_links(
    files: &BTreeMap<PathBuf, String>,
    exists: &dyn Fn(&Path) -> bool,
    read: &dyn Fn(&Path) -> Option<String>,
) -> Vec<String> {
    let mut broken = Vec::new();
    for (file, text) in files {
        for link in links(text) {
            let target = link.target.as_str();
            if target.is_empty() {
                broken.push(format!("{}:{}: an empty link", file.display(), link.line));
                continue;
            }
            if target.contains("://") || target.starts_with("mailto:") {
                continue;
            }
            let (path, anchor) = match target.split_once('#') {
                Some((path, anchor)) => (path, Some(anchor)),
                None => (target, None),
            };
            let resolved = if path.is_empty() {
                file.clone()
            } else {
                normalize(&file.parent().unwrap_or(Path::new("")).join(path))
            };
            if !exists(&resolved) {
                broken.push(format!(
                    "{}:{}: {target}: {} does not exist",
                    file.display(),
                    link.line,
                    resolved.display()
                ));
                continue;
            }
            let Some(anchor) = anchor else { continue };
            let heading_source = files.get(&resolved).cloned().or_else(|| read(&resolved));
            let Some(markdown) =
                heading_source.filter(|_| resolved.extension().is_some_and(|x| x == "md"))
            else {
                broken.push(format!(
                    "{}:{}: {target}: an anchor into a file that is not Markdown",
                    file.display(),
                    link.line
                ));
                continue;
            };
            let slugs = heading_slugs(&markdown);
            if !slugs.contains(anchor) {
                broken.push(format!(
                    "{}:{}: {target}: no heading of {} has the anchor #{anchor} (it has: {})",
                    file.display(),
                    link.line,
                    resolved.display(),
                    slugs.into_iter().collect::<Vec<_>>().join(", ")
                ));
            }
        }
    }
    broken
}

/// This test file, as a path under the repository.
const THIS_FILE: &str = "crates/durability/tests/docs_links.rs";

fn on_disk(relative: &Path) -> bool {
    repository().join(relative).exists()
}

fn read_on_disk(relative: &Path) -> Option<String> {
    std::fs::read_to_string(repository().join(relative)).ok()
}

#[test]
fn every_relative_link_of_the_readme_and_the_guide_resolves() {
    let files = guide_files();
    assert!(
        files.len() > 2,
        "the guide's files were not found: {:?}",
        files.keys()
    );
    let broken = broken_links(&files, &on_disk, &read_on_disk);
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}

#[test]
fn every_chapter_of_the_guide_is_listed_in_its_index() {
    // The guide's index names every chapter, so none is orphaned.
    let files = guide_files();
    let index = &files[Path::new("docs/README.md")];
    let listed: BTreeSet<PathBuf> = links(index)
        .into_iter()
        .filter(|l| !l.target.contains("://") && l.target.ends_with(".md"))
        .map(|l| normalize(&Path::new("docs").join(&l.target)))
        .collect();
    for chapter in files.keys() {
        let is_index = chapter == Path::new("docs/README.md") || chapter == Path::new("README.md");
        assert!(
            is_index || listed.contains(chapter),
            "{} is not listed in docs/README.md",
            chapter.display()
        );
    }
}

#[test]
fn every_guide_file_the_crates_docs_mention_exists() {
    // Doc comments and crate docs point readers at `docs/<chapter>.md`
    // (optionally with an anchor): each must still be there after the
    // guide is reorganised.
    let root = repository();
    let mut mentions = Vec::new();
    let mut stack = vec![root.join("crates"), root.join("examples")];
    while let Some(dir) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            if path.is_dir() {
                stack.push(path);
            } else if path.ends_with(THIS_FILE) {
                // Its own fixtures name broken links on purpose.
                continue;
            } else if path.extension().is_some_and(|x| x == "rs")
                && let Ok(text) = std::fs::read_to_string(&path)
            {
                for (n, line) in text.lines().enumerate() {
                    let mut rest = line;
                    while let Some(at) = rest.find("docs/") {
                        let tail = &rest[at..];
                        let end = tail
                            .find(|c: char| !(c.is_alphanumeric() || "/._-#".contains(c)))
                            .unwrap_or(tail.len());
                        let mention = tail[..end].trim_end_matches('.');
                        if mention.contains(".md") {
                            mentions.push((path.clone(), n + 1, mention.to_owned()));
                        }
                        rest = &tail[end.max(1)..];
                    }
                }
            }
        }
    }
    let mut broken = Vec::new();
    for (source, line, mention) in mentions {
        let mut files = BTreeMap::new();
        files.insert(PathBuf::from("mention.md"), format!("[x]({mention})"));
        for problem in broken_links(&files, &on_disk, &read_on_disk) {
            broken.push(format!("{}:{line}: {problem}", source.display()));
        }
    }
    assert!(broken.is_empty(), "{}", broken.join("\n"));
}

#[test]
fn a_link_to_a_missing_file_or_heading_is_reported() {
    // The checker itself: a guide with one good and two broken links.
    let mut files = BTreeMap::new();
    files.insert(
        PathBuf::from("README.md"),
        "# Title\n\nSee [limits](docs/limits.md#one-machine), [gone](docs/gone.md) \
         and [here](#no-such-heading); `[not](a-link.md)` is code.\n\n```\n[no](fence.md)\n```\n"
            .to_owned(),
    );
    files.insert(
        PathBuf::from("docs/limits.md"),
        "# Limits\n\n## One machine\n".to_owned(),
    );
    let exists = |p: &Path| p == Path::new("docs/limits.md") || p == Path::new("README.md");
    let broken = broken_links(&files, &exists, &|_| None);
    assert_eq!(broken.len(), 2, "{broken:#?}");
    assert!(
        broken[0].contains("docs/gone.md does not exist"),
        "{}",
        broken[0]
    );
    assert!(broken[1].contains("#no-such-heading"), "{}", broken[1]);
}

#[test]
fn github_slugs_drop_punctuation_and_number_repeated_headings() {
    let slugs = heading_slugs(
        "# Observe: metrics, traces, inspect\n## `Fanout::enqueue` and DLQ\n## Limits\n## Limits\n\
         ## Beyond one machine: Cloudflare\n### 1. Run the demo\n",
    );
    let expected = [
        "observe-metrics-traces-inspect",
        "fanoutenqueue-and-dlq",
        "limits",
        "limits-1",
        "beyond-one-machine-cloudflare",
        "1-run-the-demo",
    ];
    for slug in expected {
        assert!(slugs.contains(slug), "{slug} not in {slugs:?}");
    }
}

#[test]
fn every_file_of_the_guide_is_compiled_as_doctests() {
    // A Rust excerpt is only checked if its file is included as a doctest
    // module somewhere: here (crates/durability/src/lib.rs) or, for the
    // chapter that needs axum, in crates/axum/src/lib.rs.
    let root = repository();
    let mut included = BTreeSet::new();
    for harness in ["crates/durability/src/lib.rs", "crates/axum/src/lib.rs"] {
        let text = std::fs::read_to_string(root.join(harness))
            .unwrap_or_else(|e| panic!("cannot read {harness}: {e}"));
        for line in text.lines() {
            if let Some(at) = line.find("include_str!(\"../../../") {
                let rest = &line[at + "include_str!(\"../../../".len()..];
                if let Some(end) = rest.find('"') {
                    included.insert(PathBuf::from(&rest[..end]));
                }
            }
        }
    }
    let missing: Vec<String> = guide_files()
        .into_keys()
        .filter(|file| !included.contains(file))
        .map(|file| file.display().to_string())
        .collect();
    assert!(
        missing.is_empty(),
        "not compiled as doctests: {}",
        missing.join(", ")
    );
}
