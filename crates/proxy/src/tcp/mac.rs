//! Per-frame authentication of the TCP transport: a 16-byte keyed BLAKE3 tag over the frame's
//! header and payload, sent right after them ([`TAG_BYTES`]).
//!
//! Each socket direction has its own key, derived from the job's frame secret (a secret the
//! job key gives every rank, never sent: [`super::Exchange::frame_secret`]), the sender's and
//! the receiver's rank, the socket's lane and the receiver's token of this run. So a frame is
//! valid only on the socket, in the direction and in the run it was made for; message numbers
//! (covered by the tag) keep it from being replayed on that socket, so nobody on the network
//! path can forge, alter, move or replay a frame without the job key.
use super::frame::{HEADER_BYTES, TOKEN_BYTES};

/// Bytes of a frame's tag.
pub const TAG_BYTES: usize = 16;

/// BLAKE3's key-derivation context of the frame keys.
const CONTEXT: &str = "mkernel-proxy 2026-12 tcp frame key v1";

/// The key of one socket direction. `Debug` never shows it.
#[derive(Clone)]
pub struct FrameKey([u8; 32]);

impl std::fmt::Debug for FrameKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("FrameKey(<redacted>)")
    }
}

impl FrameKey {
    /// The key of the frames rank `from` sends to rank `to` on socket `lane`, in the run where
    /// `to` published `token`, from the job's frame `secret`.
    pub fn derive(secret: &[u8; 32], from: usize, to: usize, lane: usize, token: &[u8; TOKEN_BYTES]) -> FrameKey {
        let mut h = blake3::Hasher::new_derive_key(CONTEXT);
        h.update(secret);
        for v in [from, to, lane] {
            h.update(&(v as u64).to_le_bytes());
        }
        h.update(token);
        FrameKey(*h.finalize().as_bytes())
    }

    /// The tag of a frame: header, then payload (empty for frames without one).
    pub fn tag(&self, header: &[u8; HEADER_BYTES], payload: &[u8]) -> [u8; TAG_BYTES] {
        let mut h = blake3::Hasher::new_keyed(&self.0);
        h.update(header);
        h.update(payload);
        let mut t = [0u8; TAG_BYTES];
        t.copy_from_slice(&h.finalize().as_bytes()[..TAG_BYTES]);
        t
    }

    /// Whether `tag` is this frame's tag (compared in constant time).
    pub fn verify(&self, header: &[u8; HEADER_BYTES], payload: &[u8], tag: &[u8; TAG_BYTES]) -> bool {
        let want = self.tag(header, payload);
        want.iter().zip(tag).fold(0u8, |acc, (a, b)| acc | (a ^ b)) == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Tags change with every input: key parts, header bytes, payload bytes; and only the
    /// matching key verifies. Checked against BLAKE3's own keyed hash (an independent call).
    #[test]
    fn tags_cover_key_header_and_payload() {
        let (secret, token) = ([7u8; 32], [9u8; TOKEN_BYTES]);
        let k = FrameKey::derive(&secret, 1, 0, 1, &token);
        let hdr = [3u8; HEADER_BYTES];
        let payload = vec![5u8; 1000];
        let t = k.tag(&hdr, &payload);
        let mut whole = hdr.to_vec();
        whole.extend(&payload);
        assert_eq!(t[..], blake3::keyed_hash(&k.0, &whole).as_bytes()[..TAG_BYTES]);
        assert!(k.verify(&hdr, &payload, &t));
        for other in [
            FrameKey::derive(&[8u8; 32], 1, 0, 1, &token),
            FrameKey::derive(&secret, 0, 1, 1, &token),
            FrameKey::derive(&secret, 1, 0, 0, &token),
            FrameKey::derive(&secret, 1, 0, 1, &[0u8; TOKEN_BYTES]),
        ] {
            assert!(!other.verify(&hdr, &payload, &t));
        }
        let mut h2 = hdr;
        h2[8] ^= 1;
        assert!(!k.verify(&h2, &payload, &t));
        let mut p2 = payload.clone();
        p2[999] ^= 0x80;
        assert!(!k.verify(&hdr, &p2, &t));
        assert!(!k.verify(&hdr, &payload[..999], &t));
        let mut t2 = t;
        t2[15] ^= 1;
        assert!(!k.verify(&hdr, &payload, &t2));
        assert_eq!(format!("{k:?}"), "FrameKey(<redacted>)");
    }
}
