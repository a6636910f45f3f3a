//! `PromptCache`: a small least-recently-used map from prompt text to its encoded states, so a repeated
//! prompt (and the default negative prompt, sent with nearly every request) is encoded once.

use std::collections::VecDeque;
use std::sync::Arc;

use ditstream_kernels::Tensor;

/// One prompt's encoder output: the states of its real tokens only (the zero rows are added when a
/// batch is assembled).
#[derive(Debug, Clone)]
pub(crate) struct CachedPrompt {
    /// [len, d_model] in the encoder's dtype, on its device.
    pub(crate) states: Tensor,
    /// Real tokens (rows of `states`).
    pub(crate) len: usize,
}

/// Hit and miss counts of the prompt cache.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Prompts answered from the cache.
    pub hits: u64,
    /// Prompts that had to be encoded.
    pub misses: u64,
    /// Prompts held now.
    pub entries: usize,
}

/// LRU over at most `capacity` prompts. A linear scan: the capacity is a few dozen at most, and an
/// encode costs far more than the scan.
pub(crate) struct PromptCache {
    capacity: usize,
    /// Most recently used at the back.
    entries: VecDeque<(String, Arc<CachedPrompt>)>,
    hits: u64,
    misses: u64,
}

impl PromptCache {
    /// An empty cache; `capacity = 0` disables caching.
    pub(crate) fn new(capacity: usize) -> Self {
        PromptCache {
            capacity,
            entries: VecDeque::with_capacity(capacity),
            hits: 0,
            misses: 0,
        }
    }

    /// The entry for `prompt`, marked most recently used; counts a hit or a miss.
    pub(crate) fn get(&mut self, prompt: &str) -> Option<Arc<CachedPrompt>> {
        match self.entries.iter().position(|(p, _)| p == prompt) {
            Some(i) => {
                self.hits += 1;
                let entry = self.entries.remove(i)?;
                let value = Arc::clone(&entry.1);
                self.entries.push_back(entry);
                Some(value)
            }
            None => {
                self.misses += 1;
                None
            }
        }
    }

    /// Stores `prompt`'s states, evicting the least recently used entry when full.
    pub(crate) fn insert(&mut self, prompt: &str, value: Arc<CachedPrompt>) {
        if self.capacity == 0 {
            return;
        }
        self.entries.retain(|(p, _)| p != prompt);
        if self.entries.len() == self.capacity {
            self.entries.pop_front();
        }
        self.entries.push_back((prompt.to_string(), value));
    }

    pub(crate) fn stats(&self) -> CacheStats {
        CacheStats {
            hits: self.hits,
            misses: self.misses,
            entries: self.entries.len(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(v: f32) -> Arc<CachedPrompt> {
        Arc::new(CachedPrompt {
            states: Tensor::from_vec(vec![v], &[1, 1]).unwrap(),
            len: 1,
        })
    }

    #[test]
    fn evicts_least_recently_used() {
        let mut c = PromptCache::new(2);
        c.insert("a", entry(1.0));
        c.insert("b", entry(2.0));
        assert!(c.get("a").is_some()); // a is now the most recent
        c.insert("c", entry(3.0)); // evicts b
        assert!(c.get("b").is_none());
        assert!(c.get("a").is_some() && c.get("c").is_some());
        assert_eq!(
            c.stats(),
            CacheStats {
                hits: 3,
                misses: 1,
                entries: 2
            }
        );
        let mut off = PromptCache::new(0);
        off.insert("a", entry(1.0));
        assert!(off.get("a").is_none());
    }
}
