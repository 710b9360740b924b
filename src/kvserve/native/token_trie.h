/* What the two tokenizers (spm_tokenize.c, bpe_tokenize.c) share: a hash of byte strings, UTF-8 lead
 * bytes, and the byte trie of a vocabulary's added pieces, cut leftmost-longest as the `tokenizers`
 * library's added vocabulary cuts them. */
#ifndef KVSERVE_TOKEN_TRIE_H
#define KVSERVE_TOKEN_TRIE_H

#include <stdint.h>
#include <stdlib.h>

static inline uint64_t hash_bytes(const char *s, int64_t n) {
    uint64_t h = 1469598103934665603ull;
    for (int64_t i = 0; i < n; i++) h = (h ^ (uint8_t)s[i]) * 1099511628211ull;
    return h ^ (h >> 29);
}

static inline int utf8_length(uint8_t lead) {
    if (lead < 0x80) return 1;
    if ((lead & 0xE0) == 0xC0) return 2;
    if ((lead & 0xF0) == 0xE0) return 3;
    if ((lead & 0xF8) == 0xF0) return 4;
    return 1;
}

/* A node's children are a list (first child, next sibling); `id` is the added piece that ends there, or
 * -1. Node 0 is the root, whose children are also indexed by byte (the root is walked the most). */
typedef struct {
    int32_t child, sibling, id;
    uint8_t byte;
} TrieNode;

typedef struct {
    TrieNode *nodes;
    int32_t count, room;
    int32_t root_child[256];
} Trie;

static inline int trie_init(Trie *t) {
    t->nodes = malloc(sizeof(TrieNode) * 64);
    t->room = 64;
    t->count = 1;
    for (int b = 0; b < 256; b++) t->root_child[b] = -1;
    if (!t->nodes) return -1;
    t->nodes[0] = (TrieNode){-1, -1, -1, 0};
    return 0;
}

static inline int32_t trie_step(const Trie *t, int32_t node, uint8_t byte) {
    if (node == 0) return t->root_child[byte];
    for (int32_t c = t->nodes[node].child; c >= 0; c = t->nodes[c].sibling)
        if (t->nodes[c].byte == byte) return c;
    return -1;
}

/* The last piece inserted with a string keeps it. 0, or -1 out of memory. */
static inline int trie_insert(Trie *t, const char *s, int64_t len, int32_t id) {
    int32_t node = 0;
    for (int64_t i = 0; i < len; i++) {
        uint8_t byte = (uint8_t)s[i];
        int32_t next = trie_step(t, node, byte);
        if (next < 0) {
            if (t->count == t->room) {
                TrieNode *more = realloc(t->nodes, sizeof(TrieNode) * (size_t)t->room * 2);
                if (!more) return -1;
                t->nodes = more;
                t->room *= 2;
            }
            next = t->count++;
            t->nodes[next] = (TrieNode){-1, t->nodes[node].child, -1, byte};
            t->nodes[node].child = next;
            if (node == 0) t->root_child[byte] = next;
        }
        node = next;
    }
    t->nodes[node].id = id;
    return 0;
}

/* The longest added piece starting at s whose type is `want` (any type: 0); its id, its length in
 * *found_len; -1 for none. */
static inline int32_t trie_longest(const Trie *t, const int32_t *types, const char *s, int64_t left, int want,
                                   int64_t *found_len) {
    int32_t found = -1;
    int32_t node = 0;
    for (int64_t i = 0; i < left; i++) {
        node = trie_step(t, node, (uint8_t)s[i]);
        if (node < 0) break;
        int32_t id = t->nodes[node].id;
        if (id >= 0 && (!want || types[id] == want)) {
            found = id;
            *found_len = i + 1;
        }
    }
    return found;
}

/* The byte offset of the first added piece of type `want` in s (its length in *found_len), or -1. */
static inline int64_t trie_first(const Trie *t, const int32_t *types, const char *s, int64_t len, int want,
                                 int64_t *found_len) {
    for (int64_t i = 0; i < len; i++) {
        if (t->root_child[(uint8_t)s[i]] >= 0 && trie_longest(t, types, s + i, len - i, want, found_len) >= 0)
            return i;
    }
    return -1;
}

#endif
