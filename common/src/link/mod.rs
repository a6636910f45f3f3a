//! The latent link: how a denoiser rank hands each finished latent, chunk by chunk, to the decoder
//! instance that owns the request. A chunk is a few latent frames with everything the receiver
//! needs to check and place it: request id, chunk index, latent frame range, shape, dtype and a
//! CRC-32 of the payload.
//!
//! The wire framing here is shared by the transports: the byte streams of [`quic`] carry it whole;
//! UCX (`ucx`, behind the `ucx` feature) moves the same header and payload as messages; the NCCL
//! link ([`nccl`], behind the `cuda` feature) sends the framed header over QUIC and the payload
//! GPU to GPU:
//!
//! `b"DSLC" | u32 header_len | header | u64 payload_len | payload`, integers little-endian.

#[cfg(feature = "cuda")]
pub mod nccl;
pub mod pool;
pub mod quic;
#[cfg(feature = "ucx")]
pub mod ucx;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// Largest header accepted: a request id and a shape, far below this.
pub const MAX_HEADER_BYTES: usize = 64 << 10;
/// Largest payload accepted: 720p 81 frames in f32 is ~40 MB; this leaves room for bigger videos.
pub const MAX_PAYLOAD_BYTES: u64 = 1 << 30;

const MAGIC: &[u8; 4] = b"DSLC";

/// Why a chunk could not be sent or received.
#[derive(Debug, thiserror::Error)]
pub enum LinkError {
    /// The transport failed (connection lost, reset, closed by the peer).
    #[error("latent link: {0}")]
    Transport(String),
    /// The bytes are not a chunk.
    #[error("latent link: malformed chunk: {0}")]
    Malformed(String),
    /// The payload does not match its checksum.
    #[error(
        "latent link: chunk {chunk_index} of request {request_id}: checksum {actual:#010x}, header says {expected:#010x}"
    )]
    Checksum {
        /// The request.
        request_id: String,
        /// The chunk.
        chunk_index: u32,
        /// CRC-32 in the header.
        expected: u32,
        /// CRC-32 of the bytes received.
        actual: u32,
    },
    /// TLS identities could not be built or loaded.
    #[error("latent link identity: {0}")]
    Identity(String),
    /// A UCX call failed or a UCX endpoint reported an error.
    #[error("latent link (UCX): {what}: {status}")]
    Ucx {
        /// What failed: the call and its subject (`ucp_ep_create to 10.0.0.2:7000`).
        what: String,
        /// UCX's status string (`ucs_status_string`), e.g. "Destination is unreachable".
        status: String,
    },
    /// The link cannot do what was asked with the library it was built against (e.g. CUDA
    /// memory through a UCX built without CUDA transports, or a kind this binary lacks).
    #[error("latent link: unsupported: {0}")]
    Unsupported(String),
    /// A `pools.link*` setting is unusable.
    #[error(transparent)]
    Config(#[from] crate::config::ConfigError),
}

impl From<std::io::Error> for LinkError {
    fn from(e: std::io::Error) -> LinkError {
        LinkError::Transport(e.to_string())
    }
}

/// Element type of a chunk's payload.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LinkDType {
    /// 32-bit float.
    F32,
    /// bfloat16.
    Bf16,
}

impl LinkDType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            LinkDType::F32 => 4,
            LinkDType::Bf16 => 2,
        }
    }

    fn code(self) -> u8 {
        match self {
            LinkDType::F32 => 0,
            LinkDType::Bf16 => 1,
        }
    }

    fn from_code(code: u8) -> Result<LinkDType, LinkError> {
        match code {
            0 => Ok(LinkDType::F32),
            1 => Ok(LinkDType::Bf16),
            other => Err(LinkError::Malformed(format!(
                "dtype code {other} is neither 0 (f32) nor 1 (bf16)"
            ))),
        }
    }
}

/// What identifies and describes a chunk.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChunkHeader {
    /// The request the latent belongs to.
    pub request_id: String,
    /// 0, 1, … in the order the decoder must consume them.
    pub chunk_index: u32,
    /// First latent frame in the chunk.
    pub first_frame: u32,
    /// Whether this is the request's last chunk.
    pub last: bool,
    /// Payload shape, e.g. [1, C, frames, H, W].
    pub shape: Vec<u64>,
    /// Payload element type.
    pub dtype: LinkDType,
    /// CRC-32 (IEEE) of the payload.
    pub checksum: u32,
}

/// A header and its payload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LatentChunk {
    /// What it is.
    pub header: ChunkHeader,
    /// The latent values, row-major, little-endian.
    pub payload: Vec<u8>,
}

impl LatentChunk {
    /// A chunk of `payload` (row-major `shape` of `dtype`), checksummed. The payload length must
    /// match the shape.
    pub fn new(
        request_id: &str,
        chunk_index: u32,
        first_frame: u32,
        last: bool,
        shape: &[u64],
        dtype: LinkDType,
        payload: Vec<u8>,
    ) -> Result<LatentChunk, LinkError> {
        let expected = shape.iter().product::<u64>() * dtype.size() as u64;
        if payload.len() as u64 != expected {
            return Err(LinkError::Malformed(format!(
                "payload of {} bytes does not hold shape {shape:?} of {dtype:?} ({expected} bytes)",
                payload.len()
            )));
        }
        let header = ChunkHeader {
            request_id: request_id.to_string(),
            chunk_index,
            first_frame,
            last,
            shape: shape.to_vec(),
            dtype,
            checksum: crc32fast::hash(&payload),
        };
        Ok(LatentChunk { header, payload })
    }

