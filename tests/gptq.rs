//! GPTQ (`lantern::quant::gptq`) against round-to-nearest on the same layer: a linear layer
//! whose inputs have a few large, correlated channels (as real activations do), where RTN's
//! per-weight rounding is known to lose more of the output than GPTQ's error feedback. The
//! output error `||(W - deq Q) X^T||^2` is compared on the calibration inputs and on held-out
//! inputs of the same distribution, by a margin; and the packed result is the layout every
//! kernel reads (it dequantizes to values of its own groups' scales).

mod common;

use common::random::Rng;
use lantern::quant::gptq::{self, GptqOptions};
use lantern::quant::{PackedMatrix, QuantError, QuantFormat, QuantKind};

/// `n` input rows of `k` channels: a shared low-rank part (correlated channels), noise, and
/// channels 3, 17 and 40 ten times larger (outliers).
fn inputs(rng: &mut Rng, n: usize, k: usize) -> Vec<f32> {
    let basis: Vec<f32> = {
        let mut b = Rng(0xba5e);
        b.vec(4 * k)
    };
    let mut x = Vec::with_capacity(n * k);
    for _ in 0..n {
        let z = rng.vec(4);
        for c in 0..k {
            let low: f32 = (0..4).map(|j| z[j] * basis[j * k + c]).sum();
            let v = low + 0.3 * rng.uniform();
            x.push(if [3, 17, 40].contains(&c) { 10.0 * v } else { v });
        }
    }
    x
}

#[test]
fn gptq_loses_less_of_the_output_than_rtn() {
    let (rows, k) = (48, 128);
    let mut rng = Rng(7);
    let w: Vec<f32> = rng.vec(rows * k).iter().map(|v| v / (k as f32).sqrt()).collect();
    let calib = inputs(&mut rng, 512, k);
    let held_out = inputs(&mut rng, 256, k);
    let h = gptq::hessian(&calib, k);
    for (kind, group) in [
        (QuantKind::Q4Sym, 32),
        (QuantKind::Q4, 32),
        (QuantKind::Q4Sym, 128),
        (QuantKind::Q8, 32),
        (QuantKind::Q3, 32),
        (QuantKind::Q3, 128),
    ] {
        let format = QuantFormat::new(kind, group);
        let rtn = PackedMatrix::quantize("w", &w, rows, k, format).unwrap();
        let g = gptq::quantize("w", &w, rows, k, &h, format, GptqOptions::default()).unwrap();
        assert_eq!((g.qs.len(), g.scales.len()), (rtn.qs.len(), rtn.scales.len()), "{format}: same layout");
        let (e_rtn, e_gptq) = (gptq::output_error(&w, &rtn, &calib), gptq::output_error(&w, &g, &calib));
        let (h_rtn, h_gptq) = (gptq::output_error(&w, &rtn, &held_out), gptq::output_error(&w, &g, &held_out));
        eprintln!(
            "{format}: calibration error RTN {e_rtn:.4e} GPTQ {e_gptq:.4e} ({:.2}x); held out RTN {h_rtn:.4e} GPTQ {h_gptq:.4e} ({:.2}x)",
            e_rtn / e_gptq,
            h_rtn / h_gptq
        );
        assert!(e_gptq < 0.7 * e_rtn, "{format}: GPTQ {e_gptq:e} is not well below RTN {e_rtn:e} on the calibration inputs");
        assert!(h_gptq < 0.8 * h_rtn, "{format}: GPTQ {h_gptq:e} is not well below RTN {h_rtn:e} on held-out inputs");
    }
}

/// With a Hessian that carries no information (the identity: inputs uncorrelated and of equal
/// size), the error feedback has nothing to exploit: GPTQ reduces to round-to-nearest and
/// gives its codes.
#[test]
fn an_identity_hessian_gives_round_to_nearest() {
    let (rows, k) = (8, 64);
    let mut rng = Rng(3);
    let w = rng.vec(rows * k);
    let mut h = vec![0f64; k * k];
    for i in 0..k {
        h[i * k + i] = 1.0;
    }
    let format = QuantFormat::new(QuantKind::Q4, 32);
    for act_order in [false, true] {
        let g = gptq::quantize("w", &w, rows, k, &h, format, GptqOptions { damp: 0.0, act_order }).unwrap();
        assert_eq!(g, PackedMatrix::quantize("w", &w, rows, k, format).unwrap(), "act_order {act_order}");
    }
}

