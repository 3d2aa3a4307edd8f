/* bpe.c: the tokenizer.json BPE encoder of bpe.h. Each stage follows the `tokenizers` crate
 * (tokenizers/src: added_vocabulary.rs, normalizers/, pre_tokenizers/, models/bpe/word.rs) step for
 * step, so that ids agree with it byte for byte; tests/test_tokenizer_encode.lua checks them against
 * ids the library wrote (scripts/make_tokenizer_fixtures.py).
 * Text moves through the stages as a list of pieces (offset, length, whether the piece begins the
 * input: Metaspace's prepend_scheme "first") over a byte buffer; each step writes a new list and
 * buffer. A word (a piece after the pre-tokenizers) becomes ids by the BPE merges, lowest rank first
 * (ties: leftmost), with a binary heap over a linked list of symbols, and is then kept in a cache.
 * Not here: JSON, Lua, decoding. */
#define _GNU_SOURCE /* memmem */
#define PCRE2_CODE_UNIT_WIDTH 8
#include "bpe.h"
#include <pcre2.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <utf8proc.h>

/* ---- growable buffers --------------------------------------------------------------------- */

/* room for need elements of elem bytes in the array *pp (a T **, given as void *) of *cap elements:
 * nothing when it has it, else reallocated to need rounded up to a power-of-two multiple of *cap (of
 * first when empty) -> 0, or -1 out of memory (the array left as it was). The pointer is read and
 * written by memcpy: T ** is not void **. */
static int grow(void *pp, size_t *cap, size_t need, size_t elem, size_t first) {
  if (need <= *cap) return 0;
  size_t c = *cap ? *cap : first;
  while (c < need) c *= 2;
  if (c > SIZE_MAX / elem) return -1;
  void *p;
  memcpy(&p, pp, sizeof p);
  void *q = realloc(p, c * elem);
  if (!q) return -1;
  memcpy(pp, &q, sizeof q);
  *cap = c;
  return 0;
}

typedef struct {
  char *p;
  size_t n, cap;
} buf;

static int buf_reserve(buf *b, size_t extra) { return grow(&b->p, &b->cap, b->n + extra, 1, 256); }

static int buf_put(buf *b, const char *s, size_t n) {
  if (buf_reserve(b, n)) return -1;
  if (n) memcpy(b->p + b->n, s, n);
  b->n += n;
  return 0;
}

typedef struct {
  size_t off, len;
  int start; /* the piece begins the input text (original offset 0) */
} piece;

typedef struct {
  piece *p;
  size_t n, cap;
} pieces;

static int pieces_push(pieces *v, size_t off, size_t len, int start) {
  if (grow(&v->p, &v->cap, v->n + 1, sizeof *v->p, 64)) return -1;
  v->p[v->n++] = (piece){off, len, start};
  return 0;
}

typedef struct {
  int32_t *p;
  size_t n, cap;
} ivec;

static int ivec_push(ivec *v, int32_t x) {
  if (grow(&v->p, &v->cap, v->n + 1, sizeof *v->p, 256)) return -1;
  v->p[v->n++] = x;
  return 0;
}

/* ---- hash tables: byte string -> int64, and (id, id) -> (rank, id) --------------------------- */

static uint64_t hash_bytes(const char *s, size_t n) {
  uint64_t h = 1469598103934665603ull; /* FNV-1a */
  for (size_t i = 0; i < n; i++) h = (h ^ (unsigned char)s[i]) * 1099511628211ull;
  return h ^ (h >> 29);
}

typedef struct {
  size_t off; /* key bytes in keys.p */
  uint32_t len;
  int64_t value;
} sslot;

typedef struct {
  sslot *slots; /* len == UINT32_MAX: empty */
  size_t cap, count;
  buf keys;
} strmap;

static int strmap_grow(strmap *m) {
  size_t cap = m->cap ? m->cap * 2 : 1024;
  sslot *s = malloc(cap * sizeof *s);
  if (!s) return -1;
  for (size_t i = 0; i < cap; i++) s[i].len = UINT32_MAX;
  for (size_t i = 0; i < m->cap; i++) {
    if (m->slots[i].len == UINT32_MAX) continue;
    size_t j = hash_bytes(m->keys.p + m->slots[i].off, m->slots[i].len) & (cap - 1);
    while (s[j].len != UINT32_MAX) j = (j + 1) & (cap - 1);
    s[j] = m->slots[i];
  }
  free(m->slots);
  m->slots = s;
  m->cap = cap;
  return 0;
}

static sslot *strmap_find(const strmap *m, const char *k, size_t n) {
  if (!m->cap) return NULL;
  for (size_t j = hash_bytes(k, n) & (m->cap - 1);; j = (j + 1) & (m->cap - 1)) {
    sslot *s = &m->slots[j];
    if (s->len == UINT32_MAX) return NULL;
    if (s->len == n && memcmp(m->keys.p + s->off, k, n) == 0) return s;
  }
}

/* Insert or overwrite; -1 on allocation failure. */
static int strmap_put(strmap *m, const char *k, size_t n, int64_t v) {
  sslot *s = strmap_find(m, k, n);
  if (s) {
    s->value = v;
    return 0;
  }
  if (n >= UINT32_MAX) return -1;
  if ((m->count + 1) * 4 > m->cap * 3 && strmap_grow(m)) return -1;
  size_t off = m->keys.n;
  if (buf_put(&m->keys, k, n)) return -1;
  size_t j = hash_bytes(k, n) & (m->cap - 1);
  while (m->slots[j].len != UINT32_MAX) j = (j + 1) & (m->cap - 1);
  m->slots[j] = (sslot){off, (uint32_t)n, v};
  m->count++;
  return 0;
}

static void strmap_clear(strmap *m) {
  for (size_t i = 0; i < m->cap; i++) m->slots[i].len = UINT32_MAX;
  m->count = 0;
  m->keys.n = 0;
}

static void strmap_free(strmap *m) {
  free(m->slots);
  free(m->keys.p);
}

typedef struct {
  uint64_t key; /* UINT64_MAX: empty */
  int32_t rank, id;
} mslot;

typedef struct {
  mslot *slots;
  size_t cap, count;
} pairmap;

static uint64_t pair_key(int32_t a, int32_t c) { return (uint64_t)(uint32_t)a << 32 | (uint32_t)c; }
static size_t pair_hash(uint64_t k) { return (size_t)((k * 0x9E3779B97F4A7C15ull) >> 20); }

static const mslot *pairmap_find(const pairmap *m, uint64_t k) {
  if (!m->cap) return NULL;
  for (size_t j = pair_hash(k) & (m->cap - 1);; j = (j + 1) & (m->cap - 1)) {
    if (m->slots[j].key == k) return &m->slots[j];
    if (m->slots[j].key == UINT64_MAX) return NULL;
  }
}

static int pairmap_put(pairmap *m, uint64_t k, int32_t rank, int32_t id) {
  if ((m->count + 1) * 2 > m->cap) {
    size_t cap = m->cap ? m->cap * 2 : 1024;
    mslot *s = malloc(cap * sizeof *s);
    if (!s) return -1;
    for (size_t i = 0; i < cap; i++) s[i].key = UINT64_MAX;
    for (size_t i = 0; i < m->cap; i++) {
      if (m->slots[i].key == UINT64_MAX) continue;
      size_t j = pair_hash(m->slots[i].key) & (cap - 1);
      while (s[j].key != UINT64_MAX) j = (j + 1) & (cap - 1);
      s[j] = m->slots[i];
    }
    free(m->slots);
    m->slots = s;
    m->cap = cap;
  }
  size_t j = pair_hash(k) & (m->cap - 1);
  while (m->slots[j].key != UINT64_MAX && m->slots[j].key != k) j = (j + 1) & (m->cap - 1);
  if (m->slots[j].key == UINT64_MAX) m->count++;
  m->slots[j] = (mslot){k, rank, id};
  return 0;
}

