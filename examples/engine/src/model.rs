//! The model: `LAYERS` f32 matrices of `COLS` columns plus a byte-token
//! embedding, generated deterministically from a seed so that a benchmark
//! can make gigabytes of weights without downloading anything.
//!
//! The file carries a SHA-256 per tensor in its safetensors metadata; a cold
//! start checks every byte against it, then derives per-row scales (a pass
//! over all weights), which is the "private runtime state" every engine
//! builds for itself. A completion reads a few rows of every layer, chosen
//! by the prompt, so it is cheap, yet a wrong byte anywhere in the rows it
//! reads (or a missing mapping) changes the text it returns.

use std::borrow::Cow;
use std::collections::HashMap;
use std::path::Path;

use safetensors::tensor::{Dtype, SafeTensors, View};
use sha2::{Digest, Sha256};

use crate::{Error, Result};

/// Columns of every matrix (one row = 4 KiB of f32).
pub const COLS: usize = 1024;
/// Layers a completion walks through.
pub const LAYERS: usize = 16;
/// Byte tokens: the embedding has one row per byte value.
pub const VOCAB: usize = 256;
/// Rows of each layer a token step reads.
const ROWS_PER_STEP: usize = 8;
/// Metadata key holding the seed the file was made from.
const SEED_KEY: &str = "shadow.seed";

/// Words the output tokens are drawn from: readable answers.
const WORDS: [&str; 32] = [
    "amber", "basalt", "cobalt", "delta", "ember", "fjord", "garnet", "harbor", "indigo", "jasper",
    "kelp", "lumen", "magma", "nimbus", "onyx", "prism", "quartz", "raven", "sierra", "tundra",
    "umber", "vector", "willow", "xenon", "yarrow", "zephyr", "atlas", "borealis", "cinder",
    "dune", "echo", "flint",
];

pub(crate) fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

fn name_hash(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
    })
}

/// Names and shapes of the tensors of a model of about `mib` MiB.
pub fn tensor_shapes(mib: u64) -> Vec<(String, [usize; 2])> {
    let embed = VOCAB * COLS * 4;
    let total = (mib as usize) << 20;
    let rows = (total.saturating_sub(embed) / (LAYERS * COLS * 4)).max(ROWS_PER_STEP);
    let mut out = vec![("embed.weight".to_owned(), [VOCAB, COLS])];
    for l in 0..LAYERS {
        out.push((format!("layers.{l:02}.weight"), [rows, COLS]));
    }
    out
}

/// One tensor whose bytes are made when the writer asks for them, so that
/// a multi-GiB file never sits in memory whole.
struct Generated {
    shape: [usize; 2],
    seed: u64,
}

impl Generated {
    fn bytes(&self) -> Vec<u8> {
        let n = self.shape[0] * self.shape[1];
        let mut out = Vec::with_capacity(n * 4);
        let mut x = self.seed | 1;
        for _ in 0..n {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            // Uniform in [-1, 1) from the top 24 bits.
            let v = (x >> 40) as f32 / (1u64 << 23) as f32 - 1.0;
            out.extend_from_slice(&v.to_le_bytes());
        }
        out
    }
}

impl View for &Generated {
    fn dtype(&self) -> Dtype {
        Dtype::F32
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Owned(self.bytes())
    }
    fn data_len(&self) -> usize {
        self.shape[0] * self.shape[1] * 4
    }
}

