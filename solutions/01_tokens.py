# Lab 01 source of truth. Edit this file, then run `python -m labsupport release 01_tokens` to
# regenerate labs/01_tokens.ipynb (learners) and solutions/01_tokens.ipynb (instructors).

# %% [markdown]
# # Lab 01: a byte-level BPE tokenizer, written, trained, measured and streamed
#
# A model never sees text: it sees token ids, and every cost of serving it (the prompt's prefill,
# each decode step, the KV cache, the bill) is counted in those ids. In this lab you will
#
# 1. look at what the course's tokenizer makes of text in several scripts, and time it;
# 2. write the heart of byte-level BPE, the merge loop, and then `encode` and `decode`; each is
#    checked;
# 3. train tokenizers of several sizes on the course's corpus and measure characters per token for
#    each kind of text (English, ten other languages, emoji, code), and plot it;
# 4. train Hugging Face `tokenizers` on the same text with the same vocabulary size, and compare
#    compression and speed in the same run;
# 5. write the incremental detokenizer a server needs to stream text, which must never emit half
#    a character; it is checked on characters whose bytes are split across tokens;
# 6. write the filter that holds back text that may still become a stop string, checked on stop
#    strings split across pieces.
#
# Everything runs on a CPU in seconds; no GPU is needed.
#
# **Run All** (*Run > Run All Cells*) runs every cell from the top and stops at the first one that
# raises an error. Until you have written an exercise, its check cell raises with a short message
# saying so, nothing below it runs, and JupyterLab scrolls back to that cell. Section 1 times the
# course's tokenizer before the first exercise, so a first Run All already measures something on
# your machine.

# %% [setup]
import labsupport

settings = labsupport.setup()

# %%
import os
import time

import matplotlib.pyplot as plt

from labsupport import ledger
from labsupport.checks import (
    check_bpe_decode,
    check_bpe_encode,
    check_bpe_merges,
    check_incremental_detokenizer,
    check_stop_strings,
)
from labsupport.timing import benchmark
from labsupport.tokenizer import (
    END_OF_TEXT,
    PASSAGE_KINDS,
    BPETokenizer,
    compression_by_kind,
    course_corpus,
    course_passages,
    course_tokenizer,
    pretokenize,
    train_bpe,
)

PASSAGES = course_passages()  # kind -> text
CORPUS = course_corpus()  # all of it, joined by blank lines
print(f"the course corpus: {len(CORPUS):,} characters, {len(CORPUS.encode()):,} bytes of UTF-8")
for kind, text in PASSAGES.items():
    print(f"  {kind:9s} {len(text):7,} characters  {text[:50]!r}")

# %% [markdown]
# ## 1. What a tokenizer makes of text
#
# `course_tokenizer()` is the tokenizer the rest of the course uses (the server of chapter 03
# serves it): byte-level BPE trained on the corpus above with a vocabulary of 1,024 ids. Ids 0 to
# 255 are the 256 values of a byte; every id above is a *merge* of two earlier ids; the last id is
# the special token `<|endoftext|>`. Below, each token is shown as the bytes it stands for.

# %% tags=["nbval-check-output"]
tok = course_tokenizer()
print(tok)
for text in ["The server streams tokens.", "Le serveur répond.", "東京タワー", "👍🏽 ok"]:
    ids = tok.encode(text)
    print(f"{text!r}: {len(text)} characters, {len(text.encode())} bytes -> {len(ids)} tokens")
    print("   ", [tok.token_bytes(i) for i in ids])

# %% [markdown]
# English words come out whole or in large pieces; Japanese falls apart into single bytes, which is
# why `b'\xe6'` and friends appear: a character of three bytes can be split across tokens. Keep
# that in mind for section 5.
#
# Now a measurement: how fast does this tokenizer encode the whole corpus on your machine? A fresh
# tokenizer is built for each call, so that its cache of already-seen words starts empty.

