//! What the model wrote, measured on the stream in bounded memory: how much of an answer repeats
//! itself.
//!
//! **Repetition** is the share of an answer's word trigrams that already occurred earlier in the
//! same answer: 0 for text that never repeats a three-word phrase, close to 1000 ‰ for one phrase
//! looped. Words are runs of ASCII letters and digits (compared case-insensitively) and of non-ASCII
//! characters; everything else separates them, so text without spaces (Chinese, Japanese) counts as
//! few long words and its repetition is not measured well.
//!
//! Memory is fixed per answer: a word is hashed as it arrives (a word split across two events is
//! one word), the last two word hashes are kept, and trigram hashes go into a table of
//! [`SLOTS`] slots. Up to [`EXACT_DISTINCT`] distinct trigrams the figure is exact (up to 32-bit
//! hash collisions); beyond that the table keeps only trigrams whose hash falls in a shrinking
//! sample (a half, a quarter, …: the same trigram is always in or out), and the share is measured
//! on that sample — an estimate whose error shrinks with the answer's length, never more memory.

/// Table slots (open addressing, at most half full).
pub const SLOTS: usize = 1024;
// The table's look-ups mask their index with `SLOTS - 1`.
const _: () = assert!(SLOTS.is_power_of_two());
/// Distinct trigrams counted exactly before sampling starts.
pub const EXACT_DISTINCT: usize = SLOTS / 2;
/// Answers with fewer trigrams (about a dozen words) get no repetition figure: too short to say.
pub const MIN_TRIGRAMS: u64 = 10;

/// One answer's repetition, as far as it has been read.
#[derive(Debug, Clone, Default)]
pub struct Repetition {
    /// Hash of the word being read (its bytes so far), `None` between words.
    word: Option<u32>,
    /// The two words before the current one.
    previous: [Option<u32>; 2],
    /// Trigrams seen, sampled or not.
    trigrams: u64,
    table: Option<Box<Table>>,
}

#[derive(Debug, Clone)]
struct Table {
    /// Trigram hash per slot; 0 is empty (a hash of 0 is stored as 1).
    keys: [u32; SLOTS],
    counts: [u16; SLOTS],
    /// Trigrams kept: those whose hash has its top `level` bits zero.
    level: u32,
    used: usize,
    /// Kept occurrences, and those of them that were repeats.
    kept: u64,
    repeats: u64,
}

/// A repetition figure: ‰ of trigrams that repeat an earlier one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RepetitionFigure {
    pub per_mille: u64,
    /// Whether every trigram was counted (`false`: measured on a sample).
    pub exact: bool,
}

const FNV_OFFSET: u32 = 0x811c_9dc5;
const FNV_PRIME: u32 = 0x0100_0193;

impl Repetition {
    /// Feeds text as it arrives (a JSON string already unescaped).
    pub fn push_text(&mut self, text: &str) {
        self.push_bytes(text.as_bytes());
    }

    /// Feeds UTF-8 bytes (a word may be cut anywhere: only ASCII bytes separate words).
    pub fn push_bytes(&mut self, bytes: &[u8]) {
        // The word's hash stays in a local while its bytes are read: through `self` it was
        // stored and loaded again at every byte (the observer's largest cost per byte of text).
        let mut word = self.word.take();
        for &b in bytes {
            match fold(b) {
                Some(folded) => word = Some(fnv(word, folded)),
                None => {
                    if let Some(w) = word.take() {
                        self.word_ended(w);
                    }
                }
            }
        }
        self.word = word;
    }

    /// Feeds the raw text of a JSON string (escapes not yet decoded): `\n`, `\"` and the like
    /// separate words and `\uXXXX` is its character, exactly as if [`Self::push_text`] had been
    /// given the decoded string.
    pub fn push_json_escaped(&mut self, raw: &[u8]) {
        let mut i = 0usize;
        while let Some(&b) = raw.get(i) {
            if b != b'\\' {
                self.byte(b);
                i = i.saturating_add(1);
                continue;
            }
            match raw.get(i.saturating_add(1)) {
                Some(b'u') => {
                    let hex = raw.get(i.saturating_add(2)..i.saturating_add(6)).and_then(|h| std::str::from_utf8(h).ok());
                    let decoded = hex.and_then(|h| u32::from_str_radix(h, 16).ok()).and_then(char::from_u32);
                    match decoded {
                        Some(c) => {
                            let mut buf = [0u8; 4];
                            for &d in c.encode_utf8(&mut buf).as_bytes() {
                                self.byte(d);
                            }
                        }
                        None => self.end_word(),
                    }
                    i = i.saturating_add(6);
                }
                // Every other escape is punctuation or a control character: a separator.
                _ => {
                    self.end_word();
                    i = i.saturating_add(2);
                }
            }
        }
    }

