//! The device mesh: which rank holds which coordinates, which ranks talk to each other in each
//! collective, and which contiguous slice of the token sequence each rank owns. Pure logic, no
//! devices, so every layout is testable anywhere.
//!
//! Axis order is cfg – tp – cp(row, col) – ulysses, CFG outermost and Ulysses innermost, so the
//! Ulysses all-to-all (the most bandwidth-hungry and latency-sensitive collective) runs between
//! consecutive ranks, which share the fastest links:
//!
//! `rank = (((cfg·T + tp)·R + row)·C + col)·U + uly`
//!
//! Ring attention uses the cp axis as a single row dimension (R = ring size, C = 1); Attention2D
//! uses both. `cp_rank = row·C + col` and `seq_rank = cp_rank·U + uly` index the contiguous
//! sequence shard a rank owns.

use std::fmt;

/// How the context-parallel (cp) axis is used.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CpLayout {
    /// No context parallelism.
    None,
    /// Ring attention over this many ranks.
    Ring(usize),
    /// Attention2D over a `rows × cols` grid (arXiv 2503.15758).
    Attn2d {
        /// Rows R: the column group (fixed col) has R ranks and gathers K/V.
        rows: usize,
        /// Columns C: the row group (fixed row) has C ranks and gathers Q, combines outputs.
        cols: usize,
    },
}

impl CpLayout {
    /// Number of ranks on the cp axis.
    pub fn size(self) -> usize {
        let (r, c) = self.grid();
        r * c
    }

    /// `(rows, cols)` of the cp tile; a ring is `(ring, 1)`.
    pub fn grid(self) -> (usize, usize) {
        match self {
            CpLayout::None => (1, 1),
            CpLayout::Ring(n) => (n, 1),
            CpLayout::Attn2d { rows, cols } => (rows, cols),
        }
    }
}

impl fmt::Display for CpLayout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CpLayout::None => write!(f, "none"),
            CpLayout::Ring(n) => write!(f, "ring {n}"),
            CpLayout::Attn2d { rows, cols } => write!(f, "attn2d {rows}x{cols}"),
        }
    }
}

/// A rank's position on every axis.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Coord {
    /// Guidance branch: 0 conditional, 1 unconditional (when cfg_size = 2).
    pub cfg: usize,
    /// Tensor-parallel index.
    pub tp: usize,
    /// cp row (the ring index for Ring).
    pub row: usize,
    /// cp column (always 0 for Ring).
    pub col: usize,
    /// Ulysses index.
    pub uly: usize,
}

/// The kinds of process group the denoiser uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GroupKind {
    /// Same everything but cfg: all-gathers the noise prediction.
    Cfg,
    /// Same everything but tp.
    Tp,
    /// Same everything but uly: the Ulysses all-to-all.
    Ulysses,
    /// The whole cp tile (row and col vary): Ring's send/recv ring.
    Cp,
    /// Attention2D row group (fixed row, col varies): Q gather and output combine.
    Row,
    /// Attention2D column group (fixed col, row varies): K/V gather.
    Col,
    /// Every rank sharing a sequence: cp and Ulysses vary, ordered by `seq_rank`. Gathers the
    /// sharded sequence before unpatchify.
    Seq,
}

impl GroupKind {
    /// Every kind, in the order `plan` prints them.
    pub const ALL: [GroupKind; 7] = [
        GroupKind::Cfg,
        GroupKind::Tp,
        GroupKind::Cp,
        GroupKind::Row,
        GroupKind::Col,
        GroupKind::Ulysses,
        GroupKind::Seq,
    ];

    /// Short name for printing.
    pub fn name(self) -> &'static str {
        match self {
            GroupKind::Cfg => "cfg",
            GroupKind::Tp => "tp",
            GroupKind::Ulysses => "ulysses",
            GroupKind::Cp => "cp",
            GroupKind::Row => "attn2d-row",
            GroupKind::Col => "attn2d-col",
            GroupKind::Seq => "seq",
        }
    }
}

/// One process group as seen from one of its members.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Group {
    /// Global ranks, ordered by group rank.
    pub ranks: Vec<usize>,
    /// This rank's index in `ranks`.
    pub index: usize,
}

