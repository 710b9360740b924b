/* SentencePiece-style ("llama" in GGUF) tokenization straight from a model's vocabulary: pieces, their
 * scores and token types, with no merges list and no Python objects per piece.
 *
 * Why here: the `tokenizers` library needs BPE merges, which a GGUF SentencePiece vocabulary does not
 * store, so they had to be derived (every split of every piece whose halves are pieces) and the result
 * parsed back: 1.6-2.6 s and +360 MiB of peak for Gemma 3's 262k pieces on every start. Here the
 * vocabulary becomes one hash table (about 20 ms) and a merge is looked up when it is needed.
 *
 * What it computes is exactly what kvserve/spm.py's `tokenizers` build computes (the tests hold the two
 * to the same ids), which is what transformers reads from the same file:
 *   1. the text is cut at added tokens (CONTROL and USER_DEFINED pieces), leftmost-longest, as the
 *      `tokenizers` added vocabulary does; `literal` keeps CONTROL matches as plain text (a user's
 *      message that spells "<start_of_turn>" is text, not a turn);
 *   2. each plain segment is normalized: a "▁" in front when the vocabulary asks for a space prefix
 *      and the segment is not empty, every ' ' as "▁";
 *   3. the segment becomes one symbol per character (its piece, else one <0xXX> piece per UTF-8 byte,
 *      else the unknown piece, consecutive unknowns fused);
 *   4. adjacent NORMAL symbols whose concatenation is a NORMAL piece merge, best first: higher score of
 *      the merged piece, then lower id of it, then lower id of the left half (the derived merges' rank
 *      order), then leftmost.
 * The vocabulary is read-only after spm_vocab_new: encodes run in parallel on one vocabulary.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "token_trie.h"

enum { TYPE_NORMAL = 1, TYPE_CONTROL = 3, TYPE_USER_DEFINED = 4 };

/* One distinct piece string: where it lies in the vocabulary's text and what it is. */
typedef struct {
    int64_t at;
    int32_t len;
    int32_t id;       /* the last piece of this string (the `tokenizers` vocabulary keeps the last) */
    int32_t normal;   /* the last NORMAL piece of it, or -1: only those merge */
} Slot;

typedef struct {
    char *text;
    float *scores;
    int32_t *types;
    Slot *slots;
    uint64_t mask;
    int32_t byte_ids[256];  /* "<0xXX>"'s id, or -1 */
    int32_t unk;
    int space_prefix;
    Trie added;  /* the CONTROL and USER_DEFINED pieces */
} Vocab;

static Slot *find(const Vocab *v, const char *s, int64_t n) {
    for (uint64_t i = hash_bytes(s, n) & v->mask;; i = (i + 1) & v->mask) {
        Slot *slot = &v->slots[i];
        if (slot->len < 0) return NULL;
        if (slot->len == n && memcmp(v->text + slot->at, s, (size_t)n) == 0) return slot;
    }
}

void *spm_vocab_new(const char *text, const int64_t *starts, const int64_t *lengths, const int *types,
                    const float *scores, int n, int space_prefix) {
    Vocab *v = calloc(1, sizeof(Vocab));
    if (!v) return NULL;
    uint64_t size = 16;
    while (size < (uint64_t)n * 2) size <<= 1;
    int64_t total = 0;
    for (int id = 0; id < n; id++) total += lengths[id];
    v->text = malloc((size_t)total + 1);
    v->scores = malloc(sizeof(float) * (size_t)(n ? n : 1));
    v->types = malloc(sizeof(int32_t) * (size_t)(n ? n : 1));
    v->slots = malloc(sizeof(Slot) * size);
    if (!v->text || !v->scores || !v->types || !v->slots || trie_init(&v->added) < 0) {
        spm_vocab_free(v);
        return NULL;
    }
    v->mask = size - 1;
    v->space_prefix = space_prefix;
    for (uint64_t i = 0; i < size; i++) v->slots[i].len = -1;
    int64_t at = 0; /* the pieces copied back to back */
    for (int id = 0; id < n; id++) {
        v->scores[id] = scores ? scores[id] : -(float)id;
        v->types[id] = types[id];
        const int64_t len = lengths[id];
        char *s = v->text + at;
        memcpy(s, text + starts[id], (size_t)len);
        Slot *slot = NULL;
        for (uint64_t i = hash_bytes(s, len) & v->mask;; i = (i + 1) & v->mask) {
            slot = &v->slots[i];
            if (slot->len < 0) {
                *slot = (Slot){at, (int32_t)len, id, -1};
                break;
            }
            if (slot->len == len && memcmp(v->text + slot->at, s, (size_t)len) == 0) break;
        }
        slot->id = id;
        if (types[id] == TYPE_NORMAL) slot->normal = id;
        if ((types[id] == TYPE_CONTROL || types[id] == TYPE_USER_DEFINED) && len > 0) {
            if (trie_insert(&v->added, s, len, id) < 0) {
                spm_vocab_free(v);
                return NULL;
            }
        }
        at += len;
    }
    for (int b = 0; b < 256; b++) {
        char name[8];
        snprintf(name, sizeof name, "<0x%02X>", b);
        Slot *slot = find(v, name, 6);
        v->byte_ids[b] = slot ? slot->id : -1;
    }
    Slot *unk = find(v, "<unk>", 5);
    v->unk = unk ? unk->id : -1;
    return v;
}