# %%
MERGES = tok.merges
timing = benchmark(lambda: BPETokenizer(MERGES).encode(CORPUS), repeats=3)
n_tokens = len(tok.encode(CORPUS))
print(f"encoded {len(CORPUS):,} characters into {n_tokens:,} tokens in {timing.median_s * 1e3:.0f} ms: "
      f"{n_tokens / timing.median_s:,.0f} tokens/s, {len(CORPUS) / n_tokens:.2f} characters per token")

# %% [markdown]
# ### Save your figures to the class ledger
#
# `ledger.record` writes this run's figures, with your device, the date and the versions, to a
# new small file in `~/.labsupport/results/` (or the folder `LABSUPPORT_LEDGER` names); it never
# replaces an earlier one. An instructor collects the class's files and runs
# `python -m labsupport ledger FOLDER` to compare everyone's GPUs side by side.

# Tokenizers run on the CPU, so the file names the CPU.

# %%
ledger.record("01_tokens", [
    ledger.Figure("course_encode_tokens_per_s", n_tokens / timing.median_s, "tokens/s",
                  f"course BPE tokenizer (Python), the {len(CORPUS):,}-character corpus in one call, fresh cache; median time"),
], on_cpu=True)

# %% [markdown]
# ## 2. Byte-level BPE, written by you
#
# **Training.** Start from the UTF-8 bytes of the text, so that every string, in any script, can
# be written with the 256 byte ids and nothing is ever unknown. Then repeat: count every pair of
# adjacent ids, merge the most frequent pair into a new id everywhere, until the vocabulary has
# the size you want. The `k`-th merge (counting from 0) gets id `256 + k`.
#
# **Pre-tokenisation.** The pairs are not counted over the text as one long sequence: the text is
# first split into *chunks* (words with the space before them, numbers, runs of punctuation,
# whitespace), and pairs are counted only inside a chunk. A merge can then never glue the end of
# one word to the start of the next. `pretokenize` does the split (its pattern is in
# `labsupport.tokenizer`):

# %% tags=["nbval-check-output"]
print(pretokenize("Hello, world! It's 2026 ... naïve 東京 👍🏽"))

# %% [markdown]
# Every chunk that occurs several times is counted once per occurrence. **Ties** (two pairs with the
# same count) go to the *smallest* pair, comparing the pairs as tuples of ids `(a, b)`: with the
# counts in a dict, `min(counts, key=lambda p: (-counts[p], p))`. Merging replaces the pair
# left to right without overlap: `a a a` with the pair `(a, a)` becomes `aa a`.
#
# ### Exercise 1: the merge loop
#
# Write `merge(ids, pair, new_id)`, then `bpe_merges(text, vocab_size)`: the list of merges (pairs
# of ids, in the order learned) for a vocabulary of `vocab_size` ids, that is `vocab_size - 256`
# merges, or fewer if no chunk has two ids left. A `collections.Counter` keyed by pairs is all you
# need; recounting every pair at every step is fine here.

# %%
from collections import Counter


def merge(ids, pair, new_id):
    # BEGIN SOLUTION: return ids with every occurrence of pair replaced by new_id, left to right
    out, i = [], 0
    while i < len(ids):
        if i + 1 < len(ids) and ids[i] == pair[0] and ids[i + 1] == pair[1]:
            out.append(new_id)
            i += 2
        else:
            out.append(ids[i])
            i += 1
    return out
    # END SOLUTION


def bpe_merges(text, vocab_size):
    # BEGIN SOLUTION: count pairs inside the chunks of pretokenize(text), merge the most frequent (ties: smallest), repeat
    chunks = Counter(pretokenize(text))  # chunk -> how often it occurs
    words = [list(chunk.encode("utf-8")) for chunk in chunks]
    freqs = list(chunks.values())
    merges = []
    while len(merges) < vocab_size - 256:
        counts = Counter()
        for word, freq in zip(words, freqs):
            for pair in zip(word, word[1:]):
                counts[pair] += freq
        if not counts:
            break
        best = min(counts, key=lambda p: (-counts[p], p))
        merges.append(best)
        words = [merge(word, best, 255 + len(merges)) for word in words]
    return merges
    # END SOLUTION


