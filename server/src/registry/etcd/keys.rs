//! The key layout under one prefix (the table in the docs of
//! [`super`]), and the escaping and range arithmetic of its keys.

/// The key layout under one prefix (see the module docs).
#[derive(Debug, Clone)]
pub(super) struct Keys {
    pub(super) root: String,
    pub(super) guards: String,
    pub(super) alive: String,
    /// `<prefix>/replicas/<name>/<address>`: replicas announced by their
    /// heartbeats (R32).
    pub(super) replicas: String,
    pub(super) revision: String,
    /// Tombstones of guards removed with `Deregister`.
    pub(super) removed: String,
    /// `<prefix>/owner/<name>`: the identity that registered the guard.
    pub(super) owner: String,
    /// `<prefix>/owned/<identity>/<name>`: the guards an identity owns,
    /// counted for its quota (R25).
    pub(super) owned: String,
}

impl Keys {
    pub(super) fn guard(&self, name: &str) -> String {
        format!("{}{name}", self.guards)
    }

    pub(super) fn alive(&self, name: &str) -> String {
        format!("{}{name}", self.alive)
    }

    pub(super) fn replica(&self, name: &str, address: &str) -> String {
        format!("{}{name}/{}", self.replicas, escape_address(address))
    }

    pub(super) fn removed(&self, name: &str) -> String {
        format!("{}{name}", self.removed)
    }

    pub(super) fn owner(&self, name: &str) -> String {
        format!("{}{name}", self.owner)
    }

    /// The prefix of the keys of the guards `identity` owns. The identity
    /// is escaped so that no identity's prefix holds another's (`a` and
    /// `a/b`).
    pub(super) fn owned_by(&self, identity: &str) -> String {
        let escaped = identity.replace('%', "%25").replace('/', "%2F");
        format!("{}{escaped}/", self.owned)
    }
}

/// `%` and `/` of an announced address escaped, for its key.
pub(super) fn escape_address(address: &str) -> String {
    address.replace('%', "%25").replace('/', "%2F")
}

/// The first key after every key that starts with `prefix` (etcd's range
/// end for a prefix).
pub(super) fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    // Every byte 0xff: to the end of the keyspace.
    vec![0]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::registry::etcd::EtcdConfig;

    #[test]
    fn prefix_ends() {
        assert_eq!(prefix_end(b"/guardmesh/"), b"/guardmesh0");
        assert_eq!(prefix_end(b"a\xff"), b"b");
        assert_eq!(prefix_end(b"\xff"), b"\0");
    }

    #[test]
    fn keys_under_one_prefix() {
        let config = EtcdConfig {
            prefix: "/guardmesh/prod/".into(),
            ..EtcdConfig::default()
        };
        let keys = config.keys();
        assert_eq!(keys.root, "/guardmesh/prod/");
        assert_eq!(keys.guard("sql/where"), "/guardmesh/prod/guards/sql/where");
        assert_eq!(keys.alive("a"), "/guardmesh/prod/alive/a");
        assert_eq!(
            config.replica_key("sql/where", "http://10.0.0.5:7001"),
            "/guardmesh/prod/replicas/sql/where/http:%2F%2F10.0.0.5:7001"
        );
        assert_eq!(keys.revision, "/guardmesh/prod/revision");
    }
}