impl Group {
    /// Number of ranks in the group.
    pub fn size(&self) -> usize {
        self.ranks.len()
    }
}

/// The denoiser mesh. Build it through [`crate::config::Config::validate`], which checks the rules.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mesh {
    cfg: usize,
    tp: usize,
    cp: CpLayout,
    ulysses: usize,
}

impl Mesh {
    /// A mesh from axis sizes (each ≥ 1; validated by the config).
    pub fn new(cfg: usize, tp: usize, cp: CpLayout, ulysses: usize) -> Mesh {
        debug_assert!(cfg >= 1 && tp >= 1 && cp.size() >= 1 && ulysses >= 1);
        Mesh {
            cfg,
            tp,
            cp,
            ulysses,
        }
    }

    /// Total ranks.
    pub fn world_size(&self) -> usize {
        self.cfg * self.tp * self.cp.size() * self.ulysses
    }

    /// CFG degree.
    pub fn cfg_size(&self) -> usize {
        self.cfg
    }

    /// Ulysses degree.
    pub fn ulysses_size(&self) -> usize {
        self.ulysses
    }

    /// Context-parallel layout.
    pub fn cp(&self) -> CpLayout {
        self.cp
    }

    /// Ranks that share one sequence: cp × ulysses.
    pub fn seq_size(&self) -> usize {
        self.cp.size() * self.ulysses
    }

    /// Coordinates of `rank` (< world size).
    pub fn coord(&self, rank: usize) -> Coord {
        assert!(
            rank < self.world_size(),
            "rank {rank} outside world {}",
            self.world_size()
        );
        let (rows, cols) = self.cp.grid();
        let mut r = rank;
        let uly = r % self.ulysses;
        r /= self.ulysses;
        let col = r % cols;
        r /= cols;
        let row = r % rows;
        r /= rows;
        let tp = r % self.tp;
        Coord {
            cfg: r / self.tp,
            tp,
            row,
            col,
            uly,
        }
    }

    /// The rank at `c` (each coordinate within its axis).
    pub fn rank(&self, c: Coord) -> usize {
        let (rows, cols) = self.cp.grid();
        (((c.cfg * self.tp + c.tp) * rows + c.row) * cols + c.col) * self.ulysses + c.uly
    }

    /// Index of `rank` in the flattened cp tile: `row·C + col`.
    pub fn cp_rank(&self, rank: usize) -> usize {
        let c = self.coord(rank);
        c.row * self.cp.grid().1 + c.col
    }

    /// Index of the contiguous sequence shard `rank` owns: `cp_rank·U + uly`.
    pub fn seq_rank(&self, rank: usize) -> usize {
        self.cp_rank(rank) * self.ulysses + self.coord(rank).uly
    }

    /// The group of `kind` containing `rank`, ordered by the varying coordinate(s).
    pub fn group(&self, kind: GroupKind, rank: usize) -> Group {
        let c = self.coord(rank);
        let (rows, cols) = self.cp.grid();
        let ranks: Vec<usize> = match kind {
            GroupKind::Cfg => (0..self.cfg)
                .map(|i| self.rank(Coord { cfg: i, ..c }))
                .collect(),
            GroupKind::Tp => (0..self.tp)
                .map(|i| self.rank(Coord { tp: i, ..c }))
                .collect(),
            GroupKind::Ulysses => (0..self.ulysses)
                .map(|i| self.rank(Coord { uly: i, ..c }))
                .collect(),
            GroupKind::Row => (0..cols)
                .map(|i| self.rank(Coord { col: i, ..c }))
                .collect(),
            GroupKind::Col => (0..rows)
                .map(|i| self.rank(Coord { row: i, ..c }))
                .collect(),
            GroupKind::Cp => (0..rows * cols)
                .map(|i| {
                    self.rank(Coord {
                        row: i / cols,
                        col: i % cols,
                        ..c
                    })
                })
                .collect(),
            // Ordered by seq_rank = (row·C + col)·U + uly.
            GroupKind::Seq => (0..self.seq_size())
                .map(|i| {
                    let (cp, uly) = (i / self.ulysses, i % self.ulysses);
                    self.rank(Coord {
                        row: cp / cols,
                        col: cp % cols,
                        uly,
                        ..c
                    })
                })
                .collect(),
        };
        let index = ranks
            .iter()
            .position(|&r| r == rank)
            .expect("a rank belongs to its own group");
        Group { ranks, index }
    }

