//! The job key and the proofs made with it.
//!
//! Nothing derived here reveals the key: the store handshake exchanges HMAC-SHA256 tags over
//! fresh random nonces (see `store::protocol` for the messages), and the job directory's name
//! is a tag too. Every tag starts with a label naming its purpose, so a tag made for one
//! purpose (the client's proof) is never valid for another (the server's proof).
use std::fmt;

use hmac::{KeyInit, Mac};

use crate::env::{vars, EnvError};
use crate::error::Result;
use crate::sys;

type HmacSha256 = hmac::Hmac<sha2::Sha256>;

/// Length of a nonce and of a tag, in bytes.
pub(crate) const TAG_LEN: usize = 32;

/// A random nonce or an HMAC-SHA256 tag.
pub(crate) type Tag = [u8; TAG_LEN];

/// Labels that separate the purposes of the tags.
pub(crate) mod label {
    /// The client's proof in the store handshake.
    pub const CLIENT: &[u8] = b"mkernel-bootstrap/v1/client-proof";
    /// The store's proof in the handshake.
    pub const SERVER: &[u8] = b"mkernel-bootstrap/v1/server-proof";
    /// The job directory's name.
    pub const JOB_DIR: &[u8] = b"mkernel-bootstrap/v1/job-dir";
    /// A secret derived for another component ([`super::JobKey::derive_secret`]).
    pub const DERIVED: &[u8] = b"mkernel-bootstrap/v1/derived-secret";
}

/// The job's shared secret (`MKERNEL_JOB_KEY`). Its `Debug` output never shows it.
#[derive(Clone, PartialEq, Eq)]
pub struct JobKey(Vec<u8>);

impl JobKey {
    /// Fewest bytes of a key. A handshake recorded off the network lets an attacker test
    /// guesses offline, so the key must not be short enough to enumerate; 16 bytes is the
    /// length of the 32-hex-digit keys that [`JobKey::random`] and `cargo xtask launch` make
    /// (128 random bits); a 16-character word has far fewer, so use random keys.
    pub const MIN_BYTES: usize = 16;

    /// The key with these bytes; a key shorter than [`JobKey::MIN_BYTES`] is refused.
    pub fn new(bytes: impl Into<Vec<u8>>) -> Result<Self, EnvError> {
        let bytes = bytes.into();
        if bytes.len() < Self::MIN_BYTES {
            return Err(EnvError::Invalid {
                var: vars::MKERNEL_JOB_KEY,
                // Never echo a secret, even a bad one.
                value: format!("<{} bytes>", bytes.len()),
                reason: format!(
                    "the job key must have at least {} bytes (e.g. `openssl rand -hex 16`; `cargo xtask launch` makes one)",
                    Self::MIN_BYTES
                ),
            });
        }
        Ok(JobKey(bytes))
    }

    /// A fresh random key (128 bits, as 32 hex digits), as `cargo xtask launch` makes on one host.
    pub fn random() -> Result<Self> {
        let mut bytes = [0u8; 16];
        sys::random_bytes(&mut bytes)?;
        let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
        Ok(JobKey(hex.into_bytes()))
    }

    /// A 32-byte secret for `purpose` (e.g. `"tcp-frames"`): HMAC-SHA256 under the key of a
    /// label and `purpose`. Knowing it reveals neither the key nor the secret of another
    /// purpose; every process of the job derives the same one.
    pub fn derive_secret(&self, purpose: &str) -> [u8; 32] {
        tag(self, label::DERIVED, &[purpose.as_bytes()])
    }

    /// The key's bytes.
    pub(crate) fn as_bytes(&self) -> &[u8] {
        &self.0
    }
}

impl fmt::Debug for JobKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("JobKey(<redacted>)")
    }
}

/// HMAC-SHA256 with `key` over `label` and `parts`, each length-prefixed so that no two
/// different inputs give the same message.
pub(crate) fn tag(key: &JobKey, label: &[u8], parts: &[&[u8]]) -> Tag {
    mac(key, label, parts).finalize().into_bytes().into()
}

/// Whether `candidate` is [`tag`]`(key, label, parts)`, compared in constant time.
pub(crate) fn verify(key: &JobKey, label: &[u8], parts: &[&[u8]], candidate: &[u8]) -> bool {
    mac(key, label, parts).verify_slice(candidate).is_ok()
}

fn mac(key: &JobKey, label: &[u8], parts: &[&[u8]]) -> HmacSha256 {
    // HMAC takes keys of any length; `new_from_slice` cannot fail for it.
    let mut mac = <HmacSha256 as KeyInit>::new_from_slice(key.as_bytes())
        .unwrap_or_else(|_| unreachable!("HMAC accepts keys of any length"));
    for part in std::iter::once(label).chain(parts.iter().copied()) {
        mac.update(&(part.len() as u64).to_le_bytes());
        mac.update(part);
    }
    mac
}

