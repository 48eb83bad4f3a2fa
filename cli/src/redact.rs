//! The `redact-formats` example guard's redaction (R33, R34): common secret
//! formats in any string of a call's arguments or of a result are replaced
//! by `[REDACTED:<kind>]`, so the secret never reaches the tool or the
//! model. The formats are the mesh's own
//! ([`guardmesh_server::secret_formats`]), the ones the decision log masks
//! in every record (`decision_log.mask_formats`).

pub use guardmesh_server::secret_formats::{redact_text, redact_value};