    /// All groups of `kind`, each once, ordered by their first rank: a partition of the world.
    pub fn groups(&self, kind: GroupKind) -> Vec<Vec<usize>> {
        let mut out: Vec<Vec<usize>> = Vec::new();
        for rank in 0..self.world_size() {
            let g = self.group(kind, rank);
            if g.index == 0 {
                out.push(g.ranks);
            }
        }
        out.sort_by_key(|g| g[0]);
        out
    }
}

impl fmt::Display for Mesh {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "cfg {} x tp {} x cp {} x ulysses {} = {} ranks",
            self.cfg,
            self.tp,
            self.cp,
            self.ulysses,
            self.world_size()
        )
    }
}

/// How a model maps video to latents and tokens: the VAE compresses `spatial`× in height and
/// width and `temporal`× in time (causally: frame 0 alone, then `temporal` frames per latent
/// frame), and the transformer patchifies `patch`×`patch` latent pixels into one token. It fixes
/// the latent grid of a video and the rules a request's size must keep: sides a multiple of
/// `spatial · patch` pixels, frames `temporal·k + 1`. The model's config owns it
/// ([`crate::config::Config::geometry`]); the decoder checks its VAE against it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LatentGeometry {
    /// VAE compression of height and width.
    pub spatial: usize,
    /// VAE compression of time (after the first frame).
    pub temporal: usize,
    /// The transformer's patch, in latent pixels per side.
    pub patch: usize,
}

impl LatentGeometry {
    /// The Wan 2.1 VAE (8×8 spatial, 4× temporal) under Wan's 1×2×2 patch.
    pub const WAN21: LatentGeometry = LatentGeometry {
        spatial: 8,
        temporal: 4,
        patch: 2,
    };
    /// The Wan 2.2 VAE (16×16 spatial, 4× temporal) under the 5B model's 1×2×2 patch.
    pub const WAN22: LatentGeometry = LatentGeometry {
        spatial: 16,
        temporal: 4,
        patch: 2,
    };

    /// Latent frames, height and width of a video of `frames` frames of `height`×`width` pixels.
    pub fn latent_grid(&self, frames: usize, height: usize, width: usize) -> (usize, usize, usize) {
        (
            (frames.max(1) - 1) / self.temporal + 1,
            height / self.spatial,
            width / self.spatial,
        )
    }

    /// What each side of a video must be a multiple of, in pixels.
    pub fn pixel_multiple(&self) -> usize {
        self.spatial * self.patch
    }

    /// Whether `frames` is `temporal·k + 1`.
    pub fn frames_fit(&self, frames: usize) -> bool {
        frames % self.temporal == 1
    }

    /// The first rule a video of `width`×`height` pixels and `frames` frames breaks, as
    /// (field, value, rule): sides a positive multiple of [`pixel_multiple`](Self::pixel_multiple),
    /// frames `temporal·k + 1`.
    pub fn check_size(
        &self,
        width: usize,
        height: usize,
        frames: usize,
    ) -> Result<(), (&'static str, usize, String)> {
        let m = self.pixel_multiple();
        for (field, side) in [("width", width), ("height", height)] {
            if side == 0 || side % m != 0 {
                return Err((field, side, format!("must be a positive multiple of {m}")));
            }
        }
        if !self.frames_fit(frames) {
            return Err((
                "num_frames",
                frames,
                format!("must be {}k+1", self.temporal),
            ));
        }
        Ok(())
    }
}

/// A video request's pixel shape, under its model's geometry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VideoShape {
    /// Width in pixels.
    pub width: usize,
    /// Height in pixels.
    pub height: usize,
    /// Frames (`temporal·k + 1`).
    pub frames: usize,
    /// How the model maps it to latents and tokens.
    pub geometry: LatentGeometry,
}

impl VideoShape {
    /// Latent grid `(frames, height, width)`.
    pub fn latent_grid(&self) -> (usize, usize, usize) {
        self.geometry
            .latent_grid(self.frames, self.height, self.width)
    }

