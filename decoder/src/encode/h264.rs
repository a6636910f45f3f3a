//! H.264 bitstream plumbing shared by both backends: Annex B (start codes) → NAL units, parameter sets,
//! access units in the length-prefixed form MP4 carries, and the RFC 6381 codec string.

use super::EncodeError;

/// NAL unit type of a coded slice of an IDR picture.
pub const NAL_IDR: u8 = 5;
/// NAL unit type of a sequence parameter set.
pub const NAL_SPS: u8 = 7;
/// NAL unit type of a picture parameter set.
pub const NAL_PPS: u8 = 8;
/// NAL unit type of an access unit delimiter.
pub const NAL_AUD: u8 = 9;

/// The NAL unit type (low 5 bits of the first byte); 0 for an empty unit.
pub fn nal_type(nal: &[u8]) -> u8 {
    nal.first().map_or(0, |b| b & 0x1f)
}

/// Splits an Annex B byte stream into NAL units (without start codes; trailing zero bytes, which
/// belong to the next 4-byte start code, are dropped). Bytes before the first start code are ignored.
pub fn split_annex_b(stream: &[u8]) -> Vec<&[u8]> {
    let mut starts = Vec::new(); // index of the first byte after each 00 00 01
    let mut i = 0;
    while i + 3 <= stream.len() {
        if stream[i] == 0 && stream[i + 1] == 0 && stream[i + 2] == 1 {
            starts.push(i + 3);
            i += 3;
        } else {
            i += 1;
        }
    }
    let mut nals = Vec::with_capacity(starts.len());
    for (k, &start) in starts.iter().enumerate() {
        let end = starts.get(k + 1).map_or(stream.len(), |&next| next - 3);
        let mut nal = &stream[start..end];
        while let [rest @ .., 0] = nal {
            nal = rest;
        }
        if !nal.is_empty() {
            nals.push(nal);
        }
    }
    nals
}

/// One SPS and one PPS (NAL units without start codes), as the init segment's `avcC` carries them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParameterSets {
    /// Sequence parameter set NAL unit (type 7), at least 4 bytes.
    pub sps: Vec<u8>,
    /// Picture parameter set NAL unit (type 8).
    pub pps: Vec<u8>,
}

impl ParameterSets {
    /// Takes the first SPS and the first PPS from an Annex B stream. Errors naming `backend` if either
    /// is missing or the SPS is too short to hold profile and level.
    pub fn from_annex_b(backend: &'static str, stream: &[u8]) -> Result<Self, EncodeError> {
        let nals = split_annex_b(stream);
        let find = |t: u8| nals.iter().find(|n| nal_type(n) == t).map(|n| n.to_vec());
        let sps = find(NAL_SPS).ok_or_else(|| EncodeError::Bitstream {
            backend,
            reason: "no SPS (NAL type 7) in the headers".into(),
        })?;
        let pps = find(NAL_PPS).ok_or_else(|| EncodeError::Bitstream {
            backend,
            reason: "no PPS (NAL type 8) in the headers".into(),
        })?;
        if sps.len() < 4 {
            return Err(EncodeError::Bitstream {
                backend,
                reason: format!("SPS of {} bytes, need at least 4", sps.len()),
            });
        }
        Ok(Self { sps, pps })
    }

    /// `profile_idc` (SPS byte 1): 66 Baseline, 77 Main, 100 High.
    pub fn profile_idc(&self) -> u8 {
        self.sps[1]
    }

    /// The constraint_set flags byte (SPS byte 2).
    pub fn constraint_flags(&self) -> u8 {
        self.sps[2]
    }

    /// `level_idc` (SPS byte 3): 10 × the level (31 = level 3.1).
    pub fn level_idc(&self) -> u8 {
        self.sps[3]
    }

    /// RFC 6381 codec string `avc1.PPCCLL` (lowercase hex of profile, constraints, level), e.g.
    /// `avc1.64001f` for High 3.1, `avc1.42c01e` for Constrained Baseline 3.0.
    pub fn codec_string(&self) -> String {
        format!(
            "avc1.{:02x}{:02x}{:02x}",
            self.profile_idc(),
            self.constraint_flags(),
            self.level_idc()
        )
    }
}

