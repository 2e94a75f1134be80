//! Kernel CPU lists (`0-3,8,10-11`, as sysfs and `taskset -c` write them): the one parser and
//! formatter of the workspace.

/// Most CPUs one range of a list may name (a bound on what a malformed list can allocate).
pub const MAX_RANGE: u32 = 65_536;

/// Parses a CPU list. Entries are `N` or `N-M` (M ≥ N), separated by commas, spaces around them
/// ignored; an empty list is empty. The error names the bad entry.
pub fn parse_cpu_list(text: &str) -> Result<Vec<u32>, String> {
    let mut cpus = Vec::new();
    for part in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let bad = || format!("bad cpu list entry {part:?} (expected N or N-M)");
        match part.split_once('-') {
            Some((a, b)) => {
                let a: u32 = a.trim().parse().map_err(|_| bad())?;
                let b: u32 = b.trim().parse().map_err(|_| bad())?;
                if b < a || b - a >= MAX_RANGE {
                    return Err(bad());
                }
                cpus.extend(a..=b);
            }
            None => cpus.push(part.parse().map_err(|_| bad())?),
        }
    }
    Ok(cpus)
}

/// Formats CPUs as a list: `[0,1,2,3,8]` → `0-3,8` (sorted, duplicates dropped).
pub fn format_cpu_list(cpus: &[u32]) -> String {
    let mut sorted = cpus.to_vec();
    sorted.sort_unstable();
    sorted.dedup();
    let mut parts = Vec::new();
    let mut i = 0;
    while i < sorted.len() {
        let start = sorted[i];
        let mut end = start;
        while i + 1 < sorted.len() && sorted[i + 1] == end + 1 {
            i += 1;
            end = sorted[i];
        }
        parts.push(if start == end { start.to_string() } else { format!("{start}-{end}") });
        i += 1;
    }
    parts.join(",")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lists_parse_and_round_trip() {
        assert_eq!(parse_cpu_list("0-3,8,10-11").unwrap(), vec![0, 1, 2, 3, 8, 10, 11]);
        assert_eq!(parse_cpu_list(" 5 , 7 - 8 ").unwrap(), vec![5, 7, 8]);
        assert_eq!(parse_cpu_list("").unwrap(), Vec::<u32>::new());
        assert_eq!(parse_cpu_list("0-3\n").unwrap(), vec![0, 1, 2, 3]);
        for bad in ["3-1", "x", "a-b", "1-", "-1", "0-99999999"] {
            let e = parse_cpu_list(bad).expect_err(bad);
            assert!(e.contains("bad cpu list entry"), "{e}");
        }
        assert_eq!(format_cpu_list(&[0, 1, 2, 3, 8, 10, 11]), "0-3,8,10-11");
        assert_eq!(format_cpu_list(&[3, 1, 2, 2]), "1-3");
        assert_eq!(format_cpu_list(&[]), "");
        for list in ["0-3,8,10-11", "5", "0,2,4"] {
            assert_eq!(format_cpu_list(&parse_cpu_list(list).unwrap()), list);
        }
    }
}