/* ---- a byte trie of the added tokens --------------------------------------------------------
 * tokenizers matches them with aho-corasick, MatchKind::LeftmostLongest: the match that starts first,
 * the longest of those. A trie walked from each position does the same; one PCRE2 alternation of
 * thousands of tokens (Gemma's) would exceed PCRE2's pattern size limit. */

typedef struct {
  pairmap edges;   /* (node, byte) -> child node, in rank */
  int64_t *value;  /* node -> id << 8 | flags of the token ending there; -1: none */
  size_t nodes, cap;
  unsigned char first[256]; /* some token starts with this byte */
} trie;

static int32_t trie_node(trie *t) {
  if (grow(&t->value, &t->cap, t->nodes + 1, sizeof *t->value, 64)) return -1;
  if (t->nodes >= INT32_MAX) return -1;
  t->value[t->nodes] = -1;
  return (int32_t)t->nodes++;
}

/* a token s[0..n) (n > 0) -> v; a text added twice keeps the first (the library's matcher reports the
 * first pattern among equal ones); -1 on allocation failure */
static int trie_add(trie *t, const char *s, size_t n, int64_t v) {
  if (!t->nodes && trie_node(t) < 0) return -1; /* the root */
  int32_t node = 0;
  for (size_t i = 0; i < n; i++) {
    uint64_t k = pair_key(node, (unsigned char)s[i]);
    const mslot *e = pairmap_find(&t->edges, k);
    if (e) {
      node = e->rank;
      continue;
    }
    int32_t c = trie_node(t);
    if (c < 0 || pairmap_put(&t->edges, k, c, 0)) return -1;
    node = c;
  }
  t->first[(unsigned char)s[0]] = 1;
  if (t->value[node] < 0) t->value[node] = v;
  return 0;
}

/* the leftmost-longest token in s[from..n): 1 and its span [*a, *z) and value, or 0 */
static int trie_find(const trie *t, const char *s, size_t n, size_t from, size_t *a, size_t *z, int64_t *v) {
  if (!t->nodes) return 0;
  for (size_t i = from; i < n; i++) {
    if (!t->first[(unsigned char)s[i]]) continue;
    int32_t node = 0;
    int64_t best = -1;
    for (size_t j = i; j < n; j++) {
      const mslot *e = pairmap_find(&t->edges, pair_key(node, (unsigned char)s[j]));
      if (!e) break;
      node = e->rank;
      if (t->value[node] >= 0) {
        best = t->value[node];
        *z = j + 1;
      }
    }
    if (best >= 0) {
      *a = i;
      *v = best;
      return 1;
    }
  }
  return 0;
}

static void trie_free(trie *t) {
  free(t->edges.slots);
  free(t->value);
}

/* ---- the encoder -------------------------------------------------------------------------- */

typedef struct {
  int kind, behavior, invert, flag;
  char *a, *c; /* pattern / string / replacement; Replace's content */
  size_t alen, clen;
  pcre2_code *re;
} step;

typedef struct { /* a word's symbol during the merges: a doubly linked list in an array */
  int32_t id, prev, next;
  size_t len; /* bytes; 0: merged into its left neighbour */
} symbol;

typedef struct {
  int32_t rank, pos, id;
} merge_item;

/* the word cache: words of at most this many bytes, this many entries (then cleared) */
#define CACHE_WORD_MAX 256
#define CACHE_ENTRIES 65536

struct nvl_bpe {
  strmap vocab;    /* token text -> id */
  pairmap merges;  /* (left id, right id) -> rank, merged id */
  int32_t nmerges;
  int32_t unk_id;
  int fuse_unk, byte_fallback, ignore_merges;
  char *prefix, *suffix; /* continuing_subword_prefix, end_of_word_suffix ("" none) */
  int32_t byte_ids[256]; /* <0xNN>'s id, -1 when absent */
  char byte_utf8[256][2];  /* GPT-2's character for each byte (ByteLevel), its UTF-8 */
  int byte_len[256];
  step *norm, *pre;
  size_t nnorm, npre;
  trie special[2];         /* added tokens: [0] matched in the raw text, [1] in the normalized text */
  pcre2_code *word_re;     /* single_word's word character (made when such a token is added) */
  pcre2_match_data *md;
  pcre2_match_context *mc; /* with jit: a JIT stack that grows to 16 MiB (long white space runs) */
  pcre2_jit_stack *jit;
  strmap cache;            /* word -> offset << 10 | count into cache_ids */
  ivec cache_ids;
  /* work space */
  buf bufs[2], seg, tmp;
  pieces pc[2];
  ivec out;
  size_t *part, part_cap; /* a split's parts: (start, end, is_match) triples */
  symbol *sym;
  size_t sym_cap;
  merge_item *heap;
  size_t heap_cap;
};

static char *dup_bytes(const char *s, size_t n) {
  char *p = malloc(n + 1);
  if (!p) return NULL;
  if (n) memcpy(p, s, n);
  p[n] = 0;
  return p;
}

/* GPT-2's bytes_to_unicode: the UTF-8 of each byte's character */
static void byte_char(int byte, char out[2], int *len) {
  int cp = byte;
  if (!((byte >= 33 && byte <= 126) || (byte >= 161 && byte <= 172) || byte >= 174)) {
    int k = 0;
    for (int v = 0; v < byte; v++)
      if (!((v >= 33 && v <= 126) || (v >= 161 && v <= 172) || v >= 174)) k++;
    cp = 256 + k;
  }
  if (cp < 0x80) {
    out[0] = (char)cp;
    *len = 1;
  } else {
    out[0] = (char)(0xC0 | (cp >> 6));
    out[1] = (char)(0x80 | (cp & 0x3F));
    *len = 2;
  }
}

nvl_status nvl_bpe_new(nvl_bpe **out) {
  *out = NULL;
  nvl_bpe *b = calloc(1, sizeof *b);
  if (!b) return nvl_error(NVL_ENOMEM, "tokenizer: out of memory");
  b->unk_id = -1;
  for (int i = 0; i < 256; i++) {
    b->byte_ids[i] = -1;
    byte_char(i, b->byte_utf8[i], &b->byte_len[i]);
  }
  b->prefix = dup_bytes("", 0);
  b->suffix = dup_bytes("", 0);
  b->md = pcre2_match_data_create(16, NULL);
  b->mc = pcre2_match_context_create(NULL);
  b->jit = pcre2_jit_stack_create(32 * 1024, 16 * 1024 * 1024, NULL);
  if (b->mc && b->jit) pcre2_jit_stack_assign(b->mc, NULL, b->jit);
  if (!b->prefix || !b->suffix || !b->md || !b->mc) {
    nvl_bpe_free(b);
    return nvl_error(NVL_ENOMEM, "tokenizer: out of memory");
  }
  *out = b;
  return NVL_OK;
}

static void free_steps(step *s, size_t n) {
  for (size_t i = 0; i < n; i++) {
    free(s[i].a);
    free(s[i].c);
    pcre2_code_free(s[i].re);
  }
  free(s);
}

