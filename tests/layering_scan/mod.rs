//! A reader of Rust source text for `tests/layering.rs`: comments and literals blanked out, the
//! paths a file imports, and the length of its functions.

/// `text` with comments and the insides of string and character literals replaced by spaces (line
/// breaks kept, so line numbers stay right).
pub fn strip(text: &str) -> String {
    let c: Vec<char> = text.chars().collect();
    let mut out = String::with_capacity(text.len());
    let blank = |ch: char| if ch == '\n' { '\n' } else { ' ' };
    let mut i = 0;
    while i < c.len() {
        let at = |k: usize| c.get(i + k).copied().unwrap_or('\0');
        if at(0) == '/' && at(1) == '/' {
            while i < c.len() && c[i] != '\n' {
                out.push(' ');
                i += 1;
            }
        } else if at(0) == '/' && at(1) == '*' {
            let mut depth = 0;
            while i < c.len() {
                if c[i] == '/' && c.get(i + 1) == Some(&'*') {
                    depth += 1;
                    out.push_str("  ");
                    i += 2;
                } else if c[i] == '*' && c.get(i + 1) == Some(&'/') {
                    depth -= 1;
                    out.push_str("  ");
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    out.push(blank(c[i]));
                    i += 1;
                }
            }
        } else if at(0) == 'r' && (at(1) == '#' || at(1) == '"') && !ident_char(prev(&c, i)) {
            // Raw string: r"..", r#".."#, ...
            let hashes = (1..).take_while(|&k| at(k) == '#').count();
            if at(1 + hashes) != '"' {
                out.push(c[i]);
                i += 1;
                continue;
            }
            out.push('"');
            i += 2 + hashes;
            while i < c.len() {
                if c[i] == '"' && (1..=hashes).all(|k| c.get(i + k) == Some(&'#')) {
                    i += 1 + hashes;
                    break;
                }
                out.push(blank(c[i]));
                i += 1;
            }
            out.push('"');
        } else if at(0) == '"' {
            out.push('"');
            i += 1;
            while i < c.len() && c[i] != '"' {
                let n = if c[i] == '\\' { 2 } else { 1 };
                for k in 0..n {
                    if let Some(&ch) = c.get(i + k) {
                        out.push(blank(ch));
                    }
                }
                i += n;
            }
            out.push('"');
            i += 1;
        } else if at(0) == '\'' && (at(2) == '\'' || (at(1) == '\\' && at(1) != '\0')) {
            // A character literal ('x', '\n', '\u{..}'); otherwise a lifetime, kept.
            let end = (i + 1..c.len()).find(|&j| c[j] == '\'' && c[j - 1] != '\\' || j > i + 12);
            let end = end.unwrap_or(i + 2);
            out.push_str("' '");
            for _ in i + 3..=end {
                out.push(' ');
            }
            i = end + 1;
        } else {
            out.push(c[i]);
            i += 1;
        }
    }
    out
}

fn prev(c: &[char], i: usize) -> char {
    if i == 0 {
        ' '
    } else {
        c[i - 1]
    }
}

fn ident_char(ch: char) -> bool {
    ch.is_alphanumeric() || ch == '_'
}

/// The paths of a stripped file's `use` trees (each tree expanded) and of its `crate::`,
/// `super::` and `self::` paths elsewhere.
pub fn import_paths(text: &str) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    let mut rest_text = String::with_capacity(text.len());
    let mut s = text;
    // `use` trees first, cut out of the text.
    while let Some(pos) = find_word(s, "use") {
        rest_text.push_str(&s[..pos]);
        let after = &s[pos + 3..];
        let Some(end) = after.find(';') else {
            break;
        };
        expand(&drop_renames(&after[..end]), &mut Vec::new(), &mut out);
        s = &after[end + 1..];
    }
    rest_text.push_str(s);
    // Paths elsewhere.
    let t = rest_text.as_bytes();
    let mut i = 0;
    while i < t.len() {
        let starts = ["crate::", "super::", "self::"]
            .into_iter()
            .find(|p| rest_text[i..].starts_with(p));
        if starts.is_some() && (i == 0 || !ident_char(t[i - 1] as char) && t[i - 1] != b'$') {
            let end = rest_text[i..]
                .find(|c: char| !(ident_char(c) || c == ':'))
                .map_or(t.len(), |e| i + e);
            let path: Vec<String> = rest_text[i..end]
                .split("::")
                .filter(|p| !p.is_empty())
                .map(String::from)
                .collect();
            out.push(path);
            i = end;
        } else {
            i += 1;
        }
    }
    out
}

