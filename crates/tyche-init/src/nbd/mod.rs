//! NBD.
