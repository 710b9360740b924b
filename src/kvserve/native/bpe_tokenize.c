/* Byte-level BPE (GGUF "gpt2": GPT-2, Llama 3, Qwen2, SmolLM2, Granite, OLMo, ...) straight from a model's
 * tokens, merges and token types, with no Python object per token.
 *
 * Why here: the `tokenizers` library is built from a dict of every token and a list of every merge, both
 * made in Python (0.4 s and +55 MiB for Qwen2.5's 151k tokens and merges at every start); here the file's
 * arrays become three hash tables (tokens by their bytes, tokens by their spelling, merges by their pair).
 *
 * What it computes is what kvserve/tokenizer.py's `tokenizers` build computes (the tests hold the two to
 * the same ids), which is what the model's own tokenizer.json computes:
 *   1. the text is cut at added tokens (CONTROL and USER_DEFINED), leftmost-longest; BPE_LITERAL keeps
 *      CONTROL matches as plain text (a user's message that spells "<|im_start|>" is text, not a turn);
 *   2. each plain segment (NFC-normalized by the caller where the vocabulary asks) is cut by the splits
 *      the file's pre-tokenizer names, in turn, each cutting the pieces the one before left; the splits
 *      are the regexes of pretokenizers.py, written out by hand (bpe_splits.h) over the character classes
 *      of unicode_classes.h (generated from the `tokenizers` regex engine itself);
 *   3. each piece is one symbol per byte (the token of that byte in GPT-2's byte alphabet), merged by
 *      the lowest merge rank first, then leftmost, as the `tokenizers` BPE merges a word; with
 *      `ignore_merges` a piece that is itself a token is that token.
 * A token is kept as its bytes: a spelling all in GPT-2's byte alphabet as the bytes it stands for, any
 * other (an added token's) as its UTF-8, as the ByteLevel decoder reads it.
 * The vocabulary is read-only after bpe_vocab_new: encodes run in parallel on one vocabulary.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "bpe_splits.h"
#include "token_trie.h"
#include "unicode_classes.h"

enum { TYPE_CONTROL = 3, TYPE_USER_DEFINED = 4 };

/* A byte string's id in one of the string tables. */
typedef struct {
    int64_t at; /* in the table's text */
    int32_t len, id;
} Entry;

typedef struct {
    const char *text;
    Entry *slots;
    uint64_t mask;
} Table;

/* A merge by its pair: (left id << 32 | right id) -> its rank and the token it makes. */
typedef struct {
    uint64_t pair;
    int32_t rank, merged;
} Merge;

typedef struct {
    int32_t n;
    int32_t *types;
    char *spellings;     /* the tokens as the file spells them, back to back */
    char *bytes;         /* the tokens as bytes, back to back */
    int64_t *byte_at;    /* token i's bytes: bytes[byte_at[i], byte_at[i + 1]) */
    Table by_bytes;      /* the tokens spelled in the byte alphabet, by their bytes: what merges build */
    Table by_spelling;   /* every token by its spelling (token_to_id) */
    Merge *merges;
    uint64_t merge_mask;
    int32_t byte_id[256]; /* the token of each single byte, or -1 */
    Trie added;
    int32_t splits[BPE_MAX_SPLITS];
    int num_splits, ignore_merges;
    uint8_t ascii_bits[128];
} Vocab;

static const uint64_t NO_PAIR = UINT64_MAX;

static uint64_t table_size(int64_t n) {
    uint64_t size = 16;
    while (size < (uint64_t)n * 2) size <<= 1;
    return size;
}

static int table_init(Table *t, const char *text, int64_t n) {
    uint64_t size = table_size(n);
    t->text = text;
    t->mask = size - 1;
    t->slots = malloc(sizeof(Entry) * size);
    if (!t->slots) return -1;
    for (uint64_t i = 0; i < size; i++) t->slots[i].len = -1;
    return 0;
}

