//! Loom models of cuarena's lock-free protocols live in `tests/`.
