//! `ditstream plan`: validates a config and prints which rank holds which coordinates and
//! sequence shard, and every process group, so operators can check a layout before launching.

use std::fmt::Write as _;
use std::path::Path;

use anyhow::{Context, bail};
use ditstream_common::config::{Config, VaeSplitDim};
use ditstream_common::mesh::{CpLayout, GroupKind, LatentGeometry, Mesh, SeqShard, VideoShape};

/// Loads, validates and prints the plan for `config`.
pub fn run(config: &Path, world: Option<usize>, video: Option<&str>) -> anyhow::Result<()> {
    let cfg = Config::from_file(config)?;
    let mesh = cfg.validate(world)?;
    let video = match video {
        Some(v) => parse_video(v, cfg.geometry())?,
        None => cfg.default_video(),
    };
    print!("{}", render(&cfg, &mesh, video));
    Ok(())
}

fn parse_video(text: &str, geometry: LatentGeometry) -> anyhow::Result<VideoShape> {
    let parts: Vec<&str> = text.split('x').collect();
    let [w, h, f] = parts.as_slice() else {
        bail!("--video {text:?}: expected WIDTHxHEIGHTxFRAMES, e.g. 832x480x81");
    };
    let num = |s: &str, what: &str| -> anyhow::Result<usize> {
        s.parse()
            .with_context(|| format!("--video {text:?}: {what} {s:?} is not a number"))
    };
    let v = VideoShape {
        width: num(w, "width")?,
        height: num(h, "height")?,
        frames: num(f, "frames")?,
        geometry,
    };
    let m = geometry.pixel_multiple();
    if v.width == 0 || !v.width.is_multiple_of(m) || v.height == 0 || !v.height.is_multiple_of(m) {
        bail!("--video {text:?}: width and height must be positive multiples of {m}");
    }
    if !geometry.frames_fit(v.frames) {
        bail!(
            "--video {text:?}: frames must be {t}k+1 (1, {}, …)",
            geometry.temporal + 1,
            t = geometry.temporal
        );
    }
    Ok(v)
}

/// The plan as text: a summary, one line per rank, then every group.
pub fn render(cfg: &Config, mesh: &Mesh, video: VideoShape) -> String {
    let mut out = String::new();
    let model = cfg.model.preset.map_or_else(
        || {
            cfg.model
                .checkpoint
                .as_ref()
                .map_or("?".into(), |p| p.display().to_string())
        },
        |p| p.name().to_string(),
    );
    let tokens = video.tokens();
    let p = mesh.seq_size();
    let shard_len = tokens.div_ceil(p);
    // `write!` into a String cannot fail.
    let _ = writeln!(
        out,
        "model      {model} ({} heads)",
        cfg.num_heads().unwrap_or(0)
    );
    let _ = writeln!(out, "denoiser   {mesh}");
    let _ = writeln!(
        out,
        "video      {}x{} {} frames -> latent {:?} -> {tokens} tokens; {p} sequence shards of {shard_len} (+{} padding)",
        video.width,
        video.height,
        video.frames,
        video.latent_grid(),
        shard_len * p - tokens,
    );
    let _ = writeln!(out, "\nrank  cfg  tp  row  col  uly  seq_rank  tokens");
    for rank in 0..mesh.world_size() {
        let c = mesh.coord(rank);
        let s = SeqShard::new(tokens, p, mesh.seq_rank(rank));
        let pad = if s.padding() > 0 {
            format!(" +{} pad", s.padding())
        } else {
            String::new()
        };
        let _ = writeln!(
            out,
            "{rank:>4}  {:>3}  {:>2}  {:>3}  {:>3}  {:>3}  {:>8}  [{}, {}){pad}",
            c.cfg,
            c.tp,
            c.row,
            c.col,
            c.uly,
            s.seq_rank,
            s.start,
            s.start + s.valid,
        );
    }
    let _ = writeln!(out, "\ngroups");
    let ring = matches!(mesh.cp(), CpLayout::Ring(_));
    for kind in GroupKind::ALL {
        let groups = mesh.groups(kind);
        // Singleton groups carry no traffic; a ring has no Attention2D rows or columns.
        if groups[0].len() == 1 || (ring && matches!(kind, GroupKind::Row | GroupKind::Col)) {
            continue;
        }
        let list: Vec<String> = groups.iter().map(|g| format!("{g:?}")).collect();
        let _ = writeln!(out, "  {:<11} {}", kind.name(), list.join(" "));
    }
    let pc = &cfg.parallel_config;
    let vae = cfg.vae_layout();
    let (_, lh, lw) = video.latent_grid();
    let extent = match pc.parallel_vae_split_dim {
        VaeSplitDim::Height => lh,
        VaeSplitDim::Width => lw,
    };
    if vae.size() == 1 {
        let _ = writeln!(out, "\ndecoder    1 rank per instance (no parallel VAE)");
    } else {
        let bands: Vec<String> = (0..vae.size())
            .map(|r| {
                let (a, b) = vae.band(extent, r);
                format!("{r}:[{a},{b})")
            })
            .collect();
        let dim = format!("{:?}", pc.parallel_vae_split_dim).to_lowercase();
        let _ = writeln!(
            out,
            "\ndecoder    {} ranks per instance; latent {dim} {extent} split into {}; halo pairs {:?}",
            vae.size(),
            bands.join(" "),
            vae.neighbour_pairs(),
        );
    }
    out
}