    /// DiT tokens after patchification.
    pub fn tokens(&self) -> usize {
        let (t, h, w) = self.latent_grid();
        let p = self.geometry.patch;
        t * (h / p) * (w / p)
    }
}

/// The contiguous slice of the token sequence one sequence rank owns. When the sequence degree
/// does not divide the token count, the sequence is padded to `shard_len × P` and the padding sits
/// at the end (so it lands on the last ranks); attention masks padded keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SeqShard {
    /// Index of the shard (= `seq_rank`).
    pub seq_rank: usize,
    /// First token of the shard in the padded sequence.
    pub start: usize,
    /// Real (unpadded) tokens in the shard; may be 0 for a trailing shard.
    pub valid: usize,
    /// Tokens every shard holds, padding included: `ceil(tokens / P)`.
    pub shard_len: usize,
}

impl SeqShard {
    /// Shard `seq_rank` of `tokens` split over `seq_size` ranks.
    pub fn new(tokens: usize, seq_size: usize, seq_rank: usize) -> SeqShard {
        assert!(
            seq_rank < seq_size,
            "seq_rank {seq_rank} outside {seq_size}"
        );
        let shard_len = tokens.div_ceil(seq_size);
        let start = seq_rank * shard_len;
        let valid = tokens.saturating_sub(start).min(shard_len);
        SeqShard {
            seq_rank,
            start,
            valid,
            shard_len,
        }
    }

    /// Padding tokens in this shard.
    pub fn padding(&self) -> usize {
        self.shard_len - self.valid
    }
}

/// One decoder instance's spatially sharded VAE: `size` ranks each own a contiguous band of the
/// latent along the split dimension, exchanging one-row halos with their neighbours.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VaeLayout {
    size: usize,
}

impl VaeLayout {
    /// A layout of `size` ranks (≥ 1, validated by the config).
    pub fn new(size: usize) -> VaeLayout {
        VaeLayout { size: size.max(1) }
    }

    /// Ranks in the instance.
    pub fn size(&self) -> usize {
        self.size
    }

    /// Neighbour pairs `(i, i+1)` that exchange halos.
    pub fn neighbour_pairs(&self) -> Vec<(usize, usize)> {
        (1..self.size).map(|i| (i - 1, i)).collect()
    }

    /// `(previous, next)` neighbours of `rank`; `None` at a true image border (zero halo).
    pub fn neighbours(&self, rank: usize) -> (Option<usize>, Option<usize>) {
        (
            (rank > 0).then(|| rank - 1),
            (rank + 1 < self.size).then_some(rank + 1),
        )
    }