/// Writes the model of `mib` MiB made from `seed` to `path`, with a SHA-256
/// of each tensor in the metadata (two passes: digests, then the file).
pub fn generate(path: &Path, mib: u64, seed: u64) -> Result<()> {
    let tensors: Vec<(String, Generated)> = tensor_shapes(mib)
        .into_iter()
        .map(|(name, shape)| {
            let seed = splitmix(seed ^ name_hash(&name));
            (name, Generated { shape, seed })
        })
        .collect();
    let mut meta = HashMap::new();
    meta.insert(SEED_KEY.to_owned(), seed.to_string());
    for (name, t) in &tensors {
        meta.insert(format!("sha256.{name}"), hex(&Sha256::digest(t.bytes())));
    }
    safetensors::serialize_to_file(
        tensors.iter().map(|(n, t)| (n.as_str(), t)),
        Some(meta),
        path,
    )
    .map_err(|e| Error::Format {
        path: path.to_owned(),
        reason: format!("writing: {e}"),
    })
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Where a tensor lies in the weights buffer, and its rows.
#[derive(Debug, Clone)]
struct Matrix {
    offset: usize,
    rows: usize,
}

impl Matrix {
    fn row<'a>(&self, bytes: &'a [u8], r: usize) -> &'a [u8] {
        let start = self.offset + r * COLS * 4;
        &bytes[start..start + COLS * 4]
    }
}

fn f32_at(row: &[u8], c: usize) -> f32 {
    let i = c * 4;
    f32::from_le_bytes([row[i], row[i + 1], row[i + 2], row[i + 3]])
}

/// An engine's private view of the weights: tensor positions in the shared
/// buffer, and per-row scales derived from every weight.
#[derive(Debug)]
pub struct Model {
    embed: Matrix,
    layers: Vec<Matrix>,
    /// 1 / RMS of each row of each layer.
    scales: Vec<Vec<f32>>,
    /// Bytes of the whole file (what a GMS reader must map).
    pub file_len: usize,
}

/// One answer.
#[derive(Debug, Clone, PartialEq)]
pub struct Completion {
    pub text: String,
    /// Hash of every value the completion computed: equal answers, equal weights.
    pub fingerprint: String,
    pub tokens: usize,
}

fn parse<'a>(bytes: &'a [u8], path: &Path) -> Result<SafeTensors<'a>> {
    SafeTensors::deserialize(bytes).map_err(|e| Error::Format {
        path: path.to_owned(),
        reason: e.to_string(),
    })
}

/// Checks every tensor's bytes against the SHA-256 in the file's metadata.
/// `path` only names the source in errors.
pub fn verify(bytes: &[u8], path: &Path) -> Result<()> {
    let (_, meta) = SafeTensors::read_metadata(bytes).map_err(|e| Error::Format {
        path: path.to_owned(),
        reason: e.to_string(),
    })?;
    let sums = meta.metadata().clone().unwrap_or_default();
    for (name, view) in parse(bytes, path)?.iter() {
        let want = sums
            .get(&format!("sha256.{name}"))
            .ok_or_else(|| Error::Tensor {
                path: path.to_owned(),
                tensor: name.to_owned(),
                reason: "no sha256 in the file's metadata".into(),
            })?;
        let got = hex(&Sha256::digest(view.data()));
        if &got != want {
            return Err(Error::Tensor {
                path: path.to_owned(),
                tensor: name.to_owned(),
                reason: format!("sha256 {got}, metadata says {want}"),
            });
        }
    }
    Ok(())
}

impl Model {
    /// Locates the tensors in `bytes` (a whole safetensors file) and derives
    /// the per-row scales. Does not verify digests: see [`verify`].
    pub fn build(bytes: &[u8], path: &Path) -> Result<Model> {
        let st = parse(bytes, path)?;
        let base = bytes.as_ptr() as usize;
        let locate = |name: &str, rows: Option<usize>| -> Result<Matrix> {
            let bad = |reason: String| Error::Tensor {
                path: path.to_owned(),
                tensor: name.to_owned(),
                reason,
            };
            let v = st.tensor(name).map_err(|e| bad(e.to_string()))?;
            if v.dtype() != Dtype::F32 || v.shape().len() != 2 || v.shape()[1] != COLS {
                return Err(bad(format!(
                    "want F32 [_, {COLS}], found {:?} {:?}",
                    v.dtype(),
                    v.shape()
                )));
            }
            if rows.is_some_and(|r| r != v.shape()[0]) {
                return Err(bad(format!("want {rows:?} rows, found {}", v.shape()[0])));
            }
            Ok(Matrix {
                offset: v.data().as_ptr() as usize - base,
                rows: v.shape()[0],
            })
        };
        let embed = locate("embed.weight", Some(VOCAB))?;
        let layers = (0..LAYERS)
            .map(|l| locate(&format!("layers.{l:02}.weight"), None))
            .collect::<Result<Vec<_>>>()?;
        let scales = layers
            .iter()
            .map(|m| {
                (0..m.rows)
                    .map(|r| {
                        let row = m.row(bytes, r);
                        let ss: f32 = (0..COLS).map(|c| f32_at(row, c).powi(2)).sum();
                        1.0 / (ss / COLS as f32).sqrt().max(1e-6)
                    })
                    .collect()
            })
            .collect();
        Ok(Model {
            embed,
            layers,
            scales,
            file_len: bytes.len(),
        })
    }

