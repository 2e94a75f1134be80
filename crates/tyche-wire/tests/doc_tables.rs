//! `docs/protocol.md` is written from `layout.rs`: check that every field table and code table in
//! it matches the constants and enums of this crate, so the two cannot drift apart.

use std::collections::BTreeMap;

use tyche_wire::layout::{self, Field};
use tyche_wire::*;

const DOC: &str = include_str!("../../../docs/protocol.md");

/// A field row of a message table: (Off, Abs, Size or None for variable sizes).
type Row = (usize, usize, Option<usize>);

/// The label of the table a line belongs to: the bold word opening the paragraph before it, or
/// the section heading.
fn label_of(line: &str) -> Option<String> {
    if line.starts_with('#') {
        if line.contains("Common header") {
            return Some("COMMON".into());
        }
        if line.contains("Sequencing fields") {
            return Some("SEQ".into());
        }
        return Some(String::new());
    }
    if let Some(rest) = line.strip_prefix("**") {
        let end = rest.find("**")?;
        return Some(rest[..end].to_string());
    }
    None
}

fn cells(line: &str) -> Vec<&str> {
    line.trim().trim_matches('|').split('|').map(str::trim).collect()
}

fn number(s: &str) -> Option<usize> {
    let s = s.trim_matches('`');
    match s.strip_prefix("0x") {
        Some(h) => usize::from_str_radix(h, 16).ok(),
        None => s.parse().ok(),
    }
}

/// Every table row of the document, with the label of its table and its cells.
fn table_rows() -> impl Iterator<Item = (String, Vec<&'static str>)> {
    let mut label = String::new();
    DOC.lines().filter_map(move |line| {
        if let Some(l) = label_of(line) {
            label = l;
            return None;
        }
        line.starts_with('|').then(|| (label.clone(), cells(line)))
    })
}

/// `` `NAME` `` → `NAME`.
fn code_name(cell: &str) -> Option<&str> {
    cell.strip_prefix('`').and_then(|n| n.strip_suffix('`'))
}

/// Field rows `| Off | Abs | Size | `NAME` | ...` by (table label, field name).
fn doc_fields() -> BTreeMap<(String, String), Row> {
    let mut out = BTreeMap::new();
    for (label, c) in table_rows() {
        if c.len() < 5 {
            continue;
        }
        let (Some(off), Some(abs), Some(name)) = (number(c[0]), number(c[1]), code_name(c[3])) else {
            continue;
        };
        let prev = out.insert((label.clone(), name.to_string()), (off, abs, number(c[2])));
        assert!(prev.is_none(), "{label}.{name} documented twice");
    }
    out
}

/// Code rows `| value | NAME | ...` of the table labelled `label`.
fn doc_codes(label: &str) -> BTreeMap<String, usize> {
    table_rows().filter(|(l, _)| l == label).filter_map(|(_, c)| Some((c.get(1)?.to_string(), number(c[0])?))).collect()
}

/// `WriteZeroes` → `WRITE_ZEROES`.
fn screaming(debug: impl core::fmt::Debug) -> String {
    let mut out = String::new();
    for (i, ch) in format!("{debug:?}").chars().enumerate() {
        if ch.is_uppercase() && i > 0 {
            out.push('_');
        }
        out.push(ch.to_ascii_uppercase());
    }
    out
}

fn f(table: &str, name: &str, field: Field) -> ((String, String), Row) {
    let key = (table.to_string(), name.to_string());
    (key, (field.start, field.start + ETH_HEADER_LEN, Some(field.len())))
}
fn b(table: &str, name: &str, at: usize) -> ((String, String), Row) {
    f(table, name, at..at + 1)
}
fn var(table: &str, name: &str, at: usize) -> ((String, String), Row) {
    let key = (table.to_string(), name.to_string());
    (key, (at, at + ETH_HEADER_LEN, None))
}