void spm_vocab_free(void *vocab) {
    Vocab *v = vocab;
    if (!v) return;
    free(v->text);
    free(v->scores);
    free(v->types);
    free(v->slots);
    free(v->added.nodes);
    free(v);
}

int64_t spm_first_special(const void *vocab, const char *s, int64_t len, int64_t *found_len) {
    const Vocab *v = vocab;
    return trie_first(&v->added, v->types, s, len, TYPE_CONTROL, found_len);
}

int spm_piece_id(const void *vocab, const char *s, int64_t len) {
    const Slot *slot = find(vocab, s, len);
    return slot ? slot->id : -1;
}

/* --- one plain segment: symbols and their merges ------------------------------------------------ */

typedef struct {
    int32_t start;
    int32_t len;    /* 0 once merged into its left neighbour */
    int32_t id;
    int32_t piece;  /* its NORMAL piece (mergeable), or -1 */
    int32_t prev, next;
} Symbol;

/* A candidate merge of symbol `left` with its right neighbour, valid while both keep these lengths. */
typedef struct {
    float score;
    int32_t merged, left_piece, left, left_len, right_len;
} Candidate;

static int before(const Candidate *a, const Candidate *b) {
    if (a->score != b->score) return a->score > b->score;
    if (a->merged != b->merged) return a->merged < b->merged;
    if (a->left_piece != b->left_piece) return a->left_piece < b->left_piece;
    return a->left < b->left;  /* symbols are numbered left to right: leftmost first */
}

typedef struct {
    Candidate *items;
    int64_t n, room;
    int failed;
} Heap;

static void heap_push(Heap *h, Candidate c) {
    if (h->n == h->room) {
        Candidate *more = realloc(h->items, sizeof(Candidate) * (size_t)(2 * h->room));
        if (!more) {
            h->failed = 1;
            return;
        }
        h->items = more;
        h->room *= 2;
    }
    int64_t i = h->n++;
    while (i > 0) {
        int64_t parent = (i - 1) / 2;
        if (!before(&c, &h->items[parent])) break;
        h->items[i] = h->items[parent];
        i = parent;
    }
    h->items[i] = c;
}

static Candidate heap_pop(Heap *h) {
    Candidate top = h->items[0], last = h->items[--h->n];
    int64_t i = 0;
    for (;;) {
        int64_t child = 2 * i + 1;
        if (child >= h->n) break;
        if (child + 1 < h->n && before(&h->items[child + 1], &h->items[child])) child++;
        if (!before(&h->items[child], &last)) break;
        h->items[i] = h->items[child];
        i = child;
    }
    if (h->n) h->items[i] = last;
    return top;
}

static void consider(const Vocab *v, const char *text, const Symbol *sym, int32_t left, Heap *h) {
    if (left < 0) return;
    int32_t right = sym[left].next;
    if (right < 0 || sym[left].piece < 0 || sym[right].piece < 0) return;
    const Slot *merged = find(v, text + sym[left].start, (int64_t)sym[left].len + sym[right].len);
    if (!merged || merged->normal < 0) return;
    heap_push(h, (Candidate){v->scores[merged->normal], merged->normal, sym[left].piece, left, sym[left].len,
                             sym[right].len});
}

/* The ids of one normalized segment text[0, n) appended at out; returns how many, or -2 out of memory.
 * sym has room for n symbols (one per byte at most). Unknown characters wait as one run, fused, until a
 * character of the vocabulary or the end: a character that falls back to bytes goes before the run, as
 * in the `tokenizers` BPE. */