# %%
check_bpe_merges(bpe_merges)

# %% [markdown]
# What did it learn? The first merges on the French passage, each shown as the bytes of the new
# token:

# %% tags=["nbval-check-output"]
french_merges = bpe_merges(PASSAGES["french"], 256 + 20)
pieces = {i: bytes([i]) for i in range(256)}
for k, (a, b) in enumerate(french_merges):
    pieces[256 + k] = pieces[a] + pieces[b]
print([pieces[256 + k].decode("utf-8", "replace") for k in range(len(french_merges))])

# %% [markdown]
# ### Exercise 2: encode and decode
#
# `bpe_encode(text, merges)`: pre-tokenise, then in each chunk start from its bytes and apply the
# merges **in the order they were learned** (going through `merges` once, in order, merging each
# pair wherever it occurs, gives the same result as training did). A string that UTF-8 cannot
# encode (a lone surrogate such as `"\ud800"`) must raise `ValueError`; `str.encode` already
# raises `UnicodeEncodeError`, which is one.
#
# `bpe_decode(ids, merges)`: each id stands for bytes (`bytes([i])` for `i < 256`, the two parts
# joined for a merge). Join the bytes of **all** the ids, then decode **once** with
# `.decode("utf-8", errors="replace")`: a character's bytes may be spread over several tokens, and
# ids that do not form valid UTF-8 (a model can emit them) must show up as `"\ufffd"`, not vanish.
# An id outside the vocabulary raises `ValueError`.

# %%
def bpe_encode(text, merges):
    # BEGIN SOLUTION: pretokenize, then apply the merges in order inside each chunk
    ids = []
    for chunk in pretokenize(text):
        chunk_ids = list(chunk.encode("utf-8"))
        for k, pair in enumerate(merges):
            if len(chunk_ids) < 2:
                break
            chunk_ids = merge(chunk_ids, pair, 256 + k)
        ids.extend(chunk_ids)
    return ids
    # END SOLUTION


def bpe_decode(ids, merges):
    # BEGIN SOLUTION: join the bytes of all ids, decode once with errors=replace; ValueError for an unknown id
    vocab = [bytes([i]) for i in range(256)]
    for a, b in merges:
        vocab.append(vocab[a] + vocab[b])
    data = b""
    for i in ids:
        if not 0 <= i < len(vocab):
            raise ValueError(f"token id {i} is outside the vocabulary (0 to {len(vocab) - 1})")
        data += vocab[i]
    return data.decode("utf-8", errors="replace")
    # END SOLUTION


# %%
check_bpe_encode(bpe_encode)

# %%
check_bpe_decode(bpe_decode)

# %% [markdown]
# Your three functions make a tokenizer. Any string survives the round trip, in any script:

# %% tags=["nbval-check-output"]
sample_merges = bpe_merges(PASSAGES["german"] + PASSAGES["russian"], 400)
for text in ["Übermorgen geht es weiter.", "Привет, мир!", "e\u0301 (e + combining accent)", "🇫🇷 👨‍👩‍👧"]:
    ids = bpe_encode(text, sample_merges)
    print(f"{len(ids):3d} tokens, round trip {'ok' if bpe_decode(ids, sample_merges) == text else 'BROKEN'}: {text}")

# %% [markdown]
# ## 3. Characters per token, by kind of text
#
# Your loop recounts every pair after every merge. The course's `train_bpe` learns the same merges
# (the check compared them), but keeps the counts for the table of distinct chunks and updates only
# the chunks that held the merged pair. The gap on one passage:

# %%
start = time.perf_counter()
yours = bpe_merges(PASSAGES["english"][:20_000], 512)
t_yours = time.perf_counter() - start
start = time.perf_counter()
course = train_bpe(PASSAGES["english"][:20_000], 512, special_tokens=()).merges
t_course = time.perf_counter() - start
print(f"20,000 characters, 256 merges: yours {t_yours:.2f} s, the course's {t_course:.3f} s; "
      f"same merges: {yours == course}")