    /// Greedy "decoding": each step embeds the last token, walks every layer
    /// through `ROWS_PER_STEP` rows picked by the running state, and picks
    /// the next word from the result. `bytes` must be the buffer the model
    /// was built from.
    pub fn complete(&self, bytes: &[u8], prompt: &str, max_tokens: usize) -> Completion {
        self.complete_with(bytes, prompt, max_tokens, || {})
    }

    /// [`complete`](Self::complete), calling `step` after each decode step:
    /// the engine's watchdog hears of progress from the step loop itself,
    /// so a generation longer than the interval keeps it fed and a stuck
    /// step starves it. The answer is the same.
    pub fn complete_with(
        &self,
        bytes: &[u8],
        prompt: &str,
        max_tokens: usize,
        mut step: impl FnMut(),
    ) -> Completion {
        let mut d = self.start(bytes, prompt);
        for _ in 0..max_tokens {
            d.next_token();
            step();
        }
        d.completion()
    }

    /// A generation of `prompt` before its first token: the prompt's bytes
    /// embedded (the "prefill"). Each [`Decoder::next_token`] then makes
    /// one decode step. `bytes` must be the buffer the model was built from.
    pub fn start<'a>(&'a self, bytes: &'a [u8], prompt: &str) -> Decoder<'a> {
        let mut x = vec![0f32; COLS];
        for &b in prompt.as_bytes() {
            let row = self.embed.row(bytes, b as usize);
            for (c, xc) in x.iter_mut().enumerate() {
                *xc += f32_at(row, c);
            }
        }
        Decoder {
            model: self,
            bytes,
            x,
            state: name_hash(prompt),
            words: Vec::new(),
        }
    }

    /// The generation of `prompt` positioned after its first `generated`
    /// tokens, as another process left it: the state is a pure function of
    /// the weights, the prompt and the count, so it is computed again
    /// (`generated` decode steps). Its [`Decoder::generated`] are the
    /// tokens already sent; the next ones follow as they would have.
    pub fn resume<'a>(&'a self, bytes: &'a [u8], prompt: &str, generated: usize) -> Decoder<'a> {
        self.resume_with(bytes, prompt, generated, || {})
    }

    /// [`resume`](Self::resume), calling `step` after each decode step (as
    /// [`complete_with`](Self::complete_with)): recomputing a long prefix
    /// feeds the engine's watchdog like decoding it did.
    pub fn resume_with<'a>(
        &'a self,
        bytes: &'a [u8],
        prompt: &str,
        generated: usize,
        mut step: impl FnMut(),
    ) -> Decoder<'a> {
        let mut d = self.start(bytes, prompt);
        for _ in 0..generated {
            d.next_token();
            step();
        }
        d
    }

    /// The generation another process left after `words.len()` tokens,
    /// from what its KV cache kept of its last step ([`Decoder::entry`]):
    /// the activation and running state after that step, and the index of
    /// every token so far in the vocabulary ([`word_index`]). Nothing is
    /// computed again. None when the entry cannot be ours (a wrong width,
    /// a word out of range).
    pub fn restore<'a>(
        &'a self,
        bytes: &'a [u8],
        x: Vec<f32>,
        state: u64,
        words: &[u32],
    ) -> Option<Decoder<'a>> {
        if x.len() != COLS {
            return None;
        }
        let words = words
            .iter()
            .map(|&w| WORDS.get(w as usize).copied())
            .collect::<Option<Vec<_>>>()?;
        Some(Decoder {
            model: self,
            bytes,
            x,
            state,
            words,
        })
    }
}

