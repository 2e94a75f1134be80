//! Runs the built `tyched` binary on the hwloc XML fixtures of `tyche-numa`.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tyche-numa/fixtures").join(name)
}

fn tyched(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tyched")).args(args).output().expect("tyched runs")
}

fn json(args: &[&str]) -> Value {
    let out = tyched(args);
    assert!(out.status.success(), "tyched {args:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).expect("stdout is JSON")
}

fn u64s(v: &Value) -> Vec<u64> {
    v.as_array().expect("an array").iter().map(|x| x.as_u64().expect("a number")).collect()
}

#[test]
fn paper_server_json_has_two_nodes_six_nics_and_local_network_threads() {
    let xml = fixture("paper-2s4c2t-6nic.xml");
    let v = json(&["topology", "--xml", xml.to_str().expect("utf-8 path"), "--json"]);
    let nodes = v["nodes"].as_array().expect("nodes");
    assert_eq!(nodes.len(), 2, "two NUMA nodes");
    for n in nodes {
        assert_eq!(n["cpus"].as_array().expect("cpus").len(), 8);
        assert!(n["memory_bytes"].as_u64().expect("memory") > 0);
    }
    let nics = v["nics"].as_array().expect("nics");
    assert_eq!(nics.len(), 6, "six NICs");
    for node in [0, 1] {
        let on = nics.iter().filter(|n| n["node"] == node).count();
        assert_eq!(on, 3, "three NICs on node {node}");
    }
    let channels = v["plan"]["channels"].as_array().expect("plan channels");
    assert_eq!(channels.len(), 6, "one channel per NIC by default");
    for ch in channels {
        let nic = ch["nic"].as_str().expect("nic name");
        let nic_node = nics.iter().find(|n| n["name"] == nic).expect("the channel's NIC is listed")["node"]
            .as_u64()
            .expect("known node");
        assert_eq!(ch["node"].as_u64(), Some(nic_node), "{nic} placed on its node");
        let node = nodes.iter().find(|n| n["id"].as_u64() == Some(nic_node)).expect("node listed");
        let cpu = ch["network_cpu"].as_u64().expect("network cpu");
        assert!(u64s(&node["cpus"]).contains(&cpu), "{nic}: network cpu {cpu} is not on node {nic_node}");
    }
    assert_eq!(v["plan"]["warnings"].as_array().expect("warnings").len(), 0);
    assert!(v["model"].is_null(), "no model without --model");
}

#[test]
fn laptop_with_too_many_channels_degrades_and_logs_it() {
    let xml = fixture("laptop-1node.xml");
    let out = tyched(&["topology", "--xml", xml.to_str().expect("utf-8 path"), "--json", "--channels-per-nic", "4"]);
    assert!(out.status.success());
    let v: Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!(v["plan"]["channels"].as_array().expect("channels").len(), 4);
    assert!(!v["plan"]["warnings"].as_array().expect("warnings").is_empty());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("WARN") && stderr.contains("free cores"), "log line: {stderr}");
}

#[test]
fn four_node_table_lists_nics_and_iface_filter_works() {
    let xml = fixture("four-node.xml");
    let xml = xml.to_str().expect("utf-8 path");
    let out = tyched(&["topology", "--xml", xml]);
    assert!(out.status.success());
    let table = String::from_utf8_lossy(&out.stdout);
    for needle in ["NUMA nodes", "enp1s0f0", "enp65s0f0", "Channel placement", "10 16 22 22"] {
        assert!(table.contains(needle), "table lacks {needle:?}:\n{table}");
    }
    let v = json(&["topology", "--xml", xml, "--json", "--iface", "enp65s0f0"]);
    let channels = v["plan"]["channels"].as_array().expect("channels");
    assert_eq!(channels.len(), 1);
    assert_eq!(channels[0]["node"], 2);

    let bad = tyched(&["topology", "--xml", xml, "--iface", "wlan9"]);
    assert!(!bad.status.success(), "unknown interface is an error");
    assert!(String::from_utf8_lossy(&bad.stderr).contains("wlan9"));
}