/* The last id put under a string keeps it, as in a dict built in id order. */
static void table_put(Table *t, int64_t at, int32_t len, int32_t id) {
    const char *s = t->text + at;
    for (uint64_t i = hash_bytes(s, len) & t->mask;; i = (i + 1) & t->mask) {
        Entry *e = &t->slots[i];
        if (e->len < 0) {
            *e = (Entry){at, len, id};
            return;
        }
        if (e->len == len && memcmp(t->text + e->at, s, (size_t)len) == 0) {
            e->id = id;
            return;
        }
    }
}

static int32_t table_get(const Table *t, const char *s, int64_t len) {
    for (uint64_t i = hash_bytes(s, len) & t->mask;; i = (i + 1) & t->mask) {
        const Entry *e = &t->slots[i];
        if (e->len < 0) return -1;
        if (e->len == len && memcmp(t->text + e->at, s, (size_t)len) == 0) return e->id;
    }
}

static uint64_t pair_slot(uint64_t pair, uint64_t mask) { return (pair * 0x9E3779B97F4A7C15ull >> 17) & mask; }

static const Merge *merge_of(const Vocab *v, int32_t left, int32_t right) {
    uint64_t pair = (uint64_t)(uint32_t)left << 32 | (uint32_t)right;
    for (uint64_t i = pair_slot(pair, v->merge_mask);; i = (i + 1) & v->merge_mask) {
        const Merge *m = &v->merges[i];
        if (m->pair == NO_PAIR) return NULL;
        if (m->pair == pair) return m;
    }
}

/* GPT-2's byte alphabet backwards: the byte a code point of a token's spelling stands for, or -1. Bytes
 * that print as themselves (! to ~, ¡ to ¬, ® to ÿ) are their own code point; the others are 256 + their
 * rank among them. */
static void byte_alphabet(int16_t of_code_point[324]) {
    for (int c = 0; c < 324; c++) of_code_point[c] = -1;
    int next = 256;
    for (int b = 0; b < 256; b++) {
        int prints = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
        of_code_point[prints ? b : next++] = (int16_t)b;
    }
}

/* The code point at s (n bytes left; the text is valid UTF-8), its length in *len. */
static uint32_t code_point(const uint8_t *s, int64_t n, int *len) {
    int k = utf8_length(s[0]);
    if (k > n) k = 1;
    *len = k;
    if (k == 1) return s[0];
    uint32_t c = s[0] & (0x7F >> k);
    for (int i = 1; i < k; i++) c = c << 6 | (s[i] & 0x3F);
    return c;
}

/* A spelling's bytes in GPT-2's alphabet into out (room for len); their number, or -1 where a character
 * is not of the alphabet. */
static int64_t alphabet_bytes(const int16_t of_code_point[324], const char *s, int64_t len, char *out) {
    int64_t n = 0;
    for (int64_t i = 0; i < len;) {
        int k;
        uint32_t c = code_point((const uint8_t *)s + i, len - i, &k);
        if (c >= 324 || of_code_point[c] < 0) return -1;
        out[n++] = (char)of_code_point[c];
        i += k;
    }
    return n;
}

static uint8_t class_bits(uint32_t c) {
    int lo = 0, hi = UC_RUNS - 1; /* the last run starting at or before c */
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if (UC_RUN_START[mid] <= c) lo = mid;
        else hi = mid - 1;
    }
    return UC_RUN_BITS[lo];
}

void bpe_vocab_free(void *vocab) {
    Vocab *v = vocab;
    if (!v) return;
    free(v->types);
    free(v->spellings);
    free(v->bytes);
    free(v->byte_at);
    free(v->by_bytes.slots);
    free(v->by_spelling.slots);
    free(v->merges);
    free(v->added.nodes);
    free(v);
}