/// Where `word` is in the vocabulary of output tokens.
pub fn word_index(word: &str) -> Option<u32> {
    WORDS.iter().position(|w| *w == word).map(|i| i as u32)
}

/// One generation in progress, token by token (see [`Model::start`],
/// [`Model::resume`]). Holds the weights it reads and every token so far.
#[derive(Clone)]
pub struct Decoder<'a> {
    model: &'a Model,
    bytes: &'a [u8],
    /// The running activation.
    x: Vec<f32>,
    /// Hash of every value computed so far (the fingerprint).
    state: u64,
    words: Vec<&'static str>,
}

/// Not the weights (gigabytes) nor the activation: where the generation is.
impl std::fmt::Debug for Decoder<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Decoder")
            .field("fingerprint", &self.fingerprint())
            .field("words", &self.words)
            .finish_non_exhaustive()
    }
}

impl Decoder<'_> {
    /// One decode step: the next token (a word, without separator).
    pub fn next_token(&mut self) -> &'static str {
        let (model, bytes) = (self.model, self.bytes);
        for (m, scales) in model.layers.iter().zip(&model.scales) {
            let mut y = [0f32; ROWS_PER_STEP];
            for (k, yk) in y.iter_mut().enumerate() {
                self.state = splitmix(self.state ^ k as u64);
                let r = (self.state % m.rows as u64) as usize;
                let row = m.row(bytes, r);
                let dot: f32 = (0..COLS).map(|c| f32_at(row, c) * self.x[c]).sum();
                *yk = (dot * scales[r] / COLS as f32).tanh();
                self.state ^= yk.to_bits() as u64;
            }
            for (c, xc) in self.x.iter_mut().enumerate() {
                *xc = 0.5 * *xc + y[c % ROWS_PER_STEP];
            }
        }
        let word = WORDS[(self.state % WORDS.len() as u64) as usize];
        self.words.push(word);
        let row = model.embed.row(bytes, (self.state % VOCAB as u64) as usize);
        for (c, xc) in self.x.iter_mut().enumerate() {
            *xc += f32_at(row, c);
        }
        word
    }

    /// The tokens generated so far, in order.
    pub fn generated(&self) -> &[&'static str] {
        &self.words
    }

    /// How many tokens were generated so far.
    pub fn tokens(&self) -> usize {
        self.words.len()
    }

    /// What a KV cache keeps of the last step: the activation and the
    /// running state after it (with [`Self::generated`], what
    /// [`Model::restore`] goes on from).
    pub fn entry(&self) -> (&[f32], u64) {
        (&self.x, self.state)
    }

    /// The fingerprint of the generation so far (that of a [`Completion`]
    /// of as many tokens).
    pub fn fingerprint(&self) -> String {
        format!("{:016x}", self.state)
    }

    /// The answer so far: the tokens joined by spaces, the fingerprint.
    pub fn completion(&self) -> Completion {
        Completion {
            text: self.words.join(" "),
            fingerprint: self.fingerprint(),
            tokens: self.words.len(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn make(dir: &Path, mib: u64, seed: u64) -> Vec<u8> {
        let p = dir.join(format!("m-{mib}-{seed}.safetensors"));
        generate(&p, mib, seed).unwrap();
        std::fs::read(&p).unwrap()
    }

    #[test]
    fn generation_is_deterministic_and_seeded() {
        let d = tempfile::tempdir().unwrap();
        let a = make(d.path(), 2, 7);
        let b = make(d.path(), 2, 7);
        let c = make(d.path(), 2, 8);
        // The header's metadata order follows a HashMap: compare contents.
        let content = |bytes: &[u8]| {
            let (_, meta) = SafeTensors::read_metadata(bytes).unwrap();
            let st = SafeTensors::deserialize(bytes).unwrap();
            let mut t: Vec<(String, Vec<u8>)> = st
                .iter()
                .map(|(n, v)| (n.to_owned(), v.data().to_vec()))
                .collect();
            t.sort();
            (meta.metadata().clone(), t)
        };
        assert!(content(&a) == content(&b), "same seed, different model");
        assert!(content(&a) != content(&c), "another seed, same model");
        assert!(a.len() >= 2 << 20, "size {}", a.len());
    }

    #[test]
    fn verify_accepts_the_file_and_names_a_corrupted_tensor() {
        let d = tempfile::tempdir().unwrap();
        let mut a = make(d.path(), 2, 7);
        verify(&a, Path::new("m")).unwrap();
        let model = Model::build(&a, Path::new("m")).unwrap();
        let off = model.layers[5].offset + 100;
        a[off] ^= 0x40;
        let e = verify(&a, Path::new("m")).unwrap_err().to_string();
        assert!(e.contains("layers.05.weight"), "{e}");
    }

    #[test]
    fn answers_are_deterministic() {
        let d = tempfile::tempdir().unwrap();
        let a = make(d.path(), 2, 7);
        let m = Model::build(&a, Path::new("m")).unwrap();
        let x = m.complete(&a, "hello", 12);
        assert_eq!(x, m.complete(&a, "hello", 12));
        assert_eq!(x.tokens, 12);
        assert_ne!(x.fingerprint, m.complete(&a, "hullo", 12).fingerprint);
        // The step hook sees every decode step and changes nothing.
        let mut steps = 0;
        assert_eq!(m.complete_with(&a, "hello", 12, || steps += 1), x);
        assert_eq!(steps, 12);
    }

    /// The completion loop as it was before the decoder: the decoder must
    /// give exactly its text and fingerprint.
    fn one_loop(m: &Model, bytes: &[u8], prompt: &str, max_tokens: usize) -> Completion {
        let mut x = vec![0f32; COLS];
        let mut state = name_hash(prompt);
        for &b in prompt.as_bytes() {
            let row = m.embed.row(bytes, b as usize);
            for (c, xc) in x.iter_mut().enumerate() {
                *xc += f32_at(row, c);
            }
        }
        let mut words = Vec::with_capacity(max_tokens);
        for _ in 0..max_tokens {
            for (l, scales) in m.layers.iter().zip(&m.scales) {
                let mut y = [0f32; ROWS_PER_STEP];
                for (k, yk) in y.iter_mut().enumerate() {
                    state = splitmix(state ^ k as u64);
                    let r = (state % l.rows as u64) as usize;
                    let row = l.row(bytes, r);
                    let dot: f32 = (0..COLS).map(|c| f32_at(row, c) * x[c]).sum();
                    *yk = (dot * scales[r] / COLS as f32).tanh();
                    state ^= yk.to_bits() as u64;
                }
                for (c, xc) in x.iter_mut().enumerate() {
                    *xc = 0.5 * *xc + y[c % ROWS_PER_STEP];
                }
            }
            words.push(WORDS[(state % WORDS.len() as u64) as usize]);
            let row = m.embed.row(bytes, (state % VOCAB as u64) as usize);
            for (c, xc) in x.iter_mut().enumerate() {
                *xc += f32_at(row, c);
            }
        }
        Completion {
            text: words.join(" "),
            fingerprint: format!("{state:016x}"),
            tokens: words.len(),
        }
    }

    #[test]
    fn the_decoder_gives_the_answers_of_the_single_loop() {
        let d = tempfile::tempdir().unwrap();
        let a = make(d.path(), 2, 7);
        let m = Model::build(&a, Path::new("m")).unwrap();
        for (prompt, n) in [("hello", 12), ("", 5), ("the prompt", 0), ("é ✓ long", 64)] {
            let want = one_loop(&m, &a, prompt, n);
            assert_eq!(m.complete(&a, prompt, n), want, "{prompt:?} {n}");
            let mut dec = m.start(&a, prompt);
            let words: Vec<&str> = (0..n).map(|_| dec.next_token()).collect();
            assert_eq!(words.join(" "), want.text);
            assert_eq!(dec.generated(), &words[..]);
            assert_eq!(dec.tokens(), n);
            assert_eq!(dec.fingerprint(), want.fingerprint);
            assert_eq!(dec.completion(), want);
        }
    }

    #[test]
    fn a_resumed_decoder_goes_on_with_the_same_tokens() {
        let d = tempfile::tempdir().unwrap();
        let a = make(d.path(), 2, 7);
        let m = Model::build(&a, Path::new("m")).unwrap();
        let whole = m.complete(&a, "resume me", 20);
        let words: Vec<&str> = whole.text.split(' ').collect();
        for k in [0, 1, 7, 19, 20] {
            let mut dec = m.resume(&a, "resume me", k);
            assert_eq!(dec.generated(), &words[..k], "after {k}");
            for (i, w) in words.iter().enumerate().skip(k) {
                assert_eq!(dec.next_token(), *w, "token {i} resumed after {k}");
            }
            assert_eq!(dec.completion(), whole, "resumed after {k}");
        }
        // A fresh decoder's fingerprint is that of an empty completion.
        assert_eq!(
            m.start(&a, "resume me").fingerprint(),
            m.complete(&a, "resume me", 0).fingerprint
        );
    }

    #[test]
    fn a_restored_decoder_goes_on_without_computing_again() {
        let dir = tempfile::tempdir().unwrap();
        let bytes = make(dir.path(), 8, 3);
        let m = Model::build(&bytes, Path::new("m")).unwrap();
        let mut d = m.start(&bytes, "restore me");
        for _ in 0..21 {
            d.next_token();
        }
        let (x, state) = d.entry();
        let words: Vec<u32> = d
            .generated()
            .iter()
            .map(|w| word_index(w).unwrap())
            .collect();
        let mut r = m.restore(&bytes, x.to_vec(), state, &words).unwrap();
        for _ in 0..11 {
            assert_eq!(r.next_token(), d.next_token());
        }
        assert_eq!(r.completion(), d.completion());
        assert!(
            m.restore(&bytes, vec![0.0; 3], 0, &[]).is_none(),
            "a wrong width"
        );
        assert!(
            m.restore(&bytes, vec![0.0; COLS], 0, &[u32::MAX]).is_none(),
            "a word out of range"
        );
    }

    #[test]
    fn answer_depends_on_every_tensor() {
        let d = tempfile::tempdir().unwrap();
        let a = make(d.path(), 2, 7);
        let m = Model::build(&a, Path::new("m")).unwrap();
        let base = m.complete(&a, "the prompt", 8);
        // Zero one tensor at a time (a missing mapping reads as zeros):
        // the answer must change for each of them.
        let mut all = vec![m.embed.clone()];
        all.extend(m.layers.iter().cloned());
        for (i, t) in all.iter().enumerate() {
            let mut b = a.clone();
            b[t.offset..t.offset + t.rows * COLS * 4].fill(0);
            let other = Model::build(&b, Path::new("m")).unwrap();
            assert_ne!(
                other.complete(&b, "the prompt", 8).fingerprint,
                base.fingerprint,
                "tensor {i} did not matter"
            );
        }
        // And another seed gives another answer.
        let c = make(d.path(), 2, 8);
        let mc = Model::build(&c, Path::new("m")).unwrap();
        assert_ne!(mc.complete(&c, "the prompt", 8), base);
    }
}
