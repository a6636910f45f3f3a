//! Pixels before encoding: RGB8 frames, YUV 4:2:0 frames, the RGB → YUV conversion (BT.601, limited
//! range), and the VAE-output conversion ([C, T, H, W] floats in [-1, 1] → RGB8, as diffusers does it).

use super::EncodeError;

/// One RGB frame, 8 bits per channel, interleaved (`r g b r g b …`), rows top to bottom, no padding:
/// `data.len() == width * height * 3`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RgbFrame {
    width: u32,
    height: u32,
    data: Vec<u8>,
}

impl RgbFrame {
    /// Wraps `data` ([H, W, 3] u8, interleaved). Errors if its length is not `width * height * 3`.
    pub fn new(width: u32, height: u32, data: Vec<u8>) -> Result<Self, EncodeError> {
        let expected = width as usize * height as usize * 3;
        if data.len() != expected {
            return Err(EncodeError::BufferLength {
                what: "rgb24",
                shape: format!("[{height}, {width}, 3]"),
                expected,
                got: data.len(),
            });
        }
        Ok(Self {
            width,
            height,
            data,
        })
    }

    /// Width in pixels.
    pub fn width(&self) -> u32 {
        self.width
    }

    /// Height in pixels.
    pub fn height(&self) -> u32 {
        self.height
    }

    /// The pixels, [H, W, 3] interleaved.
    pub fn data(&self) -> &[u8] {
        &self.data
    }

    /// Gives the pixel buffer back.
    pub fn into_data(self) -> Vec<u8> {
        self.data
    }
}

/// One frame in planar YUV 4:2:0 (I420), BT.601 limited range: Y in [16, 235], Cb/Cr in [16, 240].
/// Planes are tightly packed: `y` is `width × height`, `u` and `v` are `width/2 × height/2`.
/// Width and height are even.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Yuv420Frame {
    width: u32,
    height: u32,
    y: Vec<u8>,
    u: Vec<u8>,
    v: Vec<u8>,
}

impl Yuv420Frame {
    /// Wraps three planes. Errors on odd or zero sizes and on plane lengths that do not match.
    pub fn new(
        width: u32,
        height: u32,
        y: Vec<u8>,
        u: Vec<u8>,
        v: Vec<u8>,
    ) -> Result<Self, EncodeError> {
        check_dimensions(width, height)?;
        let (w, h) = (width as usize, height as usize);
        let shape = format!("{width}x{height}");
        for (what, plane, expected) in [
            ("yuv420 y plane", &y, w * h),
            ("yuv420 u plane", &u, w * h / 4),
            ("yuv420 v plane", &v, w * h / 4),
        ] {
            if plane.len() != expected {
                return Err(EncodeError::BufferLength {
                    what,
                    shape: shape.clone(),
                    expected,
                    got: plane.len(),
                });
            }
        }
        Ok(Self {
            width,
            height,
            y,
            u,
            v,
        })
    }

    /// Converts an RGB frame (BT.601 matrix, limited range; see [`rgb_to_yuv420`]).
    pub fn from_rgb(rgb: &RgbFrame) -> Result<Self, EncodeError> {
        rgb_to_yuv420(rgb)
    }

    /// Width in pixels (even).
    pub fn width(&self) -> u32 {
        self.width
    }

    /// Height in pixels (even).
    pub fn height(&self) -> u32 {
        self.height
    }

    /// Luma plane, `width × height`.
    pub fn y(&self) -> &[u8] {
        &self.y
    }

    /// Cb plane, `width/2 × height/2`.
    pub fn u(&self) -> &[u8] {
        &self.u
    }

    /// Cr plane, `width/2 × height/2`.
    pub fn v(&self) -> &[u8] {
        &self.v
    }
}

/// Largest width or height accepted (H.264 level 6.2 tops out at 8192 × 4320; OpenH264 itself stops
/// at 3840 × 2160 and says so when opened).
pub const MAX_DIMENSION: u32 = 8192;