void *bpe_vocab_new(const char *text, const int64_t *starts, const int64_t *lengths, const int *types, int n,
                    const char *merge_text, const int64_t *merge_starts, const int64_t *merge_lengths,
                    int num_merges, const int *splits, int num_splits, int ignore_merges) {
    if (num_splits < 0 || num_splits > BPE_MAX_SPLITS || n < 0 || num_merges < 0) return NULL;
    Vocab *v = calloc(1, sizeof(Vocab));
    if (!v) return NULL;
    int64_t total = 0;
    for (int id = 0; id < n; id++) total += lengths[id];
    v->n = n;
    v->types = malloc(sizeof(int32_t) * (size_t)(n ? n : 1));
    v->spellings = malloc((size_t)total + 1);
    v->bytes = malloc((size_t)total + 1);
    v->byte_at = malloc(sizeof(int64_t) * ((size_t)n + 1));
    uint64_t merge_size = table_size(num_merges);
    v->merges = malloc(sizeof(Merge) * merge_size);
    if (!v->types || !v->spellings || !v->bytes || !v->byte_at || !v->merges || trie_init(&v->added) < 0 ||
        table_init(&v->by_bytes, v->bytes, n) < 0 || table_init(&v->by_spelling, v->spellings, n) < 0) {
        bpe_vocab_free(v);
        return NULL;
    }
    memcpy(v->splits, splits, sizeof(int) * (size_t)num_splits);
    v->num_splits = num_splits;
    v->ignore_merges = ignore_merges;
    for (int c = 0; c < 128; c++) v->ascii_bits[c] = class_bits((uint32_t)c);
    int16_t of_code_point[324];
    byte_alphabet(of_code_point);
    int64_t spelled = 0, at = 0;
    for (int id = 0; id < n; id++) {
        const int64_t len = lengths[id];
        char *s = v->spellings + spelled;
        memcpy(s, text + starts[id], (size_t)len);
        v->types[id] = types[id];
        table_put(&v->by_spelling, spelled, (int32_t)len, id);
        v->byte_at[id] = at;
        int64_t k = alphabet_bytes(of_code_point, s, len, v->bytes + at);
        if (k >= 0) {
            table_put(&v->by_bytes, at, (int32_t)k, id);
        } else { /* not of the alphabet: read as the UTF-8 it is */
            memcpy(v->bytes + at, s, (size_t)len);
            k = len;
        }
        if ((types[id] == TYPE_CONTROL || types[id] == TYPE_USER_DEFINED) && len > 0 &&
            trie_insert(&v->added, s, len, id) < 0) {
            bpe_vocab_free(v);
            return NULL;
        }
        spelled += len;
        at += k;
    }
    v->byte_at[n] = at;
    for (int b = 0; b < 256; b++) {
        char byte = (char)b;
        v->byte_id[b] = table_get(&v->by_bytes, &byte, 1);
    }
    v->merge_mask = merge_size - 1;
    for (uint64_t i = 0; i < merge_size; i++) v->merges[i].pair = NO_PAIR;
    char *halves = malloc(4096);
    if (!halves) {
        bpe_vocab_free(v);
        return NULL;
    }
    for (int rank = 0; rank < num_merges; rank++) {
        /* "left right", both spelled in the alphabet; a merge of tokens not in the vocabulary is left out */
        const char *s = merge_text + merge_starts[rank];
        int64_t len = merge_lengths[rank], space = 0;
        while (space < len && s[space] != ' ') space++;
        if (space == len || len > 4096) continue;
        int64_t left = alphabet_bytes(of_code_point, s, space, halves);
        int64_t right = left < 0 ? -1 : alphabet_bytes(of_code_point, s + space + 1, len - space - 1, halves + left);
        if (right < 0) continue;
        int32_t left_id = table_get(&v->by_bytes, halves, left);
        int32_t right_id = table_get(&v->by_bytes, halves + left, right);
        int32_t merged = table_get(&v->by_bytes, halves, left + right);
        if (left_id < 0 || right_id < 0 || merged < 0) continue;
        uint64_t pair = (uint64_t)(uint32_t)left_id << 32 | (uint32_t)right_id;
        for (uint64_t i = pair_slot(pair, v->merge_mask);; i = (i + 1) & v->merge_mask) {
            Merge *m = &v->merges[i];
            if (m->pair == NO_PAIR || m->pair == pair) { /* a pair listed twice: its last rank, as a map */
                *m = (Merge){pair, rank, merged};
                break;
            }
        }
    }
    free(halves);
    return v;
}