    /// A chunk of f32 values.
    pub fn from_f32(
        request_id: &str,
        chunk_index: u32,
        first_frame: u32,
        last: bool,
        shape: &[u64],
        values: &[f32],
    ) -> Result<LatentChunk, LinkError> {
        let payload = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        Self::new(
            request_id,
            chunk_index,
            first_frame,
            last,
            shape,
            LinkDType::F32,
            payload,
        )
    }

    /// The payload as f32 values (f32 chunks only).
    pub fn to_f32(&self) -> Result<Vec<f32>, LinkError> {
        if self.header.dtype != LinkDType::F32 {
            return Err(LinkError::Malformed(format!(
                "chunk holds {:?}, not f32",
                self.header.dtype
            )));
        }
        Ok(self
            .payload
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect())
    }

    /// Latent frames in the chunk (axis 2 of a [B, C, T, H, W] shape).
    pub fn frames(&self) -> u32 {
        self.header.shape.get(2).map_or(0, |&t| t as u32)
    }

    /// Checks the payload against the header's shape and checksum.
    pub fn verify(&self) -> Result<(), LinkError> {
        let h = &self.header;
        let expected = h.payload_bytes();
        if self.payload.len() as u64 != expected {
            return Err(LinkError::Malformed(format!(
                "chunk {} of {}: {} payload bytes for shape {:?} ({expected} expected)",
                h.chunk_index,
                h.request_id,
                self.payload.len(),
                h.shape
            )));
        }
        let actual = crc32fast::hash(&self.payload);
        if actual != h.checksum {
            return Err(LinkError::Checksum {
                request_id: h.request_id.clone(),
                chunk_index: h.chunk_index,
                expected: h.checksum,
                actual,
            });
        }
        Ok(())
    }
}

impl ChunkHeader {
    /// The payload's size in bytes by its shape and dtype.
    pub fn payload_bytes(&self) -> u64 {
        self.shape.iter().product::<u64>() * self.dtype.size() as u64
    }

    /// The header's bytes: id, index, first frame, last flag, dtype, checksum, rank, dims.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(32 + self.request_id.len() + 8 * self.shape.len());
        out.extend((self.request_id.len() as u32).to_le_bytes());
        out.extend(self.request_id.as_bytes());
        out.extend(self.chunk_index.to_le_bytes());
        out.extend(self.first_frame.to_le_bytes());
        out.push(u8::from(self.last));
        out.push(self.dtype.code());
        out.extend(self.checksum.to_le_bytes());
        out.extend((self.shape.len() as u32).to_le_bytes());
        for d in &self.shape {
            out.extend(d.to_le_bytes());
        }
        out
    }

    /// Parses [`ChunkHeader::encode`]'s bytes.
    pub fn decode(bytes: &[u8]) -> Result<ChunkHeader, LinkError> {
        let mut r = Reader { bytes, at: 0 };
        let id_len = r.u32()? as usize;
        let request_id = String::from_utf8(r.take(id_len)?.to_vec())
            .map_err(|_| LinkError::Malformed("request id is not UTF-8".into()))?;
        let chunk_index = r.u32()?;
        let first_frame = r.u32()?;
        let last = r.take(1)?[0] != 0;
        let dtype = LinkDType::from_code(r.take(1)?[0])?;
        let checksum = r.u32()?;
        let rank = r.u32()? as usize;
        if rank > 8 {
            return Err(LinkError::Malformed(format!("shape rank {rank} exceeds 8")));
        }
        let shape = (0..rank).map(|_| r.u64()).collect::<Result<Vec<_>, _>>()?;
        if r.at != bytes.len() {
            return Err(LinkError::Malformed(format!(
                "{} trailing header bytes",
                bytes.len() - r.at
            )));
        }
        Ok(ChunkHeader {
            request_id,
            chunk_index,
            first_frame,
            last,
            shape,
            dtype,
            checksum,
        })
    }
}

struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], LinkError> {
        let end = self
            .at
            .checked_add(n)
            .filter(|&e| e <= self.bytes.len())
            .ok_or_else(|| {
                LinkError::Malformed(format!(
                    "header ends at byte {} but needs {}",
                    self.bytes.len(),
                    self.at + n
                ))
            })?;
        let out = &self.bytes[self.at..end];
        self.at = end;
        Ok(out)
    }

    fn u32(&mut self) -> Result<u32, LinkError> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn u64(&mut self) -> Result<u64, LinkError> {
        let b = self.take(8)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }
}