/// One encoded frame: an H.264 access unit in MP4 sample form (each NAL unit prefixed by its 4-byte
/// big-endian length; SPS, PPS and access unit delimiters removed: they live in the init segment).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AccessUnit {
    /// Index of the frame in the stream (0-based; also its presentation and decode order).
    pub frame_index: u64,
    /// An IDR picture: decoding can start here.
    pub keyframe: bool,
    /// Length-prefixed NAL units.
    pub data: Vec<u8>,
}

impl AccessUnit {
    /// Builds an access unit from one frame's Annex B output. In-band SPS/PPS, if any, must equal
    /// `params` (the init segment's): otherwise [`EncodeError::ParameterSetsChanged`].
    /// `keyframe` is true when the unit holds an IDR slice.
    pub fn from_annex_b(
        backend: &'static str,
        frame_index: u64,
        stream: &[u8],
        params: &ParameterSets,
    ) -> Result<Self, EncodeError> {
        let mut data = Vec::with_capacity(stream.len());
        let mut keyframe = false;
        let mut slices = 0usize;
        for nal in split_annex_b(stream) {
            match nal_type(nal) {
                NAL_SPS if nal != params.sps.as_slice() => {
                    return Err(EncodeError::ParameterSetsChanged { frame_index });
                }
                NAL_PPS if nal != params.pps.as_slice() => {
                    return Err(EncodeError::ParameterSetsChanged { frame_index });
                }
                NAL_SPS | NAL_PPS | NAL_AUD => continue,
                t => {
                    keyframe |= t == NAL_IDR;
                    slices += usize::from(t == 1 || t == NAL_IDR);
                }
            }
            let len = u32::try_from(nal.len()).map_err(|_| EncodeError::Bitstream {
                backend,
                reason: format!("NAL unit of {} bytes in frame {frame_index}", nal.len()),
            })?;
            data.extend_from_slice(&len.to_be_bytes());
            data.extend_from_slice(nal);
        }
        if slices == 0 {
            return Err(EncodeError::Bitstream {
                backend,
                reason: format!("frame {frame_index} has no coded slice"),
            });
        }
        Ok(Self {
            frame_index,
            keyframe,
            data,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SPS: [u8; 5] = [0x67, 0x64, 0x00, 0x1f, 0xac];
    const PPS: [u8; 3] = [0x68, 0xee, 0x3c];

    fn params() -> ParameterSets {
        ParameterSets {
            sps: SPS.to_vec(),
            pps: PPS.to_vec(),
        }
    }

    #[test]
    fn splits_three_and_four_byte_start_codes() {
        let stream = [
            0, 0, 0, 1, 0x67, 1, 2, 0, 0, 1, 0x68, 3, 0, 0, 0, 0, 1, 0x65, 4, 5,
        ];
        let nals = split_annex_b(&stream);
        assert_eq!(
            nals,
            vec![&[0x67, 1, 2][..], &[0x68, 3][..], &[0x65, 4, 5][..]]
        );
    }

    #[test]
    fn codec_string_from_sps() {
        assert_eq!(params().codec_string(), "avc1.64001f");
        let cb = ParameterSets {
            sps: vec![0x67, 0x42, 0xc0, 0x1e],
            pps: PPS.to_vec(),
        };
        assert_eq!(cb.codec_string(), "avc1.42c01e");
    }

    #[test]
    fn access_unit_drops_parameter_sets_and_length_prefixes() {
        let mut stream = vec![0, 0, 0, 1];
        stream.extend_from_slice(&SPS);
        stream.extend_from_slice(&[0, 0, 0, 1]);
        stream.extend_from_slice(&PPS);
        stream.extend_from_slice(&[0, 0, 0, 1, 0x06, 9, 0, 0, 1, 0x65, 7, 8]);
        let au = AccessUnit::from_annex_b("test", 0, &stream, &params()).expect("valid");
        assert!(au.keyframe);
        assert_eq!(au.data, vec![0, 0, 0, 2, 0x06, 9, 0, 0, 0, 3, 0x65, 7, 8]);

        let p = AccessUnit::from_annex_b("test", 1, &[0, 0, 1, 0x41, 1], &params()).expect("valid");
        assert!(!p.keyframe);

        let changed = [0, 0, 1, 0x67, 0x42, 0, 0x1e, 0, 0, 1, 0x65, 1];
        assert!(matches!(
            AccessUnit::from_annex_b("test", 5, &changed, &params()),
            Err(EncodeError::ParameterSetsChanged { frame_index: 5 })
        ));
        assert!(AccessUnit::from_annex_b("test", 2, &[0, 0, 1, 0x06, 1], &params()).is_err());
    }
}
