//! State.
