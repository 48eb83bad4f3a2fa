//! Who may reach the mesh: TLS and mTLS on the listener ([`tls`]), and the
//! identities and roles of callers ([`auth`], R24).

pub mod auth;
pub mod tls;
