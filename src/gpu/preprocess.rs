//! A tiny WGSL preprocessor: `#include "file"`, `#if NAME`, `#ifdef NAME`, `#ifndef NAME`,
//! `#elif NAME` (a chain of alternatives without nesting), `#else`, `#endif`. Value constants are not text-substituted: a variant's sizes are emitted
//! as WGSL `const` declarations at the top of the expanded source (see `shader.rs`).

use std::collections::BTreeSet;

/// Errors in shader sources. Only reachable by editing the embedded shaders, so tests catch
/// them; still typed so that a bad shader never panics at runtime.
#[derive(Debug, thiserror::Error, PartialEq)]
#[non_exhaustive]
pub enum PreprocessError {
    #[error("{file}:{line}: include of unknown file `{target}`")]
    UnknownInclude { file: String, line: usize, target: String },
    #[error("{file}:{line}: `{directive}` without matching `#if`")]
    Unbalanced { file: String, line: usize, directive: String },
    #[error("{file}: unterminated `#if` block")]
    Unterminated { file: String },
    #[error("{file}:{line}: unknown directive `{directive}`")]
    UnknownDirective { file: String, line: usize, directive: String },
    #[error("{file}: include depth exceeded (cycle?)")]
    IncludeCycle { file: String },
}

/// Expand `source` (named `file`) with the given set of defined flags. `lookup` returns the
/// text of an includable file by path.
pub fn preprocess(
    file: &str,
    source: &str,
    defined: &BTreeSet<String>,
    lookup: &dyn Fn(&str) -> Option<&'static str>,
) -> Result<String, PreprocessError> {
    let mut out = String::with_capacity(source.len() * 2);
    let mut included = BTreeSet::new();
    expand(file, source, defined, lookup, &mut out, &mut included, 0)?;
    Ok(out)
}

fn expand(
    file: &str,
    source: &str,
    defined: &BTreeSet<String>,
    lookup: &dyn Fn(&str) -> Option<&'static str>,
    out: &mut String,
    included: &mut BTreeSet<String>,
    depth: usize,
) -> Result<(), PreprocessError> {
    if depth > 8 {
        return Err(PreprocessError::IncludeCycle { file: file.into() });
    }
    // Stack of (this branch active, any branch of the chain taken).
    let mut stack: Vec<(bool, bool)> = Vec::new();
    let active = |stack: &Vec<(bool, bool)>| stack.iter().all(|s| s.0);
    for (i, line) in source.lines().enumerate() {
        let lineno = i + 1;
        let trimmed = line.trim_start();
        if let Some(rest) = trimmed.strip_prefix('#') {
            let mut parts = rest.split_whitespace();
            let directive = parts.next().unwrap_or("");
            let arg = parts.next().unwrap_or("");
            match directive {
                "if" | "ifdef" => {
                    let cond = defined.contains(arg);
                    stack.push((cond, cond));
                }
                "ifndef" => {
                    let cond = !defined.contains(arg);
                    stack.push((cond, cond));
                }
                "elif" => match stack.last_mut() {
                    Some(top) => {
                        top.0 = !top.1 && defined.contains(arg);
                        top.1 |= top.0;
                    }
                    None => return Err(PreprocessError::Unbalanced { file: file.into(), line: lineno, directive: "#elif".into() }),
                },
                "else" => match stack.last_mut() {
                    Some(top) => {
                        top.0 = !top.1;
                        top.1 = true;
                    }
                    None => return Err(PreprocessError::Unbalanced { file: file.into(), line: lineno, directive: "#else".into() }),
                },
                "endif" => {
                    if stack.pop().is_none() {
                        return Err(PreprocessError::Unbalanced { file: file.into(), line: lineno, directive: "#endif".into() });
                    }
                }
                "include" => {
                    if !active(&stack) {
                        continue;
                    }
                    let target = arg.trim_matches('"');
                    let text = lookup(target).ok_or_else(|| PreprocessError::UnknownInclude {
                        file: file.into(),
                        line: lineno,
                        target: target.into(),
                    })?;
                    // Each snippet is included once per expanded shader.
                    if included.insert(target.to_string()) {
                        out.push_str(&format!("// ---- begin {target}\n"));
                        expand(target, text, defined, lookup, out, included, depth + 1)?;
                        out.push_str(&format!("// ---- end {target}\n"));
                    }
                }
                other => return Err(PreprocessError::UnknownDirective { file: file.into(), line: lineno, directive: format!("#{other}") }),
            }
            continue;
        }
        if active(&stack) {
            out.push_str(line);
            out.push('\n');
        }
    }
    if !stack.is_empty() {
        return Err(PreprocessError::Unterminated { file: file.into() });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lookup(p: &str) -> Option<&'static str> {
        match p {
            "common/a.wgsl" => Some("fn a() {}\n"),
            _ => None,
        }
    }

    #[test]
    fn conditionals_and_includes() {
        let src = "#include \"common/a.wgsl\"\n#if X\nx\n#else\nnot_x\n#endif\n#ifndef Y\nno_y\n#endif\n#include \"common/a.wgsl\"\n";
        let mut d = BTreeSet::new();
        d.insert("X".to_string());
        let out = preprocess("t.wgsl", src, &d, &lookup).unwrap();
        assert!(out.contains("fn a() {}"));
        assert_eq!(out.matches("fn a()").count(), 1, "included once");
        assert!(out.contains("\nx\n"));
        assert!(!out.contains("not_x"));
        assert!(out.contains("no_y"));
    }

    #[test]
    fn elif_chains_take_the_first_defined_branch() {
        let src = "#if A\na\n#elif B\nb\n#elif C\nc\n#else\nnone\n#endif\n";
        let run = |names: &[&str]| {
            let d: BTreeSet<String> = names.iter().map(|s| s.to_string()).collect();
            preprocess("t.wgsl", src, &d, &lookup).unwrap().trim().to_string()
        };
        assert_eq!(run(&["A", "B", "C"]), "a");
        assert_eq!(run(&["B", "C"]), "b");
        assert_eq!(run(&["C"]), "c");
        assert_eq!(run(&[]), "none");
        // Inside an inactive block nothing of the chain is emitted.
        let nested = "#if X\n#if A\na\n#elif B\nb\n#endif\n#endif\n";
        let d: BTreeSet<String> = ["B".to_string()].into();
        assert_eq!(preprocess("t.wgsl", nested, &d, &lookup).unwrap().trim(), "");
    }

    #[test]
    fn errors_are_typed() {
        let d = BTreeSet::new();
        assert!(matches!(preprocess("t", "#endif\n", &d, &lookup), Err(PreprocessError::Unbalanced { .. })));
        assert!(matches!(preprocess("t", "#elif X\n", &d, &lookup), Err(PreprocessError::Unbalanced { .. })));
        assert!(matches!(preprocess("t", "#if X\n", &d, &lookup), Err(PreprocessError::Unterminated { .. })));
        assert!(matches!(preprocess("t", "#include \"nope\"\n", &d, &lookup), Err(PreprocessError::UnknownInclude { .. })));
        assert!(matches!(preprocess("t", "#pragma x\n", &d, &lookup), Err(PreprocessError::UnknownDirective { .. })));
    }
}
