//! `PromptTokenizer`: a checkpoint's `tokenizer/tokenizer.json` through the `tokenizers` crate, with
//! the Wan pipeline's prompt path: `prompt_clean`, then `</s>` appended, truncation to `max_len`
//! (the `</s>` kept) and right padding with `<pad>` plus an attention mask.

use std::path::Path;

use tokenizers::{Tokenizer, TruncationDirection, TruncationParams, TruncationStrategy};

use super::TextError;

/// One prompt's tokens as the pipeline feeds them to the encoder.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenizedPrompt {
    /// `[max_len]` token ids: the real tokens (ending in `</s>`), then the pad id.
    pub ids: Vec<u32>,
    /// `[max_len]` 1 for a real token, 0 for padding.
    pub attention_mask: Vec<u32>,
    /// Number of real tokens (the mask's sum), ≤ max_len.
    pub len: usize,
}

impl TokenizedPrompt {
    /// The real tokens, without padding.
    pub fn real_ids(&self) -> &[u32] {
        &self.ids[..self.len]
    }
}

/// A T5/umT5 tokenizer with the Wan pipeline's truncation and padding.
pub struct PromptTokenizer {
    tokenizer: Tokenizer,
    max_len: usize,
    pad_id: u32,
}

impl PromptTokenizer {
    /// Loads `tokenizer.json` (the `tokenizer/` folder of a Wan diffusers checkpoint); prompts are cut
    /// or padded to `max_len` tokens (Wan: 512). Errors name the file.
    pub fn from_file(path: &Path, max_len: usize) -> Result<Self, TextError> {
        if !path.is_file() {
            return Err(TextError::Io {
                path: path.to_path_buf(),
                source: std::io::Error::new(std::io::ErrorKind::NotFound, "no such file"),
            });
        }
        let tokenizer = Tokenizer::from_file(path).map_err(|e| TextError::Tokenizer {
            path: path.to_path_buf(),
            message: e.to_string(),
        })?;
        Self::new(tokenizer, max_len, &path.display().to_string())
    }

    /// Parses the contents of a `tokenizer.json`; `origin` names it in errors.
    pub fn from_json_bytes(bytes: &[u8], max_len: usize, origin: &str) -> Result<Self, TextError> {
        let tokenizer = Tokenizer::from_bytes(bytes).map_err(|e| TextError::Tokenizer {
            path: origin.into(),
            message: e.to_string(),
        })?;
        Self::new(tokenizer, max_len, origin)
    }

    fn new(mut tokenizer: Tokenizer, max_len: usize, origin: &str) -> Result<Self, TextError> {
        let bad = |message: String| TextError::Tokenizer {
            path: origin.into(),
            message,
        };
        if max_len == 0 {
            return Err(bad("max_len = 0: must be at least 1".into()));
        }
        // transformers' `truncation=True, max_length=N`: the post-processor's `</s>` counts toward N
        // and survives; the text's tokens are cut from the right.
        tokenizer
            .with_truncation(Some(TruncationParams {
                direction: TruncationDirection::Right,
                max_length: max_len,
                strategy: TruncationStrategy::LongestFirst,
                stride: 0,
            }))
            .map_err(|e| bad(format!("cannot truncate to {max_len}: {e}")))?;
        // Padding is ours (below), whatever the file says.
        tokenizer.with_padding(None);
        let pad_id = tokenizer
            .token_to_id("<pad>")
            .ok_or_else(|| bad("has no `<pad>` token".into()))?;
        Ok(PromptTokenizer {
            tokenizer,
            max_len,
            pad_id,
        })
    }

    /// Tokens per prompt after padding (Wan: 512).
    pub fn max_len(&self) -> usize {
        self.max_len
    }

    /// Tokens in the vocabulary, added tokens included.
    pub fn vocab_size(&self) -> usize {
        self.tokenizer.get_vocab_size(true)
    }

    /// The pipeline's tokenisation of one prompt: `prompt_clean`, then
    /// `tokenizer(padding="max_length", max_length, truncation=True, add_special_tokens=True)`.
    pub fn tokenize(&self, prompt: &str) -> Result<TokenizedPrompt, TextError> {
        let cleaned = prompt_clean(prompt);
        let encoding =
            self.tokenizer
                .encode(cleaned.as_str(), true)
                .map_err(|e| TextError::Encode {
                    prompt: prompt.to_string(),
                    message: e.to_string(),
                })?;
        let mut ids = encoding.get_ids().to_vec();
        let len = ids.len().min(self.max_len);
        ids.truncate(len);
        ids.resize(self.max_len, self.pad_id);
        let attention_mask = (0..self.max_len).map(|i| u32::from(i < len)).collect();
        Ok(TokenizedPrompt {
            ids,
            attention_mask,
            len,
        })
    }
}