void nvl_bpe_free(nvl_bpe *b) {
  if (!b) return;
  strmap_free(&b->vocab);
  free(b->merges.slots);
  free(b->prefix);
  free(b->suffix);
  free_steps(b->norm, b->nnorm);
  free_steps(b->pre, b->npre);
  pcre2_code_free(b->word_re);
  for (int i = 0; i < 2; i++) {
    trie_free(&b->special[i]);
    free(b->bufs[i].p);
    free(b->pc[i].p);
  }
  pcre2_match_data_free(b->md);
  pcre2_match_context_free(b->mc);
  pcre2_jit_stack_free(b->jit);
  free(b->part);
  strmap_free(&b->cache);
  free(b->cache_ids.p);
  free(b->seg.p);
  free(b->tmp.p);
  free(b->out.p);
  free(b->sym);
  free(b->heap);
  free(b);
}

static nvl_status oom(void) { return nvl_error(NVL_ENOMEM, "tokenizer: out of memory"); }

int32_t nvl_bpe_token_id(const nvl_bpe *b, const char *text, size_t len) {
  const sslot *s = strmap_find(&b->vocab, text, len);
  return s ? (int32_t)s->value : -1;
}

static int hexval(char c) {
  return c >= '0' && c <= '9' ? c - '0' : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
}

nvl_status nvl_bpe_add_token(nvl_bpe *b, const char *text, size_t len, int32_t id) {
  if (id < 0) return nvl_error(NVL_EINVAL, "tokenizer: token '%.*s' has a negative id %d", (int)len, text, id);
  if (strmap_put(&b->vocab, text, len, id)) return oom();
  /* byte_fallback's tokens: "<0x" two upper-case hex digits ">" (Rust's format!("<{:#04X}>", b)) */
  if (len == 6 && memcmp(text, "<0x", 3) == 0 && text[5] == '>' && hexval(text[3]) >= 0 && hexval(text[4]) >= 0)
    b->byte_ids[hexval(text[3]) * 16 + hexval(text[4])] = id;
  return NVL_OK;
}

nvl_status nvl_bpe_add_merge(nvl_bpe *b, const char *a, size_t alen, const char *c, size_t clen) {
  int32_t ia = nvl_bpe_token_id(b, a, alen), ic = nvl_bpe_token_id(b, c, clen);
  if (ia < 0 || ic < 0) {
    return nvl_error(NVL_EINVAL, "tokenizer: merge %d ('%.*s' '%.*s'): '%.*s' is not in the vocabulary", b->nmerges,
                     (int)alen, a, (int)clen, c, (int)(ia < 0 ? alen : clen), ia < 0 ? a : c);
  }
  /* the merged token: a, then c without the continuing_subword_prefix's length (models/bpe/model.rs) */
  size_t plen = strlen(b->prefix);
  b->tmp.n = 0;
  if (buf_put(&b->tmp, a, alen) || buf_put(&b->tmp, c + (clen >= plen ? plen : clen), clen >= plen ? clen - plen : 0))
    return oom();
  int32_t id = nvl_bpe_token_id(b, b->tmp.p, b->tmp.n);
  if (id < 0) {
    return nvl_error(NVL_EINVAL, "tokenizer: merge %d ('%.*s' '%.*s'): the merged token '%.*s' is not in the vocabulary",
                     b->nmerges, (int)alen, a, (int)clen, c, (int)b->tmp.n, b->tmp.p);
  }
  if (pairmap_put(&b->merges, pair_key(ia, ic), b->nmerges, id)) return oom();
  b->nmerges++;
  return NVL_OK;
}

nvl_status nvl_bpe_set_model(nvl_bpe *b, int32_t unk_id, int fuse_unk, int byte_fallback, int ignore_merges,
                             const char *prefix, const char *suffix) {
  char *p = dup_bytes(prefix ? prefix : "", prefix ? strlen(prefix) : 0);
  char *s = dup_bytes(suffix ? suffix : "", suffix ? strlen(suffix) : 0);
  if (!p || !s) {
    free(p);
    free(s);
    return oom();
  }
  free(b->prefix);
  free(b->suffix);
  b->prefix = p;
  b->suffix = s;
  b->unk_id = unk_id;
  b->fuse_unk = fuse_unk;
  b->byte_fallback = byte_fallback;
  b->ignore_merges = ignore_merges;
  return NVL_OK;
}

/* Oniguruma (Ruby syntax), which tokenizers compiles a file's regexes with, and PCRE2 read some of the
 * same spellings differently. Rewritten for PCRE2: \w, \W, \b and \B (Oniguruma's word characters, as
 * tokenizers 0.23 matches them: Alphabetic, marks, numbers, connector punctuation, but inside a class
 * only the decimal numbers; PCRE2 10.42's \w has every number and no marks), \h and \H (hex digits
 * in Ruby, horizontal space in PCRE2), the option m of (?m) and (?m:...) (Ruby's dot-all, PCRE2's s).
 * ^ and $ are line anchors in both once compiled with PCRE2_MULTILINE. Refused by name: \W and \H
 * inside a class (PCRE2 has no class-in-class to say them), Ruby's nested classes and && intersections. */
#define ONIG_WORD "[\\p{Alphabetic}\\p{M}\\p{N}\\p{Pc}]"
#define ONIG_NOT_WORD "[^\\p{Alphabetic}\\p{M}\\p{N}\\p{Pc}]"
#define ONIG_CLASS_WORD "\\p{Alphabetic}\\p{M}\\p{Nd}\\p{Pc}"
/* the Rust regex crate's \w (tokenizers' Whitespace pre-tokenizer, single_word): Join_Control too */
#define RUST_WORD "[\\p{Alphabetic}\\p{M}\\p{Nd}\\p{Pc}\\x{200C}\\x{200D}]"

/* how much of a pattern an error quotes: 80 bytes, cut at a character boundary */
static int quoted(const char *pat, size_t len) {
  size_t q = len > 80 ? 80 : len;
  while (q < len && q > 0 && ((unsigned char)pat[q] & 0xC0) == 0x80) q--;
  return (int)q;
}

static nvl_status refuse(const char *what, const char *pat, size_t len, const char *why) {
  return nvl_error(NVL_EINVAL, "tokenizer: %s regex '%.*s%s' uses %s: not supported", what, quoted(pat, len), pat,
                   len > 80 ? "..." : "", why);
}