static int64_t encode_segment(const Vocab *v, char *text, int64_t n, Symbol *sym, Heap *h, int *out) {
    int32_t count = 0;
    int64_t kept = 0;  /* text[0, kept): the characters kept, moved left over any dropped one */
    int64_t unk_at = 0, unk_len = 0; /* the pending run of unknown characters */
#define FLUSH_UNKNOWN()                                                                                      \
    if (unk_len) {                                                                                           \
        sym[count] = (Symbol){(int32_t)unk_at, (int32_t)unk_len, v->unk, -1, count - 1, -1};                 \
        count++;                                                                                             \
        unk_len = 0;                                                                                         \
    }
    for (int64_t at = 0; at < n;) {
        int64_t len = utf8_length((uint8_t)text[at]);
        if (len > n - at) len = n - at;
        const Slot *slot = find(v, text + at, len);
        int fallback = !slot;
        for (int64_t b = 0; fallback && b < len; b++) fallback = v->byte_ids[(uint8_t)text[at + b]] >= 0;
        if (slot) {
            FLUSH_UNKNOWN();
            sym[count] = (Symbol){(int32_t)kept, (int32_t)len, slot->id, slot->normal, count - 1, -1};
            count++;
        } else if (fallback) {
            for (int64_t b = 0; b < len; b++, count++)
                sym[count] = (Symbol){(int32_t)(kept + b), 1, v->byte_ids[(uint8_t)text[at + b]], -1, count - 1,
                                      -1};
        } else if (v->unk >= 0) {
            if (!unk_len) unk_at = kept;
            unk_len += len;
        } else {  /* no unknown piece at all: the character is dropped, as the `tokenizers` BPE drops it */
            at += len;
            continue;
        }
        memmove(text + kept, text + at, (size_t)len);
        kept += len;
        at += len;
    }
    FLUSH_UNKNOWN();
#undef FLUSH_UNKNOWN
    for (int32_t i = 0; i + 1 < count; i++) sym[i].next = i + 1;
    h->n = 0;
    for (int32_t i = 0; i + 1 < count; i++) consider(v, text, sym, i, h);
    while (h->n) {
        Candidate c = heap_pop(h);
        Symbol *left = &sym[c.left];
        if (left->len != c.left_len || left->next < 0 || sym[left->next].len != c.right_len) continue;
        Symbol *right = &sym[left->next];
        left->len += right->len;
        left->piece = c.merged;
        left->id = find(v, text + left->start, left->len)->id;
        left->next = right->next;
        if (right->next >= 0) sym[right->next].prev = c.left;
        right->len = 0;
        consider(v, text, sym, left->prev, h);
        consider(v, text, sym, c.left, h);
    }
    if (h->failed) return -2;
    int64_t written = 0;
    for (int32_t i = count ? 0 : -1; i >= 0; i = sym[i].next) out[written++] = sym[i].id;
    return written;
}

/* "▁" (U+2581) in UTF-8 */
static const char SPACE_MARK[3] = {(char)0xE2, (char)0x96, (char)0x81};

static int64_t plain(const Vocab *v, const char *s, int64_t len, int prefix, char *norm, Symbol *sym,
                     Heap *heap, int *out) {
    if (len == 0) return 0;
    int64_t n = 0;
    if (prefix) {
        memcpy(norm, SPACE_MARK, 3);
        n = 3;
    }
    for (int64_t i = 0; i < len; i++) {
        if (s[i] == ' ') {
            memcpy(norm + n, SPACE_MARK, 3);
            n += 3;
        } else {
            norm[n++] = s[i];
        }
    }
    return encode_segment(v, norm, n, sym, heap, out);
}

/* The ids of s[0, len) into out (room for `capacity`, at least 4 * len + 3); returns how many, -1 for too
 * little room or a text of 512 MiB or more, -2 out of memory. A plain segment of m bytes normalizes to at
 * most 3 m + 3 (each ' ' as the 3 bytes of "▁", plus the prefix), and gives at most an id per normalized
 * byte ("▁" falls back to 3 byte pieces in a vocabulary without it); every segment but the last ends at an
 * added piece of at least one byte, one id: at most 3 len + 3 + len ids in all. */
int64_t spm_encode(const void *vocab, const char *s, int64_t len, int flags, int *out, int64_t capacity) {
    const Vocab *v = vocab;
    int literal = flags & SPM_LITERAL, prefix = v->space_prefix && !(flags & SPM_NO_PREFIX);
    if (capacity < 4 * len + 3 || len >= INT32_MAX / 4) return -1;
    char *norm = malloc((size_t)(3 * len + 3));
    Symbol *sym = malloc(sizeof(Symbol) * (size_t)(3 * len + 3)); /* a symbol per normalized byte at most */
    Heap heap = {malloc(sizeof(Candidate) * 1024), 0, 1024, 0};
    int64_t written = 0, from = 0;
    for (int64_t i = 0; norm && sym && heap.items && written >= 0 && i < len;) {
        int64_t found_len = 0;
        int32_t added = v->added.root_child[(uint8_t)s[i]] >= 0
                            ? trie_longest(&v->added, v->types, s + i, len - i, 0, &found_len) : -1;
        if (added < 0) {
            i++;
            continue;
        }
        if (literal && v->types[added] == TYPE_CONTROL) {  /* plain text, matched and passed over */
            i += found_len;
            continue;
        }
        int64_t got = plain(v, s + from, i - from, prefix, norm, sym, &heap, out + written);
        written = got < 0 ? got : written + got;
        if (written >= 0) out[written++] = added;
        i += found_len;
        from = i;
    }
    if (!norm || !sym || !heap.items) written = -2;
    if (written >= 0) {
        int64_t got = plain(v, s + from, len - from, prefix, norm, sym, &heap, out + written);
        written = got < 0 ? got : written + got;
    }
    free(norm);
    free(sym);
    free(heap.items);
    return written;
}