int64_t bpe_first_special(const void *vocab, const char *s, int64_t len, int64_t *found_len) {
    const Vocab *v = vocab;
    return trie_first(&v->added, v->types, s, len, TYPE_CONTROL, found_len);
}

int bpe_token_id(const void *vocab, const char *s, int64_t len) {
    const Vocab *v = vocab;
    return table_get(&v->by_spelling, s, len);
}

int64_t bpe_decode(const void *vocab, const int *ids, int64_t n, int skip_special, char *out, int64_t capacity) {
    const Vocab *v = vocab;
    int64_t written = 0;
    for (int64_t i = 0; i < n; i++) {
        int32_t id = ids[i];
        if (id < 0 || id >= v->n || (skip_special && v->types[id] == TYPE_CONTROL)) continue;
        int64_t len = v->byte_at[id + 1] - v->byte_at[id];
        if (written + len > capacity) return -1;
        memcpy(out + written, v->bytes + v->byte_at[id], (size_t)len);
        written += len;
    }
    return written;
}

/* --- merging one piece ----------------------------------------------------------------------------- */

typedef struct {
    int32_t id, prev, next, alive;
} Symbol;

/* A candidate merge of symbol `left` with its right neighbour, valid while both are still those tokens.
 * Ordered by (rank, left): the `tokenizers` BPE's order, lowest rank first, then leftmost. */
typedef struct {
    uint64_t order;
    int32_t left, left_id, right_id, merged;
} Candidate;

typedef struct {
    Candidate *items;
    int64_t n, room;
} Heap;

static int heap_push(Heap *h, Candidate c) {
    if (h->n == h->room) {
        Candidate *more = realloc(h->items, sizeof(Candidate) * (size_t)(2 * h->room));
        if (!more) return -1;
        h->items = more;
        h->room *= 2;
    }
    int64_t i = h->n++;
    while (i > 0 && c.order < h->items[(i - 1) / 2].order) {
        h->items[i] = h->items[(i - 1) / 2];
        i = (i - 1) / 2;
    }
    h->items[i] = c;
    return 0;
}

static Candidate heap_pop(Heap *h) {
    Candidate top = h->items[0], last = h->items[--h->n];
    int64_t i = 0;
    for (;;) {
        int64_t child = 2 * i + 1;
        if (child >= h->n) break;
        if (child + 1 < h->n && h->items[child + 1].order < h->items[child].order) child++;
        if (h->items[child].order >= last.order) break;
        h->items[i] = h->items[child];
        i = child;
    }
    if (h->n) h->items[i] = last;
    return top;
}

/* An encode's working state: its segment, its buffers, where its ids go. */
typedef struct {
    const Vocab *v;
    Segment seg;
    Symbol *sym;
    Heap heap;
    int *out;
    int64_t written;
    int failed;
} Encode;

static void consider(Encode *e, int32_t left) {
    if (left < 0) return;
    int32_t right = e->sym[left].next;
    if (right < 0) return;
    const Merge *m = merge_of(e->v, e->sym[left].id, e->sym[right].id);
    if (m && heap_push(&e->heap, (Candidate){(uint64_t)(uint32_t)m->rank << 32 | (uint32_t)left, left,
                                             e->sym[left].id, e->sym[right].id, m->merged}) < 0)
        e->failed = 1;
}