/// A `use` tree without whitespace and without its renames (`a::B as C` -> `a::B`).
fn drop_renames(tree: &str) -> String {
    let words: Vec<&str> = tree.split_whitespace().collect();
    let mut out = String::new();
    let mut k = 0;
    while k < words.len() {
        if words[k] == "as" && k + 1 < words.len() {
            // Keep what follows the new name (`C},` keeps `},`).
            let rest = words[k + 1].trim_start_matches(|c: char| ident_char(c));
            out.push_str(rest);
            k += 2;
        } else {
            out.push_str(words[k]);
            k += 1;
        }
    }
    out
}

/// Byte offset of `word` standing alone (not part of a longer name).
fn find_word(s: &str, word: &str) -> Option<usize> {
    let b = s.as_bytes();
    let mut from = 0;
    while let Some(p) = s[from..].find(word) {
        let at = from + p;
        let before = at == 0 || !ident_char(b[at - 1] as char);
        let after = b
            .get(at + word.len())
            .is_none_or(|&c| !ident_char(c as char));
        if before && after {
            return Some(at);
        }
        from = at + word.len();
    }
    None
}

/// Expands a whitespace-free `use` tree (`a::{b, c::{self, D}}`) into paths after `prefix`.
fn expand(tree: &str, prefix: &mut Vec<String>, out: &mut Vec<Vec<String>>) {
    if let Some(open) = tree.find('{') {
        let head: Vec<String> = tree[..open]
            .split("::")
            .filter(|p| !p.is_empty())
            .map(String::from)
            .collect();
        let inner = &tree[open + 1..tree.rfind('}').unwrap_or(tree.len())];
        let n = prefix.len();
        prefix.extend(head);
        let mut depth = 0;
        let mut start = 0;
        for (k, ch) in inner.char_indices() {
            match ch {
                '{' => depth += 1,
                '}' => depth -= 1,
                ',' if depth == 0 => {
                    expand(&inner[start..k], prefix, out);
                    start = k + 1;
                }
                _ => {}
            }
        }
        expand(&inner[start..], prefix, out);
        prefix.truncate(n);
        return;
    }
    let mut path = prefix.clone();
    for seg in tree.split("::").filter(|p| !p.is_empty()) {
        if seg == "self" && !path.is_empty() {
            continue;
        }
        if seg != "*" {
            path.push(seg.to_string());
        }
    }
    if !path.is_empty() {
        out.push(path);
    }
}

/// `(name, first line, lines)` of each function with a body, outside `#[cube]` kernels (a
/// function nested in another counts in the outer one's lines too).
pub fn function_lengths(text: &str) -> Vec<(String, usize, usize)> {
    let s = strip(text);
    let b = s.as_bytes();
    let line_of = |at: usize| s[..at].matches('\n').count() + 1;
    let mut out = Vec::new();
    let mut from = 0;
    while let Some(p) = find_word(&s[from..], "fn") {
        let at = from + p;
        from = at + 2;
        let name: String = s[at + 2..]
            .trim_start()
            .chars()
            .take_while(|&c| ident_char(c))
            .collect();
        if name.is_empty() {
            continue; // `fn(..)` pointer types
        }
        // The body starts at the first `{` before any `;` (a declaration without a body).
        let Some(open) = s[at..].find(['{', ';']).map(|o| at + o) else {
            continue;
        };
        if b[open] == b';' {
            continue;
        }
        let mut depth = 0;
        let mut close = open;
        for (k, &ch) in b[open..].iter().enumerate() {
            match ch {
                b'{' => depth += 1,
                b'}' => {
                    depth -= 1;
                    if depth == 0 {
                        close = open + k;
                        break;
                    }
                }
                _ => {}
            }
        }
        // Attributes on the lines above the signature.
        let head_start = s[..at].rfind(['}', ';']).map_or(0, |e| e + 1);
        if s[head_start..at].contains("#[cube") {
            continue;
        }
        out.push((name, line_of(at), line_of(close) - line_of(at) + 1));
    }
    out
}