# %% [markdown]
# Now train on the whole corpus at three vocabulary sizes and measure how many characters each
# kind of text gets per token. (These are measured on the text the tokenizers were trained on,
# which flatters them a little; the comparison between kinds is what matters.)

# %% tags=["nbval-check-output"]
VOCAB_SIZES = [512, 1024, 2048]
trained = {v: train_bpe(CORPUS, v) for v in VOCAB_SIZES}
compression = {v: compression_by_kind(t.encode) for v, t in trained.items()}
print(f"{'kind':9s} {'bytes/char':>10s}" + "".join(f" {f'chars/token @{v}':>17s}" for v in VOCAB_SIZES))
for kind in PASSAGE_KINDS:
    first = compression[VOCAB_SIZES[0]][kind]
    print(f"{kind:9s} {first.utf8_bytes / first.chars:10.2f}"
          + "".join(f" {compression[v][kind].chars_per_token:17.2f}" for v in VOCAB_SIZES))

# %%
fig, ax = plt.subplots(figsize=(11, 3.8))
width = 0.8 / len(VOCAB_SIZES)
for j, v in enumerate(VOCAB_SIZES):
    ax.bar([i + j * width for i in range(len(PASSAGE_KINDS))],
           [compression[v][k].chars_per_token for k in PASSAGE_KINDS], width, label=f"{v:,} ids")
ax.set_xticks([i + width * (len(VOCAB_SIZES) - 1) / 2 for i in range(len(PASSAGE_KINDS))], PASSAGE_KINDS,
              rotation=45)
ax.set(ylabel="characters per token", title="byte-level BPE trained on the course corpus (mostly English)")
ax.legend()
fig.tight_layout()

# %% [markdown]
# The corpus is mostly English (the course's own chapters), so English gets the most characters
# per token, and a larger vocabulary helps it most. Scripts whose characters take two or three
# bytes in UTF-8 and that the training text holds little of get fewer than one character per
# token: a Chinese sentence costs several tokens per character. The same question therefore costs
# a different number of tokens, so different prefill time, KV cache and price, in each language.
#
# ## 4. The same training in Hugging Face `tokenizers`
#
# `tokenizers` (written in Rust) trains byte-level BPE too. Same text, same vocabulary size (its
# `vocab_size` also counts the 256 bytes and the special token), a `ByteLevel` pre-tokeniser (GPT-2's
# split, close to ours) and a `BpeTrainer`. The library is installed with `transformers`, which Colab
# has; if it is missing here, `pip install tokenizers` and rerun.

# %%
# Hugging Face's trainer runs on every core by default (through Rayon); ours runs on one. The
# library reads TOKENIZERS_PARALLELISM at each call; this sets it, so from here on both sides use one thread.
from labsupport.tokenizer import hf_single_thread

hf_single_thread()
try:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
except ModuleNotFoundError:
    Tokenizer = None
    print("Hugging Face tokenizers is not installed: pip install tokenizers, then rerun this section")

if Tokenizer is not None:
    def train_hf(passages, vocab_size):
        hf = Tokenizer(models.BPE())
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        hf.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[END_OF_TEXT], show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        hf.train_from_iterator(passages, trainer)
        return hf

    VOCAB = 1024
    start = time.perf_counter()
    hf = train_hf(list(PASSAGES.values()), VOCAB)
    t_train_hf = time.perf_counter() - start
    start = time.perf_counter()
    ours = train_bpe(CORPUS, VOCAB)
    t_train_ours = time.perf_counter() - start
    hf_compression = compression_by_kind(lambda text: hf.encode(text).ids)
    print(f"vocabulary sizes: ours {ours.vocab_size:,}, Hugging Face {hf.get_vocab_size():,}; "
          f"HF round trip exact: {hf.decode(hf.encode(CORPUS).ids) == CORPUS}")
    print(f"{'kind':9s} {'ours':>6s} {'HF':>6s}   (characters per token)")
    for kind in PASSAGE_KINDS:
        print(f"{kind:9s} {compression[VOCAB][kind].chars_per_token:6.2f} {hf_compression[kind].chars_per_token:6.2f}")