/// Checks the size rules every frame and stream obeys: non-zero, at most [`MAX_DIMENSION`], and even
/// (H.264 4:2:0 subsamples chroma 2×2, and neither backend crops odd sizes).
pub fn check_dimensions(width: u32, height: u32) -> Result<(), EncodeError> {
    for (name, value) in [("width", width), ("height", height)] {
        if value == 0 {
            return Err(EncodeError::Dimension {
                name,
                value,
                rule: "must be positive",
            });
        }
        if value > MAX_DIMENSION {
            return Err(EncodeError::Dimension {
                name,
                value,
                rule: "must be at most 8192 (H.264 level 6.2)",
            });
        }
        if value % 2 != 0 {
            return Err(EncodeError::Dimension {
                name,
                value,
                rule: "must be even (H.264 4:2:0 subsamples chroma 2x2)",
            });
        }
    }
    Ok(())
}

/// Fixed-point (×2^16) form of a conversion coefficient, rounded to nearest.
const fn fix16(x: f64) -> i32 {
    if x < 0.0 {
        -((-x * 65536.0 + 0.5) as i32)
    } else {
        (x * 65536.0 + 0.5) as i32
    }
}

// BT.601 (Kr = 0.299, Kb = 0.114), limited range: Y = 16 + 219/255·(Kr R + Kg G + Kb B),
// Cb = 128 + 224/255·(B − Y')/(2(1 − Kb)), Cr = 128 + 224/255·(R − Y')/(2(1 − Kr)).
const Y_SCALE: f64 = 219.0 / 255.0;
const C_SCALE: f64 = 224.0 / 255.0;
const YR: i32 = fix16(Y_SCALE * 0.299);
const YG: i32 = fix16(Y_SCALE * 0.587);
const YB: i32 = fix16(Y_SCALE * 0.114);
const UR: i32 = fix16(C_SCALE * -0.299 / 1.772);
const UG: i32 = fix16(C_SCALE * -0.587 / 1.772);
const UB: i32 = fix16(C_SCALE * 0.5);
const VR: i32 = fix16(C_SCALE * 0.5);
const VG: i32 = fix16(C_SCALE * -0.587 / 1.402);
const VB: i32 = fix16(C_SCALE * -0.114 / 1.402);

/// RGB8 → YUV 4:2:0 with the BT.601 matrix in limited ("TV", "MPEG") range, the combination the
/// encoders signal in the H.264 VUI and the MP4 `colr` box (primaries, transfer and matrix all
/// SMPTE 170M, `full_range = 0`), so every player converts back the same way.
///
/// Luma per pixel; chroma from the mean of each 2×2 block (chroma sited at the block centre, as
/// libyuv's `ARGBToI420` does). Fixed point with 16 fractional bits, rounded to nearest.
/// Errors on odd or zero sizes.
pub fn rgb_to_yuv420(rgb: &RgbFrame) -> Result<Yuv420Frame, EncodeError> {
    check_dimensions(rgb.width, rgb.height)?;
    let (w, h) = (rgb.width as usize, rgb.height as usize);
    let src = &rgb.data;
    let mut y = vec![0u8; w * h];
    let mut u = vec![0u8; w * h / 4];
    let mut v = vec![0u8; w * h / 4];

    for (row, y_row) in y.chunks_exact_mut(w).enumerate() {
        let src_row = &src[row * w * 3..(row + 1) * w * 3];
        for (px, out) in src_row.chunks_exact(3).zip(y_row.iter_mut()) {
            let (r, g, b) = (i32::from(px[0]), i32::from(px[1]), i32::from(px[2]));
            let luma = (YR * r + YG * g + YB * b + (16 << 16) + (1 << 15)) >> 16;
            *out = luma.clamp(0, 255) as u8;
        }
    }

    let cw = w / 2;
    for crow in 0..h / 2 {
        let top = &src[2 * crow * w * 3..(2 * crow + 1) * w * 3];
        let bottom = &src[(2 * crow + 1) * w * 3..(2 * crow + 2) * w * 3];
        for ccol in 0..cw {
            let i = ccol * 6;
            let sum = |c: usize| {
                i32::from(top[i + c])
                    + i32::from(top[i + 3 + c])
                    + i32::from(bottom[i + c])
                    + i32::from(bottom[i + 3 + c])
            };
            let (r, g, b) = (sum(0), sum(1), sum(2));
            // The sums are 4× the block mean: shift by 2 more bits.
            let cb = (UR * r + UG * g + UB * b + (128 << 18) + (1 << 17)) >> 18;
            let cr = (VR * r + VG * g + VB * b + (128 << 18) + (1 << 17)) >> 18;
            u[crow * cw + ccol] = cb.clamp(0, 255) as u8;
            v[crow * cw + ccol] = cr.clamp(0, 255) as u8;
        }
    }
    Ok(Yuv420Frame {
        width: rgb.width,
        height: rgb.height,
        y,
        u,
        v,
    })
}