/* The ids of the piece of code points [a, b) appended to the output. */
static void merge_piece(Encode *e, int64_t a, int64_t b) {
    const Vocab *v = e->v;
    const char *s = e->seg.text + e->seg.at[a];
    int64_t len = e->seg.at[b] - e->seg.at[a];
    if (v->ignore_merges) {
        int32_t whole = table_get(&v->by_bytes, s, len);
        if (whole >= 0) {
            e->out[e->written++] = whole;
            return;
        }
    }
    Symbol *sym = e->sym;
    int32_t count = 0;
    for (int64_t i = 0; i < len; i++) { /* a byte with no token of its own is dropped, as the library drops it */
        int32_t id = v->byte_id[(uint8_t)s[i]];
        if (id >= 0) {
            sym[count] = (Symbol){id, count - 1, -1, 1};
            count++;
        }
    }
    for (int32_t i = 0; i + 1 < count; i++) sym[i].next = i + 1;
    e->heap.n = 0;
    for (int32_t i = 0; i + 1 < count; i++) consider(e, i);
    while (e->heap.n) {
        Candidate c = heap_pop(&e->heap);
        Symbol *left = &sym[c.left];
        if (!left->alive || left->next < 0 || left->id != c.left_id || sym[left->next].id != c.right_id) continue;
        Symbol *right = &sym[left->next];
        left->id = c.merged;
        left->next = right->next;
        if (right->next >= 0) sym[right->next].prev = c.left;
        right->alive = 0;
        consider(e, left->prev);
        consider(e, c.left);
    }
    for (int32_t i = count ? 0 : -1; i >= 0; i = sym[i].next) e->out[e->written++] = sym[i].id;
}

/* The pieces of [a, b) under split `level` and those after it, merged in order. A regex's matches and the
 * stretches between them both become pieces ("isolated"). */
static void split(Encode *e, int level, int64_t a, int64_t b) {
    if (level == e->v->num_splits) {
        merge_piece(e, a, b);
        return;
    }
    int kind = e->v->splits[level];
    int64_t gap = a;
    for (int64_t i = a; i < b;) {
        int64_t m = match(kind, &e->seg, i, b);
        if (!m) {
            i++;
            continue;
        }
        if (gap < i) split(e, level + 1, gap, i);
        split(e, level + 1, i, i + m);
        i += m;
        gap = i;
    }
    if (gap < b) split(e, level + 1, gap, b);
}

static void plain(Encode *e, const char *s, int64_t len) {
    if (len == 0) return;
    Segment *t = &e->seg;
    t->text = s;
    t->n = 0;
    for (int64_t i = 0; i < len;) {
        int k;
        uint32_t c = code_point((const uint8_t *)s + i, len - i, &k);
        t->cp[t->n] = c;
        t->bits[t->n] = c < 128 ? e->v->ascii_bits[c] : class_bits(c);
        t->at[t->n++] = i;
        i += k;
    }
    t->at[t->n] = len;
    split(e, 0, 0, t->n);
}

/* The ids of s[0, len) (valid UTF-8) into out (room for `capacity`, at least len + 1: an id covers a byte
 * at least); returns how many, -1 for too little room or a text of 512 MiB or more, -2 out of memory. */
int64_t bpe_encode(const void *vocab, const char *s, int64_t len, int flags, int *out, int64_t capacity) {
    const Vocab *v = vocab;
    if (capacity < len + 1 || len >= (int64_t)1 << 29) return -1;
    size_t room = (size_t)len + 1;
    Encode e = {v, {s, malloc(sizeof(uint32_t) * room), malloc(room), malloc(sizeof(int64_t) * room), 0},
                malloc(sizeof(Symbol) * room), {malloc(sizeof(Candidate) * 256), 0, 256}, out, 0, 0};
    if (!e.seg.cp || !e.seg.bits || !e.seg.at || !e.sym || !e.heap.items) e.failed = 1;
    int64_t from = 0;
    for (int64_t i = 0; !e.failed && i < len;) {
        int64_t found_len = 0;
        int32_t added = v->added.root_child[(uint8_t)s[i]] >= 0
                            ? trie_longest(&v->added, v->types, s + i, len - i, 0, &found_len) : -1;
        if (added < 0) {
            i++;
            continue;
        }
        if ((flags & BPE_LITERAL) && v->types[added] == TYPE_CONTROL) { /* plain text, passed over */
            i += found_len;
            continue;
        }
        plain(&e, s + from, i - from);
        e.out[e.written++] = added;
        i += found_len;
        from = i;
    }
    if (!e.failed) plain(&e, s + from, len - from);
    free(e.seg.cp);
    free(e.seg.bits);
    free(e.seg.at);
    free(e.sym);
    free(e.heap.items);
    return e.failed ? -2 : e.written;
}