    /// The end of the answer: a word still being read is complete.
    pub fn finish(&mut self) {
        self.end_word();
    }

    /// The figure so far (a word still being read is not counted); `None` below [`MIN_TRIGRAMS`].
    pub fn figure(&self) -> Option<RepetitionFigure> {
        if self.trigrams < MIN_TRIGRAMS {
            return None;
        }
        let t = self.table.as_ref()?;
        if t.kept == 0 {
            return None;
        }
        let per_mille = t.repeats.saturating_mul(1000) / t.kept;
        Some(RepetitionFigure { per_mille, exact: t.level == 0 })
    }

    fn byte(&mut self, b: u8) {
        match fold(b) {
            Some(folded) => self.word = Some(fnv(self.word, folded)),
            None => self.end_word(),
        }
    }

    fn end_word(&mut self) {
        if let Some(word) = self.word.take() {
            self.word_ended(word);
        }
    }

    // Out of line: the simulator measured fewer instructions so at one token an event (−0.3 %;
    // +0.1 % at sixteen), the byte loop of `push_bytes` left without the word's work inside.
    #[inline(never)]
    fn word_ended(&mut self, word: u32) {
        if let [Some(a), Some(b)] = self.previous {
            self.trigram(mix(a, b, word));
        }
        self.previous = [self.previous[1], Some(word)];
    }

    fn trigram(&mut self, hash: u32) {
        self.trigrams = self.trigrams.saturating_add(1);
        // 0 marks an empty slot: a hash of 0 is stored as 1.
        let hash = hash.max(1);
        match &mut self.table {
            Some(table) => table.add(hash),
            // Out of line: once an answer.
            None => self.first_trigram(hash),
        }
    }

    #[cold]
    #[inline(never)]
    fn first_trigram(&mut self, hash: u32) {
        self.table.get_or_insert_with(|| Box::new(Table::new())).add(hash);
    }
}

/// A word byte as it is hashed (ASCII letters folded to lower case); `None` for a separator.
fn fold(b: u8) -> Option<u8> {
    // One load instead of three range tests a byte of text.
    FOLDED.get(usize::from(b)).copied().filter(|&f| f != 0)
}

/// [`fold`] as a table: the byte as hashed, 0 for a separator (no word byte folds to 0).
// Built at compile time: an index out of bounds would fail the build, not panic in wasm.
#[allow(clippy::indexing_slicing)]
const FOLDED: [u8; 256] = {
    let mut table = [0u8; 256];
    let mut b = 0usize;
    while b < 256 {
        let byte = b as u8;
        table[b] = match byte {
            b'A'..=b'Z' => byte | 0x20,
            b'a'..=b'z' | b'0'..=b'9' | 0x80..=0xff => byte,
            _ => 0,
        };
        b += 1;
    }
    table
};

/// The word hash `word` (`None`: a word starting) extended by one folded byte.
fn fnv(word: Option<u32>, folded: u8) -> u32 {
    (word.unwrap_or(FNV_OFFSET) ^ u32::from(folded)).wrapping_mul(FNV_PRIME)
}

/// A trigram's hash from its words' (order matters: "a b c" is not "c b a").
fn mix(a: u32, b: u32, c: u32) -> u32 {
    let mut h = a.wrapping_mul(0x9e37_79b1);
    h = (h.rotate_left(13) ^ b).wrapping_mul(0x85eb_ca77);
    h = (h.rotate_left(13) ^ c).wrapping_mul(0xc2b2_ae3d);
    h ^ (h >> 16)
}

impl Table {
    fn new() -> Table {
        Table { keys: [0; SLOTS], counts: [0; SLOTS], level: 0, used: 0, kept: 0, repeats: 0 }
    }

    fn sampled(&self, hash: u32) -> bool {
        self.level == 0 || hash.checked_shr(32 - self.level).unwrap_or(0) == 0
    }

    fn add(&mut self, hash: u32) {
        if !self.sampled(hash) {
            return;
        }
        // SLOTS is a power of two: the mask keeps every index in bounds, so the look-ups below
        // compile without their failure branches (one word of an answer's text each).
        const MASK: usize = SLOTS - 1;
        let mut slot = hash as usize & MASK;
        self.kept = self.kept.saturating_add(1);
        loop {
            let Some(key) = self.keys.get_mut(slot & MASK) else { return };
            if *key == hash {
                if let Some(count) = self.counts.get_mut(slot & MASK) {
                    *count = count.saturating_add(1);
                }
                self.repeats = self.repeats.saturating_add(1);
                return;
            }
            if *key == 0 {
                *key = hash;
                if let Some(count) = self.counts.get_mut(slot & MASK) {
                    *count = 1;
                }
                break;
            }
            slot = slot.wrapping_add(1) & MASK;
        }
        self.used += 1;
        if self.used > EXACT_DISTINCT {
            self.halve();
        }
    }