/// One VAE output value in [-1, 1] → one 8-bit channel value, exactly as diffusers' postprocessing
/// (`VaeImageProcessor.denormalize` then `numpy_to_pil`): `round(clamp(x·0.5 + 0.5, 0, 1) · 255)` in f32,
/// rounding half to even (numpy's and torch's `round`), so 0.0 → 127.5 → 128. NaN maps to 0.
pub fn vae_value_to_u8(x: f32) -> u8 {
    let unit = (x * 0.5 + 0.5).clamp(0.0, 1.0);
    // In [0, 255] after the clamp; `as` maps NaN to 0.
    (unit * 255.0).round_ties_even() as u8
}

/// Decoded video as the VAE returns it, `data`: [C = 3, T, H, W] f32 in [-1, 1] (contiguous, one batch
/// element) → `T` RGB frames of `W × H`, converted with [`vae_value_to_u8`]. This is the encoder's
/// input for one decoded chunk (`T` = 1 for latent frame 0, 4 for every later one).
///
/// Errors if `channels != 3` or `data.len() != 3·T·H·W`. Sizes are checked again (even) when the
/// frames are encoded.
pub fn vae_output_to_rgb(
    data: &[f32],
    channels: usize,
    frames: usize,
    height: usize,
    width: usize,
) -> Result<Vec<RgbFrame>, EncodeError> {
    if channels != 3 {
        return Err(EncodeError::Channels { channels });
    }
    let plane = height * width;
    let expected = channels * frames * plane;
    if data.len() != expected {
        return Err(EncodeError::BufferLength {
            what: "vae output [C, T, H, W]",
            shape: format!("[{channels}, {frames}, {height}, {width}]"),
            expected,
            got: data.len(),
        });
    }
    let (w32, h32) = dims_u32(width, height)?;
    let channel_stride = frames * plane;
    (0..frames)
        .map(|t| {
            let r = &data[t * plane..(t + 1) * plane];
            let g = &data[channel_stride + t * plane..channel_stride + (t + 1) * plane];
            let b = &data[2 * channel_stride + t * plane..2 * channel_stride + (t + 1) * plane];
            let mut rgb = Vec::with_capacity(plane * 3);
            for i in 0..plane {
                rgb.extend_from_slice(&[
                    vae_value_to_u8(r[i]),
                    vae_value_to_u8(g[i]),
                    vae_value_to_u8(b[i]),
                ]);
            }
            Ok(RgbFrame {
                width: w32,
                height: h32,
                data: rgb,
            })
        })
        .collect()
}