static nvl_status onig_to_pcre2(const char *what, const char *p, size_t n, buf *out) {
  int in_class = 0, bad = 0;
  for (size_t i = 0; i < n && !bad; i++) {
    char c = p[i];
    if (c == '\\' && i + 1 < n) {
      char e = p[++i];
      if (e == 'w' || e == 'W') {
        if (in_class && e == 'W') return refuse(what, p, n, "\\W inside a character class");
        const char *t = in_class ? ONIG_CLASS_WORD : e == 'w' ? ONIG_WORD : ONIG_NOT_WORD;
        bad = buf_put(out, t, strlen(t));
      } else if ((e == 'b' || e == 'B') && !in_class) { /* (in a class \b is a backspace in both) */
        const char *w = ONIG_WORD;
        char t[512];
        int k = e == 'b' ? snprintf(t, sizeof t, "(?:(?<=%s)(?!%s)|(?<!%s)(?=%s))", w, w, w, w)
                         : snprintf(t, sizeof t, "(?:(?<=%s)(?=%s)|(?<!%s)(?!%s))", w, w, w, w);
        bad = buf_put(out, t, (size_t)k);
      } else if (e == 'h' || e == 'H') {
        if (in_class && e == 'H') return refuse(what, p, n, "\\H inside a character class");
        const char *t = in_class ? "0-9a-fA-F" : e == 'h' ? "[0-9a-fA-F]" : "[^0-9a-fA-F]";
        bad = buf_put(out, t, strlen(t));
      } else {
        bad = buf_put(out, p + i - 1, 2);
      }
    } else if (in_class) {
      if (c == '[' && i + 1 < n && p[i + 1] == ':') { /* a POSIX bracket, [:alpha:], as far as ":]" */
        const char *end = memmem(p + i + 2, n - i - 2, ":]", 2);
        if (!end) return refuse(what, p, n, "an unclosed [: in a character class");
        bad = buf_put(out, p + i, (size_t)(end + 2 - (p + i)));
        i = (size_t)(end + 1 - p);
      } else if (c == '[') {
        return refuse(what, p, n, "a character class inside a character class (Ruby's nested sets)");
      } else if (c == '&' && i + 1 < n && p[i + 1] == '&') {
        return refuse(what, p, n, "&& inside a character class (Ruby's intersection)");
      } else {
        if (c == ']') in_class = 0;
        bad = buf_put(out, &c, 1);
      }
    } else if (c == '[') {
      in_class = 1;
      bad = buf_put(out, &c, 1);
      if (i + 1 < n && p[i + 1] == '^') bad |= buf_put(out, p + ++i, 1);
      if (i + 1 < n && p[i + 1] == ']') bad |= buf_put(out, p + ++i, 1); /* a leading ] is literal */
    } else if (c == '(' && i + 2 < n && p[i + 1] == '?' && p[i + 2] && strchr("imx-", p[i + 2])) {
      size_t j = i + 2; /* an option setting (?imx-imx) or group (?imx-imx:...) */
      while (j < n && p[j] && strchr("imx-", p[j])) j++;
      if (j < n && (p[j] == ':' || p[j] == ')')) {
        bad = buf_put(out, "(?", 2);
        for (size_t k = i + 2; k < j && !bad; k++) bad = buf_put(out, p[k] == 'm' ? "s" : p + k, 1);
        i = j - 1;
      } else {
        bad = buf_put(out, &c, 1);
      }
    } else {
      bad = buf_put(out, &c, 1);
    }
  }
  return bad ? oom() : NVL_OK;
}

/* compile a tokenizer.json regex (Oniguruma's syntax) for PCRE2 */
static nvl_status compile(const char *what, const char *pat, size_t len, pcre2_code **re) {
  buf src = {0};
  nvl_status st = onig_to_pcre2(what, pat, len, &src);
  if (st != NVL_OK) {
    free(src.p);
    return st;
  }
  int err;
  PCRE2_SIZE at;
  *re = pcre2_compile((PCRE2_SPTR)(src.p ? src.p : ""), src.n, PCRE2_UTF | PCRE2_UCP | PCRE2_MULTILINE, &err, &at, NULL);
  free(src.p);
  if (!*re) { /* PCRE2's reason first; the pattern quoted as the file has it, its first 80 bytes */
    PCRE2_UCHAR msg[256];
    pcre2_get_error_message(err, msg, sizeof msg);
    return nvl_error(NVL_EINVAL, "tokenizer: %s regex does not compile: %s (regex '%.*s%s')", what, (const char *)msg,
                     quoted(pat, len), pat, len > 80 ? "..." : "");
  }
  pcre2_jit_compile(*re, PCRE2_JIT_COMPLETE); /* the interpreter runs it when JIT is unavailable */
  return NVL_OK;
}

static nvl_status push_step(step **list, size_t *n, step s) {
  step *p = realloc(*list, (*n + 1) * sizeof *p);
  if (!p) {
    free(s.a);
    free(s.c);
    pcre2_code_free(s.re);
    return oom();
  }
  *list = p;
  p[(*n)++] = s;
  return NVL_OK;
}

nvl_status nvl_bpe_add_normalizer(nvl_bpe *b, nvl_bpe_norm kind, const char *a, size_t alen, const char *c,
                                  size_t clen, int flag) {
  if ((int)kind < 0 || kind >= NVL_NORM_COUNT) return nvl_error(NVL_EINVAL, "tokenizer: normalizer kind %d", kind);
  step s = {.kind = kind, .flag = flag};
  s.a = dup_bytes(a ? a : "", a ? alen : 0);
  s.c = dup_bytes(c ? c : "", c ? clen : 0);
  s.alen = a ? alen : 0;
  s.clen = c ? clen : 0;
  if (!s.a || !s.c) {
    free(s.a);
    free(s.c);
    return oom();
  }
  if (kind == NVL_NORM_REPLACE_REGEX) {
    nvl_status st = compile("Replace normalizer's", s.a, s.alen, &s.re);
    if (st != NVL_OK) {
      free(s.a);
      free(s.c);
      return st;
    }
  }
  return push_step(&b->norm, &b->nnorm, s);
}

nvl_status nvl_bpe_add_pre(nvl_bpe *b, nvl_bpe_pre kind, const char *a, size_t alen, nvl_bpe_behavior behavior,
                           int invert, int flag) {
  if ((int)kind < 0 || kind >= NVL_PRE_COUNT) return nvl_error(NVL_EINVAL, "tokenizer: pre-tokenizer kind %d", kind);
  if ((int)behavior < 0 || behavior >= NVL_SPLIT_COUNT)
    return nvl_error(NVL_EINVAL, "tokenizer: split behavior %d", behavior);
  step s = {.kind = kind, .behavior = behavior, .invert = invert, .flag = flag};
  s.a = dup_bytes(a ? a : "", a ? alen : 0);
  s.alen = a ? alen : 0;
  if (!s.a) return oom();
  if (kind == NVL_PRE_SPLIT_REGEX) {
    nvl_status st = compile("Split pre-tokenizer's", s.a, s.alen, &s.re);
    if (st != NVL_OK) {
      free(s.a);
      return st;
    }
  }
  return push_step(&b->pre, &b->npre, s);
}

/* ---- characters ---------------------------------------------------------------------------- */

/* the code point at s[*i] (valid UTF-8), *i advanced past it */
static int32_t next_cp(const char *s, size_t n, size_t *i) {
  utf8proc_int32_t cp;
  utf8proc_ssize_t k = utf8proc_iterate((const utf8proc_uint8_t *)s + *i, (utf8proc_ssize_t)(n - *i), &cp);
  *i += k > 0 ? (size_t)k : 1;
  return cp;
}

/* the code point ending at s[i] (exclusive), valid UTF-8 */
static int32_t prev_cp(const char *s, size_t i) {
  size_t j = i - 1;
  while (j > 0 && ((unsigned char)s[j] & 0xC0) == 0x80) j--;
  return next_cp(s, i, &j);
}

/* Rust's char::is_whitespace: the White_Space property (Zs, Zl, Zp, \t..\r, U+0085) */
static int is_space(int32_t cp) {
  if (cp == ' ' || (cp >= 9 && cp <= 13) || cp == 0x85) return 1;
  if (cp < 0x80) return 0;
  utf8proc_category_t c = utf8proc_category(cp);
  return c == UTF8PROC_CATEGORY_ZS || c == UTF8PROC_CATEGORY_ZL || c == UTF8PROC_CATEGORY_ZP;
}

/* Rust's char::is_numeric: Nd, Nl, No */
static int is_numeric(int32_t cp) {
  if (cp < 0x80) return cp >= '0' && cp <= '9';
  utf8proc_category_t c = utf8proc_category(cp);
  return c == UTF8PROC_CATEGORY_ND || c == UTF8PROC_CATEGORY_NL || c == UTF8PROC_CATEGORY_NO;
}