/// A fresh random nonce.
pub(crate) fn nonce() -> Result<Tag> {
    let mut n = [0u8; TAG_LEN];
    sys::random_bytes(&mut n)?;
    Ok(n)
}

/// What one store handshake's proofs cover: both nonces, the claimed rank and world size.
///
/// The client proves it knows the key with `HMAC(key, client label, server_nonce, rank, world,
/// client_nonce)`; the store answers with `HMAC(key, server label, client_nonce, server_nonce,
/// rank)`, so a client also knows it reached its own job's store.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Handshake {
    /// The store's fresh nonce.
    pub server_nonce: Tag,
    /// The client's fresh nonce.
    pub client_nonce: Tag,
    /// The rank the client claims.
    pub rank: u32,
    /// The world size the client believes in.
    pub world_size: u32,
}

impl Handshake {
    fn client_parts(&self) -> ([u8; 4], [u8; 4]) {
        (self.rank.to_le_bytes(), self.world_size.to_le_bytes())
    }

    /// The client's proof.
    pub fn client_proof(&self, key: &JobKey) -> Tag {
        let (rank, world) = self.client_parts();
        tag(
            key,
            label::CLIENT,
            &[&self.server_nonce, &rank, &world, &self.client_nonce],
        )
    }

    /// Whether `proof` is the client's proof for `key` (constant time).
    pub fn client_proof_ok(&self, key: &JobKey, proof: &[u8]) -> bool {
        let (rank, world) = self.client_parts();
        verify(
            key,
            label::CLIENT,
            &[&self.server_nonce, &rank, &world, &self.client_nonce],
            proof,
        )
    }

    /// The store's proof.
    pub fn server_proof(&self, key: &JobKey) -> Tag {
        tag(
            key,
            label::SERVER,
            &[&self.client_nonce, &self.server_nonce, &self.rank.to_le_bytes()],
        )
    }

    /// Whether `proof` is the store's proof for `key` (constant time).
    pub fn server_proof_ok(&self, key: &JobKey, proof: &[u8]) -> bool {
        verify(
            key,
            label::SERVER,
            &[&self.client_nonce, &self.server_nonce, &self.rank.to_le_bytes()],
            proof,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tags_depend_on_key_label_and_parts() {
        let k = JobKey::new("key-0123456789abcdef").unwrap();
        let t = tag(&k, label::CLIENT, &[b"a", b"b"]);
        assert!(verify(&k, label::CLIENT, &[b"a", b"b"], &t));
        assert!(!verify(
            &JobKey::new("kez-0123456789abcdef").unwrap(),
            label::CLIENT,
            &[b"a", b"b"],
            &t
        ));
        assert!(!verify(&k, label::SERVER, &[b"a", b"b"], &t));
        assert!(!verify(&k, label::CLIENT, &[b"ab", b""], &t));
        assert!(!verify(&k, label::CLIENT, &[b"a", b"b"], &t[..31]));
    }

    #[test]
    fn derived_secrets_depend_on_key_and_purpose() {
        let k = JobKey::new("key-0123456789abcdef").unwrap();
        let a = k.derive_secret("tcp-frames");
        assert_eq!(a, k.derive_secret("tcp-frames"));
        assert_ne!(a, k.derive_secret("other"));
        assert_ne!(
            a,
            JobKey::new("kez-0123456789abcdef").unwrap().derive_secret("tcp-frames")
        );
        assert_ne!(a, tag(&k, label::CLIENT, &[b"tcp-frames"]));
    }

    #[test]
    fn handshake_proofs_are_not_interchangeable() {
        let k = JobKey::new("key-0123456789abcdef").unwrap();
        let h = Handshake {
            server_nonce: [1; 32],
            client_nonce: [2; 32],
            rank: 3,
            world_size: 4,
        };
        assert!(h.client_proof_ok(&k, &h.client_proof(&k)));
        assert!(h.server_proof_ok(&k, &h.server_proof(&k)));
        assert!(!h.server_proof_ok(&k, &h.client_proof(&k)));
        let other_rank = Handshake { rank: 2, ..h };
        assert!(!other_rank.client_proof_ok(&k, &h.client_proof(&k)));
        assert!(!h.client_proof_ok(&JobKey::new("other-0123456789abcdef").unwrap(), &h.client_proof(&k)));
    }

    #[test]
    fn random_keys_differ_and_debug_hides_them() {
        let (a, b) = (JobKey::random().unwrap(), JobKey::random().unwrap());
        assert_ne!(a, b);
        assert_eq!(a.as_bytes().len(), 32);
        assert_eq!(format!("{a:?}"), "JobKey(<redacted>)");
        assert!(JobKey::new("").is_err());
        let e = JobKey::new("fifteen bytes!!").unwrap_err().to_string();
        assert!(e.contains("at least 16 bytes") && !e.contains("fifteen"), "{e}");
        JobKey::new("sixteen bytes!!!").unwrap();
    }
}