# %% [markdown]
# Compression is nearly the same: both learn byte-level merges inside pre-tokenised chunks from
# the same counts; the small differences come from the two pre-tokenisers (GPT-2's pattern does not
# cut numbers into groups of three, for one).
#
# Speed is measured below in one run, on the same machine, each side on one thread (the cell above
# set `TOKENIZERS_PARALLELISM=false`: without it Hugging Face's trainer uses every core, and the
# training row would compare one core against all of them): interpreted Python (ours) against Rust
# (Hugging Face). Both encoders keep a cache of words they have already seen,
# so each timed call builds a fresh tokenizer (ours from its merges, Hugging Face's from its JSON).
# Two ways of encoding: the whole corpus in one call, and line by line (one call per line, closer to
# a server encoding many short requests, where the cost of each call counts); and training.

# %%
if Tokenizer is not None:
    hf_json = hf.to_str()
    ours_merges = ours.merges
    lines = CORPUS.split("\n")
    n_ours, n_hf = len(ours.encode(CORPUS)), len(hf.encode(CORPUS).ids)

    def hf_lines():
        fresh = Tokenizer.from_str(hf_json)
        return [fresh.encode(line) for line in lines]

    def ours_lines():
        fresh = BPETokenizer(ours_merges)
        return [fresh.encode(line) for line in lines]

    speed = {  # what -> (ours s, HF s)
        "encode the corpus in one call": (benchmark(lambda: BPETokenizer(ours_merges).encode(CORPUS), repeats=3).median_s,
                                          benchmark(lambda: Tokenizer.from_str(hf_json).encode(CORPUS), repeats=3).median_s),
        f"encode it line by line ({len(lines):,} calls)": (benchmark(ours_lines, repeats=3).median_s,
                                                         benchmark(hf_lines, repeats=3).median_s),
        f"train to {VOCAB:,} ids": (t_train_ours, t_train_hf),
    }
    print(f"{'':40s} {'ours (Python)':>14s} {'HF (Rust)':>11s} {'Python/Rust time':>17s}")
    for what, (t_py, t_rs) in speed.items():
        print(f"{what:40s} {t_py * 1e3:11.0f} ms {t_rs * 1e3:8.0f} ms {t_py / t_rs:16.1f}x")
    t_py, t_rs = speed["encode the corpus in one call"]
    print(f"one call: ours {n_ours / t_py:,.0f} tokens/s, HF {n_hf / t_rs:,.0f} tokens/s")

# %% [markdown]
# The ratio is not one number: it depends on how the text arrives. Encoding long text,
# both sides spend most of their time once per *distinct* word: the BPE merge loop runs once for
# each, then the cache answers, and our pre-tokeniser is Python's regular-expression engine, which
# is written in C. Per call, Python pays for its interpreter on every line. Training, ours
# recounts in Python what theirs counts in Rust. A production tokenizer wins more on large
# vocabularies, long inputs of rare words, and by encoding batches on several threads.

# %%
if Tokenizer is not None:
    fig, ax = plt.subplots(figsize=(11, 3.4))
    xs = range(len(PASSAGE_KINDS))
    ax.bar([x - 0.2 for x in xs], [compression[VOCAB][k].chars_per_token for k in PASSAGE_KINDS], 0.4,
           label="ours (Python)")
    ax.bar([x + 0.2 for x in xs], [hf_compression[k].chars_per_token for k in PASSAGE_KINDS], 0.4,
           label="Hugging Face tokenizers (Rust)")
    ax.set_xticks(list(xs), PASSAGE_KINDS, rotation=45)
    ax.set(ylabel="characters per token", title=f"same corpus, {VOCAB:,} ids each")
    ax.legend()
    fig.tight_layout()