/// Act-order (columns by decreasing Hessian diagonal, static group scales) on a layer whose
/// inputs differ widely in size: the order GPTQ's paper recommends for such layers loses
/// less of the output than RTN, in every format, and the codes land in column order (a
/// permuted Hessian of a permuted matrix gives the permuted result's codes back).
#[test]
fn act_order_loses_less_than_rtn_and_keeps_column_order() {
    let (rows, k) = (32, 128);
    let mut rng = Rng(17);
    let w: Vec<f32> = rng.vec(rows * k).iter().map(|v| v / (k as f32).sqrt()).collect();
    let mut calib = inputs(&mut rng, 512, k);
    // Input sizes spread over two orders of magnitude, column by column.
    for row in calib.chunks_exact_mut(k) {
        for (j, v) in row.iter_mut().enumerate() {
            *v *= 0.1 + 10.0 * ((j * 37) % k) as f32 / k as f32;
        }
    }
    let h = gptq::hessian(&calib, k);
    for (kind, group) in [(QuantKind::Q4Sym, 32), (QuantKind::Q4, 128), (QuantKind::Q3, 32)] {
        let format = QuantFormat::new(kind, group);
        let rtn = PackedMatrix::quantize("w", &w, rows, k, format).unwrap();
        let plain = gptq::quantize("w", &w, rows, k, &h, format, GptqOptions::default()).unwrap();
        let act = gptq::quantize("w", &w, rows, k, &h, format, GptqOptions { act_order: true, ..GptqOptions::default() }).unwrap();
        let e = |m: &PackedMatrix| gptq::output_error(&w, m, &calib);
        let (e_rtn, e_plain, e_act) = (e(&rtn), e(&plain), e(&act));
        eprintln!("{format}: output error RTN {e_rtn:.4e}, GPTQ {e_plain:.4e}, act-order {e_act:.4e}");
        assert!(e_act < 0.7 * e_rtn, "{format}: act-order {e_act:e} not well below RTN {e_rtn:e}");
        // Static groups: every group's scale is RTN's, from the original weights.
        for r in 0..rows {
            for g in 0..k / group as usize {
                assert_eq!(act.group_scale(r, g), rtn.group_scale(r, g), "{format} row {r} group {g}");
            }
        }
    }
}

#[test]
fn bad_inputs_are_typed_errors_naming_the_tensor() {
    let (rows, k) = (4, 64);
    let w = vec![0.5f32; rows * k];
    let h = vec![0f64; k * k];
    let f = QuantFormat::new(QuantKind::Q4Sym, 32);
    // A Hessian of the wrong size.
    let e = gptq::quantize("blk.q", &w, rows, k, &h[..10], f, GptqOptions::default()).unwrap_err();
    assert!(matches!(&e, QuantError::Invalid { tensor, reason } if tensor == "blk.q" && reason.contains("64 x 64")), "{e}");
    // A kind round-to-nearest cannot produce; a group that does not divide the rows.
    let e = gptq::quantize("blk.q", &w, rows, k, &h, QuantFormat::new(QuantKind::Q4K, 32), GptqOptions::default()).unwrap_err();
    assert!(e.to_string().contains("blk.q"), "{e}");
    assert!(matches!(
        gptq::quantize("blk.q", &w, rows, k, &h, QuantFormat::new(QuantKind::Q4, 48), GptqOptions::default()),
        Err(QuantError::GroupMismatch { .. })
    ));
    // Non-finite weights.
    let mut bad = w.clone();
    bad[5] = f32::NAN;
    assert!(gptq::quantize("blk.q", &bad, rows, k, &h, f, GptqOptions::default()).unwrap_err().to_string().contains("non-finite"));
    // An all-zero Hessian (no calibration signal): every input is dead, the weights zero out.
    let g = gptq::quantize("blk.q", &w, rows, k, &h, f, GptqOptions::default()).unwrap();
    assert!(g.dequantize().iter().all(|v| *v == 0.0));
}