/* a word character for single_word tokens: the \w of the Rust regex crate that tokenizers' added
 * vocabulary uses (Alphabetic, which has letters like U+24B6 that are So; marks; Nd; connector
 * punctuation such as "_"; Join_Control: ZWNJ, ZWJ), b->word_re past ASCII */
static int is_word_char(nvl_bpe *b, int32_t cp) {
  if (cp < 0x80) return (cp >= '0' && cp <= '9') || (cp >= 'A' && cp <= 'Z') || (cp >= 'a' && cp <= 'z') || cp == '_';
  utf8proc_uint8_t e[4];
  utf8proc_ssize_t k = utf8proc_encode_char(cp, e);
  return pcre2_match(b->word_re, e, (size_t)k, 0, PCRE2_ANCHORED | PCRE2_NO_UTF_CHECK, b->md, b->mc) >= 0;
}

/* tokenizers' is_punc: ASCII punctuation or Unicode P* */
static int is_punct(int32_t cp) {
  if (cp < 0x80) return (cp >= 33 && cp <= 47) || (cp >= 58 && cp <= 64) || (cp >= 91 && cp <= 96) || (cp >= 123 && cp <= 126);
  utf8proc_category_t c = utf8proc_category(cp);
  return c >= UTF8PROC_CATEGORY_PC && c <= UTF8PROC_CATEGORY_PO;
}

/* ---- normalizers ---------------------------------------------------------------------------- */

/* the matches of re in s[0..n) as (start, end) pairs in out, as the onig crate's find_iter gives them:
 * each search starts where the last match ended, and an empty match ending where the last match
 * ended is dropped and the search moves one character on; a PCRE2 failure's code, -1 for memory */
typedef struct {
  size_t *v;
  size_t n, cap;
} spans;

static int spans_push(spans *sp, size_t a, size_t z) {
  if (grow(&sp->v, &sp->cap, sp->n + 2, sizeof *sp->v, 64)) return -1;
  sp->v[sp->n++] = a;
  sp->v[sp->n++] = z;
  return 0;
}

static int regex_spans(pcre2_code *re, pcre2_match_data *md, pcre2_match_context *mc, const char *s, size_t n,
                       spans *out) {
  out->n = 0;
  size_t at = 0, last = SIZE_MAX; /* search from at; the last match's end (none yet) */
  while (at <= n) {
    int rc = pcre2_match(re, (PCRE2_SPTR)s, n, at, PCRE2_NO_UTF_CHECK, md, mc);
    if (rc == PCRE2_ERROR_NOMATCH) break;
    if (rc < 0) return rc;
    PCRE2_SIZE *ov = pcre2_get_ovector_pointer(md);
    if (ov[0] == ov[1] && ov[1] == last) {
      if (at >= n) break;
      next_cp(s, n, &at);
      continue;
    }
    if (spans_push(out, ov[0], ov[1])) return -1;
    at = last = ov[1];
  }
  return 0;
}

static int string_spans(const char *pat, size_t plen, const char *s, size_t n, spans *out) {
  out->n = 0;
  if (!plen) return 0;
  for (size_t i = 0; i + plen <= n;) {
    const char *hit = memmem(s + i, n - i, pat, plen);
    if (!hit) break;
    size_t a = (size_t)(hit - s);
    if (spans_push(out, a, a + plen)) return -1;
    i = a + plen;
  }
  return 0;
}

/* a failed match (PCRE2's code, or -1 for memory) as an error naming what ran */
static nvl_status regex_error(int rc, const char *what, size_t n) {
  if (rc == -1) return oom();
  PCRE2_UCHAR msg[256];
  pcre2_get_error_message(rc, msg, sizeof msg);
  return nvl_error(NVL_EINVAL, "tokenizer: %s failed on a text of %zu bytes: %s", what, n, (const char *)msg);
}

/* one normalizer over src[0..n) into dst (emptied first) */
static nvl_status normalize_one(nvl_bpe *b, const step *st, const char *src, size_t n, buf *dst, spans *sp) {
  dst->n = 0;
  switch (st->kind) {
  case NVL_NORM_NFC:
  case NVL_NORM_NFD:
  case NVL_NORM_NFKC:
  case NVL_NORM_NFKD: {
    if (!n) return NVL_OK;
    int opt = UTF8PROC_STABLE;
    opt |= (st->kind == NVL_NORM_NFC || st->kind == NVL_NORM_NFKC) ? UTF8PROC_COMPOSE : UTF8PROC_DECOMPOSE;
    if (st->kind == NVL_NORM_NFKC || st->kind == NVL_NORM_NFKD) opt |= UTF8PROC_COMPAT;
    utf8proc_uint8_t *o = NULL;
    utf8proc_ssize_t k = utf8proc_map((const utf8proc_uint8_t *)src, (utf8proc_ssize_t)n, &o, opt);
    if (k < 0) return nvl_error(NVL_EINVAL, "tokenizer: normalization failed: %s", utf8proc_errmsg(k));
    int bad = buf_put(dst, (const char *)o, (size_t)k);
    free(o);
    return bad ? oom() : NVL_OK;
  }
  case NVL_NORM_LOWERCASE:
  case NVL_NORM_STRIP_ACCENTS:
    for (size_t i = 0; i < n;) {
      int32_t cp = next_cp(src, n, &i);
      if (st->kind == NVL_NORM_LOWERCASE) {
        /* Rust's char::to_lowercase, which tokenizers uses, is utf8proc's simple mapping but for the one
         * unconditional multi-character lowercase of SpecialCasing.txt: U+0130 -> "i" U+0307 */
        if (cp == 0x130) {
          if (buf_put(dst, "i\xCC\x87", 3)) return oom();
          continue;
        }
        cp = utf8proc_tolower(cp);
      } else if (utf8proc_category(cp) >= UTF8PROC_CATEGORY_MN && utf8proc_category(cp) <= UTF8PROC_CATEGORY_ME) continue;
      utf8proc_uint8_t e[4];
      utf8proc_ssize_t k = utf8proc_encode_char(cp, e);
      if (buf_put(dst, (const char *)e, (size_t)k)) return oom();
    }
    return NVL_OK;
  case NVL_NORM_REPLACE:
  case NVL_NORM_REPLACE_REGEX: {
    int bad = st->kind == NVL_NORM_REPLACE ? string_spans(st->a, st->alen, src, n, sp)
                                           : regex_spans(st->re, b->md, b->mc, src, n, sp);
    if (bad) return regex_error(bad, "a Replace normalizer", n);
    size_t at = 0;
    for (size_t k = 0; k < sp->n; k += 2) {
      if (buf_put(dst, src + at, sp->v[k] - at) || buf_put(dst, st->c, st->clen)) return oom();
      at = sp->v[k + 1];
    }
    return buf_put(dst, src + at, n - at) ? oom() : NVL_OK;
  }
  case NVL_NORM_PREPEND:
    if (n && buf_put(dst, st->a, st->alen)) return oom();
    return buf_put(dst, src, n) ? oom() : NVL_OK;
  case NVL_NORM_STRIP: {
    size_t lo = 0, hi = n;
    if (st->flag & 1) {
      while (lo < hi) {
        size_t j = lo;
        if (!is_space(next_cp(src, hi, &j))) break;
        lo = j;
      }
    }
    if (st->flag & 2) {
      while (hi > lo && is_space(prev_cp(src, hi))) {
        hi--;
        while (hi > lo && ((unsigned char)src[hi] & 0xC0) == 0x80) hi--;
      }
    }
    return buf_put(dst, src + lo, hi - lo) ? oom() : NVL_OK;
  }
  }
  return nvl_error(NVL_EINVAL, "tokenizer: normalizer kind %d", st->kind);
}

