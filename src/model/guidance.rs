//! The llguidance token environment of a [`Tokenizer`]: every token's bytes (byte-level BPE
//! through GPT-2's byte-to-unicode table; SentencePiece pieces with `▁` as a space and
//! `<0xNN>` byte fallback; special tokens as llguidance's `0xff` + name), the token trie,
//! and the grammar compiler (`ParserFactory`) over it. Built once per tokenizer and cached
//! there ([`Tokenizer::guidance`]), so a constrained request only compiles its grammar.

use std::collections::HashMap;
use std::sync::Arc;

use llguidance::ParserFactory;
use toktrie::{TokRxInfo, TokTrie, TokenId, TokenizerEnv};

use super::tokenizer::{Tokenizer, TokenizerError};

/// How a vocabulary spells bytes.
enum Spelling {
    /// GPT-2 byte-level BPE: each byte is one printable character.
    ByteLevel(HashMap<char, u8>),
    /// SentencePiece: `space` stands for ' ', `<0xNN>` pieces are single bytes.
    Pieces { space: char },
}

/// GPT-2's `bytes_to_unicode`, inverted: character -> byte.
fn byte_level_chars() -> HashMap<char, u8> {
    let mut map = HashMap::new();
    let mut extra = 0u32;
    for b in 0..=255u8 {
        let printable = (b'!'..=b'~').contains(&b) || (0xA1..=0xAC).contains(&b) || (0xAE..=0xFF).contains(&b);
        let c = if printable {
            char::from(b)
        } else {
            extra += 1;
            char::from_u32(255 + extra).unwrap_or('\u{FFFD}')
        };
        map.insert(c, b);
    }
    map
}

/// The spelling the tokenizer's decoder implies (what `tokenizer.json` says or what
/// `Tokenizer::from_gguf` built).
fn spelling(tok: &Tokenizer) -> Result<Spelling, String> {
    let decoder = tok.inner().get_decoder().map(serde_json::to_value).transpose().map_err(|e| e.to_string())?;
    let decoder = decoder.unwrap_or(serde_json::Value::Null);
    let parts: Vec<&serde_json::Value> = match decoder["type"].as_str() {
        Some("Sequence") => decoder["decoders"].as_array().map(|a| a.iter().collect()).unwrap_or_default(),
        _ => vec![&decoder],
    };
    if parts.iter().any(|d| d["type"] == "ByteLevel") {
        return Ok(Spelling::ByteLevel(byte_level_chars()));
    }
    if parts.iter().any(|d| d["type"] == "ByteFallback" || d["type"] == "Metaspace") {
        let space = parts
            .iter()
            .find(|d| d["type"] == "Replace" && d["content"] == " ")
            .and_then(|d| d["pattern"]["String"].as_str())
            .and_then(|s| s.chars().next())
            .or_else(|| parts.iter().find(|d| d["type"] == "Metaspace").and_then(|d| d["replacement"].as_str()?.chars().next()))
            .unwrap_or('▁');
        return Ok(Spelling::Pieces { space });
    }
    Err(format!("decoder {:?} is neither byte-level BPE nor SentencePiece with byte fallback", decoder["type"]))
}

/// Every token id's bytes (`vocab_size` entries; ids without a token are empty).
pub fn token_bytes(tok: &Tokenizer) -> Result<Vec<Vec<u8>>, TokenizerError> {
    let err = |reason: String| TokenizerError::InvalidVocab { source_name: "constrained decoding".into(), reason };
    let spelling = spelling(tok).map_err(err)?;
    let vocab = tok.inner().get_vocab(true);
    let n = vocab.values().map(|&id| id as usize + 1).max().unwrap_or(0).max(tok.vocab_size());
    let mut words = vec![Vec::new(); n];
    let added = tok.inner().get_added_tokens_decoder();
    for (name, &id) in &vocab {
        let bytes = if let Some(a) = added.get(&id) {
            let mut b = a.content.as_bytes().to_vec();
            if a.special {
                b.insert(0, TokTrie::SPECIAL_TOKEN_MARKER);
            }
            b
        } else {
            match &spelling {
                Spelling::ByteLevel(map) => {
                    name.chars().map(|c| map.get(&c).copied()).collect::<Option<Vec<u8>>>().unwrap_or_else(|| name.as_bytes().to_vec())
                }
                Spelling::Pieces { space } => match name.strip_prefix("<0x").and_then(|h| h.strip_suffix('>')) {
                    Some(hex) if hex.len() == 2 => {
                        u8::from_str_radix(hex, 16).map(|b| vec![b]).unwrap_or_else(|_| name.as_bytes().to_vec())
                    }
                    _ => name.replace(*space, " ").into_bytes(),
                },
            }
        };
        words[id as usize] = bytes;
    }
    Ok(words)
}

/// llguidance's view of a Lantern tokenizer: the trie, and Lantern's own encoder for the
/// text a grammar forces.
struct Env {
    tokenizer: Tokenizer,
    trie: TokTrie,
}

impl TokenizerEnv for Env {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        match std::str::from_utf8(s).ok().and_then(|t| self.tokenizer.encode_with(t, false).ok()) {
            Some(ids) => ids,
            None => self.trie.greedy_tokenize(s),
        }
    }
}

/// Build the grammar compiler over `tok`'s vocabulary (what [`Tokenizer::guidance`] caches).
pub(super) fn build_factory(tok: &Tokenizer) -> Result<Arc<ParserFactory>, TokenizerError> {
    let words = token_bytes(tok)?;
    let eos = tok.eos_id().unwrap_or(0);
    let info = TokRxInfo::new(words.len() as u32, eos);
    let trie = TokTrie::from(&info, &words);
    let env: toktrie::TokEnv = Arc::new(Env { tokenizer: tok.clone(), trie });
    let mut factory = ParserFactory::new_simple(&env)
        .map_err(|e| TokenizerError::InvalidVocab { source_name: "constrained decoding".into(), reason: e.to_string() })?;
    factory.quiet();
    Ok(Arc::new(factory))
}
