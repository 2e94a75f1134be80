//! The NBD server (stub).
pub fn run(_data: &[u8]) {}