    /// Keeps only the trigrams of the next, smaller sample, recounting what was kept of them.
    fn halve(&mut self) {
        while self.used > EXACT_DISTINCT && self.level < 31 {
            self.level += 1;
            let old_keys = self.keys;
            let old_counts = self.counts;
            self.keys = [0; SLOTS];
            self.counts = [0; SLOTS];
            self.used = 0;
            self.kept = 0;
            self.repeats = 0;
            for (&key, &count) in old_keys.iter().zip(old_counts.iter()) {
                if key == 0 || !self.sampled(key) {
                    continue;
                }
                let mut slot = key as usize % SLOTS;
                while self.keys.get(slot).is_some_and(|&k| k != 0) {
                    slot = (slot + 1) % SLOTS;
                }
                if let (Some(k), Some(c)) = (self.keys.get_mut(slot), self.counts.get_mut(slot)) {
                    *k = key;
                    *c = count;
                }
                self.used += 1;
                self.kept = self.kept.saturating_add(u64::from(count));
                self.repeats = self.repeats.saturating_add(u64::from(count).saturating_sub(1));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
    use super::*;

    fn of(text: &str) -> Option<RepetitionFigure> {
        let mut r = Repetition::default();
        r.push_text(text);
        r.finish();
        r.figure()
    }

    #[test]
    fn constructed_answers_measure_exactly() {
        // 60 distinct words: 58 trigrams, none repeated.
        let honest: String = (0..60).map(|i| format!("word{i} ")).collect();
        assert_eq!(of(&honest), Some(RepetitionFigure { per_mille: 0, exact: true }));
        // "I am sorry." × 40 = 120 words, 118 trigrams of which 3 are distinct: 115 repeats.
        let looped = "I am sorry. ".repeat(40);
        assert_eq!(of(&looped), Some(RepetitionFigure { per_mille: 115 * 1000 / 118, exact: true }));
        // Distinct sentence then one phrase twice: 20 words + "see you later" ×2 (6 words): 24 trigrams;
        // repeats: "see you later" once more, and the wrap-around trigrams "later see you", "you later see"
        // happen once each — 1 repeat of 24.
        let mut tail: String = (0..20).map(|i| format!("w{i} ")).collect();
        tail.push_str("see you later see you later");
        assert_eq!(of(&tail), Some(RepetitionFigure { per_mille: 1000 / 24, exact: true }));
    }

    #[test]
    fn short_answers_have_no_figure() {
        assert_eq!(of("Paris is the capital of France."), None);
        assert_eq!(of(""), None);
    }

    #[test]
    fn words_split_across_events_are_one_word_and_case_does_not_matter() {
        let text = "The quick brown fox jumps over the lazy dog and THE QUICK BROWN fox again and again today";
        let whole = of(text);
        let mut r = Repetition::default();
        for piece in text.as_bytes().chunks(3) {
            r.push_text(std::str::from_utf8(piece).unwrap());
        }
        r.finish();
        assert_eq!(r.figure(), whole);
        // 18 words, 16 trigrams: "the quick brown" and "quick brown fox" repeat.
        assert_eq!(whole, Some(RepetitionFigure { per_mille: 2 * 1000 / 16, exact: true }));
    }

    #[test]
    fn escaped_json_text_reads_as_its_decoded_string() {
        let decoded = "caf\u{e9} au lait\nis \"good\" caf\u{e9} au lait\tis good caf\u{e9} au lait is good indeed, really";
        let raw = serde_json::to_string(decoded).unwrap();
        let raw = raw.trim_matches('"').replace('\u{e9}', "\\u00e9");
        assert!(raw.contains("\\u00e9") && raw.contains("\\n") && raw.contains("\\\""));
        let mut r = Repetition::default();
        r.push_json_escaped(raw.as_bytes());
        r.finish();
        assert_eq!(r.figure(), of(decoded));
        assert!(r.figure().unwrap().per_mille > 0);
    }

    #[test]
    fn long_answers_are_sampled_in_fixed_memory_and_stay_close() {
        // 20,000 distinct words, then the first 5,000 again: 25,000 words, a quarter of them repeated.
        let words: Vec<String> = (0..20_000).map(|i| format!("t{i}")).collect();
        let mut r = Repetition::default();
        for w in words.iter().chain(words.iter().take(5_000)) {
            r.push_text(w);
            r.push_text(" ");
        }
        r.finish();
        let f = r.figure().unwrap();
        assert!(!f.exact);
        // Exact: 4,998 repeats of 24,998 trigrams = 199 ‰ (the two trigrams at the join are new).
        assert!((150..=250).contains(&f.per_mille), "{f:?}");
        assert!(r.table.as_ref().unwrap().used <= EXACT_DISTINCT);
    }
}
