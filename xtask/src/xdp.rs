use anyhow::Result;
use std::path::Path;
#[derive(Debug, clap::Args)]
pub struct SmokeArgs {}
#[derive(Debug, clap::Args)]
pub struct BenchArgs {}
pub fn smoke(_r: &Path, _a: &SmokeArgs) -> Result<()> { Ok(()) }
pub fn bench(_r: &Path, _a: &BenchArgs) -> Result<()> { Ok(()) }
