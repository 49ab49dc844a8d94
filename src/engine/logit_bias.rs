//! OpenAI's `logit_bias` and presence/frequency penalties: what a request adds to its
//! logits, and each sequence's running state of it. Every step turns that state into sparse
//! `(token, delta)` pairs for the sequence's logit row, which the GPU adds before the logit
//! mask, argmax and top-k (`kernels::logit_bias`), so a biased or penalised token competes
//! in the GPU's own argmax and top-k like any other.
//!
//! The penalties follow OpenAI's definition over the tokens generated so far (not the
//! prompt): `logit[t] -= count[t] * frequency_penalty + (count[t] > 0) * presence_penalty`.

use std::collections::BTreeMap;

/// The additive logit changes a request asks for (none by default).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LogitBias {
    /// Added to these tokens' logits at every step (OpenAI's `logit_bias`; each token once).
    pub tokens: Vec<(u32, f32)>,
    /// Subtracted once from the logit of every token generated so far.
    pub presence_penalty: f32,
    /// Subtracted from the logit of every token generated so far, once per occurrence.
    pub frequency_penalty: f32,
}

impl LogitBias {
    /// Whether it changes nothing.
    pub fn is_none(&self) -> bool {
        self.tokens.iter().all(|p| p.1 == 0.0) && self.presence_penalty == 0.0 && self.frequency_penalty == 0.0
    }

    /// Why it cannot apply to a vocabulary of `vocab` tokens: a token outside it or listed
    /// twice, or a value that is not finite.
    pub fn check(&self, vocab: usize) -> Result<(), String> {
        for (name, v) in [("presence_penalty", self.presence_penalty), ("frequency_penalty", self.frequency_penalty)] {
            if !v.is_finite() {
                return Err(format!("{name} {v} is not a finite number"));
            }
        }
        let mut seen = std::collections::BTreeSet::new();
        for &(t, d) in &self.tokens {
            if t as usize >= vocab {
                return Err(format!("logit_bias names token {t}, outside the vocabulary (size {vocab})"));
            }
            if !d.is_finite() {
                return Err(format!("logit_bias for token {t} is {d}, not a finite number"));
            }
            if !seen.insert(t) {
                return Err(format!("logit_bias names token {t} twice"));
            }
        }
        Ok(())
    }
}

/// One sequence's biases: the request's, and the counts of the tokens it has generated.
#[derive(Debug, Clone)]
pub struct BiasState {
    fixed: BTreeMap<u32, f32>,
    presence: f32,
    frequency: f32,
    counts: BTreeMap<u32, u32>,
}

impl BiasState {
    /// The state for a request; None when it changes nothing (no bias pass runs).
    pub fn new(b: &LogitBias) -> Option<BiasState> {
        if b.is_none() {
            return None;
        }
        Some(BiasState {
            fixed: b.tokens.iter().copied().filter(|p| p.1 != 0.0).collect(),
            presence: b.presence_penalty,
            frequency: b.frequency_penalty,
            counts: BTreeMap::new(),
        })
    }

    /// A token the sequence generated.
    pub fn observe(&mut self, token: u32) {
        if self.presence != 0.0 || self.frequency != 0.0 {
            *self.counts.entry(token).or_default() += 1;
        }
    }

    /// The next logit row's `(token, delta)` pairs, by token, each token once.
    pub fn row(&self) -> Vec<(u32, f32)> {
        let mut out: BTreeMap<u32, f32> = self.fixed.clone();
        for (&t, &c) in &self.counts {
            *out.entry(t).or_default() -= c as f32 * self.frequency + self.presence;
        }
        out.into_iter().filter(|p| p.1 != 0.0).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn penalties_follow_the_openai_definition() {
        let b = LogitBias { tokens: vec![(3, 5.0), (7, -100.0)], presence_penalty: 0.5, frequency_penalty: 0.25 };
        let mut s = BiasState::new(&b).unwrap();
        assert_eq!(s.row(), vec![(3, 5.0), (7, -100.0)]);
        for t in [3, 9, 9, 9] {
            s.observe(t);
        }
        // 3: +5 - (1 * 0.25 + 0.5); 9: -(3 * 0.25 + 0.5).
        assert_eq!(s.row(), vec![(3, 4.25), (7, -100.0), (9, -1.25)]);
    }

    #[test]
    fn nothing_to_do_is_none_and_bad_values_are_named() {
        assert!(BiasState::new(&LogitBias::default()).is_none());
        assert!(BiasState::new(&LogitBias { tokens: vec![(1, 0.0)], ..Default::default() }).is_none());
        let e = LogitBias { tokens: vec![(10, 1.0)], ..Default::default() }.check(10).unwrap_err();
        assert!(e.contains("token 10") && e.contains("size 10"), "{e}");
        let e = LogitBias { tokens: vec![(1, 1.0), (1, 2.0)], ..Default::default() }.check(10).unwrap_err();
        assert!(e.contains("twice"), "{e}");
        let e = LogitBias { presence_penalty: f32::NAN, ..Default::default() }.check(10).unwrap_err();
        assert!(e.contains("presence_penalty"), "{e}");
    }
}