fn expected_fields() -> Vec<((String, String), Row)> {
    use layout::*;
    let seq = |t: &str| vec![f(t, "SEQ", seq::SEQ), f(t, "ACK", seq::ACK)];
    let mut v = vec![
        b("COMMON", "VERSION", common::VERSION),
        b("COMMON", "KIND", common::KIND),
        f("COMMON", "FLAGS", common::FLAGS),
        f("COMMON", "LENGTH", common::LENGTH),
        f("COMMON", "CHANNEL", common::CHANNEL),
        f("COMMON", "SESSION", common::SESSION),
        f("DISCOVER", "NONCE", discover::NONCE),
        f("DISCOVER", "START", discover::START),
        f("DISCOVER", "RESERVED0", discover::RESERVED0),
        f("DISCOVER_REPLY", "NONCE", discover_reply::NONCE),
        f("DISCOVER_REPLY", "TOTAL", discover_reply::TOTAL),
        f("DISCOVER_REPLY", "START", discover_reply::START),
        f("DISCOVER_REPLY", "COUNT", discover_reply::COUNT),
        f("DISCOVER_REPLY", "RESERVED0", discover_reply::RESERVED0),
        var("DISCOVER_REPLY", "ENTRIES", discover_reply::ENTRIES),
        f("CONNECT", "NONCE", connect::NONCE),
        f("CONNECT", "RING", connect::RING),
        f("CONNECT", "REMQ_SLOTS", connect::REMQ_SLOTS),
        f("CONNECT", "DAMQ_SLOTS", connect::DAMQ_SLOTS),
        f("CONNECT", "SEGMENT", connect::SEGMENT),
        f("CONNECT", "MAX_IO", connect::MAX_IO),
        f("CONNECT", "FEATURES", connect::FEATURES),
        f("CONNECT", "PROOF", connect::PROOF),
        b("CONNECT", "NAME_LEN", connect::NAME_LEN),
        f("CONNECT", "RESERVED0", connect::RESERVED0),
        var("CONNECT", "NAME", connect::NAME),
        f("CHALLENGE", "NONCE", challenge::NONCE),
        f("CHALLENGE", "TARGET_NONCE", challenge::TARGET_NONCE),
        f("ACCEPT", "NONCE", accept::NONCE),
        f("ACCEPT", "RING", accept::RING),
        f("ACCEPT", "REMQ_SLOTS", accept::REMQ_SLOTS),
        f("ACCEPT", "DAMQ_SLOTS", accept::DAMQ_SLOTS),
        f("ACCEPT", "SEGMENT", accept::SEGMENT),
        f("ACCEPT", "MAX_IO", accept::MAX_IO),
        f("ACCEPT", "FEATURES", accept::FEATURES),
        f("ACCEPT", "EXPORT_SIZE", accept::EXPORT_SIZE),
        f("ACCEPT", "BLOCK_SIZE", accept::BLOCK_SIZE),
        f("ACCEPT", "EXPORT_FLAGS", accept::EXPORT_FLAGS),
        f("ACCEPT", "RESERVED0", accept::RESERVED0),
        f("ACCEPT", "PROOF", accept::PROOF),
        f("ACCEPT", "DURABILITY_EPOCH", accept::DURABILITY_EPOCH),
        f("ACCEPT", "CHANNEL_MAC", accept::CHANNEL_MAC),
        f("ACCEPT", "RESERVED1", accept::RESERVED1),
        f("REJECT", "NONCE", reject::NONCE),
        f("REJECT", "REASON", reject::REASON),
        f("REJECT", "HOLDER", reject::HOLDER),
        b("REQUEST", "OP", request::OP),
        b("REQUEST", "REQ_FLAGS", request::REQ_FLAGS),
        f("REQUEST", "REMQ", request::REMQ),
        f("REQUEST", "DAMQ", request::DAMQ),
        f("REQUEST", "HOME", request::HOME),
        f("REQUEST", "TAG", request::TAG),
        f("REQUEST", "FLOOR", request::FLOOR),
        f("REQUEST", "OFFSET", request::OFFSET),
        f("REQUEST", "LENGTH", request::LENGTH),
        f("REQUEST", "RESERVED1", request::RESERVED1),
        f("COMPLETION", "STATUS", completion::STATUS),
        f("COMPLETION", "REMQ", completion::REMQ),
        f("COMPLETION", "DAMQ", completion::DAMQ),
        f("COMPLETION", "RESERVED0", completion::RESERVED0),
        f("COMPLETION", "TAG", completion::TAG),
        f("DATA", "DAMQ", data::DAMQ),
        f("DATA", "SEG_INDEX", data::SEG_INDEX),
        f("DATA", "SEG_COUNT", data::SEG_COUNT),
        f("DATA", "RESERVED0", data::RESERVED0),
        f("DATA", "TAG", data::TAG),
        f("DATA", "OFFSET", data::OFFSET),
        f("DATA", "DIGEST", data::DIGEST),
        var("DATA", "PAYLOAD", data::PAYLOAD),
        f("ACK", "SEQ", ack::SEQ),
        f("ACK", "RESERVED0", ack::RESERVED0),
        f("ACK", "BITMAP", ack::BITMAP),
        f("KEEPALIVE", "NONCE", keepalive::NONCE),
        f("KEEPALIVE", "TIMESTAMP", keepalive::TIMESTAMP),
        f("DISCONNECT", "REASON", disconnect::REASON),
        f("DISCONNECT", "RESERVED0", disconnect::RESERVED0),
    ];
    v.extend(seq("SEQ"));
    v.extend(seq("REQUEST"));
    v.extend(seq("COMPLETION"));
    v.extend(seq("DATA"));
    v
}