/// Writes one framed chunk.
pub async fn write_chunk<W: AsyncWrite + Unpin>(
    w: &mut W,
    chunk: &LatentChunk,
) -> Result<(), LinkError> {
    write_frame_head(w, &chunk.header, chunk.payload.len() as u64).await?;
    w.write_all(&chunk.payload).await?;
    Ok(())
}

/// Writes a frame's magic, header and payload length, and not the payload: the payload follows
/// on the same stream ([`write_chunk`]) or over another transport (the NCCL link's GPU-to-GPU
/// transfer, which has no framing of its own).
pub async fn write_frame_head<W: AsyncWrite + Unpin>(
    w: &mut W,
    header: &ChunkHeader,
    payload_len: u64,
) -> Result<(), LinkError> {
    let header = header.encode();
    w.write_all(MAGIC).await?;
    w.write_all(&(header.len() as u32).to_le_bytes()).await?;
    w.write_all(&header).await?;
    w.write_all(&payload_len.to_le_bytes()).await?;
    Ok(())
}

/// Reads one framed chunk and verifies it; `None` at a clean end of stream (between chunks).
pub async fn read_chunk<R: AsyncRead + Unpin>(r: &mut R) -> Result<Option<LatentChunk>, LinkError> {
    let Some((header, payload_len)) = read_frame_head(r).await? else {
        return Ok(None);
    };
    let mut payload = vec![0u8; payload_len as usize];
    r.read_exact(&mut payload).await?;
    let chunk = LatentChunk { header, payload };
    chunk.verify()?;
    Ok(Some(chunk))
}

/// Reads a frame's magic, header and payload length (checked against the size limits), leaving
/// the payload unread; `None` at a clean end of stream.
pub async fn read_frame_head<R: AsyncRead + Unpin>(
    r: &mut R,
) -> Result<Option<(ChunkHeader, u64)>, LinkError> {
    let mut magic = [0u8; 4];
    match r.read_exact(&mut magic).await {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e.into()),
    }
    if &magic != MAGIC {
        return Err(LinkError::Malformed(format!(
            "stream starts with {magic:02x?}, not \"DSLC\""
        )));
    }
    let header_len = r.read_u32_le().await? as usize;
    if header_len > MAX_HEADER_BYTES {
        return Err(LinkError::Malformed(format!(
            "header of {header_len} bytes exceeds {MAX_HEADER_BYTES}"
        )));
    }
    let mut header = vec![0u8; header_len];
    r.read_exact(&mut header).await?;
    let header = ChunkHeader::decode(&header)?;
    let payload_len = r.read_u64_le().await?;
    if payload_len > MAX_PAYLOAD_BYTES {
        return Err(LinkError::Malformed(format!(
            "payload of {payload_len} bytes exceeds {MAX_PAYLOAD_BYTES}"
        )));
    }
    Ok(Some((header, payload_len)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chunk() -> LatentChunk {
        let values: Vec<f32> = (0..2 * 16 * 3 * 4).map(|i| i as f32 * 0.5 - 3.0).collect();
        LatentChunk::from_f32(
            "req-7",
            1,
            1,
            false,
            &[1, 16, 2, 3, 4],
            &values[..16 * 2 * 3 * 4],
        )
        .unwrap()
    }

    #[tokio::test]
    async fn framing_round_trips() {
        let c = chunk();
        let mut buf = Vec::new();
        write_chunk(&mut buf, &c).await.unwrap();
        write_chunk(&mut buf, &c).await.unwrap();
        let mut r = buf.as_slice();
        assert_eq!(read_chunk(&mut r).await.unwrap().unwrap(), c);
        let again = read_chunk(&mut r).await.unwrap().unwrap();
        assert_eq!(again.to_f32().unwrap(), c.to_f32().unwrap());
        assert_eq!(again.frames(), 2);
        assert!(
            read_chunk(&mut r).await.unwrap().is_none(),
            "clean end of stream"
        );
    }

    #[tokio::test]
    async fn corruption_is_caught() {
        let c = chunk();
        let mut buf = Vec::new();
        write_chunk(&mut buf, &c).await.unwrap();
        let last = buf.len() - 1;
        buf[last] ^= 0x40;
        let e = read_chunk(&mut buf.as_slice())
            .await
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("latent link: chunk 1 of request req-7: checksum"),
            "{e}"
        );
        let e = read_chunk(&mut &b"HTTP/1.1"[..])
            .await
            .unwrap_err()
            .to_string();
        assert!(e.contains("not \"DSLC\""), "{e}");
        let mut truncated = Vec::new();
        write_chunk(&mut truncated, &c).await.unwrap();
        truncated.truncate(truncated.len() - 10);
        assert!(
            read_chunk(&mut truncated.as_slice()).await.is_err(),
            "a cut payload is an error"
        );
    }

    #[test]
    fn shape_must_match_payload() {
        let e = LatentChunk::from_f32("r", 0, 0, true, &[1, 16, 1, 2, 2], &[0.0; 10]).unwrap_err();
        assert!(
            e.to_string()
                .contains("does not hold shape [1, 16, 1, 2, 2]"),
            "{e}"
        );
        assert!(ChunkHeader::decode(&[1, 0, 0]).is_err());
    }
}