    /// Band `[start, end)` of a split dimension of `extent` owned by `rank`. Uneven splits give the
    /// first `extent % size` ranks one extra row, so bands differ by at most one.
    pub fn band(&self, extent: usize, rank: usize) -> (usize, usize) {
        let (base, extra) = (extent / self.size, extent % self.size);
        let start = rank * base + rank.min(extra);
        (start, start + base + usize::from(rank < extra))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    /// Every mesh the validation accepts up to `max_world` ranks (tp is 1 until TP lands).
    fn all_meshes(max_world: usize) -> Vec<Mesh> {
        let mut out = Vec::new();
        for cfg in 1..=2 {
            for uly in 1..=max_world {
                let mut cps = vec![CpLayout::None];
                cps.extend((2..=max_world).map(CpLayout::Ring));
                for rows in 1..=max_world {
                    for cols in 1..=max_world {
                        if rows * cols > 1 {
                            cps.push(CpLayout::Attn2d { rows, cols });
                        }
                    }
                }
                for cp in cps {
                    let m = Mesh::new(cfg, 1, cp, uly);
                    if m.world_size() <= max_world {
                        out.push(m);
                    }
                }
            }
        }
        out
    }

    #[test]
    fn coords_round_trip_and_are_unique() {
        for m in all_meshes(72) {
            let mut seen = HashSet::new();
            for rank in 0..m.world_size() {
                let c = m.coord(rank);
                assert_eq!(m.rank(c), rank, "{m}");
                assert!(seen.insert(c), "{m}: duplicate coordinates {c:?}");
            }
        }
    }

    #[test]
    fn groups_partition_the_world_with_the_right_sizes() {
        let meshes = all_meshes(72);
        assert!(
            meshes.len() > 1000,
            "enumerated only {} layouts",
            meshes.len()
        );
        for m in meshes {
            let (rows, cols) = m.cp().grid();
            for kind in GroupKind::ALL {
                let expected = match kind {
                    GroupKind::Cfg => m.cfg_size(),
                    GroupKind::Tp => 1,
                    GroupKind::Ulysses => m.ulysses_size(),
                    GroupKind::Cp => rows * cols,
                    GroupKind::Row => cols,
                    GroupKind::Col => rows,
                    GroupKind::Seq => m.seq_size(),
                };
                let groups = m.groups(kind);
                assert_eq!(groups.len() * expected, m.world_size(), "{m} {kind:?}");
                let mut covered = vec![false; m.world_size()];
                for g in &groups {
                    assert_eq!(g.len(), expected, "{m} {kind:?}");
                    for &r in g {
                        assert!(!covered[r], "{m} {kind:?}: rank {r} in two groups");
                        covered[r] = true;
                        // Every member sees the same group, with itself at its own index.
                        let seen = m.group(kind, r);
                        assert_eq!(&seen.ranks, g);
                        assert_eq!(g[seen.index], r);
                    }
                }
                assert!(covered.iter().all(|&c| c), "{m} {kind:?}: not a partition");
            }
        }
    }

    #[test]
    fn sequence_shards_are_contiguous_and_ordered() {
        for m in all_meshes(72) {
            for g in m.groups(GroupKind::Seq) {
                // Group order is seq_rank order, and seq ranks are 0..P.
                for (i, &r) in g.iter().enumerate() {
                    assert_eq!(m.seq_rank(r), i, "{m}");
                }
            }
            for tokens in [1, 7, 32_760, 75_600] {
                let p = m.seq_size();
                let mut next = 0;
                let mut total_valid = 0;
                for s in 0..p {
                    let shard = SeqShard::new(tokens, p, s);
                    assert_eq!(shard.start, next, "{m} tokens {tokens}");
                    next += shard.shard_len;
                    total_valid += shard.valid;
                    // Valid tokens form one prefix: once a shard is short, later ones are empty.
                    if shard.valid < shard.shard_len {
                        for later in s + 1..p {
                            assert_eq!(SeqShard::new(tokens, p, later).valid, 0);
                        }
                    }
                }
                assert_eq!(total_valid, tokens);
                assert!(
                    next - tokens < p,
                    "padding must be less than one token per rank"
                );
            }
        }
    }

    #[test]
    fn nvl72_recipe_matches_hand_written_layout() {
        // cfg 2 · ulysses 4 · attn2d 3×3 (reference/visualgen.md §2):
        // rank = ((cfg·3 + row)·3 + col)·4 + uly.
        let m = Mesh::new(2, 1, CpLayout::Attn2d { rows: 3, cols: 3 }, 4);
        assert_eq!(m.world_size(), 72);
        assert_eq!(m.group(GroupKind::Ulysses, 0).ranks, vec![0, 1, 2, 3]);
        assert_eq!(m.group(GroupKind::Ulysses, 45).ranks, vec![44, 45, 46, 47]);
        // Row group: fixed row, col varies: stride 4.
        assert_eq!(m.group(GroupKind::Row, 0).ranks, vec![0, 4, 8]);
        assert_eq!(m.group(GroupKind::Row, 13).ranks, vec![13, 17, 21]);
        // Column group: fixed col, row varies: stride 12.
        assert_eq!(m.group(GroupKind::Col, 0).ranks, vec![0, 12, 24]);
        assert_eq!(m.group(GroupKind::Col, 5).ranks, vec![5, 17, 29]);
        // CFG: stride 36.
        assert_eq!(m.group(GroupKind::Cfg, 7).ranks, vec![7, 43]);
        assert_eq!(
            m.coord(43),
            Coord {
                cfg: 1,
                tp: 0,
                row: 0,
                col: 1,
                uly: 3
            }
        );
        // The sequence group of cfg 0 is ranks 0..36 in order; cfg 1's is 36..72.
        assert_eq!(
            m.group(GroupKind::Seq, 10).ranks,
            (0..36).collect::<Vec<_>>()
        );
        assert_eq!(
            m.group(GroupKind::Seq, 40).ranks,
            (36..72).collect::<Vec<_>>()
        );
        assert_eq!(m.seq_rank(43), 7);
    }

    #[test]
    fn small_layouts_match_hand_written_expectations() {
        // cfg 2 on 2 GPUs: one branch per GPU.
        let m = Mesh::new(2, 1, CpLayout::None, 1);
        assert_eq!(m.groups(GroupKind::Cfg), vec![vec![0, 1]]);
        assert_eq!(m.groups(GroupKind::Seq), vec![vec![0], vec![1]]);
        // ring 2 × ulysses 2: Ulysses pairs (0,1),(2,3); ring pairs (0,2),(1,3).
        let m = Mesh::new(1, 1, CpLayout::Ring(2), 2);
        assert_eq!(m.groups(GroupKind::Ulysses), vec![vec![0, 1], vec![2, 3]]);
        assert_eq!(m.groups(GroupKind::Cp), vec![vec![0, 2], vec![1, 3]]);
        assert_eq!(
            m.groups(GroupKind::Row),
            vec![vec![0], vec![1], vec![2], vec![3]]
        );
        // attn2d 2×1: the column group holds both ranks (K/V gather), rows are singletons.
        let m = Mesh::new(1, 1, CpLayout::Attn2d { rows: 2, cols: 1 }, 1);
        assert_eq!(m.groups(GroupKind::Col), vec![vec![0, 1]]);
        assert_eq!(m.groups(GroupKind::Row), vec![vec![0], vec![1]]);
        // attn2d 1×2: the row group holds both (Q gather, output combine).
        let m = Mesh::new(1, 1, CpLayout::Attn2d { rows: 1, cols: 2 }, 1);
        assert_eq!(m.groups(GroupKind::Row), vec![vec![0, 1]]);
    }

    #[test]
    fn a_size_that_breaks_the_geometry_names_the_field_and_the_rule() {
        let g = LatentGeometry::WAN21;
        assert_eq!(g.check_size(832, 480, 81), Ok(()));
        assert_eq!(
            g.check_size(830, 480, 81),
            Err((
                "width",
                830,
                "must be a positive multiple of 16".to_string()
            ))
        );
        assert_eq!(
            g.check_size(832, 0, 81),
            Err(("height", 0, "must be a positive multiple of 16".to_string()))
        );
        assert_eq!(
            g.check_size(832, 480, 80),
            Err(("num_frames", 80, "must be 4k+1".to_string()))
        );
    }

    #[test]
    fn padded_shards_for_81_frames() {
        // 480p 81 frames is 32,760 tokens; 7 sequence ranks do not divide it.
        let v = VideoShape {
            width: 832,
            height: 480,
            frames: 81,
            geometry: LatentGeometry::WAN21,
        };
        assert_eq!(v.tokens(), 32_760);
        let last = SeqShard::new(v.tokens(), 7, 6);
        assert_eq!(
            (last.shard_len, last.start, last.valid, last.padding()),
            (4680, 28_080, 4680, 0)
        );
        let s = SeqShard::new(75_600, 72, 71);
        assert_eq!((s.shard_len, s.valid), (1050, 1050));
        let s = SeqShard::new(10, 4, 3);
        assert_eq!((s.shard_len, s.start, s.valid, s.padding()), (3, 9, 1, 2));
    }

    #[test]
    fn vae_bands_cover_uneven_extents() {
        for size in 1..=8 {
            let vae = VaeLayout::new(size);
            assert_eq!(vae.neighbour_pairs().len(), size - 1);
            for extent in [size, 60, 61, 90, 160] {
                let mut next = 0;
                for rank in 0..size {
                    let (start, end) = vae.band(extent, rank);
                    assert_eq!(start, next);
                    assert!(end - start == extent / size || end - start == extent / size + 1);
                    next = end;
                }
                assert_eq!(next, extent);
            }
        }
        assert_eq!(VaeLayout::new(3).neighbours(0), (None, Some(1)));
        assert_eq!(VaeLayout::new(3).neighbours(2), (Some(1), None));
    }
}