#[test]
fn field_tables_match_layout() {
    let doc = doc_fields();
    let want: BTreeMap<_, _> = expected_fields().into_iter().collect();
    for (key, row) in &want {
        match doc.get(key) {
            Some(got) if got == row => {}
            Some(got) => panic!("{}.{}: doc has {got:?}, layout {row:?}", key.0, key.1),
            None => panic!("{}.{} missing from docs/protocol.md", key.0, key.1),
        }
    }
    for key in doc.keys() {
        assert!(want.contains_key(key), "{}.{} documented but not in layout.rs", key.0, key.1);
    }
}

#[test]
fn field_tables_cover_every_byte() {
    // Within each table, the fields tile the message from the end of the common header (or of
    // the sequencing fields) to its fixed end without gaps or overlaps.
    let doc = doc_fields();
    let mut tables: BTreeMap<&str, Vec<Row>> = BTreeMap::new();
    for ((t, _), row) in &doc {
        tables.entry(t.as_str()).or_default().push(*row);
    }
    let ends = [
        ("COMMON", layout::common::END),
        ("SEQ", layout::seq::END),
        ("DISCOVER", Kind::Discover.fixed_len()),
        ("DISCOVER_REPLY", Kind::DiscoverReply.fixed_len()),
        ("CONNECT", Kind::Connect.fixed_len()),
        ("CHALLENGE", Kind::Challenge.fixed_len()),
        ("ACCEPT", Kind::Accept.fixed_len()),
        ("REJECT", Kind::Reject.fixed_len()),
        ("REQUEST", Kind::Request.fixed_len()),
        ("COMPLETION", Kind::Completion.fixed_len()),
        ("DATA", Kind::Data.fixed_len()),
        ("ACK", Kind::Ack.fixed_len()),
        ("KEEPALIVE", Kind::Keepalive.fixed_len()),
        ("DISCONNECT", Kind::Disconnect.fixed_len()),
    ];
    assert_eq!(tables.len(), ends.len(), "tables: {:?}", tables.keys());
    for (t, end) in ends {
        let mut rows = tables.remove(t).unwrap_or_else(|| panic!("no table {t}"));
        rows.sort();
        let mut at = rows[0].0;
        let start = if t == "COMMON" { 0 } else { layout::common::END };
        assert_eq!(at, start, "{t} starts at {start}");
        for (off, _, size) in rows {
            assert_eq!(off, at, "{t}: gap or overlap at {at}");
            at = off + size.unwrap_or(0);
        }
        assert_eq!(at, end, "{t}: fields end at the fixed length");
    }
}