/* all normalizers over s[0..n) -> b->seg */
static nvl_status normalize(nvl_bpe *b, const char *s, size_t n, spans *sp) {
  b->seg.n = 0;
  if (buf_put(&b->seg, s, n)) return oom();
  for (size_t i = 0; i < b->nnorm; i++) {
    NVL_TRY(normalize_one(b, &b->norm[i], b->seg.p, b->seg.n, &b->tmp, sp));
    buf t = b->seg;
    b->seg = b->tmp;
    b->tmp = t;
  }
  return NVL_OK;
}

/* ---- added tokens ---------------------------------------------------------------------------- */

nvl_status nvl_bpe_add_special(nvl_bpe *b, const char *content, size_t len, int32_t id, int flags) {
  if (!len) return nvl_error(NVL_EINVAL, "tokenizer: added token %d has empty content", id);
  spans sp = {0};
  const char *c = content;
  size_t n = len;
  if (flags & NVL_ADDED_NORMALIZED) {
    nvl_status st = normalize(b, content, len, &sp);
    free(sp.v);
    NVL_TRY(st);
    c = b->seg.p;
    n = b->seg.n;
    if (!n) return NVL_OK; /* normalized away: it can never match */
  }
  if ((flags & NVL_ADDED_SINGLE_WORD) && !b->word_re)
    NVL_TRY(compile("single_word's", RUST_WORD, strlen(RUST_WORD), &b->word_re));
  if (trie_add(&b->special[!!(flags & NVL_ADDED_NORMALIZED)], c, n, (int64_t)id << 8 | (flags & 0xFF))) return oom();
  return NVL_OK;
}

/* text between added tokens, and the tokens, in order */
typedef struct {
  size_t off, len; /* text; len 0 and id >= 0: an added token */
  int32_t id;
  int start;
} seg_item;

typedef struct {
  seg_item *p;
  size_t n, cap;
} segs;

static int segs_push(segs *v, seg_item it) {
  if (grow(&v->p, &v->cap, v->n + 1, sizeof *v->p, 16)) return -1;
  v->p[v->n++] = it;
  return 0;
}

/* split s[0..n) at the added tokens of t into out: texts (start: it begins the input, when at offset 0
 * and start0) and tokens, as added_vocabulary.rs's find_matches. The next token is searched from the
 * end of the last one's match, before its rstrip: a token after an rstrip one may take the spaces
 * the rstrip took too, as in the library. */
static nvl_status split_added(nvl_bpe *b, const trie *t, const char *s, size_t n, int start0, segs *out) {
  size_t at = 0, done = 0, a = 0, z = 0; /* search from at; text before done is already emitted */
  int64_t v;
  while (at < n && trie_find(t, s, n, at, &a, &z, &v)) {
    at = z;
    int flags = (int)(v & 0xFF);
    int32_t id = (int32_t)(v >> 8);
    if (flags & NVL_ADDED_SINGLE_WORD) {
      int left_ok = a == 0 || !is_word_char(b, prev_cp(s, a));
      size_t j = z;
      int right_ok = z == n || !is_word_char(b, next_cp(s, n, &j));
      if (!left_ok || !right_ok) continue;
    }
    if (flags & NVL_ADDED_LSTRIP) { /* the spaces before it, back to the previous match */
      while (a > done && is_space(prev_cp(s, a))) {
        a--;
        while (a > done && ((unsigned char)s[a] & 0xC0) == 0x80) a--;
      }
    }
    if (flags & NVL_ADDED_RSTRIP) {
      while (z < n) {
        size_t j = z;
        if (!is_space(next_cp(s, n, &j))) break;
        z = j;
      }
    }
    if (a > done && segs_push(out, (seg_item){done, a - done, -1, start0 && done == 0})) return oom();
    if (segs_push(out, (seg_item){0, 0, id, 0})) return oom();
    done = z;
  }
  if (n > done && segs_push(out, (seg_item){done, n - done, -1, start0 && done == 0})) return oom();
  return NVL_OK;
}

/* ---- pre-tokenizers ------------------------------------------------------------------------- */

/* one split step over a piece: the (offset, length, is_match) list tokenizers' find_matches makes,
 * then the behavior; the surviving non-empty parts appended to out over the same buffer */
static nvl_status split_piece(nvl_bpe *b, const step *st, const char *s, piece pc, pieces *out, spans *sp) {
  const char *p = s + pc.off;
  size_t n = pc.len;
  int bad = 0;
  switch (st->kind) {
  case NVL_PRE_SPLIT_REGEX: bad = regex_spans(st->re, b->md, b->mc, p, n, sp); break;
  case NVL_PRE_SPLIT_STRING: bad = string_spans(st->a, st->alen, p, n, sp); break;
  default:
    sp->n = 0;
    for (size_t i = 0; i < n;) {
      size_t a = i;
      int32_t cp = next_cp(p, n, &i);
      int hit = st->kind == NVL_PRE_SPLIT_DIGIT ? is_numeric(cp) : st->kind == NVL_PRE_SPLIT_SPACE ? is_space(cp)
                                                                                                   : is_punct(cp);
      if (hit && spans_push(sp, a, i)) return oom();
    }
  }
  if (bad) return regex_error(bad, "a Split pre-tokenizer", n);
  /* parts: matches and the gaps between them, each (a, z, is_match) */
  size_t nparts = 0, prev = 0, need = (sp->n + 2) * 3;
  if (need > b->part_cap) {
    size_t *np = realloc(b->part, need * 2 * sizeof *np);
    if (!np) return oom();
    b->part = np;
    b->part_cap = need * 2;
  }
  size_t *part = b->part;
#define PART(a_, z_, m_) (part[3 * nparts] = (a_), part[3 * nparts + 1] = (z_), part[3 * nparts + 2] = (m_), nparts++)
  for (size_t k = 0; k < sp->n; k += 2) {
    if (sp->v[k] != prev) PART(prev, sp->v[k], 0);
    PART(sp->v[k], sp->v[k + 1], 1);
    prev = sp->v[k + 1];
  }
  if (prev != n || n == 0) PART(prev, n, 0);
#undef PART
  if (st->invert)
    for (size_t k = 0; k < nparts; k++) part[3 * k + 2] = !part[3 * k + 2];
  /* the behavior, in place: parts become (a, z, keep) */
  size_t m = 0;
  int prev_match = 0;
  switch (st->behavior) {
  case NVL_SPLIT_REMOVED:
    for (size_t k = 0; k < nparts; k++)
      if (!part[3 * k + 2]) part[3 * m] = part[3 * k], part[3 * m + 1] = part[3 * k + 1], m++;
    break;
  case NVL_SPLIT_ISOLATED: m = nparts; break;
  case NVL_SPLIT_MERGED_WITH_PREVIOUS:
  case NVL_SPLIT_CONTIGUOUS:
    for (size_t k = 0; k < nparts; k++) {
      int is = (int)part[3 * k + 2];
      int merge = st->behavior == NVL_SPLIT_CONTIGUOUS ? is == prev_match : (is && !prev_match);
      if (merge && m > 0) part[3 * (m - 1) + 1] = part[3 * k + 1];
      else part[3 * m] = part[3 * k], part[3 * m + 1] = part[3 * k + 1], m++;
      prev_match = is;
    }
    break;
  case NVL_SPLIT_MERGED_WITH_NEXT: { /* the same from the right: built reversed in q, then turned */
    size_t *q = malloc((nparts + 1) * 2 * sizeof *q);
    if (!q) return oom();
    for (size_t k = nparts; k-- > 0;) {
      int is = (int)part[3 * k + 2];
      if (is && !prev_match && m > 0) q[2 * (m - 1)] = part[3 * k];
      else q[2 * m] = part[3 * k], q[2 * m + 1] = part[3 * k + 1], m++;
      prev_match = is;
    }
    for (size_t k = 0; k < m; k++) part[3 * k] = q[2 * (m - 1 - k)], part[3 * k + 1] = q[2 * (m - 1 - k) + 1];
    free(q);
    break;
  }
  }
  for (size_t k = 0; k < m; k++) {
    size_t a = part[3 * k], z = part[3 * k + 1];
    if (z > a && pieces_push(out, pc.off + a, z - a, pc.start && a == 0)) return oom();
  }
  return NVL_OK;
}