fn dims_u32(width: usize, height: usize) -> Result<(u32, u32), EncodeError> {
    let w = u32::try_from(width).map_err(|_| EncodeError::Dimension {
        name: "width",
        value: u32::MAX,
        rule: "must fit in 32 bits",
    })?;
    let h = u32::try_from(height).map_err(|_| EncodeError::Dimension {
        name: "height",
        value: u32::MAX,
        rule: "must fit in 32 bits",
    })?;
    Ok((w, h))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn solid(r: u8, g: u8, b: u8) -> Yuv420Frame {
        let rgb = RgbFrame::new(2, 2, [r, g, b].repeat(4)).expect("2x2x3 bytes");
        rgb_to_yuv420(&rgb).expect("even size")
    }

    #[test]
    fn bt601_limited_range_reference_colours() {
        // Reference values: ITU-R BT.601 studio range (e.g. the tables in Poynton, "Digital Video and HD").
        let cases = [
            ((0, 0, 0), (16, 128, 128)),
            ((255, 255, 255), (235, 128, 128)),
            ((255, 0, 0), (81, 90, 240)),
            ((0, 255, 0), (145, 54, 34)),
            ((0, 0, 255), (41, 240, 110)),
        ];
        for ((r, g, b), (y, u, v)) in cases {
            let f = solid(r, g, b);
            assert_eq!((f.y()[0], f.u()[0], f.v()[0]), (y, u, v), "rgb {r},{g},{b}");
        }
    }

    #[test]
    fn chroma_is_the_mean_of_each_2x2_block() {
        // Left column red, right column blue: chroma is the conversion of their mean (127.5, 0, 127.5).
        let rgb = RgbFrame::new(2, 2, vec![255, 0, 0, 0, 0, 255, 255, 0, 0, 0, 0, 255])
            .expect("12 bytes");
        let f = rgb_to_yuv420(&rgb).expect("even");
        assert_eq!(f.y(), &[81, 41, 81, 41]);
        // Cb = 128 + 224/255·(−0.168736·127.5 + 0.5·127.5) = 165.1; Cr = 128 + 224/255·(0.5·127.5 − 0.081312·127.5) = 174.9
        assert_eq!((f.u()[0], f.v()[0]), (165, 175));
    }

    #[test]
    fn odd_and_zero_sizes_are_refused_naming_the_value() {
        let err = rgb_to_yuv420(&RgbFrame::new(3, 2, vec![0; 18]).expect("18 bytes"))
            .expect_err("odd width");
        assert!(
            err.to_string().contains("width = 3") && err.to_string().contains("even"),
            "{err}"
        );
        let err = check_dimensions(4, 7).expect_err("odd height");
        assert!(err.to_string().contains("height = 7"), "{err}");
        assert!(check_dimensions(0, 2).is_err());
        assert!(
            check_dimensions(8194, 2)
                .expect_err("too wide")
                .to_string()
                .contains("8194")
        );
    }

    #[test]
    fn vae_values_follow_diffusers_postprocessing() {
        assert_eq!(vae_value_to_u8(-1.0), 0);
        assert_eq!(vae_value_to_u8(1.0), 255);
        assert_eq!(vae_value_to_u8(0.0), 128); // 127.5 rounds half to even
        assert_eq!(vae_value_to_u8(-3.0), 0);
        assert_eq!(vae_value_to_u8(7.0), 255);
        assert_eq!(vae_value_to_u8(f32::NAN), 0);
        // 2·(2.5/255) − 1 → 2.5 → rounds to 2 (half to even), as numpy does.
        assert_eq!(vae_value_to_u8(2.0 * (2.5 / 255.0) - 1.0), 2);
    }

    #[test]
    fn vae_layout_is_c_t_h_w() {
        // C=3, T=2, H=1, W=2: value = channel marker per (t, x).
        let (c, t, h, w) = (3, 2, 1, 2);
        let mut data = vec![0f32; c * t * h * w];
        for ci in 0..c {
            for ti in 0..t {
                for x in 0..w {
                    // Distinct values: 2·(k/255) − 1 maps to k exactly.
                    let k = (ci * 100 + ti * 10 + x) as f32;
                    data[((ci * t + ti) * h) * w + x] = 2.0 * (k / 255.0) - 1.0;
                }
            }
        }
        let frames = vae_output_to_rgb(&data, c, t, h, w).expect("shape matches");
        assert_eq!(frames.len(), 2);
        assert_eq!(frames[0].data(), &[0, 100, 200, 1, 101, 201]);
        assert_eq!(frames[1].data(), &[10, 110, 210, 11, 111, 211]);
        assert!(vae_output_to_rgb(&data, 4, t, h, w).is_err());
        assert!(vae_output_to_rgb(&data[1..], c, t, h, w).is_err());
    }
}