# %% [markdown]
# ## 5. Streaming text out of a model
#
# A server sends text to the client as the model produces tokens, one at a time. Decoding each
# token on its own breaks as soon as a character's bytes are split across tokens:

# %% tags=["nbval-check-output"]
ids = tok.encode("Привет, 東京!")
print("token by token:", [tok.token_bytes(i).decode("utf-8", errors="replace") for i in ids])
print("all at once:   ", tok.decode(ids))

# %% [markdown]
# ### Exercise 3: an incremental detokenizer
#
# Write the class `StreamDetokenizer(tokenizer)`:
#
# * `push(token_id)` adds the token's bytes (`self.tokenizer.token_bytes(token_id)`) and returns the
#   text that is now complete: every character whose bytes have all arrived, and never a piece of
#   one. Keep back only a **trailing incomplete character**: a lead byte (`0xC2`-`0xDF` starts a
#   2-byte character, `0xE0`-`0xEF` a 3-byte one, `0xF0`-`0xF4` a 4-byte one) followed by fewer
#   continuation bytes (`0x80`-`0xBF`) than it needs. Everything before it is decoded with
#   `errors="replace"` and returned (return `""` when nothing is complete). So you never hold more
#   than 3 bytes, and a byte that can never be part of a character (a stray continuation byte, or
#   `0xC0`, `0xC1`, `0xF5`-`0xFF`) comes out at once as `"\ufffd"`: a stream must not freeze because a
#   model emitted one bad byte. One case is yours to choose: a lead byte whose next byte already rules
#   its character out (`E0 80` would be an overlong form, `ED A0` a surrogate, `F4 90` beyond
#   U+10FFFF) may be held like any other unfinished character, as the rule above says, or emitted at
#   once as `"\ufffd"`, as Python's own decoder and the course's detokenizer do (chapter 01
#   explains why): the joined text is the same, and the check accepts either.
# * `flush()` returns whatever is still held, decoded with `errors="replace"` (a stream that
#   stops in the middle of a character ends with `"\ufffd"`), and empties the buffer.
#
# Joined, the pieces must equal `tokenizer.decode(ids)`. Python's own
# `codecs.getincrementaldecoder` does this job; the check refuses it, since writing it is the
# point.

# %%
class StreamDetokenizer:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.pending = b""  # bytes received but not yet returned

    def push(self, token_id):
        # BEGIN SOLUTION: add the token's bytes; return all but a trailing incomplete character
        self.pending += self.tokenizer.token_bytes(token_id)
        cut = len(self.pending)
        for back in range(1, min(3, len(self.pending)) + 1):
            byte = self.pending[-back]
            if 0x80 <= byte <= 0xBF:
                continue  # a continuation byte: look further back for its lead byte
            need = 2 if 0xC2 <= byte <= 0xDF else 3 if 0xE0 <= byte <= 0xEF else 4 if 0xF0 <= byte <= 0xF4 else 1
            if need > back:
                cut = len(self.pending) - back  # hold the unfinished character
            break
        text = self.pending[:cut].decode("utf-8", errors="replace")
        self.pending = self.pending[cut:]
        return text
        # END SOLUTION

    def flush(self):
        # BEGIN SOLUTION: return what is still held, decoded with errors=replace, and empty the buffer
        text = self.pending.decode("utf-8", errors="replace")
        self.pending = b""
        return text
        # END SOLUTION


# %%
check_incremental_detokenizer(StreamDetokenizer)

# %% [markdown]
# The stream from before, piece by piece: each push returns only whole characters.

# %% tags=["nbval-check-output"]
stream = StreamDetokenizer(tok)
pieces = [stream.push(i) for i in ids] + [stream.flush()]
print(pieces)
print("joined equals decode:", "".join(pieces) == tok.decode(ids))