#[test]
fn model_refuses_an_xml_topology() {
    let xml = fixture("paper-2s4c2t-6nic.xml");
    let out = tyched(&["topology", "--xml", xml.to_str().expect("utf-8"), "--model"]);
    assert!(!out.status.success(), "--model with --xml must fail");
    assert!(String::from_utf8_lossy(&out.stderr).contains("--model"));
}

#[test]
fn this_machine_with_model_reports_at_least_one_node_and_a_model() {
    let dir = tempfile::tempdir().expect("temp dir");
    let cache = dir.path().join("model.json");
    let cache = cache.to_str().expect("utf-8");
    let v = json(&["topology", "--json", "--model", "--model-ms", "5", "--model-cache", cache]);
    assert!(!v["nodes"].as_array().expect("nodes").is_empty());
    let io_nodes = v["model"]["io_nodes"].as_array().expect("model present");
    assert!(!io_nodes.is_empty(), "at least one device node modelled");
    // Measured and stored once; shown from the cache after, measured again when asked.
    let again = tyched(&["topology", "--json", "--model", "--model-cache", cache]);
    assert!(again.status.success());
    assert!(String::from_utf8_lossy(&again.stderr).contains("bandwidth model: Loaded"), "{again:?}");
    let cached: Value = serde_json::from_slice(&again.stdout).expect("json");
    assert_eq!(cached["model"], v["model"]);
    let fresh =
        tyched(&["topology", "--json", "--model", "--model-ms", "5", "--model-cache", cache, "--model-refresh"]);
    assert!(String::from_utf8_lossy(&fresh.stderr).contains("bandwidth model: Measured"), "{fresh:?}");
}

/// A model for NICs on node 1 of the two-node paper server: `other` is node 0's bandwidth
/// (node 1's own is 10 GB/s), so within 10 % puts node 0 in class 1.
fn two_node_model(other: f64) -> String {
    serde_json::json!({
        "tolerance": 0.1,
        "io_nodes": [{
            "io_node": 1,
            "write": [{"node": 0, "gbytes_per_s": other, "class": if other >= 9.0 { 1 } else { 2 }},
                      {"node": 1, "gbytes_per_s": 10.0, "class": 1}],
            "read": [{"node": 0, "gbytes_per_s": other, "class": if other >= 9.0 { 1 } else { 2 }},
                     {"node": 1, "gbytes_per_s": 10.0, "class": 1}],
        }],
    })
    .to_string()
}

#[test]
fn model_file_decides_where_a_busy_nodes_channels_go() {
    let xml = fixture("paper-2s4c2t-6nic.xml");
    let xml = xml.to_str().expect("utf-8");
    let dir = tempfile::tempdir().expect("temp dir");
    // Consumers on every CPU of node 1, the node of ens3f0.
    let busy = "8-15";
    for (other, moves) in [(9.5, true), (6.0, false)] {
        let file = dir.path().join(format!("model-{other}.json"));
        std::fs::write(&file, two_node_model(other)).expect("write the model");
        let v = json(&[
            "topology",
            "--xml",
            xml,
            "--json",
            "--iface",
            "ens3f0",
            "--consumer-cpus",
            busy,
            "--model-file",
            file.to_str().expect("utf-8"),
        ]);
        let ch = &v["plan"]["channels"][0];
        assert_eq!(ch["nic_node"], 1);
        assert_eq!(ch["memory_node"], 1, "memory stays beside the NIC");
        let warnings = v["plan"]["warnings"].to_string();
        if moves {
            assert_eq!(ch["node"], 0, "node 0 is class 1 for node 1's NICs: {v}");
            assert_eq!(ch["exclusive_core"], true);
            assert!(warnings.contains("class 1"), "{warnings}");
        } else {
            assert_eq!(ch["node"], 1, "node 0 is class 2: never traded for a core: {v}");
            assert_eq!(ch["exclusive_core"], false);
            assert!(warnings.contains("consumers run on all"), "{warnings}");
        }
    }
    // A file that is not a model is a clear error.
    let junk = dir.path().join("junk.json");
    std::fs::write(&junk, "[1, 2]").expect("write");
    let out = tyched(&["topology", "--xml", xml, "--model-file", junk.to_str().expect("utf-8")]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--model-file"), "{out:?}");
}
