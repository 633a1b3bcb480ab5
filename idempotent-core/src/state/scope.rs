//! Which state: [`Scope`], a name within an optional tenant.

use std::fmt;

use sha2::{Digest, Sha256};

use crate::key::field;

/// Which state: a name (a thread id, a cart id) within an optional tenant.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Scope {
    tenant: Option<String>,
    name: String,
    digest: [u8; 32],
}

impl Scope {
    /// The state named `name`, outside any tenant.
    pub fn new(name: impl Into<String>) -> Scope {
        let name = name.into();
        let digest = Self::digest_of(None, &name);
        Scope { tenant: None, name, digest }
    }

    /// The same name within `tenant` (a different state from the name in another tenant).
    pub fn tenant(mut self, tenant: impl Into<String>) -> Scope {
        let tenant = tenant.into();
        self.digest = Self::digest_of(Some(&tenant), &self.name);
        self.tenant = Some(tenant);
        self
    }

    /// The name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The tenant, if any.
    pub fn tenant_name(&self) -> Option<&str> {
        self.tenant.as_deref()
    }

    /// The sha256 the stores key the state by (so that names can hold any character and a
    /// tenant cannot reach another's state).
    pub fn digest(&self) -> &[u8; 32] {
        &self.digest
    }

    fn digest_of(tenant: Option<&str>, name: &str) -> [u8; 32] {
        let mut h = Sha256::new();
        field(&mut h, b"idempotent/state-scope");
        match tenant {
            None => h.update([0u8]),
            Some(t) => {
                h.update([1u8]);
                field(&mut h, t.as_bytes());
            }
        }
        field(&mut h, name.as_bytes());
        h.finalize().into()
    }
}

impl fmt::Display for Scope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.tenant {
            Some(t) => write!(f, "{t}/{}", self.name),
            None => f.write_str(&self.name),
        }
    }
}