/* one transforming step over a piece, written to dst; out gets the new piece */
static nvl_status transform_piece(nvl_bpe *b, const step *st, const char *s, piece pc, buf *dst, pieces *out) {
  const char *p = s + pc.off;
  size_t n = pc.len, off = dst->n;
  int bad = 0;
  if (st->kind == NVL_PRE_PREFIX_SPACE) {
    if (!(n && p[0] == ' ')) bad |= buf_put(dst, " ", 1);
    bad |= buf_put(dst, p, n);
  } else if (st->kind == NVL_PRE_BYTES) {
    bad |= buf_reserve(dst, 2 * n);
    for (size_t i = 0; !bad && i < n; i++) {
      unsigned char c = (unsigned char)p[i];
      memcpy(dst->p + dst->n, b->byte_utf8[c], (size_t)b->byte_len[c]);
      dst->n += (size_t)b->byte_len[c];
    }
  } else { /* METASPACE: " " -> replacement, then the prepend scheme */
    /* after the replacement, does the piece start with it? */
    int starts = (n >= st->alen && memcmp(p, st->a, st->alen) == 0) || (n && p[0] == ' ');
    if (!starts && (st->flag == 2 || (st->flag == 1 && pc.start))) bad |= buf_put(dst, st->a, st->alen);
    for (size_t i = 0; i < n && !bad; i++) bad |= p[i] == ' ' ? buf_put(dst, st->a, st->alen) : buf_put(dst, p + i, 1);
  }
  if (bad || pieces_push(out, off, dst->n - off, pc.start)) return oom();
  return NVL_OK;
}

/* ---- the BPE model ---------------------------------------------------------------------------- */

static int heap_less(merge_item x, merge_item y) { return x.rank < y.rank || (x.rank == y.rank && x.pos < y.pos); }

static int heap_push(nvl_bpe *b, size_t *n, merge_item it) {
  if (grow(&b->heap, &b->heap_cap, *n + 1, sizeof *b->heap, 64)) return -1;
  size_t i = (*n)++;
  while (i > 0 && heap_less(it, b->heap[(i - 1) / 2])) {
    b->heap[i] = b->heap[(i - 1) / 2];
    i = (i - 1) / 2;
  }
  b->heap[i] = it;
  return 0;
}

static merge_item heap_pop(nvl_bpe *b, size_t *n) {
  merge_item top = b->heap[0], last = b->heap[--*n];
  size_t i = 0;
  for (;;) {
    size_t c = 2 * i + 1;
    if (c >= *n) break;
    if (c + 1 < *n && heap_less(b->heap[c + 1], b->heap[c])) c++;
    if (!heap_less(b->heap[c], last)) break;
    b->heap[i] = b->heap[c];
    i = c;
  }
  if (*n) b->heap[i] = last;
  return top;
}

static int sym_push(nvl_bpe *b, size_t *n, int32_t id, size_t len) {
  if (grow(&b->sym, &b->sym_cap, *n + 1, sizeof *b->sym, 64)) return -1;
  b->sym[*n] = (symbol){id, (int32_t)*n - 1, -1, len};
  if (*n > 0) b->sym[*n - 1].next = (int32_t)*n;
  (*n)++;
  return 0;
}

/* a word's ids appended to out: models/bpe/model.rs merge_word + word.rs merge_all */
static nvl_status bpe_word(nvl_bpe *b, const char *w, size_t n, ivec *out) {
  if (n > INT32_MAX) return nvl_error(NVL_EINVAL, "tokenizer: a word of %zu bytes (at most 2^31 - 1)", n);
  if (b->ignore_merges) {
    int32_t id = nvl_bpe_token_id(b, w, n);
    if (id >= 0) return ivec_push(out, id) ? oom() : NVL_OK;
  }
  size_t ns = 0;
  int32_t unk = -1;
  size_t unk_len = 0;
  size_t plen = strlen(b->prefix), slen = strlen(b->suffix);
  for (size_t i = 0; i < n;) {
    size_t a = i;
    next_cp(w, n, &i);
    const char *key = w + a;
    size_t klen = i - a;
    if ((a > 0 && plen) || (i == n && slen)) {
      b->tmp.n = 0;
      if ((a > 0 && buf_put(&b->tmp, b->prefix, plen)) || buf_put(&b->tmp, w + a, i - a) ||
          (i == n && buf_put(&b->tmp, b->suffix, slen)))
        return oom();
      key = b->tmp.p;
      klen = b->tmp.n;
    }
    int32_t id = nvl_bpe_token_id(b, key, klen);
    if (id >= 0) {
      if (unk >= 0 && sym_push(b, &ns, unk, unk_len)) return oom();
      unk = -1;
      if (sym_push(b, &ns, id, i - a)) return oom();
      continue;
    }
    if (b->byte_fallback) { /* the bytes of what was looked up: prefix, character, suffix */
      int all = 1;
      for (size_t k = 0; k < klen; k++) all &= b->byte_ids[(unsigned char)key[k]] >= 0;
      if (all) {
        for (size_t k = 0; k < klen; k++)
          if (sym_push(b, &ns, b->byte_ids[(unsigned char)key[k]], 1)) return oom();
        continue;
      }
    }
    if (b->unk_id >= 0) {
      if (unk >= 0 && b->fuse_unk) {
        unk_len += i - a;
      } else {
        if (unk >= 0 && sym_push(b, &ns, unk, unk_len)) return oom();
        unk = b->unk_id;
        unk_len = i - a;
      }
    } /* no unk token: the character is dropped, as tokenizers does */
  }
  if (unk >= 0 && sym_push(b, &ns, unk, unk_len)) return oom();
  size_t nh = 0;
  for (size_t i = 0; i + 1 < ns; i++) {
    const mslot *m = pairmap_find(&b->merges, pair_key(b->sym[i].id, b->sym[i + 1].id));
    if (m && heap_push(b, &nh, (merge_item){m->rank, (int32_t)i, m->id})) return oom();
  }
  while (nh) {
    merge_item top = heap_pop(b, &nh);
    symbol *l = &b->sym[top.pos];
    if (l->len == 0 || l->next < 0) continue;
    symbol *r = &b->sym[l->next];
    const mslot *m = pairmap_find(&b->merges, pair_key(l->id, r->id));
    if (!m || m->id != top.id) continue; /* a stale entry */
    l->id = top.id;
    l->len += r->len;
    l->next = r->next;
    r->len = 0;
    if (r->next >= 0) b->sym[r->next].prev = top.pos;
    if (l->prev >= 0) {
      const mslot *pm = pairmap_find(&b->merges, pair_key(b->sym[l->prev].id, l->id));
      if (pm && heap_push(b, &nh, (merge_item){pm->rank, l->prev, pm->id})) return oom();
    }
    if (l->next >= 0) {
      const mslot *nm = pairmap_find(&b->merges, pair_key(l->id, b->sym[l->next].id));
      if (nm && heap_push(b, &nh, (merge_item){nm->rank, top.pos, nm->id})) return oom();
    }
  }
  for (size_t i = 0; i < ns; i++)
    if (b->sym[i].len && ivec_push(out, b->sym[i].id)) return oom();
  return NVL_OK;
}