/// The Wan pipeline's `prompt_clean` (diffusers `pipeline_wan.py`, without `ftfy`, which diffusers
/// applies only when it is installed): HTML-unescape twice and `strip()`, then every run of
/// whitespace (the `regex` module's `\s`: Unicode White_Space) to one space, and `strip()` again.
pub fn prompt_clean(text: &str) -> String {
    let unescaped = html_unescape(&html_unescape(text));
    let mut out = String::with_capacity(unescaped.len());
    let mut in_space = false;
    for c in unescaped.trim_matches(is_python_space).chars() {
        if c.is_whitespace() {
            if !in_space {
                out.push(' ');
            }
            in_space = true;
        } else {
            out.push(c);
            in_space = false;
        }
    }
    out.trim_matches(is_python_space).to_string()
}

/// Python's `str.isspace` (what `strip()` removes): Unicode White_Space plus the ASCII information
/// separators U+001C..U+001F.
fn is_python_space(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

/// Python's `html.unescape` for the references prompts contain: numeric (`&#39;`, `&#x27;`, with or
/// without `;`) and the named `&amp; &lt; &gt; &quot; &apos; &nbsp;` (the first five also without
/// `;`, as HTML5's legacy rule allows). Other named references are left as written.
fn html_unescape(text: &str) -> String {
    if !text.contains('&') {
        return text.to_string();
    }
    const NAMED: [(&str, char, bool); 6] = [
        // (name, character, valid without `;`)
        ("amp", '&', true),
        ("lt", '<', true),
        ("gt", '>', true),
        ("quot", '"', true),
        ("nbsp", '\u{a0}', true),
        ("apos", '\'', false),
    ];
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find('&') {
        out.push_str(&rest[..at]);
        let after = &rest[at + 1..];
        if let Some((c, used)) = numeric_reference(after) {
            out.push(c);
            rest = &after[used..];
            continue;
        }
        let named = NAMED.iter().find_map(|&(name, c, legacy)| {
            let tail = after.strip_prefix(name)?;
            if tail.starts_with(';') {
                Some((c, name.len() + 1))
            } else if legacy {
                Some((c, name.len()))
            } else {
                None
            }
        });
        match named {
            Some((c, used)) => {
                out.push(c);
                rest = &after[used..];
            }
            None => {
                out.push('&');
                rest = after;
            }
        }
    }
    out.push_str(rest);
    out
}

/// `#123` / `#x7B` at the start of `s` (after the `&`): the character and the bytes used (including
/// an optional `;`). Invalid code points become U+FFFD as in Python; Python's Windows-1252 remapping
/// of 0x80..0x9F is not reproduced.
fn numeric_reference(s: &str) -> Option<(char, usize)> {
    let body = s.strip_prefix('#')?;
    let (radix, digits_at) = match body.chars().next()? {
        'x' | 'X' => (16, 2),
        _ => (10, 1),
    };
    let digits = s[digits_at..]
        .chars()
        .take_while(|c| c.is_digit(radix))
        .count();
    if digits == 0 {
        return None;
    }
    let end = digits_at + digits;
    let code = u32::from_str_radix(&s[digits_at..end], radix).unwrap_or(u32::MAX);
    let c = if code == 0 {
        '\u{fffd}'
    } else {
        char::from_u32(code).unwrap_or('\u{fffd}')
    };
    let used = if s[end..].starts_with(';') {
        end + 1
    } else {
        end
    };
    Some((c, used))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompt_clean_matches_the_pipeline() {
        assert_eq!(
            prompt_clean("  Tom &amp; Jerry\n\tchase   each  other  "),
            "Tom & Jerry chase each other"
        );
        // Unescaped twice: "&amp;lt;" → "&lt;" → "<".
        assert_eq!(prompt_clean("a &amp;lt; b"), "a < b");
        assert_eq!(
            prompt_clean("&#39;x&#x27; &quot;y&quot &apos;z&apos;"),
            "'x' \"y\" 'z'"
        );
        // Expected values from Python (diffusers imports `regex`, whose `\s` leaves U+001F alone, while
        // `strip()` would remove it at the ends).
        assert_eq!(
            prompt_clean("&amplifier &unknown; &#;"),
            "&lifier &unknown; &#;"
        );
        assert_eq!(prompt_clean("\u{3000}猫\u{1f}\u{a0}犬 "), "猫\u{1f} 犬");
        assert_eq!(prompt_clean("\u{1f} x \u{1c}"), "x");
        assert_eq!(prompt_clean(""), "");
    }
}
