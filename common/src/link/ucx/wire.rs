//! The UCX link's message header: every active message carries one, saying what it is and which
//! request stream and position it belongs to. A chunk's [`ChunkHeader`](crate::link::ChunkHeader)
//! bytes follow it in the same header; the payload travels as the message's data.
//!
//! `b"DU" | kind u8 | stream u32 | seq u32 | rest`, integers little-endian.

use crate::link::LinkError;

const MAGIC: &[u8; 2] = b"DU";
const FIXED: usize = 2 + 1 + 4 + 4;

/// What a message is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Kind {
    /// Client → server after connecting; answered by `HelloAck` (connect waits for it).
    Hello = 1,
    /// The server saw the client: the connection works both ways.
    HelloAck = 2,
    /// Chunk `seq` of request stream `stream`; `rest` is the encoded chunk header.
    Chunk = 3,
    /// Stream `stream` ended after `seq` chunks.
    Fin = 4,
    /// The sender dropped stream `stream` after `seq` chunks without finishing it.
    Abort = 5,
    /// The sender closes the connection: the endpoint error that follows is not a crash.
    Bye = 6,
}

/// One message's header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct WireHeader {
    pub(super) kind: Kind,
    pub(super) stream: u32,
    pub(super) seq: u32,
    pub(super) rest: Vec<u8>,
}

impl WireHeader {
    pub(super) fn new(kind: Kind, stream: u32, seq: u32) -> WireHeader {
        WireHeader {
            kind,
            stream,
            seq,
            rest: Vec::new(),
        }
    }

    pub(super) fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(FIXED + self.rest.len());
        out.extend(MAGIC);
        out.push(self.kind as u8);
        out.extend(self.stream.to_le_bytes());
        out.extend(self.seq.to_le_bytes());
        out.extend(&self.rest);
        out
    }

    pub(super) fn decode(bytes: &[u8]) -> Result<WireHeader, LinkError> {
        if bytes.len() < FIXED {
            return Err(LinkError::Malformed(format!(
                "a {}-byte UCX message header (at least {FIXED} expected)",
                bytes.len()
            )));
        }
        if &bytes[..2] != MAGIC {
            return Err(LinkError::Malformed(format!(
                "UCX message header starts with {:02x?}, not \"DU\"",
                &bytes[..2]
            )));
        }
        let kind = match bytes[2] {
            1 => Kind::Hello,
            2 => Kind::HelloAck,
            3 => Kind::Chunk,
            4 => Kind::Fin,
            5 => Kind::Abort,
            6 => Kind::Bye,
            other => {
                return Err(LinkError::Malformed(format!(
                    "UCX message kind {other} is unknown"
                )));
            }
        };
        let u32_at = |at: usize| {
            u32::from_le_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]])
        };
        Ok(WireHeader {
            kind,
            stream: u32_at(3),
            seq: u32_at(7),
            rest: bytes[FIXED..].to_vec(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_rejects_short_or_foreign_headers() {
        let mut h = WireHeader::new(Kind::Chunk, 7, 3);
        h.rest = vec![1, 2, 3];
        assert_eq!(WireHeader::decode(&h.encode()).unwrap(), h);
        let bytes = h.encode();
        let e = WireHeader::decode(&bytes[..5]).unwrap_err().to_string();
        assert!(e.contains("a 5-byte UCX message header"), "{e}");
        let e = WireHeader::decode(b"HTTP/1.1 200").unwrap_err().to_string();
        assert!(e.contains("not \"DU\""), "{e}");
        let mut bad = bytes.clone();
        bad[2] = 99;
        assert!(WireHeader::decode(&bad).is_err());
    }
}