#[test]
fn code_tables_match_enums() {
    fn check<T: Copy + core::fmt::Debug>(label: &str, all: &[T], value: impl Fn(T) -> usize) {
        let doc = doc_codes(label);
        assert_eq!(doc.len(), all.len(), "{label}: {doc:?}");
        for &v in all {
            let name = screaming(v);
            assert_eq!(doc.get(&name), Some(&value(v)), "{label}: {name}");
        }
    }
    check("Kind", Kind::ALL, |k| k as usize);
    check("Op", Op::ALL, |o| o as usize);
    check("Status", Status::ALL, |s| s as usize);
    check("RejectReason", RejectReason::ALL, |r| r as usize);
    check("DisconnectReason", DisconnectReason::ALL, |r| r as usize);
}

/// Rows `| Off | Size | `NAME` | ... |` (four cells, fixed numbers) of the table labelled `label`.
fn doc_payload_fields(label: &str) -> BTreeMap<String, (usize, usize)> {
    table_rows()
        .filter(|(l, c)| l == label && c.len() == 4)
        .filter_map(|(_, c)| Some((code_name(c[2])?.to_string(), (number(c[0])?, number(c[1])?))))
        .collect()
}

#[test]
fn block_status_tables_match_layout() {
    use layout::block_status as l;
    let list = doc_payload_fields("BLOCK_STATUS list");
    let want: BTreeMap<String, (usize, usize)> = [
        ("COUNT".to_string(), (l::COUNT.start, l::COUNT.len())),
        ("RESERVED0".into(), (l::RESERVED0.start, l::RESERVED0.len())),
    ]
    .into_iter()
    .collect();
    assert_eq!(list, want, "BLOCK_STATUS list table");
    assert!(DOC.contains(&format!("| {} | 16 × `COUNT` | `EXTENTS` |", l::EXTENTS)), "EXTENTS row");
    assert!(DOC.contains(&format!("number of extents, 1 to {} |", l::MAX_EXTENTS)), "MAX_EXTENTS");
    assert!(DOC.contains(&format!("exactly {} bytes in the request's `damq` slot", l::LEN)), "LEN");
    let extent = doc_payload_fields("Extent");
    let want: BTreeMap<String, (usize, usize)> = [
        ("EXTENT_LENGTH", l::EXTENT_LENGTH),
        ("EXTENT_FLAGS", l::EXTENT_FLAGS),
        ("EXTENT_RESERVED", l::EXTENT_RESERVED),
    ]
    .into_iter()
    .map(|(n, f)| (n.to_string(), (f.start, f.len())))
    .collect();
    assert_eq!(extent, want, "Extent table");
    assert_eq!(l::EXTENT_RESERVED.end, l::EXTENT_LEN);
    assert!(DOC.contains(&format!("bit `{:#x}` HOLE", flags::EXTENT_HOLE)));
    assert!(DOC.contains(&format!("bit `{:#x}` ZERO", flags::EXTENT_ZERO)));
    assert!(DOC.contains(&format!("| `{:#010x}` | BLOCK_STATUS |", flags::FEATURE_BLOCK_STATUS)));
}

#[test]
fn segment_examples_match_segment_size_for() {
    let mut seen = 0;
    let mut in_table = false;
    for line in DOC.lines() {
        if line.starts_with("| MTU | Frame capacity | Segment |") {
            in_table = true;
            continue;
        }
        if !in_table {
            continue;
        }
        if !line.starts_with('|') {
            break;
        }
        let c = cells(line);
        let (Some(mtu), cap, want) = (number(c[0]), c[1], c[2]) else {
            continue;
        };
        // "any" capacity: larger than every MTU in the table.
        let cap: usize = cap.split_whitespace().next().and_then(|s| s.parse().ok()).unwrap_or(1 << 20);
        let want = want.parse::<u32>().ok();
        assert_eq!(segment_size_for(mtu, cap), want, "segment for MTU {mtu}, capacity {cap}");
        seen += 1;
    }
    assert!(seen >= 6, "segment example table found ({seen} rows)");
}
