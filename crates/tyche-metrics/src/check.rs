//! Reading an exposition back, for the daemons' tests: which families it has (name, type,
//! label names) and which a document's metric table lists, so that a test can hold the two
//! together.

/// One family: its name as its `# TYPE` line says it (counters with `_total`), its type, and
/// the label names of its first sample, in order.
pub type Family = (String, String, Vec<String>);

/// The label names of one sample's label set (what follows `name{`), escapes honoured.
fn label_names(set: &str) -> Vec<String> {
    let mut names = Vec::new();
    let mut rest = set;
    while let Some((name, after)) = rest.split_once("=\"") {
        names.push(name.trim_start_matches(',').to_owned());
        // The value ends at the first quote that no backslash escapes.
        let mut escaped = false;
        let end = after.char_indices().find(|&(_, c)| {
            let end = c == '"' && !escaped;
            escaped = c == '\\' && !escaped;
            end
        });
        match end {
            Some((k, _)) => rest = &after[k + 1..],
            None => break,
        }
    }
    names
}

/// Every family of `text` (Prometheus text format), in order.
pub fn families(text: &str) -> Vec<Family> {
    text.lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split_once(' '))
        .map(|(name, kind)| {
            let labels = text
                .lines()
                .find_map(|l| l.strip_prefix(name).and_then(|rest| rest.strip_prefix('{')))
                .map(label_names)
                .unwrap_or_default();
            (name.to_owned(), kind.to_owned(), labels)
        })
        .collect()
}

/// The rows of a Markdown table that documents metrics named `prefix...`:
/// `| `name` | type | `label`, `label` | what |`, in order.
pub fn documented(markdown: &str, prefix: &str) -> Vec<Family> {
    let start = format!("| `{prefix}");
    markdown
        .lines()
        .filter_map(|l| l.trim().strip_prefix("| `").filter(|_| l.trim().starts_with(&start)))
        .map(|row| {
            let cells: Vec<&str> = row.split('|').map(str::trim).collect();
            let labels = cells[2].split(',').map(|c| c.trim().trim_matches('`').to_owned()).filter(|c| !c.is_empty());
            (cells[0].trim_end_matches('`').to_owned(), cells[1].to_owned(), labels.collect())
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn families_and_tables_are_read() {
        let text = "# HELP x_a_total A.\n# TYPE x_a_total counter\nx_a_total{k=\"a\\\",b=\\\\\",l=\"\"} 1\n\
                    # TYPE x_b gauge\nx_b 2\n";
        let f = |n: &str, k: &str, l: &[&str]| (n.to_owned(), k.to_owned(), l.iter().map(|s| s.to_string()).collect());
        assert_eq!(families(text), vec![f("x_a_total", "counter", &["k", "l"]), f("x_b", "gauge", &[])]);
        let doc = "text\n| metric | type | labels | what |\n|---|---|---|---|\n\
                   | `x_a_total` | counter | `k`, `l` | a |\n  | `x_b` | gauge | | b |\n| `y_c` | gauge | | no |\n";
        assert_eq!(documented(doc, "x_"), families(text));
    }
}