# %% [markdown]
# ## 6. Stop strings, held back
#
# A request may name **stop strings** (`"stop": ["\n\nUser:"]` in an OpenAI request): the answer
# ends where one first appears, and the stop string is not part of it. A stop string can arrive
# split across tokens (`"\n"`, `"\nUs"`, `"er:"`), so a streaming server cannot send every piece as
# it comes: text that may still become the start of a stop string waits until a later piece says
# whether it does. Wait for too little and the client receives half a stop string it must never
# see; wait for too much and every token reaches the client late.
#
# ### Exercise 4: hold back exactly what may begin a stop string
#
# Write the class `StopStringFilter(stops)` (`stops`: a list of non-empty strings, maybe empty):
#
# * `push(text)` adds a piece of the answer and returns a tuple `(text_to_send, stopped)`. Look for
#   every stop string in *the text you hold plus the new piece*. If one occurs, return what comes
#   before the **earliest** occurrence (whichever stop string it is) and `stopped=True`; the stop
#   string and everything after it are dropped, and the stream ends there. Otherwise hold the
#   **longest end** of that text that is the beginning of some stop string (`"\n"` for
#   `"\n\nUser:"`, `"\n\nUs"` after another piece), send all the rest, and return `stopped=False`.
# * `flush()` is called when the answer ends another way (end of sequence, length limit): return
#   the text you still hold (it belongs to the answer) and empty it. After a stop nothing is held (what
#   followed the stop string is dropped), so a `flush()` then returns `""`.
#
# The check pushes streams whose stop strings are split over several pieces, false starts
# (`"</b>"` before `"</s>"`), two stop strings at once, and a real stream from the course
# tokenizer, and compares what you have sent after every call with the rule.

# %%
class StopStringFilter:
    def __init__(self, stops):
        self.stops = list(stops)
        self.held = ""  # text received but not yet sent

    def push(self, text):
        # BEGIN SOLUTION: find the earliest stop in held + text; else hold the longest end that begins a stop
        text = self.held + text
        hits = [text.find(s) for s in self.stops if s in text]
        if hits:
            self.held = ""
            return text[:min(hits)], True
        keep = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(text)), keep, -1):
                if text.endswith(s[:k]):
                    keep = k
                    break
        self.held = text[len(text) - keep:]
        return text[:len(text) - keep], False
        # END SOLUTION

    def flush(self):
        # BEGIN SOLUTION: return what is still held and empty it
        text, self.held = self.held, ""
        return text
        # END SOLUTION


# %%
check_stop_strings(StopStringFilter)

# %% [markdown]
# Your detokenizer and your filter together, as a server streams an answer that meets a stop
# string: each line is one token's piece and what the client received for it.

# %% tags=["nbval-check-output"]
answer_ids = tok.encode("The answer is 4.\n\nUser: and what else?")
detok, stops = StreamDetokenizer(tok), StopStringFilter(["\n\nUser:"])
for i in answer_ids:
    piece = detok.push(i)
    sent, stopped = stops.push(piece)
    print(f"piece {piece!r:12} sent {sent!r}")
    if stopped:
        print("stopped: the stop string and what follows are never sent")
        break

# %% [markdown]
# ## What you measured
#
# * Byte-level BPE never meets an unknown character: the worst case is one token per byte.
# * How many characters a token carries depends on the kind of text and on what the tokenizer was
#   trained on; every cost of serving (prefill, decode steps, KV cache, price) follows the token count.
# * A larger vocabulary shortens sequences, with diminishing returns; chapter 01 computes what it
#   costs the model's output layer.
# * A Rust tokenizer and this Python one compress alike; the speed ratio you measured is the
#   language, not the algorithm.
# * Streaming needs a detokenizer that holds back the bytes of an unfinished character; the server
#   of chapter 03 uses the course's `labsupport.tokenizer.IncrementalDetokenizer`, which does what
#   yours does.
# * Stop strings can arrive split across tokens, so a server holds back exactly the text that may
#   still begin one: less leaks a piece of it, more delays every token. The course server's back
#   ends do it with `labsupport.stop_strings.split_at_stop`, the same rule as yours.
