//! [`Shard`]: which part of a request's frames one rank of a parallel-VAE instance owns, at every
//! resolution of the decoder. Geometry only; no communication.
//!
//! The latent's split extent (height or width) is cut into contiguous bands by
//! [`VaeLayout::band`] (uneven extents give the first `extent % size` ranks one more latent row).
//! Bands are fixed at the latent and scaled, never recomputed at a higher resolution: the nearest ×2
//! upsampling maps latent rows [s, e) onto rows [2s, 2e), so at spatial scale f a rank owns
//! rows [f·s, f·e). (`VaeLayout::band(f·extent)` would differ for uneven splits.)

use ditstream_common::config::VaeSplitDim;
use ditstream_common::mesh::VaeLayout;
use ditstream_kernels::Tensor;

use super::error::{ParallelVaeError, Result};

/// One rank's band of one request: the split dimension, the instance's layout, the caller's rank
/// and the whole latent's size. "Rows" below are the split dimension's lines (columns for a width
/// split).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shard {
    split_dim: VaeSplitDim,
    layout: VaeLayout,
    rank: usize,
    latent_height: usize,
    latent_width: usize,
}

impl Shard {
    /// The band of group rank `rank` of `size` ranks for a latent of `latent_height` ×
    /// `latent_width`. Every rank needs at least one latent row of the split dimension.
    pub fn new(
        split_dim: VaeSplitDim,
        size: usize,
        rank: usize,
        latent_height: usize,
        latent_width: usize,
    ) -> Result<Self> {
        let extent = match split_dim {
            VaeSplitDim::Height => latent_height,
            VaeSplitDim::Width => latent_width,
        };
        if size == 0 || extent < size {
            return Err(ParallelVaeError::SplitTooFine {
                split_dim,
                extent,
                latent_height,
                latent_width,
                size,
            });
        }
        if rank >= size {
            return Err(ParallelVaeError::RankOutOfRange { rank, size });
        }
        Ok(Shard {
            split_dim,
            layout: VaeLayout::new(size),
            rank,
            latent_height,
            latent_width,
        })
    }

    /// The split dimension.
    pub fn split_dim(&self) -> VaeSplitDim {
        self.split_dim
    }

    /// Ranks in the instance.
    pub fn size(&self) -> usize {
        self.layout.size()
    }

    /// The caller's group rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// `(previous, next)` ranks along the split axis; `None` at a true image border.
    pub fn neighbours(&self) -> (Option<usize>, Option<usize>) {
        self.layout.neighbours(self.rank)
    }

    /// The whole latent's (height, width).
    pub fn latent_size(&self) -> (usize, usize) {
        (self.latent_height, self.latent_width)
    }

    /// Axis of the split dimension in [B, C, T, H, W] tensors: 3 (height) or 4 (width).
    pub fn axis(&self) -> usize {
        match self.split_dim {
            VaeSplitDim::Height => 3,
            VaeSplitDim::Width => 4,
        }
    }

    /// The whole latent's extent along the split dimension.
    pub fn latent_extent(&self) -> usize {
        match self.split_dim {
            VaeSplitDim::Height => self.latent_height,
            VaeSplitDim::Width => self.latent_width,
        }
    }

    /// The whole latent's extent along the other (unsplit) dimension.
    pub fn latent_other_extent(&self) -> usize {
        match self.split_dim {
            VaeSplitDim::Height => self.latent_width,
            VaeSplitDim::Width => self.latent_height,
        }
    }

    /// Latent rows `[start, end)` owned by `rank`.
    pub fn latent_band(&self, rank: usize) -> (usize, usize) {
        self.layout.band(self.latent_extent(), rank)
    }

    /// Rows owned by `rank` at spatial scale `scale` (1 at the latent, 8 in Wan 2.1's video).
    pub fn band_len(&self, rank: usize, scale: usize) -> usize {
        let (start, end) = self.latent_band(rank);
        (end - start) * scale
    }

    /// The spatial scale at which this rank owns `local_rows` rows, if any (a whole multiple of its
    /// latent band).
    pub fn scale_of(&self, local_rows: usize) -> Option<usize> {
        let own = self.band_len(self.rank, 1);
        (local_rows > 0 && local_rows.is_multiple_of(own)).then(|| local_rows / own)
    }

    /// This rank's [B, C, T, h, w] band (along [`Shard::axis`]) of a whole-latent tensor
    /// [B, C, T, H, W] (H, W the latent size).
    pub fn narrow(&self, whole: &Tensor) -> Result<Tensor> {
        let shape = whole.shape();
        if shape.len() != 5 || (shape[3], shape[4]) != (self.latent_height, self.latent_width) {
            return Err(ParallelVaeError::WholeLatentShape {
                latent_height: self.latent_height,
                latent_width: self.latent_width,
                shape: shape.to_vec(),
            });
        }
        let (start, end) = self.latent_band(self.rank);
        Ok(whole.narrow(self.axis(), start, end - start)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bands_scale_with_the_resolution_and_tile_the_frame() -> Result<()> {
        // 6 latent rows over 4 ranks: 2, 2, 1, 1; at scale 8: 16, 16, 8, 8 (not band(48)'s 12 each).
        let shards = (0..4)
            .map(|r| Shard::new(VaeSplitDim::Height, 4, r, 6, 10))
            .collect::<Result<Vec<_>>>()?;
        let lens: Vec<usize> = shards.iter().map(|s| s.band_len(s.rank(), 8)).collect();
        assert_eq!(lens, [16, 16, 8, 8]);
        assert_eq!(shards[2].scale_of(8), Some(8));
        assert_eq!(shards[0].scale_of(3), None);
        assert_eq!(shards[0].latent_other_extent(), 10);
        assert_eq!(shards[3].neighbours(), (Some(2), None));
        Ok(())
    }

    #[test]
    fn a_split_finer_than_the_latent_is_refused() {
        assert!(matches!(
            Shard::new(VaeSplitDim::Width, 11, 0, 6, 10),
            Err(ParallelVaeError::SplitTooFine {
                extent: 10,
                size: 11,
                ..
            })
        ));
        assert!(Shard::new(VaeSplitDim::Height, 6, 5, 6, 10).is_ok());
        assert!(matches!(
            Shard::new(VaeSplitDim::Height, 2, 2, 6, 10),
            Err(ParallelVaeError::RankOutOfRange { rank: 2, size: 2 })
        ));
    }
}
