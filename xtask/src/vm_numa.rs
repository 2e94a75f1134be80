//! `vm-test`'s second guest test: NUMA placement on a 2-node guest (being written; until then it
//! fails, so `vm-test` cannot pass without it).

use anyhow::{bail, Result};

/// Runs the test; returns the summary for the final line (`2 nodes, 2 nics`).
pub fn guest() -> Result<String> {
    bail!("the NUMA guest test is not written yet")
}
