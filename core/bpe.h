/* bpe.h: encoding text to token ids the way a Hugging Face tokenizer.json with a BPE model does —
 * added tokens split out first, then the normalizers, the pre-tokenizers and the BPE merges, each as
 * the `tokenizers` library (Rust) runs it. The file's regexes, Oniguruma's syntax, run on PCRE2 (UTF +
 * UCP + MULTILINE, JIT when the library has it) with the escapes whose meaning differs rewritten
 * (\w \W \b \B \h \H, (?m)); normalization forms and character classes are utf8proc's.
 * Not here: reading the JSON (lua/nvlua/tokenizer.lua turns it into the calls below, flattening
 * Sequences and refusing what is not supported), the post-processor's special tokens and decoding
 * (also Lua), the WordPiece / Unigram models, offsets, truncation and padding.
 * Ids are 0-based int32 as in the file. An encoder is not thread-safe (it keeps a word cache and
 * work buffers); use one per thread. */
#ifndef NVL_BPE_H
#define NVL_BPE_H
#include <stddef.h>
#include <stdint.h>
#include "nvl.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct nvl_bpe nvl_bpe;

/* Normalizers, applied in the order added to each piece of text between added tokens. */
typedef enum {
  NVL_NORM_NFC = 0,
  NVL_NORM_NFD = 1,
  NVL_NORM_NFKC = 2,
  NVL_NORM_NFKD = 3,
  NVL_NORM_LOWERCASE = 4,      /* per code point (utf8proc_tolower) */
  NVL_NORM_REPLACE = 5,        /* every occurrence of a string (a) by content (b) */
  NVL_NORM_REPLACE_REGEX = 6,  /* every match of a regex (a) by content (b), taken literally */
  NVL_NORM_PREPEND = 7,        /* a before a non-empty text */
  NVL_NORM_STRIP = 8,          /* white space off the left (flag & 1) and right (flag & 2) ends */
  NVL_NORM_STRIP_ACCENTS = 9,  /* drop combining marks (Mn, Mc, Me) */
  NVL_NORM_COUNT
} nvl_bpe_norm;

/* Pre-tokenizer steps, applied in the order added to every piece; the splits follow
 * tokenizers' SplitDelimiterBehavior. */
typedef enum {
  NVL_PRE_SPLIT_REGEX = 0,   /* split at the matches of a regex (a) */
  NVL_PRE_SPLIT_STRING = 1,  /* at the occurrences of a string (a) */
  NVL_PRE_SPLIT_DIGIT = 2,   /* at each numeric character (Unicode N*) */
  NVL_PRE_SPLIT_SPACE = 3,   /* at each white space character */
  NVL_PRE_SPLIT_PUNCT = 4,   /* at each punctuation character (ASCII punctuation, Unicode P*) */
  NVL_PRE_PREFIX_SPACE = 5,  /* ByteLevel's add_prefix_space: " " before a piece not starting with one */
  NVL_PRE_BYTES = 6,         /* ByteLevel: every byte to its GPT-2 character */
  NVL_PRE_METASPACE = 7,     /* " " -> a; a prepended (flag: 0 never, 1 first, 2 always) unless there */
  NVL_PRE_COUNT
} nvl_bpe_pre;

typedef enum {
  NVL_SPLIT_REMOVED = 0,
  NVL_SPLIT_ISOLATED = 1,
  NVL_SPLIT_MERGED_WITH_PREVIOUS = 2,
  NVL_SPLIT_MERGED_WITH_NEXT = 3,
  NVL_SPLIT_CONTIGUOUS = 4,
  NVL_SPLIT_COUNT
} nvl_bpe_behavior;

/* Flags of an added token (tokenizers' AddedToken). */
enum { NVL_ADDED_LSTRIP = 1, NVL_ADDED_RSTRIP = 2, NVL_ADDED_SINGLE_WORD = 4, NVL_ADDED_NORMALIZED = 8 };

/* A new, empty encoder. NVL_ENOMEM. */
nvl_status nvl_bpe_new(nvl_bpe **out);
/* Frees it (NULL: nothing). */
void nvl_bpe_free(nvl_bpe *b);

/* The model's vocabulary: token text (bytes, as in the file) -> id >= 0. A text given twice keeps
 * the later id (a JSON object has one of each). */
nvl_status nvl_bpe_add_token(nvl_bpe *b, const char *text, size_t len, int32_t id);
/* The next merge (rank = merges added before it): both tokens and the merged one (a, then c less
 * the continuing_subword_prefix's length: set the model first) must be in the vocabulary
 * (NVL_EINVAL naming the missing one). A pair given twice keeps the later rank. */
nvl_status nvl_bpe_add_merge(nvl_bpe *b, const char *a, size_t alen, const char *c, size_t clen);
/* The model's options: unk_id (-1: none), fuse_unk, byte_fallback (<0xNN> tokens), ignore_merges
 * (a word in the vocabulary is one token), continuing_subword_prefix / end_of_word_suffix (NULL or
 * "": none). */
nvl_status nvl_bpe_set_model(nvl_bpe *b, int32_t unk_id, int fuse_unk, int byte_fallback, int ignore_merges,
                             const char *prefix, const char *suffix);
/* Append a normalizer: a and c as nvl_bpe_norm says (else unused), flag for STRIP. NVL_EINVAL for
 * a regex that does not compile (PCRE2's message). */
nvl_status nvl_bpe_add_normalizer(nvl_bpe *b, nvl_bpe_norm kind, const char *a, size_t alen, const char *c,
                                  size_t clen, int flag);
/* Append a pre-tokenizer step: the pattern a (SPLIT_REGEX, SPLIT_STRING) or replacement a
 * (METASPACE, with flag the prepend scheme), the behavior and invert of a split. */
nvl_status nvl_bpe_add_pre(nvl_bpe *b, nvl_bpe_pre kind, const char *a, size_t alen, nvl_bpe_behavior behavior,
                           int invert, int flag);
/* An added token: content -> id, NVL_ADDED_* flags. Normalized ones are matched in the normalized
 * text, their content normalized by the normalizers added so far (add those first). Matched leftmost-
 * longest; of two with the same (normalized) content in one kind, the first added. Any number. */
nvl_status nvl_bpe_add_special(nvl_bpe *b, const char *content, size_t len, int32_t id, int flags);

/* Encode len bytes of UTF-8 text: *ids (valid until the next call on b) and *n. NVL_EINVAL when
 * the text is not UTF-8 (naming the byte). A character with no token, no byte fallback and no unk
 * token is left out, as tokenizers does. Cost: linear in the text, plus the merges of each word not
 * in the word cache. */
nvl_status nvl_bpe_encode(nvl_bpe *b, const char *text, size_t len, const int32_t **ids, size_t *n);

/* The bytes of work space the encoder holds now (buffers above 16 MiB are freed after each encode). */
size_t nvl_bpe_work_bytes(const nvl_bpe *b);

/* The vocabulary's id of a text, or -1. */
int32_t nvl_bpe_token_id(const nvl_bpe *b, const char *text, size_t len);

#ifdef __cplusplus
}
#endif
#endif