/* a word through the cache */
static nvl_status encode_word(nvl_bpe *b, const char *w, size_t n) {
  const sslot *c = n <= CACHE_WORD_MAX ? strmap_find(&b->cache, w, n) : NULL;
  if (c) {
    size_t off = (size_t)(c->value >> 10), cnt = (size_t)(c->value & 1023);
    for (size_t i = 0; i < cnt; i++)
      if (ivec_push(&b->out, b->cache_ids.p[off + i])) return oom();
    return NVL_OK;
  }
  size_t first = b->out.n;
  NVL_TRY(bpe_word(b, w, n, &b->out));
  size_t cnt = b->out.n - first;
  if (n <= CACHE_WORD_MAX && cnt < 1024) {
    if (b->cache.count >= CACHE_ENTRIES) {
      strmap_clear(&b->cache);
      b->cache_ids.n = 0;
    }
    size_t off = b->cache_ids.n;
    for (size_t i = 0; i < cnt; i++)
      if (ivec_push(&b->cache_ids, b->out.p[first + i])) return oom();
    if (strmap_put(&b->cache, w, n, (int64_t)off << 10 | (int64_t)cnt)) return oom();
  }
  return NVL_OK;
}

/* normalized text (b->seg) -> pre-tokenizers -> words -> ids */
static nvl_status encode_text(nvl_bpe *b, const char *s, size_t n, int start, spans *sp) {
  int cur = 0;
  b->bufs[0].n = 0;
  b->pc[0].n = 0;
  if (buf_put(&b->bufs[0], s, n) || pieces_push(&b->pc[0], 0, n, start)) return oom();
  for (size_t k = 0; k < b->npre; k++) {
    const step *st = &b->pre[k];
    int nxt = !cur;
    b->pc[nxt].n = 0;
    int splits = st->kind <= NVL_PRE_SPLIT_PUNCT;
    if (!splits) b->bufs[nxt].n = 0;
    for (size_t i = 0; i < b->pc[cur].n; i++) {
      if (splits) NVL_TRY(split_piece(b, st, b->bufs[cur].p, b->pc[cur].p[i], &b->pc[nxt], sp));
      else NVL_TRY(transform_piece(b, st, b->bufs[cur].p, b->pc[cur].p[i], &b->bufs[nxt], &b->pc[nxt]));
    }
    if (splits) { /* same bytes: the buffer moves along with the pieces */
      buf t = b->bufs[nxt];
      b->bufs[nxt] = b->bufs[cur];
      b->bufs[cur] = t;
    }
    cur = nxt;
  }
  for (size_t i = 0; i < b->pc[cur].n; i++) {
    piece pc = b->pc[cur].p[i];
    if (pc.len) NVL_TRY(encode_word(b, b->bufs[cur].p + pc.off, pc.len));
  }
  return NVL_OK;
}

/* work space above this many bytes is freed after an encode (the ids at the start of the next one):
 * a long text's buffers, tens of times its size, would otherwise stay for the encoder's life */
#define WORK_KEEP ((size_t)16 << 20)
#define TRIM(p_, n_, cap_, size_)            \
  if ((cap_) * (size_) > WORK_KEEP) {        \
    free(p_);                                \
    (p_) = NULL;                             \
    (n_) = (cap_) = 0;                       \
  }

static void trim_work(nvl_bpe *b) {
  for (int i = 0; i < 2; i++) {
    TRIM(b->bufs[i].p, b->bufs[i].n, b->bufs[i].cap, 1);
    TRIM(b->pc[i].p, b->pc[i].n, b->pc[i].cap, sizeof(piece));
  }
  TRIM(b->seg.p, b->seg.n, b->seg.cap, 1);
  TRIM(b->tmp.p, b->tmp.n, b->tmp.cap, 1);
  size_t unused = 0; /* these three have no count: it lives in the calls that use them */
  TRIM(b->part, unused, b->part_cap, sizeof(size_t));
  TRIM(b->sym, unused, b->sym_cap, sizeof(symbol));
  TRIM(b->heap, unused, b->heap_cap, sizeof(merge_item));
  (void)unused;
}

size_t nvl_bpe_work_bytes(const nvl_bpe *b) {
  size_t n = b->seg.cap + b->tmp.cap + b->out.cap * sizeof(int32_t) + b->part_cap * sizeof(size_t) +
             b->sym_cap * sizeof(symbol) + b->heap_cap * sizeof(merge_item);
  for (int i = 0; i < 2; i++) n += b->bufs[i].cap + b->pc[i].cap * sizeof(piece);
  return n;
}

nvl_status nvl_bpe_encode(nvl_bpe *b, const char *text, size_t len, const int32_t **ids, size_t *n) {
  *ids = NULL;
  *n = 0;
  TRIM(b->out.p, b->out.n, b->out.cap, sizeof(int32_t)); /* the last call's ids: the caller is done with them */
  b->out.n = 0;
  utf8proc_ssize_t bad_at = -1;
  for (size_t i = 0; i < len;) {
    utf8proc_int32_t cp;
    utf8proc_ssize_t k = utf8proc_iterate((const utf8proc_uint8_t *)text + i, (utf8proc_ssize_t)(len - i), &cp);
    if (k < 0) {
      bad_at = (utf8proc_ssize_t)i;
      break;
    }
    i += (size_t)k;
  }
  if (bad_at >= 0)
    return nvl_error(NVL_EINVAL, "tokenizer: the text is not valid UTF-8 (byte %zd of %zu)", bad_at + 1, len);
  segs raw = {0}, norm = {0};
  spans sp = {0};
  nvl_status st = split_added(b, &b->special[0], text, len, 1, &raw);
  for (size_t i = 0; st == NVL_OK && i < raw.n; i++) {
    seg_item it = raw.p[i];
    if (it.id >= 0) {
      if (ivec_push(&b->out, it.id)) st = oom();
      continue;
    }
    st = normalize(b, text + it.off, it.len, &sp);
    if (st != NVL_OK) break;
    /* the normalized text is copied: splitting and encoding reuse b->seg's buffers */
    buf seg = {0};
    if (buf_put(&seg, b->seg.p, b->seg.n)) {
      st = oom();
      break;
    }
    norm.n = 0;
    st = split_added(b, &b->special[1], seg.p, seg.n, it.start, &norm);
    for (size_t j = 0; st == NVL_OK && j < norm.n; j++) {
      if (norm.p[j].id >= 0) st = ivec_push(&b->out, norm.p[j].id) ? oom() : NVL_OK;
      else st = encode_text(b, seg.p + norm.p[j].off, norm.p[j].len, norm.p[j].start, &sp);
    }
    free(seg.p);
  }
  free(raw.p);
  free(norm.p);
  free(sp.v);
  trim_work(b);
  if (st != NVL_OK) return st;
  *ids = b->out.p;
  *n = b->out.n;
  return NVL_OK;
}
