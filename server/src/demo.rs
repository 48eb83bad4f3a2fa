//! `guardmesh demo` (filled in below).
